package breaker

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// childEnv carries a probeJob to the test binary run as a child process.
const childEnv = "TOLLGATE_BREAKER_CHILD"

// probeJob is what a child process does: race Acquire with Workers
// goroutines until Until and report the probes it was granted (then,
// once every child has stopped, report them successful), or, with Hold, take a probe lease, say so and
// wait to be killed.
type probeJob struct {
	Addr, Prefix, Key string
	Set               SharedSettings
	Workers           int
	Until             time.Time // when every child stops racing: one wall clock, one machine
	Hold              bool
}

// probeReport is a child's answer: the generation of each probe granted.
type probeReport struct {
	Probes []int64
	Errors int
}

const reportMarker = "PROBE-REPORT "

// TestBreakerChildProcess is not a test of its own: the process tests run
// the test binary again with this test selected and a job in childEnv.
func TestBreakerChildProcess(t *testing.T) {
	spec := os.Getenv(childEnv)
	if spec == "" {
		t.Skip("runs only as a child of TestRedisProbesAcrossProcesses and TestRedisDeadProberProcess")
	}
	var job probeJob
	require.NoError(t, json.Unmarshal([]byte(spec), &job))
	c := redistest.NewClient(t, patient(job.Addr))
	b, err := NewShared(c, job.Set, WithPrefix(job.Prefix), WithLogger(nil), WithFailurePolicy(FailClosed))
	require.NoError(t, err)
	if job.Hold {
		for {
			tk, err := b.Acquire(ctx, job.Key)
			if err == nil && tk.Probe() {
				os.Stdout.WriteString("HOLDING\n")
				select {} // until killed
			}
			time.Sleep(time.Millisecond)
		}
	}
	var mu sync.Mutex
	var rep probeReport
	var granted []Ticket
	deadline := job.Until
	var wg sync.WaitGroup
	for range job.Workers {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				tk, err := b.Acquire(ctx, job.Key)
				mu.Lock()
				switch {
				case errors.Is(err, ErrOpen):
				case err != nil:
					rep.Errors++
				default:
					rep.Probes = append(rep.Probes, tk.Generation())
					granted = append(granted, tk)
				}
				mu.Unlock()
				time.Sleep(200 * time.Microsecond)
			}
		})
	}
	wg.Wait()
	time.Sleep(300 * time.Millisecond) // until every child has stopped racing
	for _, tk := range granted {
		if !tk.Probe() || tk.Done(ctx, Success) != nil {
			rep.Errors++
		}
	}
	out, err := json.Marshal(rep)
	require.NoError(t, err)
	os.Stdout.WriteString(reportMarker + string(out) + "\n")
}

// child starts the test binary as a child process running job.
func child(t *testing.T, ctx context.Context, job probeJob) (*exec.Cmd, *bytes.Buffer, *bufio.Scanner) {
	t.Helper()
	spec, err := json.Marshal(job)
	require.NoError(t, err)
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestBreakerChildProcess$", "-test.count=1", "-test.timeout=2m")
	cmd.Env = append(os.Environ(), childEnv+"="+string(spec))
	var errOut bytes.Buffer
	cmd.Stderr = &errOut
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.WaitDelay = 5 * time.Second
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	return cmd, &errOut, bufio.NewScanner(out)
}

// TestRedisProbesAcrossProcesses: 4 processes × 16 goroutines race Acquire
// at the end of the open time; exactly Probes leases are granted, all in
// one half-open generation.
func TestRedisProbesAcrossProcesses(t *testing.T) {
	c, prefix := realRedis(t)
	for _, probes := range []int{1, 2} {
		set := SharedSettings{MinCalls: 4, OpenFor: 700 * time.Millisecond, Probes: probes, ProbeTimeout: 30 * time.Second}
		b := fleet(t, c.Options().Addr, prefix, 1, set)[0]
		key := "procs-" + string(rune('0'+probes))
		trip(t, b, key)
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		job := probeJob{Addr: c.Options().Addr, Prefix: prefix, Key: key, Set: set, Workers: 16, Until: time.Now().Add(2 * time.Second)}
		var all []int64
		type kid struct {
			cmd    *exec.Cmd
			errOut *bytes.Buffer
			out    *bufio.Scanner
		}
		kids := make([]kid, 4)
		for i := range kids {
			cmd, errOut, out := child(t, ctx, job)
			kids[i] = kid{cmd, errOut, out}
		}
		for i, k := range kids {
			var rep probeReport
			found := false
			for k.out.Scan() {
				if line, ok := strings.CutPrefix(k.out.Text(), reportMarker); ok {
					require.NoError(t, json.Unmarshal([]byte(line), &rep))
					found = true
				}
			}
			require.NoError(t, k.cmd.Wait(), "child %d: %s", i, k.errOut)
			require.True(t, found, "child %d reported nothing: %s", i, k.errOut)
			assert.Zero(t, rep.Errors, "child %d", i)
			all = append(all, rep.Probes...)
		}
		require.Len(t, all, probes, "leases granted across 4 processes")
		for _, g := range all {
			assert.Equal(t, all[0], g, "one half-open generation")
		}
		t.Logf("Probes %d: %d leases granted to 4 processes × 16 goroutines", probes, len(all))
		st, err := b.State(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, Closed, st, "the probes' successes closed it")
	}
}

// TestRedisDeadProberProcess: the process holding the probe lease is
// killed; another instance probes once ProbeTimeout has passed since the
// lease was granted, not before.
func TestRedisDeadProberProcess(t *testing.T) {
	c, prefix := realRedis(t)
	set := SharedSettings{MinCalls: 4, OpenFor: 50 * time.Millisecond, ProbeTimeout: 500 * time.Millisecond}
	b := fleet(t, c.Options().Addr, prefix, 1, set)[0]
	trip(t, b, "k")
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd, errOut, out := child(t, ctx, probeJob{Addr: c.Options().Addr, Prefix: prefix, Key: "k", Set: set, Hold: true})
	require.True(t, out.Scan(), "child: %s", errOut)
	require.Equal(t, "HOLDING", out.Text())
	held := time.Now() // the lease was granted just before
	require.NoError(t, cmd.Process.Kill())
	_ = cmd.Wait()

	var probe Ticket
	var err error
	for {
		probe, err = b.Acquire(ctx, "k")
		if err == nil {
			break
		}
		require.ErrorIs(t, err, ErrOpen)
		time.Sleep(2 * time.Millisecond)
	}
	waited := time.Since(held)
	t.Logf("the next probe came %v after the killed process took the lease (ProbeTimeout 500ms)", waited)
	assert.GreaterOrEqual(t, waited, 450*time.Millisecond)
	assert.Less(t, waited, 2*time.Second)
	require.True(t, probe.Probe())
	require.NoError(t, probe.Done(ctx, Success))
}
