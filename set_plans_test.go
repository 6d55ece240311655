package tollgate

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

func TestSetPlansReplacesTheTable(t *testing.T) {
	ctx := context.Background()
	l := newTestLimiter(t, NewMemoryStore())
	require.NoError(t, l.SetPlans([]Plan{{Name: "silver", Capacity: 2, Rate: 1}, {Name: "gold", Capacity: 10, Rate: 1}}))
	p, ok := l.Plan("gold")
	require.True(t, ok)
	assert.Equal(t, int64(10), p.Capacity)
	_, ok = l.Plan("daily")
	assert.False(t, ok)
	_, err := l.Allow(ctx, "k", "daily")
	assert.ErrorIs(t, err, ErrUnknownPlan)
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, "silver", r.Plan, "no plan named: the first plan given")

	st := l.Stats()
	require.Len(t, st.Plans, 3)
	assert.Equal(t, []string{"silver", "gold", "daily"}, []string{st.Plans[0].Plan, st.Plans[1].Plan, st.Plans[2].Plan},
		"the table's plans in order, then names it no longer holds")
}

func TestSetPlansRejectsBadTablesAndKeepsTheOld(t *testing.T) {
	l := newTestLimiter(t, NewMemoryStore())
	for name, plans := range map[string][]Plan{
		"none":      nil,
		"duplicate": {{Name: "a", Capacity: 1, Rate: 1}, {Name: "a", Capacity: 2, Rate: 1}},
		"invalid":   {{Name: "a", Capacity: 1, Rate: 1}, {Name: "b", Capacity: 0, Rate: 1}},
		"bad name":  {{Name: "a b", Capacity: 1, Rate: 1}},
	} {
		assert.ErrorIs(t, l.SetPlans(plans), ErrInvalidPlan, name)
		p, ok := l.Plan("gold")
		require.True(t, ok, name)
		assert.Equal(t, testPlans[0], p, name)
	}
}

// A raised limit admits at once, never masked by a denial remembered
// under the old one.
func TestSetPlansUpgradeIsNotMaskedByTheDenialCache(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		l := newTestLimiter(t, newCountingStore())
		time.Sleep(time.Nanosecond) // off the instant of New: see testDenialCacheSparesTheStore
		_, err := l.AllowN(ctx, "k", 4, "gold")
		require.NoError(t, err)
		time.Sleep(250 * time.Millisecond) // half a token at 2/s
		r, err := l.Allow(ctx, "k", "gold")
		require.NoError(t, err)
		require.False(t, r.Allowed)
		r, err = l.Allow(ctx, "k", "gold")
		require.NoError(t, err)
		require.Equal(t, SourceCache, r.Source)
		require.NoError(t, l.SetPlans([]Plan{{Name: "gold", Capacity: 4, Rate: 20}, testPlans[1]}))
		r, err = l.Allow(ctx, "k", "gold")
		require.NoError(t, err)
		assert.True(t, r.Allowed, "5 tokens accrued at the new rate")
	})
}

// A denial remembered under a slow plan does not outlive a round trip
// through a fast one, which refilled the bucket: here or on another
// instance, which this one cannot hear.
func TestSetPlansRoundTripForgetsRememberedDenials(t *testing.T) {
	slow := Plan{Name: "api", Capacity: 2, Rate: Per(1, time.Hour)}
	fast := Plan{Name: "api", Capacity: 2, Rate: 1000}
	for name, newStore := range clockedStores() {
		for _, elsewhere := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/fast decision elsewhere %t", name, elsewhere), func(t *testing.T) {
				ctx := context.Background()
				s, advance := newStore(t)
				l, err := New(s, []Plan{slow}, WithLogger(nil), WithDenialCache(100))
				require.NoError(t, err)
				other, err := New(s, []Plan{fast}, WithLogger(nil), WithDenialCache(100))
				require.NoError(t, err)
				drainAndRemember(t, l, "k")
				require.NoError(t, l.SetPlans([]Plan{fast}))
				advance(time.Second)
				decider := l
				if elsewhere {
					decider = other
				}
				r, err := decider.Allow(ctx, "k")
				require.NoError(t, err)
				require.True(t, r.Allowed, "the fast plan refilled the bucket")
				require.NoError(t, l.SetPlans([]Plan{slow}))

				p, err := l.Peek(ctx, "k")
				require.NoError(t, err)
				require.True(t, p.Allowed)
				require.Equal(t, int64(1), p.Remaining)
				r, err = l.Allow(ctx, "k")
				require.NoError(t, err)
				assert.True(t, r.Allowed, "Peek said a token remains; denied with RetryAfter %v", r.RetryAfter)
				assert.Equal(t, SourceStore, r.Source)
			})
		}
	}
}

// A denial remembered under one plan never answers for the plan of its
// name that a resolver gives next with a new Version or of another kind:
// the cache names a plan by every parameter, version and kind included,
// so the first request under the new plan asks the store, which answers
// otherwise: a version that resets admits, a window that counts what the
// bucket used denies for its window, not for the bucket's hour.
func TestNewVersionOrKindForgetsRememberedDenials(t *testing.T) {
	old := Plan{Name: "api", Capacity: 2, Rate: Per(1, time.Hour)}
	for _, tc := range []struct {
		name string
		next Plan
	}{
		{"version", Plan{Name: "api", Capacity: 2, Rate: Per(1, time.Hour), Version: 2, Inherit: InheritReset}},
		{"kind", Plan{Name: "api", Capacity: 2, Window: time.Minute}},
	} {
		for name, newStore := range clockedStores() {
			t.Run(tc.name+"/"+name, func(t *testing.T) {
				ctx := context.Background()
				s, _ := newStore(t)
				var changed atomic.Bool
				l, err := New(s, []Plan{old}, WithLogger(nil), WithDenialCache(100),
					WithPlanResolver(func(_ context.Context, _ string, p Plan) (Plan, error) {
						if changed.Load() {
							return tc.next, nil
						}
						return p, nil
					}))
				require.NoError(t, err)
				drainAndRemember(t, l, "k")
				changed.Store(true)
				r, err := l.Allow(ctx, "k")
				require.NoError(t, err)
				assert.Equal(t, SourceStore, r.Source, "the new plan is asked of the store")
				if !tc.next.isWindow() {
					assert.True(t, r.Allowed, "version 2 reset the bucket")
					return
				}
				assert.False(t, r.Allowed, "the window counts what the bucket used")
				assert.LessOrEqual(t, r.RetryAfter, time.Minute+time.Minute/20,
					"until the window's counts leave (its window and a sub-window at most), not the bucket's hour")
			})
		}
	}
}

// SetPlans races with decisions, Stats and Plan: run with -race.
func TestSetPlansRacesWithAllow(t *testing.T) {
	ctx := context.Background()
	l := newTestLimiter(t, NewMemoryStore())
	tables := [][]Plan{testPlans, {{Name: "gold", Capacity: 8, Rate: 4}, {Name: "daily", Capacity: 50, Rate: 1}}}
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for range 500 {
				_, err := l.Allow(ctx, "k", "gold", "daily")
				assert.NoError(t, err)
				_, err = l.Allow(ctx, "k")
				assert.NoError(t, err)
				_, _ = l.Plan("gold")
				if g == 0 {
					_ = l.Stats()
				}
			}
		})
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for i := 0; ; i++ {
		select {
		case <-done:
		default:
			require.NoError(t, l.SetPlans(tables[i%2]))
			continue
		}
		break
	}
	st := l.Stats()
	assert.Equal(t, "gold", st.Plans[0].Plan)
	assert.Positive(t, st.Plans[0].Allowed[SourceStore])
}

// TestRollingDeployStaysWithinTheTransitionBound has two instances with
// different plans of one name alternate on one key, as during a rolling
// deploy, on a real Redis: admissions stay within max(old, new) capacity
// + max(old, new) rate × elapsed, elapsed read from Redis TIME.
func TestRollingDeployStaysWithinTheTransitionBound(t *testing.T) {
	addr := redistest.Addr(t)
	ctx := context.Background()
	prefix := redistest.KeyPrefix()
	old := Plan{Name: "api", Capacity: 200, Rate: 100}
	next := Plan{Name: "api", Capacity: 100, Rate: 400}
	var limiters [2]*Limiter
	for i, p := range []Plan{old, next} {
		l, err := New(NewRedisStore(redistest.NewClient(t, &redis.Options{Addr: addr}), WithKeyPrefix(prefix)), []Plan{p},
			WithFailurePolicy(breaker.FailClosed), WithLogger(nil), WithDenialCache(0))
		require.NoError(t, err)
		limiters[i] = l
	}
	probe := redistest.NewClient(t, &redis.Options{Addr: addr})
	start := redistest.Time(t, probe)
	admitted := 0
	for step := range 10_000 {
		r, err := limiters[step%2].Allow(ctx, "k")
		require.NoError(t, err)
		if r.Allowed {
			admitted++
		}
	}
	end := redistest.Time(t, probe)
	bound := float64(max(old.Capacity, next.Capacity)) + max(old.Rate, next.Rate)*float64(end-start)/1e6
	t.Logf("admitted %d of 10000 in %.3f s; bound %.1f", admitted, float64(end-start)/1e6, bound)
	assert.LessOrEqual(t, float64(admitted), bound)
	assert.Less(t, admitted, 10_000, "the test must push past the limit")
}

// TestConcurrencyPlanNeedsAStoreThatHoldsPermits: New and SetPlans refuse
// a concurrency plan on a store, or a fallback store, that cannot hold
// permits, whose every Acquire would fail. Before, New took it and each
// Acquire returned errors.ErrUnsupported: httplimit answered every
// request 500.
func TestConcurrencyPlanNeedsAStoreThatHoldsPermits(t *testing.T) {
	inflight := Plan{Name: "inflight", Capacity: 2, Concurrency: true}
	_, err := New(foreignStore{NewMemoryStore()}, []Plan{testPlans[0], inflight})
	assert.ErrorIs(t, err, errors.ErrUnsupported, "the store holds no permits")
	rs, _, _ := newMiniredisStore(t)
	_, err = New(rs, []Plan{inflight}, WithFallback(foreignStore{NewMemoryStore()}))
	assert.ErrorIs(t, err, errors.ErrUnsupported, "the fallback holds no permits")

	l := newTestLimiter(t, foreignStore{NewMemoryStore()})
	assert.ErrorIs(t, l.SetPlans([]Plan{testPlans[0], inflight}), errors.ErrUnsupported)
	_, ok := l.Plan("inflight")
	assert.False(t, ok, "the old plans stay")
	l, err = New(NewMemoryStore(), []Plan{testPlans[0], inflight}, WithFallback(NewMemoryStore()))
	require.NoError(t, err, "a MemoryStore holds permits")
	require.NoError(t, l.Close())
}

// TestSetPlansKeepsTheDefaultsKind: the plan a call that names none uses
// cannot become, or stop being, a concurrency plan, since its callers
// (httplimit and grpclimit without WithPlans among them) Acquire or
// Allow by its kind, checked when they were built. Before, SetPlans took
// the new table and every such call failed.
func TestSetPlansKeepsTheDefaultsKind(t *testing.T) {
	inflight := Plan{Name: "inflight", Capacity: 2, Concurrency: true}
	l := newTestLimiter(t, NewMemoryStore())
	assert.ErrorIs(t, l.SetPlans([]Plan{inflight, testPlans[0]}), ErrInvalidPlan)
	assert.Equal(t, testPlans[0], l.DefaultPlan(), "the old plans stay")
	require.NoError(t, l.SetPlans([]Plan{testPlans[1], inflight}), "another rate plan first")
	assert.Equal(t, testPlans[1], l.DefaultPlan())

	l, err := New(NewMemoryStore(), []Plan{inflight, testPlans[0]}, WithLogger(nil))
	require.NoError(t, err)
	assert.ErrorIs(t, l.SetPlans([]Plan{testPlans[0], inflight}), ErrInvalidPlan)
	assert.Equal(t, inflight, l.DefaultPlan(), "the old plans stay")
	other := Plan{Name: "other", Capacity: 1, Concurrency: true}
	require.NoError(t, l.SetPlans([]Plan{other, testPlans[0]}), "another concurrency plan first")
	assert.Equal(t, other, l.DefaultPlan())
}

// TestConcurrentSetPlansKeepKinds: of two SetPlans at once, one adding
// plan x as a concurrency plan and the other as a token bucket, the one
// that lands second sees x of the other kind and fails: never both.
func TestConcurrentSetPlansKeepKinds(t *testing.T) {
	l := newTestLimiter(t, NewMemoryStore())
	withX := func(x Plan) []Plan { return []Plan{testPlans[0], x} }
	permits := withX(Plan{Name: "x", Capacity: 2, Concurrency: true})
	tokens := withX(Plan{Name: "x", Capacity: 2, Rate: 1})
	for range 20000 {
		require.NoError(t, l.SetPlans(testPlans))
		var wg sync.WaitGroup
		var landed atomic.Int32
		for _, plans := range [][]Plan{permits, tokens} {
			wg.Go(func() {
				if l.SetPlans(plans) == nil {
					landed.Add(1)
				}
			})
		}
		wg.Wait()
		require.EqualValues(t, 1, landed.Load(), "x changed its kind")
	}
}

// TestAPlanKeepsItsKindAcrossATableWithoutIt: a concurrency plan removed
// by one SetPlans and given back as a token bucket by the next (or the
// other way) changes its kind as surely as in one step: a bucket's
// decision would overwrite the permits still held, and the plan given
// back as a concurrency plan would grant its capacity again while they
// work. A name keeps its kind for the Limiter's life.
func TestAPlanKeepsItsKindAcrossATableWithoutIt(t *testing.T) {
	inflight := Plan{Name: "inflight", Capacity: 2, Concurrency: true}
	asTokens := Plan{Name: "inflight", Capacity: 2, Rate: 1}
	l := newTestLimiter(t, NewMemoryStore())
	require.NoError(t, l.SetPlans([]Plan{testPlans[0], inflight}))
	require.NoError(t, l.SetPlans([]Plan{testPlans[0]}), "a table without it")
	assert.ErrorIs(t, l.SetPlans([]Plan{testPlans[0], asTokens}), ErrInvalidPlan, "given back as a token bucket")
	require.NoError(t, l.SetPlans([]Plan{testPlans[0], inflight}), "given back as it was")

	l = newTestLimiter(t, NewMemoryStore())
	require.NoError(t, l.SetPlans([]Plan{testPlans[0], asTokens}))
	require.NoError(t, l.SetPlans([]Plan{testPlans[0]}))
	assert.ErrorIs(t, l.SetPlans([]Plan{testPlans[0], inflight}), ErrInvalidPlan, "given back as a concurrency plan")
}

// TestProportionalScaleForgottenVoidsTheRefund: a name pushed out of the
// history by maxHistoryNames others, and back, starts its scale anew,
// which tells nothing of the reservations taken before: their refunds are
// void. So are those of a plan without a Version across a proportional
// version, whose bucket kept the capacity of a version before it; one
// across no proportional version is whole.
func TestProportionalScaleForgottenVoidsTheRefund(t *testing.T) {
	p := Plan{Name: "p", Capacity: 100, Rate: 1, Version: 1}
	half := Plan{Name: "p", Capacity: 50, Rate: 1, Version: 2, Inherit: InheritProportional}
	then := &planTable{plans: []Plan{p}, history: historyAfter(nil, []Plan{p})}
	away := then
	for round := 0; round < 64; round++ { // each round keeps some of the names before it, at random
		if _, kept := away.history.byName["p"]; !kept {
			break
		}
		others := make([]Plan, maxHistoryNames)
		for i := range others {
			others[i] = Plan{Name: fmt.Sprint(round, "/", i), Capacity: 1, Rate: 1}
		}
		away = &planTable{plans: others, history: historyAfter(away, others)}
	}
	_, kept := away.history.byName["p"]
	require.False(t, kept, "forgotten")
	back := historyAfter(away, []Plan{half})
	assert.Zero(t, refundScale([]Plan{p}, 0, &then.history, &back), "forgotten, then proportional")
	again := historyAfter(then, []Plan{half})
	assert.Equal(t, 0.5, refundScale([]Plan{p}, 0, &then.history, &again))
	assert.Equal(t, 1.0, refundScale([]Plan{p}, 1, &then.history, &again), "plan 0 left alone")
	unversioned := p
	unversioned.Version = 0
	assert.Zero(t, refundScale([]Plan{unversioned}, 0, &then.history, &again))
	same := historyAfter(then, []Plan{p})
	assert.Equal(t, 1.0, refundScale([]Plan{unversioned}, 0, &then.history, &same))
}
