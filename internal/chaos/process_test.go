//go:build chaos

package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// childEnv carries a childJob to the test binary run as a child process.
const childEnv = "TOLLGATE_CHAOS_CHILD"

// childJob is what one child process does: decide on keys for a while.
type childJob struct {
	Addr     string        `json:"addr"`
	Prefix   string        `json:"prefix"`
	Keys     []string      `json:"keys"`
	Workers  int           `json:"workers"`
	MaxOps   int           `json:"max_ops"`  // per worker
	Duration time.Duration `json:"duration"` // for the whole child
}

// childReport is what a child prints on stdout, as one JSON line.
type childReport struct {
	Allowed  map[string]int `json:"allowed"`
	Denied   map[string]int `json:"denied"`
	Errors   int            `json:"errors"`
	FirstErr string         `json:"first_error,omitempty"`
}

// TestChaosChildProcess is not a test of its own: TestChaosProcesses runs
// the test binary again with this test selected and a job in childEnv. It
// decides under FailClosed, so that any failure is counted as an error, not
// hidden by a fallback, and prints its counts.
func TestChaosChildProcess(t *testing.T) {
	spec := os.Getenv(childEnv)
	if spec == "" {
		t.Skip("runs only as a child of TestChaosProcesses")
	}
	var job childJob
	require.NoError(t, json.Unmarshal([]byte(spec), &job))
	c := redis.NewClient(pooled(&redis.Options{Addr: job.Addr}))
	defer c.Close()
	plan := chaosPlan
	if chaosLease {
		plan.Lease = 4 // of a capacity of 10: leases are often denied, and the key decided request by request
	}
	lim, err := tollgate.New(tollgate.NewRedisStore(c, storeOptions(job.Prefix)...), []tollgate.Plan{plan},
		tollgate.WithFailurePolicy(breaker.FailClosed), tollgate.WithLogger(nil))
	require.NoError(t, err)
	defer lim.Close()

	var mu sync.Mutex
	rep := childReport{Allowed: map[string]int{}, Denied: map[string]int{}}
	deadline := time.Now().Add(job.Duration)
	var wg sync.WaitGroup
	for w := 0; w < job.Workers; w++ {
		wg.Go(func() {
			for n := 0; n < job.MaxOps && time.Now().Before(deadline); n++ {
				key := job.Keys[(n*job.Workers+w)%len(job.Keys)]
				r, err := lim.Allow(context.Background(), key)
				mu.Lock()
				switch {
				case err != nil:
					rep.Errors++
					if rep.FirstErr == "" {
						rep.FirstErr = err.Error()
					}
				case r.Allowed:
					rep.Allowed[key]++
				default:
					rep.Denied[key]++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	out, err := json.Marshal(rep)
	require.NoError(t, err)
	fmt.Println(string(out))
}

// TestChaosProcesses runs several OS processes, each with its own Limiter
// and client, on the same keys of one Redis, and checks that together they
// admit no more than one bucket allows: capacity + rate × elapsed per key,
// elapsed from Redis TIME before the first child starts and after the last
// one ends. Nothing fails here, so there is no tolerance.
func TestChaosProcesses(t *testing.T) {
	chaosPrologue(t, true)
	srv := redistest.StartServer(t)
	procs, run := pick(4, 8), pick(1500*time.Millisecond, 15*time.Second)
	job := childJob{
		Addr: srv.Addr(), Prefix: redistest.KeyPrefix(), Keys: chaosKeys(4),
		Workers: 4, MaxOps: 1_000_000, Duration: run,
	}
	spec, err := json.Marshal(job)
	require.NoError(t, err)

	start := redisClock(t, srv.Addr())
	ctx, cancel := context.WithTimeout(context.Background(), run+2*time.Minute) // a hung child is killed
	defer cancel()
	cmds := make([]*exec.Cmd, procs)
	outs := make([]*bytes.Buffer, procs)
	for i := range cmds {
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestChaosChildProcess$", "-test.count=1", "-test.timeout=5m")
		cmd.Env = append(os.Environ(), childEnv+"="+string(spec))
		outs[i] = &bytes.Buffer{}
		cmd.Stdout, cmd.Stderr = outs[i], outs[i]
		cmd.WaitDelay = 5 * time.Second
		require.NoError(t, cmd.Start())
		cmds[i] = cmd
	}
	reports := make([]childReport, procs)
	for i, cmd := range cmds {
		err := cmd.Wait()
		require.NoError(t, err, "child %d:\n%s", i, outs[i])
		reports[i] = parseChildReport(t, outs[i].String())
	}
	end := redisClock(t, srv.Addr())

	elapsed := float64(end-start) / 1e6
	bound := float64(chaosPlan.Capacity) + chaosPlan.Rate*elapsed
	admitted, decisions, errs := 0, 0, 0
	for _, key := range job.Keys {
		n := 0
		for _, r := range reports {
			n += r.Allowed[key]
			decisions += r.Allowed[key] + r.Denied[key]
		}
		assert.LessOrEqual(t, float64(n), bound, "key %s: the processes together over-admitted", key)
		assert.GreaterOrEqual(t, n, int(chaosPlan.Capacity), "key %s: at least the burst must pass", key)
		admitted += n
	}
	for i, r := range reports {
		errs += r.Errors
		assert.Zero(t, r.Errors, "child %d: first error %s", i, r.FirstErr)
	}
	totalBound := bound * float64(len(job.Keys))
	chaosLine(t, "multi-process", "processes", procs, "keys", len(job.Keys), "admitted", admitted, "bound", totalBound,
		"ratio", float64(admitted)/totalBound, "decisions", decisions, "elapsed", time.Duration(end-start)*time.Microsecond, "errors", errs)
	assert.Greater(t, decisions, admitted, "the load must push past the limit")
}

// parseChildReport finds the child's JSON line among the test binary's own
// output ("PASS" and the like).
func parseChildReport(t *testing.T, out string) childReport {
	t.Helper()
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		if line := sc.Text(); strings.HasPrefix(line, "{") {
			var r childReport
			require.NoError(t, json.Unmarshal([]byte(line), &r), "child output: %s", out)
			return r
		}
	}
	t.Fatalf("no report in the child's output:\n%s", out)
	return childReport{}
}
