package tollgate

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
)

// readmeBudget is the call budget of README's client settings: a wait for
// a connection (100 ms) and one network wait (100 ms).
const readmeBudget = 200 * time.Millisecond

// errReadTimeout is what go-redis returns when a read's deadline passes.
var errReadTimeout = &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}

// stallingStore is a healthy store, a round trip away, in a process that
// is stopped now and then (SIGSTOP, a CPU quota) on synctest's clock.
// A call in flight when a stop begins ends when the stop ends, with a
// read timeout: its timer fired while the process was stopped, and runs
// first when the process runs again. While hung, every call ends at the
// client's read timeout without an answer, as on a hung Redis.
type stallingStore struct {
	*MemoryStore
	budget    time.Duration
	stopUntil atomic.Int64 // UnixNano; the process is stopped until then
	hung      atomic.Bool
	timedOut  atomic.Int64 // calls that ended in a timeout
}

func (s *stallingStore) callBudget() time.Duration { return s.budget }

func (s *stallingStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if s.hung.Load() {
		time.Sleep(100 * time.Millisecond)
		s.timedOut.Add(1)
		return Result{}, errReadTimeout
	}
	time.Sleep(time.Millisecond) // the round trip
	if until := s.stopUntil.Load(); time.Now().UnixNano() < until {
		s.waitForStop()
		s.timedOut.Add(1)
		return Result{}, errReadTimeout
	}
	return s.MemoryStore.Take(ctx, key, cost, plans)
}

// stop stops the process for d.
func (s *stallingStore) stop(d time.Duration) { s.stopUntil.Store(time.Now().Add(d).UnixNano()) }

// waitForStop waits, as a stopped process's goroutine does, until it runs.
func (s *stallingStore) waitForStop() {
	if d := time.Until(time.Unix(0, s.stopUntil.Load())); d > 0 {
		time.Sleep(d)
	}
}

// stallLoad runs callers goroutines that decide on keys of their own
// until stop is closed, waiting while the process is stopped, and counts
// their decisions by source.
func stallLoad(l *Limiter, s *stallingStore, callers int, stop <-chan struct{}) (sources map[Source]int, wait func()) {
	var mu sync.Mutex
	var wg sync.WaitGroup
	sources = map[Source]int{}
	for c := range callers {
		wg.Go(func() {
			key := fmt.Sprint("caller-", c)
			for {
				select {
				case <-stop:
					return
				default:
				}
				s.waitForStop()
				r, err := l.Peek(context.Background(), key)
				if err == nil {
					mu.Lock()
					sources[r.Source]++
					mu.Unlock()
				}
				time.Sleep(time.Millisecond)
			}
		})
	}
	return sources, wg.Wait
}

// Calls in flight when a process is stopped (SIGSTOP, a CPU quota) all
// time out when it runs again, however soon the store answered: they
// landed as a burst of consecutive failures, which tripped the breaker of
// a healthy store, and the failure policy then answered every call for a
// cooldown: 4–6 trips and millions of fallback decisions in the
// multi-process scenario. Only the calls in flight at the stops may go to
// the failure policy.
func TestStalledProcessDoesNotTripTheBreaker(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &stallingStore{MemoryStore: NewMemoryStore(), budget: readmeBudget}
		l := newTestLimiter(t, s)
		stop := make(chan struct{})
		sources, wait := stallLoad(l, s, 16, stop)
		for range 6 {
			time.Sleep(200 * time.Millisecond)
			s.stop(300 * time.Millisecond)
			s.waitForStop()
		}
		time.Sleep(200 * time.Millisecond)
		close(stop)
		wait()

		st := l.Stats()
		stalled := int(s.timedOut.Load())
		t.Logf("sources %v, timed out %d, stats: trips %d, errors %v", sources, stalled, st.BreakerOpened, st.StoreErrors)
		require.NotZero(t, stalled, "the stops must catch calls in flight")
		assert.Zero(t, st.BreakerOpened, "a stalled process is no store outage")
		assert.Equal(t, stalled, sources[SourceFallback], "the failure policy answers the calls in flight at the stops, and only those")
		assert.Equal(t, map[string]uint64{"stalled": uint64(stalled)}, st.StoreErrors)
		assert.False(t, st.Outage)
	})
}

// A hung store's calls fail at the client's read timeout, within the call
// budget: each is the store's failure, and the breaker trips at the
// first run of them, as before.
func TestHungStoreTripsTheBreakerPromptly(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &stallingStore{MemoryStore: NewMemoryStore(), budget: readmeBudget}
		l := newTestLimiter(t, s)
		stop := make(chan struct{})
		_, wait := stallLoad(l, s, 16, stop)
		time.Sleep(50 * time.Millisecond)
		s.hung.Store(true)
		time.Sleep(150 * time.Millisecond) // one read timeout, and a half
		assert.Equal(t, uint64(1), l.Stats().BreakerOpened, "the first timeouts trip the breaker")
		close(stop)
		wait()
		assert.NotZero(t, l.Stats().StoreErrors["timeout"])
	})
}

// A store that hangs while this process is stalled too: every call times
// out late. Each looks like a stall's, until no call has succeeded for a
// cooldown before it began: then the store is blamed, and the breaker
// trips, a cooldown and a call after the store hung.
func TestHungStoreInAStalledProcessTripsTheBreaker(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &stallingStore{MemoryStore: NewMemoryStore(), budget: 50 * time.Millisecond}
		l := newTestLimiter(t, s)
		stop := make(chan struct{})
		_, wait := stallLoad(l, s, 16, stop)
		time.Sleep(50 * time.Millisecond)
		s.hung.Store(true)                                            // 100 ms a call: twice its budget
		time.Sleep(l.health.settings.Cooldown + 250*time.Millisecond) // and two calls
		st := l.Stats()
		assert.Equal(t, uint64(1), st.BreakerOpened, "errors %v", st.StoreErrors)
		assert.True(t, st.Outage)
		close(stop)
		wait()
	})
}

// A probe in flight when the process is stopped times out late, as every
// call then does: it tells nothing of the store, which the breaker kept
// every call from until the probe began, so it is abandoned and the next
// call probes, rather than reopening the breaker for another cooldown.
func TestStalledProbeIsAbandoned(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		s := &stallingStore{MemoryStore: NewMemoryStore(), budget: readmeBudget}
		l := newTestLimiter(t, s)
		s.hung.Store(true)
		for range 3 {
			_, _ = l.Peek(context.Background(), "k") // within the budget: the store's
		}
		require.Equal(t, breaker.Open, l.health.one.State(), "3 timeouts trip it")
		s.hung.Store(false)
		time.Sleep(l.health.settings.Cooldown)
		s.stop(300 * time.Millisecond)
		_, _ = l.Peek(context.Background(), "k") // the probe, cut by the stop
		assert.Equal(t, breaker.Open, l.health.one.State())
		_, _ = l.Peek(context.Background(), "k")
		assert.Equal(t, breaker.Closed, l.health.one.State(), "the next call probes and closes it")
		assert.Equal(t, uint64(1), l.Stats().StoreErrors["stalled"])
	})
}
