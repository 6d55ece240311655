//go:build chaos

package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// stallChildEnv carries a stallJob to the test binary run as a child
// process by TestChaosStalledProcesses.
const stallChildEnv = "TOLLGATE_CHAOS_STALL_CHILD"

// stallJob is what one stalled child does: decide with README's client
// settings and the Fallback policy until its stdin closes.
type stallJob struct {
	Addr    string `json:"addr"`
	Prefix  string `json:"prefix"`
	Workers int    `json:"workers"`
}

// stallReport is what a stalled child prints, as one JSON line, for each
// line read on its stdin: its counts so far.
type stallReport struct {
	Sources     map[string]int    `json:"sources"` // decisions by Source
	Trips       uint64            `json:"trips"`
	Outage      bool              `json:"outage"`
	StoreErrors map[string]uint64 `json:"store_errors"`
}

// stallPlan never denies in these tests: every decision is a store call.
var stallPlan = tollgate.Plan{Name: "stall", Capacity: 1_000_000_000, Rate: 1_000_000}

// TestChaosStalledChild is not a test of its own: TestChaosStalledProcesses
// runs the test binary again with this test selected and a job in
// stallChildEnv. It prints "ready" once every worker has decided, then a
// report for each line on its stdin, and ends when its stdin closes.
func TestChaosStalledChild(t *testing.T) {
	spec := os.Getenv(stallChildEnv)
	if spec == "" {
		t.Skip("runs only as a child of TestChaosStalledProcesses")
	}
	var job stallJob
	require.NoError(t, json.Unmarshal([]byte(spec), &job))
	c := redistest.NewClient(t, pooled(redistest.FailFast(job.Addr)))
	lim, err := tollgate.New(tollgate.NewRedisStore(c, storeOptions(job.Prefix)...), []tollgate.Plan{stallPlan},
		tollgate.WithLogger(nil))
	require.NoError(t, err)
	defer lim.Close()

	var mu sync.Mutex
	sources := map[string]int{}
	var ready, done sync.WaitGroup
	stop := make(chan struct{})
	ready.Add(job.Workers)
	for w := range job.Workers {
		done.Go(func() {
			key := fmt.Sprint("worker-", w)
			for n := 0; ; n++ {
				r, err := lim.Allow(context.Background(), key)
				mu.Lock()
				if err == nil {
					sources[r.Source.String()]++
				} else {
					sources["error"]++
				}
				mu.Unlock()
				if n == 0 {
					ready.Done()
				}
				select {
				case <-stop:
					return
				default:
				}
			}
		})
	}
	ready.Wait()
	fmt.Println("ready")
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		st := lim.Stats()
		mu.Lock()
		out, err := json.Marshal(stallReport{Sources: sources, Trips: st.BreakerOpened, Outage: st.Outage, StoreErrors: st.StoreErrors})
		mu.Unlock()
		require.NoError(t, err)
		fmt.Println(string(out))
	}
	close(stop)
	done.Wait()
}

// stallChild is a running TestChaosStalledChild.
type stallChild struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string // its stdout, line by line; closed at its end
}

// startStallChild starts a child on job and waits until it is ready.
func startStallChild(t *testing.T, ctx context.Context, job stallJob) *stallChild {
	t.Helper()
	spec, err := json.Marshal(job)
	require.NoError(t, err)
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^TestChaosStalledChild$", "-test.count=1", "-test.timeout=5m")
	cmd.Env = append(os.Environ(), stallChildEnv+"="+string(spec))
	cmd.Stderr = os.Stderr
	cmd.WaitDelay = 5 * time.Second
	c := &stallChild{cmd: cmd, lines: make(chan string, 16)}
	c.in, err = cmd.StdinPipe()
	require.NoError(t, err)
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	go func() {
		defer close(c.lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			c.lines <- sc.Text()
		}
	}()
	if line := c.next(t); line != "ready" {
		for more := range c.lines {
			line += "\n" + more
		}
		_ = cmd.Wait()
		t.Fatalf("the child did not start:\n%s", line)
	}
	return c
}

// next returns the child's next line of output.
func (c *stallChild) next(t *testing.T) string {
	t.Helper()
	select {
	case line, ok := <-c.lines:
		require.True(t, ok, "the child ended")
		return line
	case <-time.After(time.Minute): // a hung child
		t.Fatal("no line from the child")
	}
	return ""
}

// report asks the child for its counts so far.
func (c *stallChild) report(t *testing.T) stallReport {
	t.Helper()
	_, err := io.WriteString(c.in, "report\n")
	require.NoError(t, err)
	var r stallReport
	line := c.next(t)
	require.NoError(t, json.Unmarshal([]byte(line), &r), "child output: %s", line)
	return r
}

// end closes the child's stdin and waits for it to exit.
func (c *stallChild) end(t *testing.T) {
	t.Helper()
	require.NoError(t, c.in.Close())
	for range c.lines { // "PASS" and the like
	}
	require.NoError(t, c.cmd.Wait())
}

// TestChaosStalledProcesses stops processes, not Redis: two OS processes
// with README's client settings and 16 callers each, each stopped with
// SIGSTOP for 300 ms six times (as a CPU quota stops a container) while
// Redis stays healthy. The calls in flight at a stop time out when the
// process runs again, however soon Redis answered. A stalled process is
// no outage: no breaker may trip, and only the calls in flight at the
// stops may go to the failure policy. Then Redis itself is stopped, and
// every process's breaker must trip: a hung Redis is an outage.
func TestChaosStalledProcesses(t *testing.T) {
	chaosPrologue(t, true)
	srv := redistest.StartServer(t)
	const procs, workers, stops = 2, 16, 6
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute) // a hung child is killed
	defer cancel()
	job := stallJob{Addr: srv.Addr(), Prefix: redistest.KeyPrefix(), Workers: workers}
	children := make([]*stallChild, procs)
	for i := range children {
		children[i] = startStallChild(t, ctx, job)
	}
	for range stops {
		for _, c := range children {
			require.NoError(t, c.cmd.Process.Signal(syscall.SIGSTOP))
		}
		time.Sleep(300 * time.Millisecond)
		for _, c := range children {
			require.NoError(t, c.cmd.Process.Signal(syscall.SIGCONT))
		}
		time.Sleep(200 * time.Millisecond)
	}
	stalled, fallback, timedOut := uint64(0), 0, uint64(0)
	for i, c := range children {
		r := c.report(t)
		t.Logf("child %d after the stops: %+v", i, r)
		stalled += r.StoreErrors["stalled"]
		timedOut += r.StoreErrors["stalled"] + r.StoreErrors["timeout"]
		fallback += r.Sources[tollgate.SourceFallback.String()]
		assert.Zero(t, r.Trips, "child %d: a stalled process is no outage", i)
		assert.LessOrEqual(t, r.Sources[tollgate.SourceFallback.String()], workers*stops,
			"child %d: only the calls in flight at the stops go to the failure policy", i)
		assert.Zero(t, r.Sources["error"], "child %d", i)
		assert.NotZero(t, r.Sources[tollgate.SourceStore.String()], "child %d", i)
	}

	require.NotZero(t, timedOut, "the stops must catch calls in flight")

	srv.Signal(syscall.SIGSTOP) // a hung Redis
	tripped := eventually(10*time.Second, 100*time.Millisecond, func() bool {
		for _, c := range children {
			if r := c.report(t); r.Trips == 0 || !r.Outage {
				return false
			}
		}
		return true
	})
	srv.Signal(syscall.SIGCONT)
	assert.True(t, tripped, "a hung Redis trips every process's breaker")
	for _, c := range children {
		c.end(t)
	}
	chaosLine(t, "stalled-processes", "processes", procs, "workers", workers, "stops", stops,
		"timed_out", timedOut, "stalled", stalled, "fallback", fallback)
}
