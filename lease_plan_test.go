package tollgate

import (
	"context"
	"fmt"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestShadowedLeasedPlanDecides: with WithShadow, a plan with a Lease
// decides alike whether it comes from the table, a resolver or
// AllowPlans: shadowed, it takes no lease, and never fails.
func TestShadowedLeasedPlanDecides(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	resolved := func(_ context.Context, _ string, p Plan) (Plan, error) { return leasedPlan, nil }
	plain := leasedPlan
	plain.Lease = 0
	l, err := New(rs, []Plan{plain}, WithShadow(), WithPlanResolver(resolved), WithLogger(nil))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	for name, decide := range map[string]func(key string) (Result, error){
		"resolver":   func(key string) (Result, error) { return l.Allow(ctx, key) },
		"AllowPlans": func(key string) (Result, error) { return l.AllowPlans(ctx, key, 1, leasedPlan) },
	} {
		for i := range 3 {
			r, err := decide(name)
			require.NoError(t, err, "%s: a shadowed plan's Lease is ignored", name)
			assert.True(t, r.Allowed, name)
			assert.Equal(t, SourceStore, r.Source, "%s: decided in Redis, not from a lease", name)
			assert.Equal(t, leasedPlan.Capacity-int64(i+1), r.Remaining, name)
		}
	}
	tl, err := New(rs, []Plan{leasedPlan}, WithShadow(), WithLogger(nil))
	require.NoError(t, err, "New takes a leased plan under WithShadow")
	t.Cleanup(func() { _ = tl.Close() })
	r, err := tl.Allow(ctx, "new")
	require.NoError(t, err)
	assert.Equal(t, SourceStore, r.Source)
	assert.Equal(t, int64(99), remaining(t, rs, "new"), "one token taken, no lease")
}

// TestShadowedLeasedPlanReportsItsTwin: a leased plan and its shadow,
// each on a key of its own, are asked for the same 13 tokens of 10: the
// shadow reports a would-be denial exactly where its twin denies, and
// ends with the tokens the twin ends with.
func TestShadowedLeasedPlanReportsItsTwin(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	plan := Plan{Name: "hot", Capacity: 10, Rate: 1, Lease: 8}
	enforced, err := New(rs, []Plan{plan}, WithLogger(nil))
	require.NoError(t, err)
	shadow, err := New(rs, []Plan{plan}, WithShadow(), WithLogger(nil))
	require.NoError(t, err)
	var denied, wouldDeny int
	for i := range 13 {
		en, err := enforced.Allow(ctx, "enforced")
		require.NoError(t, err)
		sh, err := shadow.Allow(ctx, "shadow")
		require.NoError(t, err)
		assert.True(t, sh.Allowed)
		assert.Equal(t, !en.Allowed, sh.ShadowDenied, "request %d", i)
		if !en.Allowed {
			denied++
		}
		if sh.ShadowDenied {
			wouldDeny++
		}
	}
	require.NoError(t, enforced.Close())
	require.NoError(t, shadow.Close())
	assert.Equal(t, 3, denied)
	assert.Equal(t, denied, wouldDeny)
	assert.Equal(t, uint64(3), shadow.Stats().Plans[0].ShadowDenied)
	assert.Equal(t, remaining(t, rs, "enforced"), remaining(t, rs, "shadow"))
}

// TestResetDropsTheKeysLease: after Reset, the key admits its capacity
// and no more: the lease taken before it serves nothing after, and its
// rest is not given back, which would overfill the bucket Reset filled.
func TestResetDropsTheKeysLease(t *testing.T) {
	ctx := context.Background()
	rs, _, setTime := newMiniredisStore(t)
	l, err := New(rs, []Plan{leasedPlan}, WithLogger(nil))
	require.NoError(t, err)
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, SourceStore, r.Source, "a lease of 10 taken")
	require.NoError(t, l.Reset(ctx, "k"))
	// Redis's clock moves on, as it does between two calls: a hold taken
	// at the very µs of the Reset is taken as before it, and its rest
	// would not come back.
	setTime(t0 + 1)
	admitted := countAdmitted(t, l, "k", 200)
	require.NoError(t, l.Close())
	assert.LessOrEqual(t, admitted, leasedPlan.Capacity, "a full bucket, once")
	assert.GreaterOrEqual(t, admitted, leasedPlan.Capacity-leasedPlan.Lease, "less at most a lease in flight")
	assert.Equal(t, leasedPlan.Capacity-admitted, remaining(t, rs, "k"))
}

// TestPlanChangeRetiresTheLease: a lease serves only the plan it was
// taken for. After SetPlans, or a resolver's new tier, lowers the
// capacity from 100 to 10, the key admits 10 at most and every Result
// reports the new Limit, whether the new plan leases or not.
func TestPlanChangeRetiresTheLease(t *testing.T) {
	ctx := context.Background()
	big := Plan{Name: "hot", Capacity: 100, Rate: 1, Lease: 50}
	for _, small := range []Plan{
		{Name: "hot", Capacity: 10, Rate: 1},
		{Name: "hot", Capacity: 10, Rate: 1, Lease: 4},
	} {
		t.Run(fmt.Sprintf("SetPlans/lease%d", small.Lease), func(t *testing.T) {
			rs, _, _ := newMiniredisStore(t)
			l, err := New(rs, []Plan{big}, WithLogger(nil))
			require.NoError(t, err)
			_, err = l.Allow(ctx, "k")
			require.NoError(t, err)
			require.NoError(t, l.SetPlans([]Plan{small}))
			checkDowngrade(t, l, rs, small)
		})
		t.Run(fmt.Sprintf("resolver/lease%d", small.Lease), func(t *testing.T) {
			rs, _, _ := newMiniredisStore(t)
			var downgraded atomic.Bool
			tier := func(_ context.Context, _ string, p Plan) (Plan, error) {
				if downgraded.Load() {
					return small, nil
				}
				return p, nil
			}
			l, err := New(rs, []Plan{big}, WithPlanResolver(tier), WithLogger(nil))
			require.NoError(t, err)
			_, err = l.Allow(ctx, "k")
			require.NoError(t, err)
			downgraded.Store(true)
			checkDowngrade(t, l, rs, small)
		})
	}
}

// checkDowngrade checks a key whose lease of 50 tokens of 100 was taken
// before its plan became small: the key admits small's capacity, less at
// most a lease of small's in flight, and after Close the bucket holds
// exactly what was not admitted: the old lease's rest came back before
// the new plan decided, not after, which would refill it.
func checkDowngrade(t *testing.T, l *Limiter, rs *RedisStore, small Plan) {
	t.Helper()
	admitted := countAdmitted(t, l, "k", 100)
	require.NoError(t, l.Close())
	assert.LessOrEqual(t, admitted, small.Capacity)
	assert.GreaterOrEqual(t, admitted, small.Capacity-small.Lease)
	assert.Equal(t, small.Capacity-admitted, remaining(t, rs, "k"))
}

// countAdmitted asks l for a token of key n times and counts the tokens
// admitted, each of which must report the Limit of the plan in force.
func countAdmitted(t *testing.T, l *Limiter, key string, n int) int64 {
	t.Helper()
	var admitted int64
	for range n {
		r, err := l.Allow(context.Background(), key)
		require.NoError(t, err)
		if r.Allowed {
			admitted++
			p, _ := l.Plan(r.Plan)
			if l.resolver != nil {
				p, _ = l.resolver(context.Background(), key, p)
			}
			assert.Equal(t, p.Capacity, r.Limit, "source %v", r.Source)
		}
	}
	return admitted
}

// TestNewVersionRetiresTheLease: a new Version of a leased plan is a plan
// change like any other. The lease of version 1 is given back before
// version 2, which resets the bucket, decides: after the reset the key
// admits its capacity, not the old lease's rest on top of it.
func TestNewVersionRetiresTheLease(t *testing.T) {
	ctx := context.Background()
	next := leasedPlan
	next.Version, next.Inherit = 2, InheritReset
	rs, _, _ := newMiniredisStore(t)
	var upgraded atomic.Bool
	tier := func(_ context.Context, _ string, p Plan) (Plan, error) {
		if upgraded.Load() {
			return next, nil
		}
		return p, nil
	}
	l, err := New(rs, []Plan{leasedPlan}, WithPlanResolver(tier), WithLogger(nil))
	require.NoError(t, err)
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, SourceStore, r.Source, "a lease of 10 taken")
	upgraded.Store(true)
	admitted := countAdmitted(t, l, "k", 200)
	require.NoError(t, l.Close())
	assert.LessOrEqual(t, admitted, next.Capacity, "the reset's capacity, once, and no lease of version 1")
	assert.GreaterOrEqual(t, admitted, next.Capacity-next.Lease, "less at most a lease in flight")
	assert.Equal(t, next.Capacity-admitted, remaining(t, rs, "k"))
}

// gateHook, once armed, holds back the reply of the next script call,
// after Redis ran it, until released; held is closed once it does.
type gateHook struct {
	armed   atomic.Bool
	held    chan struct{}
	release chan struct{}
}

func (h *gateHook) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *gateHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if isScriptCmd(cmd) && h.armed.CompareAndSwap(true, false) {
			close(h.held)
			<-h.release
		}
		return err
	}
}

func (h *gateHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// leaseTakenAhead returns a Limiter, on miniredis, of a plan "hot" of
// 100 with a lease of 50, which has handed out 25 of its lease on key
// "k", so that the next lease, of 25, is being taken ahead: Redis ran
// that take, and gate holds its reply until gate.release is closed. It
// returns the Limiter's store too.
func leaseTakenAhead(t *testing.T) (*Limiter, *RedisStore, *gateHook) {
	t.Helper()
	big := Plan{Name: "hot", Capacity: 100, Rate: 1, Lease: 50}
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(t0))
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	gate := &gateHook{held: make(chan struct{}), release: make(chan struct{})}
	c.AddHook(gate)
	rs := NewRedisStore(c, WithoutBatching())
	l, err := New(rs, []Plan{big}, WithLogger(nil))
	require.NoError(t, err)
	require.EqualValues(t, 24, countAdmitted(t, l, "k", 24))
	gate.armed.Store(true)
	r, err := l.Allow(context.Background(), "k") // leaves 25 of the lease: the next is taken ahead
	require.NoError(t, err)
	require.Equal(t, SourceLease, r.Source)
	<-gate.held
	return l, rs, gate
}

// admittedReleasing counts what l admits of 30 requests on key "k" while
// gate holds the reply of the lease taken ahead, and lets that reply come
// back once they are decided, or after 100 ms if they wait for it.
func admittedReleasing(t *testing.T, l *Limiter, gate *gateHook) int64 {
	t.Helper()
	done := make(chan int64)
	go func() { done <- countAdmitted(t, l, "k", 30) }()
	select {
	case admitted := <-done: // decided before the lease taken ahead came back
		close(gate.release)
		return admitted
	case <-time.After(100 * time.Millisecond): // waits for it: let it come back
		close(gate.release)
		return <-done
	}
}

// TestPlanChangeWaitsForTheLeaseTakenAhead: a lease of 50 of 100 has
// handed out 25, so the next lease, of 25, is being taken ahead when the
// plan becomes one of 10. Redis ran that take (the bucket holds 25) but
// its reply is late. The lease taken ahead is the old plan's too: its
// tokens must be back before the new plan decides, or their refund lands
// on the bucket the new plan drained and refills it (before: 20 admitted
// at one instant under a plan of 10).
func TestPlanChangeWaitsForTheLeaseTakenAhead(t *testing.T) {
	small := Plan{Name: "hot", Capacity: 10, Rate: 1}
	l, rs, gate := leaseTakenAhead(t)
	require.NoError(t, l.SetPlans([]Plan{small}))
	done := make(chan int64)
	go func() { done <- countAdmitted(t, l, "k", 30) }()
	select {
	case admitted := <-done: // a store that decided before the lease taken ahead came back
		close(gate.release)
		require.NoError(t, l.Close())
		admitted += countAdmitted(t, plainLimiter(t, rs, small), "k", 30)
		assert.LessOrEqual(t, admitted, small.Capacity, "admitted under the plan of 10, at one instant")
	case <-time.After(100 * time.Millisecond): // waits for it: let it come back
		close(gate.release)
		admitted := <-done
		require.NoError(t, l.Close())
		admitted += countAdmitted(t, plainLimiter(t, rs, small), "k", 30)
		assert.Equal(t, small.Capacity, admitted, "admitted under the plan of 10, at one instant")
	}
}

// TestPlanChangeWaitsForTheLeaseTakenAheadOfASpentLease: as
// TestPlanChangeWaitsForTheLeaseTakenAhead, but the lease runs out while
// the next is taken ahead, and the request that finds it spent takes no
// new lease (Redis holds 25, a lease is 50): the key holds no lease, only
// the take of the old plan under way. Its tokens must be back before the
// new plan decides (before: 20 admitted at one instant under a plan of
// 10).
func TestPlanChangeWaitsForTheLeaseTakenAheadOfASpentLease(t *testing.T) {
	ctx := context.Background()
	small := Plan{Name: "hot", Capacity: 10, Rate: 1}
	l, rs, gate := leaseTakenAhead(t)
	require.EqualValues(t, 25, countAdmitted(t, l, "k", 25), "the lease runs out")
	spent := make(chan struct{})
	var late atomic.Int64 // 1 if it came so late that the new plan admitted it
	go func() {
		defer close(spent)
		if r, err := l.Allow(ctx, "k"); err == nil && r.Allowed && r.Limit == small.Capacity {
			late.Store(1)
		}
	}()
	select {
	case <-spent: // decided without the lease taken ahead
	case <-time.After(100 * time.Millisecond): // waits for it
	}
	require.NoError(t, l.SetPlans([]Plan{small}))
	admitted := admittedReleasing(t, l, gate)
	<-spent
	require.NoError(t, l.Close())
	admitted += late.Load() + countAdmitted(t, plainLimiter(t, rs, small), "k", 30)
	// The spent lease's request, decided under the old plan, may take its
	// token from the bucket after the new plan wrote it: then 9 are
	// admitted under the new plan, and 10 in all.
	assert.LessOrEqual(t, admitted, small.Capacity, "admitted under the plan of 10, at one instant")
	assert.GreaterOrEqual(t, admitted, small.Capacity-1, "the new plan's tokens, but the old plan's request's")
}

// plainLimiter returns a Limiter of plan on rs that remembers no denial.
func plainLimiter(t *testing.T, rs *RedisStore, plan Plan) *Limiter {
	t.Helper()
	l, err := New(rs, []Plan{plan}, WithDenialCache(0), WithLogger(nil))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	return l
}

// TestLeasedTierRoundTripForgetsRememberedDenials: a denial remembered
// under the free tier, then a gold tier whose requests a lease serves,
// then the free tier again once the bucket refilled. The gold tier's
// requests are requests under the plan's other parameters, lease or not:
// they forget the free tier's denials, which the bucket, refilled under
// gold, no longer bears out (before: the 10 tokens Redis held were denied
// from the cache for the free denial's 6 minutes).
func TestLeasedTierRoundTripForgetsRememberedDenials(t *testing.T) {
	ctx := context.Background()
	free := Plan{Name: "api", Capacity: 10, Rate: Per(10, time.Hour)}
	gold := Plan{Name: "api", Capacity: 100, Rate: 1, Lease: 10}
	rs, _, setTime := newMiniredisStore(t)
	var isGold atomic.Bool
	l, err := New(rs, []Plan{free}, WithLogger(nil), WithPlanResolver(func(_ context.Context, _ string, p Plan) (Plan, error) {
		if isGold.Load() {
			return gold, nil
		}
		return p, nil
	}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	time.Sleep(time.Millisecond) // off the instant of New: see testDenialCacheSparesTheStore
	require.EqualValues(t, 10, countAdmitted(t, l, "k", 10))
	for _, src := range []Source{SourceStore, SourceCache} {
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.False(t, r.Allowed)
		require.Equal(t, src, r.Source, "the free tier's denial is remembered")
	}
	setTime(t0 + 10e6) // 10 tokens under gold: one lease, and none to take ahead
	isGold.Store(true)
	require.EqualValues(t, 10, countAdmitted(t, l, "k", 10), "a lease of 10")
	waitFetched(t, l, "k", "api")
	setTime(t0 + 10e6 + time.Hour.Microseconds()) // full under free
	isGold.Store(false)
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.True(t, r.Allowed, "10 in Redis; denied by %v", r.Source)
	assert.EqualValues(t, 9, countAdmitted(t, l, "k", 12))
}

// waitFetched waits until no lease of key's plan is being taken ahead.
func waitFetched(t *testing.T, l *Limiter, key, plan string) {
	t.Helper()
	require.Eventually(t, func() bool {
		e := l.leases.lookup(key, plan, false)
		e.mu.Lock()
		defer e.mu.Unlock()
		return e.fetched == nil
	}, 5*time.Second, time.Millisecond)
}

// TestPlanChangeRetiresTheLeaseBeforeDecisionsNoLeaseServes: after a
// downgrade, the first decision under the new plan is a Reserve, a chain
// or an Acquire, which no lease serves. The old lease must go back before
// it too, or its rest, given back later (here by Close), refills the
// bucket the new plan drained (before: 20 admitted at one instant under a
// plan of 10, for each).
func TestPlanChangeRetiresTheLeaseBeforeDecisionsNoLeaseServes(t *testing.T) {
	ctx := context.Background()
	big := Plan{Name: "hot", Capacity: 100, Rate: 1, Lease: 50}
	small := Plan{Name: "hot", Capacity: 10, Rate: 1}
	other := Plan{Name: "other", Capacity: 1000, Rate: 1}
	inflight := Plan{Name: "inflight", Capacity: 1000, Concurrency: true}
	for name, drain := range map[string]func(l *Limiter) int64{
		"Acquire": func(l *Limiter) int64 {
			var admitted int64
			for range 30 {
				p, err := l.Acquire(ctx, "k", 1, "inflight", "hot")
				require.NoError(t, err)
				if p.OK() {
					admitted++
					require.NoError(t, p.Release(ctx))
				}
			}
			return admitted
		},
		"Reserve": func(l *Limiter) int64 {
			rv, err := l.Reserve(ctx, "k", small.Capacity)
			require.NoError(t, err)
			if !rv.Result().Allowed {
				return 0
			}
			_, err = rv.Settle(ctx, small.Capacity)
			require.NoError(t, err)
			return small.Capacity
		},
		"chain": func(l *Limiter) int64 {
			var admitted int64
			for range 30 {
				r, err := l.Allow(ctx, "k", "hot", "other")
				require.NoError(t, err)
				if r.Allowed {
					admitted++
				}
			}
			return admitted
		},
	} {
		t.Run(name, func(t *testing.T) {
			rs, _, _ := newMiniredisStore(t)
			l, err := New(rs, []Plan{big, other, inflight}, WithLogger(nil))
			require.NoError(t, err)
			r, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, SourceStore, r.Source, "a lease of 50 taken")
			require.NoError(t, l.SetPlans([]Plan{small, other, inflight}))
			admitted := drain(l)
			require.NoError(t, l.Close())
			admitted += countAdmitted(t, plainLimiter(t, rs, small), "k", 30)
			assert.Equal(t, small.Capacity, admitted, "admitted under the plan of 10, at one instant")
		})
	}
}
