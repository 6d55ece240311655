package tollgate

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// outageObserver records, for TestObserverOnRealOutage, everything the
// metrics adapters turn into metrics.
type outageObserver struct {
	mu          sync.Mutex
	sources     map[Source]int
	storeCalls  int
	storeErrs   int
	fallback    []bool
	transitions [][2]BreakerState
	scriptLoads int
}

func (o *outageObserver) ObserveDecision(d Decision) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.sources[d.Source]++
}

func (o *outageObserver) ObserveStore(_ time.Duration, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.storeCalls++
	if err != nil {
		o.storeErrs++
	}
}

func (o *outageObserver) ObserveFallback(active bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.fallback = append(o.fallback, active)
}

func (o *outageObserver) ObserveBreaker(from, to BreakerState) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.transitions = append(o.transitions, [2]BreakerState{from, to})
}

func (o *outageObserver) ObserveScriptLoad() {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.scriptLoads++
}

// TestObserverOnRealOutage kills and restarts a real redis-server under
// load and checks what an Observer hears: the calls the metrics adapters
// map one to one onto metrics (their own tests drive them with fakes, as
// they cannot import internal/redistest from their modules).
func TestObserverOnRealOutage(t *testing.T) {
	srv := ownServer(t)
	obs := &outageObserver{sources: map[Source]int{}}
	store := NewRedisStore(newRealClient(t, failFast(srv.Addr())), WithRedisObserver(obs))
	l, err := New(store, testPlans, WithObserver(obs), WithLogger(nil),
		WithBreaker(BreakerSettings{Failures: 3, Cooldown: 100 * time.Millisecond}))
	require.NoError(t, err)

	stop := loadUntilStopped(4, func(g, i int) {
		_, err := l.Allow(context.Background(), fmt.Sprint("user-", g, "-", i%10), "gold")
		assert.NoError(t, err, "Fallback hides the outage from callers")
		time.Sleep(time.Millisecond)
	})
	count := func(s Source) int {
		obs.mu.Lock()
		defer obs.mu.Unlock()
		return obs.sources[s]
	}
	waitMore := func(s Source, within time.Duration) {
		t.Helper()
		n := count(s)
		require.Eventually(t, func() bool { return count(s) > n+20 }, within, 5*time.Millisecond, "decisions from %s", s)
	}
	waitMore(SourceStore, 2*time.Second)
	srv.Kill()
	waitMore(SourceFallback, 2*time.Second)
	srv.Restart() // with an empty script cache
	waitMore(SourceStore, 3*time.Second)
	stop()

	obs.mu.Lock()
	defer obs.mu.Unlock()
	t.Logf("decisions %v, store calls %d (%d failed), breaker %v, script loads %d",
		obs.sources, obs.storeCalls, obs.storeErrs, obs.transitions, obs.scriptLoads)
	// A starved machine can time out a call after the restart and see a
	// second, short outage; each must start before it ends.
	require.NotEmpty(t, obs.fallback)
	require.Zero(t, len(obs.fallback)%2, "every outage that started ended: %v", obs.fallback)
	for i, active := range obs.fallback {
		assert.Equal(t, i%2 == 0, active, "outage starts and ends alternate: %v", obs.fallback)
	}
	assert.GreaterOrEqual(t, obs.storeErrs, 3, "the failures that opened the breaker")
	assert.Less(t, obs.storeErrs, obs.storeCalls, "calls skipped by the open breaker are not reported")
	require.NotEmpty(t, obs.transitions)
	assert.Equal(t, [2]BreakerState{BreakerClosed, BreakerOpen}, obs.transitions[0])
	assert.Equal(t, [2]BreakerState{BreakerHalfOpen, BreakerClosed}, obs.transitions[len(obs.transitions)-1])
	for i := 1; i < len(obs.transitions); i++ {
		assert.Equal(t, obs.transitions[i-1][1], obs.transitions[i][0], "transition %d starts where the last ended", i)
	}
	assert.GreaterOrEqual(t, obs.scriptLoads, 2, "loaded on the fresh server, and again after the restart")
	assert.Zero(t, obs.sources[SourceFailOpen])
}
