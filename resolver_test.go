package tollgate

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/tollgate-go/tollgate/breaker"
)

var (
	freeTier = Plan{Name: "api", Capacity: 2, Rate: 1}
	goldTier = Plan{Name: "api", Capacity: 10, Rate: 5}
)

// tiers is a resolver that gives the keys in gold the gold tier.
func tiers(gold map[string]bool) planResolver {
	return func(_ context.Context, key string, p Plan) (Plan, error) {
		if p.Name == "api" && gold[key] {
			return goldTier, nil
		}
		return p, nil
	}
}

func TestResolverAppliesTheKeysTier(t *testing.T) {
	ctx := context.Background()
	l, err := New(NewMemoryStore(), []Plan{freeTier}, WithLogger(nil), WithPlanResolver(tiers(map[string]bool{"g": true})))
	require.NoError(t, err)
	for key, want := range map[string]int{"f": 2, "g": 10} {
		admitted := 0
		for range 20 {
			r, err := l.Allow(ctx, key)
			require.NoError(t, err)
			if r.Allowed {
				admitted++
			}
		}
		assert.Equal(t, want, admitted, "key %s", key)
	}
	r, err := l.Allow(ctx, "g", "api")
	require.NoError(t, err)
	assert.Equal(t, []PlanResult{{Plan: "api", Limit: 10, Rate: 5, RetryAfter: r.RetryAfter, ResetAfter: r.ResetAfter}}, r.PlanResults(),
		"the Result describes the plan applied")
	st := l.Stats()
	require.Len(t, st.Plans, 1, "metrics are labelled by name, never by tier")
	assert.Equal(t, uint64(12), st.Plans[0].Allowed[SourceStore])
}

// An upgrade keeps the tokens left and refills toward the new capacity;
// a downgrade clamps to it: the plan's name is the bucket.
func TestTierChangeKeepsTokensAndClamps(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		var gold atomic.Bool
		l, err := New(NewMemoryStore(), []Plan{freeTier}, WithLogger(nil), WithPlanResolver(func(_ context.Context, _ string, p Plan) (Plan, error) {
			if gold.Load() {
				return goldTier, nil
			}
			return p, nil
		}))
		require.NoError(t, err)
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, int64(1), r.Remaining)
		gold.Store(true)
		r, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, int64(0), r.Remaining, "upgrade: the 1 token left, not a fresh bucket of 10")
		time.Sleep(2 * time.Second)
		r, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, int64(9), r.Remaining, "refilled toward 10 at the gold rate, 5/s")
		gold.Store(false)
		r, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, int64(1), r.Remaining, "downgrade: clamped to 2, then one taken")
	})
}

// A denial remembered under the free tier never masks an upgrade: the
// denial cache names plans with their parameters (Envoy's cache does not).
func TestTierUpgradeMidDenialIsAdmittedAtOnce(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		s := newCountingStore()
		var gold atomic.Bool
		l, err := New(s, []Plan{freeTier}, WithLogger(nil), WithPlanResolver(func(_ context.Context, _ string, p Plan) (Plan, error) {
			if gold.Load() {
				return goldTier, nil
			}
			return p, nil
		}))
		require.NoError(t, err)
		time.Sleep(time.Nanosecond) // off the instant of New: see testDenialCacheSparesTheStore
		_, err = l.AllowN(ctx, "k", 2)
		require.NoError(t, err)
		// Half a second: half a token at the free rate, 2.5 at gold's.
		time.Sleep(500 * time.Millisecond)
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.False(t, r.Allowed)
		r, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		require.False(t, r.Allowed)
		require.Equal(t, SourceCache, r.Source, "the denial cache is on and remembers the denial")
		gold.Store(true)
		r, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.True(t, r.Allowed, "the upgrade admits at once")
		assert.Equal(t, SourceStore, r.Source)
		assert.Equal(t, int64(10), r.Limit)
	})
}

// A denial remembered under the free tier does not outlive an upgrade and
// a downgrade: the gold tier refilled the bucket, and the store admits
// what Peek says remains.
func TestTierRoundTripForgetsRememberedDenials(t *testing.T) {
	free := Plan{Name: "api", Capacity: 2, Rate: Per(1, time.Hour)}
	gold := Plan{Name: "api", Capacity: 10, Rate: 1000}
	for name, newStore := range clockedStores() {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			s, advance := newStore(t)
			l, isGold := tierLimiter(t, s, free, gold)
			drainAndRemember(t, l, "k")
			isGold.Store(true)
			advance(time.Second)
			r, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			require.True(t, r.Allowed, "the upgrade admits at once")
			isGold.Store(false)

			admitsWhatPeekSays(t, l, "k", 2)
		})
	}
}

// ResolveAs names the key a resolver sees for one key of the bucket's
// kind; the bucket stays the key's, and other keys are seen as they are.
func TestResolveAsGivesTheResolverTheCallersKey(t *testing.T) {
	var seen []string
	l, err := New(NewMemoryStore(), []Plan{freeTier}, WithLogger(nil), WithPlanResolver(func(_ context.Context, key string, p Plan) (Plan, error) {
		seen = append(seen, key)
		if key == "g" {
			return goldTier, nil
		}
		return p, nil
	}))
	require.NoError(t, err)
	ctx := ResolveAs(context.Background(), "header:K:g", "g")
	ctx = ResolveAs(ctx, "principal:x", "x")
	r, err := l.Allow(ctx, "header:K:g")
	require.NoError(t, err)
	assert.Equal(t, int64(10), r.Limit, "the gold tier, found past the nearer ResolveAs")
	_, err = l.Allow(ctx, "principal:x")
	require.NoError(t, err)
	_, err = l.Allow(ctx, "g")
	require.NoError(t, err)
	assert.Equal(t, []string{"g", "x", "g"}, seen)
	r, err = l.Peek(ctx, "header:K:g")
	require.NoError(t, err)
	assert.Equal(t, int64(9), r.Remaining, "the bucket is the key's")
	r, err = l.Peek(context.Background(), "header:K:g")
	require.NoError(t, err)
	assert.Equal(t, int64(2), r.Limit, "without ResolveAs, the resolver sees the key")
}

func TestResolverBadAnswers(t *testing.T) {
	ctx := context.Background()
	errLookup := errors.New("tier lookup failed")
	tests := []struct {
		name    string
		resolve planResolver
		want    error
	}{
		{"error", func(context.Context, string, Plan) (Plan, error) { return Plan{}, errLookup }, errLookup},
		{"error is ErrResolver", func(context.Context, string, Plan) (Plan, error) { return Plan{}, errLookup }, ErrResolver},
		{"panic", func(context.Context, string, Plan) (Plan, error) { panic("boom") }, ErrResolver},
		{"invalid plan", func(_ context.Context, _ string, p Plan) (Plan, error) { p.Capacity = 0; return p, nil }, ErrInvalidPlan},
		{"NaN rate", func(_ context.Context, _ string, p Plan) (Plan, error) { p.Rate = -p.Rate; return p, nil }, ErrInvalidPlan},
		{"renamed", func(_ context.Context, _ string, p Plan) (Plan, error) { p.Name = "other"; return p, nil }, ErrInvalidPlan},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, policy := range []breaker.FailurePolicy{breaker.Fallback, breaker.FailOpen, breaker.FailClosed} {
				s := newCountingStore()
				l, err := New(s, []Plan{freeTier, {Name: "daily", Capacity: 5, Rate: 1}}, WithLogger(nil),
					WithFailurePolicy(policy), WithPlanResolver(tt.resolve))
				require.NoError(t, err)
				for _, names := range [][]string{nil, {"api", "daily"}} {
					r, err := l.Allow(ctx, "k", names...)
					require.ErrorIs(t, err, tt.want, "policy %v, plans %v", policy, names)
					assert.Equal(t, Result{}, r)
				}
				assert.Zero(t, s.calls.Load(), "nothing reaches the store")
			}
		})
	}
}

func TestExemptKeysSkipTheStore(t *testing.T) {
	ctx := context.Background()
	s := newCountingStore()
	exemptDaily := func(_ context.Context, key string, p Plan) (Plan, error) {
		if key == "admin" || key == "batch" && p.Name == "daily" {
			return Plan{}, ErrExempt
		}
		return p, nil
	}
	daily := Plan{Name: "daily", Capacity: 1, Rate: 1}
	l, err := New(s, []Plan{freeTier, daily}, WithLogger(nil), WithPlanResolver(exemptDaily))
	require.NoError(t, err)
	for range 5 {
		r, err := l.Allow(ctx, "admin", "api", "daily")
		require.NoError(t, err)
		assert.True(t, r.Allowed)
		assert.Equal(t, SourceExempt, r.Source)
	}
	assert.Zero(t, s.calls.Load(), "an exempt key never reaches the store")
	assert.Zero(t, l.Stats().Plans[0].Allowed[SourceStore]+l.Stats().Plans[0].Denied[SourceStore])

	// A bad cost is an error, exempt or not.
	for _, n := range []int64{0, -1} {
		_, err := l.AllowN(ctx, "admin", n, "api", "daily")
		require.ErrorIs(t, err, ErrInvalidCost, "cost %d", n)
	}

	// A context that has ended gets its error, exempt or not.
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	r, err := l.Allow(cctx, "admin", "api", "daily")
	require.ErrorIs(t, err, context.Canceled)
	assert.False(t, r.Allowed)

	// Exempt from one plan of a chain: the others still decide.
	admitted := 0
	for range 5 {
		r, err := l.Allow(ctx, "batch", "api", "daily")
		require.NoError(t, err)
		assert.Equal(t, "api", r.Plan)
		if r.Allowed {
			admitted++
		}
	}
	assert.Equal(t, 2, admitted, "api's capacity, not daily's")
}

func TestAllowPlans(t *testing.T) {
	ctx := context.Background()
	l, err := New(NewMemoryStore(), []Plan{freeTier}, WithLogger(nil))
	require.NoError(t, err)
	r, err := l.AllowPlans(ctx, "k", 1, goldTier)
	require.NoError(t, err)
	assert.Equal(t, int64(9), r.Remaining, "the plan given, in the bucket of its name")
	r, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, int64(1), r.Remaining, "the same bucket, clamped to the table's capacity of 2")

	search := Plan{Name: "search", Capacity: 3, Rate: 1}
	for range 4 {
		_, err = l.AllowPlans(ctx, "k2", 1, search, goldTier)
		require.NoError(t, err)
	}
	st := l.Stats()
	require.Len(t, st.Plans, 2)
	assert.Equal(t, "api", st.Plans[0].Plan, "the table's plans first")
	assert.Equal(t, "search", st.Plans[1].Plan, "then others, by name")
	assert.Equal(t, uint64(3), st.Plans[1].Allowed[SourceStore], "search bound every decision")
	assert.Equal(t, uint64(1), st.Plans[1].Denied[SourceStore])

	_, err = l.AllowPlans(ctx, "k", 1)
	assert.ErrorIs(t, err, ErrUnknownPlan)
	_, err = l.AllowPlans(ctx, "k", 1, Plan{Name: "bad", Capacity: 1})
	assert.ErrorIs(t, err, ErrInvalidPlan)
	_, err = l.AllowPlans(ctx, "k", 1, search, search)
	assert.ErrorIs(t, err, ErrInvalidPlan)
	_, err = l.AllowPlans(ctx, "", 1, search)
	assert.ErrorIs(t, err, ErrInvalidKey)
	_, err = l.AllowPlans(ctx, "k", 4, search)
	assert.ErrorIs(t, err, ErrInvalidCost)
}

// TestAllowPlansRefusalKeepsNoPlan: AllowPlans refuses a concurrency
// plan, which only Acquire takes, and keeps nothing of it, so that the
// name still takes a token bucket (before: the refused plan was kept as
// the name's, and every later AllowPlans of a bucket of that name got
// ErrInvalidPlan, 0 of 3 admitted).
func TestAllowPlansRefusalKeepsNoPlan(t *testing.T) {
	ctx := context.Background()
	l, err := New(NewMemoryStore(), []Plan{freeTier}, WithLogger(nil))
	require.NoError(t, err)
	_, err = l.AllowPlans(ctx, "k", 1, Plan{Name: "x", Capacity: 3, Concurrency: true})
	require.ErrorIs(t, err, ErrInvalidPlan)
	admitted := 0
	for range 4 {
		r, err := l.AllowPlans(ctx, "k", 1, Plan{Name: "x", Capacity: 3, Rate: 1})
		require.NoError(t, err)
		if r.Allowed {
			admitted++
		}
	}
	assert.Equal(t, 3, admitted)
}

// A resolver that returns cached plans, and AllowPlans given the same
// plans, allocate nothing per decision on the memory store: the Limiter
// keeps the plans it has seen, checked once.
func TestResolvedPlansAllocateNothing(t *testing.T) {
	ctx := context.Background()
	l, err := New(NewMemoryStore(), []Plan{freeTier}, WithLogger(nil), WithPlanResolver(tiers(map[string]bool{"g": true})))
	require.NoError(t, err)
	assert.Zero(t, testing.AllocsPerRun(100, func() { _, _ = l.Allow(ctx, "g") }))
	assert.Zero(t, testing.AllocsPerRun(100, func() { _, _ = l.AllowPlans(ctx, "g", 1, goldTier) }))
}

// Past 16 distinct plans of one name, each decides as well, only without
// being kept.
func TestVariantsAreBounded(t *testing.T) {
	ctx := context.Background()
	l, err := New(NewMemoryStore(), []Plan{freeTier}, WithLogger(nil))
	require.NoError(t, err)
	for c := int64(1); c <= 2*maxVariants; c++ {
		r, err := l.AllowPlans(ctx, "k", 1, Plan{Name: "api", Capacity: c + 100, Rate: 1})
		require.NoError(t, err)
		assert.Equal(t, c+100, r.Limit)
	}
	assert.Len(t, *l.table.Load().defaults.variants.Load(), maxVariants)
}

func TestFingerprintNamesEveryParameter(t *testing.T) {
	base := Plan{Name: "w", Capacity: 10, Window: time.Second, Slots: 4, Suppress: 1.5}
	seen := map[string]Plan{fingerprint(base): base}
	for _, p := range []Plan{
		{Name: "v", Capacity: 10, Window: time.Second, Slots: 4, Suppress: 1.5},
		{Name: "w", Capacity: 11, Window: time.Second, Slots: 4, Suppress: 1.5},
		{Name: "w", Capacity: 10, Window: 2 * time.Second, Slots: 4, Suppress: 1.5},
		{Name: "w", Capacity: 10, Window: time.Second, Slots: 5, Suppress: 1.5},
		{Name: "w", Capacity: 10, Window: time.Second, Slots: 4, Suppress: 2},
		{Name: "w", Capacity: 10, Window: time.Second, Slots: 4, Suppress: 1.5, Shadow: true},
		{Name: "w", Capacity: 10, Rate: 1},
		{Name: "w", Capacity: 10, Rate: 2},
	} {
		fp := fingerprint(p)
		_, dup := seen[fp]
		assert.False(t, dup, "%+v and %+v share %q", p, seen[fp], fp)
		seen[fp] = p
	}
}

// BenchmarkResolver measures what a resolver that returns a cached plan
// adds to a decision on the memory store: run the variants side by side
// (-count 6) and compare with benchstat.
func BenchmarkResolver(b *testing.B) {
	ctx := context.Background()
	gold := Plan{Name: "api", Capacity: 1 << 29, Rate: 1} // a cached tier: the resolver's own lookup is not measured
	for _, bc := range []struct {
		name string
		opts []Option
	}{
		{"none", nil},
		{"same-plan", []Option{WithPlanResolver(func(_ context.Context, _ string, p Plan) (Plan, error) { return p, nil })}},
		{"tier", []Option{WithPlanResolver(func(context.Context, string, Plan) (Plan, error) { return gold, nil })}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			l, err := New(NewMemoryStore(), []Plan{{Name: "api", Capacity: 1 << 30, Rate: 1}}, bc.opts...)
			require.NoError(b, err)
			b.ReportAllocs()
			for b.Loop() {
				_, _ = l.Allow(ctx, "user-1")
			}
		})
	}
	b.Run("allow-plans", func(b *testing.B) {
		l, err := New(NewMemoryStore(), []Plan{{Name: "api", Capacity: 1 << 30, Rate: 1}})
		require.NoError(b, err)
		p := Plan{Name: "api", Capacity: 1 << 29, Rate: 1}
		b.ReportAllocs()
		for b.Loop() {
			_, _ = l.AllowPlans(ctx, "user-1", 1, p)
		}
	})
}

// lateStore answers a Take on its inner store at once, but holds the
// reply of the first Take after hold is set until the channel is closed:
// a reply in flight.
type lateStore struct {
	Store
	hold atomic.Pointer[chan struct{}]
}

func (s *lateStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	r, err := s.Store.Take(ctx, key, cost, plans)
	if late := s.hold.Swap(nil); late != nil {
		<-*late
	}
	return r, err
}

// A denial under the free tier whose reply arrives after the key moved to
// gold and back is stale: gold refilled the bucket meanwhile. The cache
// refuses it, as it refuses one asked before SetPlans or Reset, and the
// store admits what Peek says remains.
func TestTierRoundTripRefusesADenialInFlight(t *testing.T) {
	free := Plan{Name: "api", Capacity: 2, Rate: Per(1, time.Hour)}
	gold := Plan{Name: "api", Capacity: 10, Rate: 1000}
	for name, newStore := range clockedStores() {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			inner, advance := newStore(t)
			s := &lateStore{Store: inner}
			l, isGold := tierLimiter(t, s, free, gold)
			time.Sleep(time.Millisecond) // off the instant of New: see testDenialCacheSparesTheStore
			_, err := l.AllowN(ctx, "k", 2)
			require.NoError(t, err)
			late := make(chan struct{})
			s.hold.Store(&late)
			denied := make(chan Result)
			go func() {
				r, _ := l.Allow(ctx, "k")
				denied <- r
			}()
			for s.hold.Load() != nil { // until the store decided the denial
				time.Sleep(time.Millisecond)
			}
			isGold.Store(true)
			advance(time.Second)
			r, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			require.True(t, r.Allowed, "gold refilled the bucket")
			isGold.Store(false)
			close(late)
			require.False(t, (<-denied).Allowed, "the free tier's denial, in flight until now")

			admitsWhatPeekSays(t, l, "k", 2)
		})
	}
}

// admitsWhatPeekSays demands that Peek finds want tokens of key left,
// clamped to the free tier's capacity, and that 6 Allows then admit
// exactly want: no denial remembered from another tier refuses them.
func admitsWhatPeekSays(t *testing.T, l *Limiter, key string, want int64) {
	t.Helper()
	ctx := context.Background()
	p, err := l.Peek(ctx, key)
	require.NoError(t, err)
	require.Equal(t, want, p.Remaining, "clamped to the free tier's capacity")
	var admitted int64
	for range 6 {
		r, err := l.Allow(ctx, key)
		require.NoError(t, err)
		if r.Allowed {
			admitted++
		}
	}
	assert.Equal(t, want, admitted, "of 6, where Peek said %d remain", want)
}

// tierLimiter returns a Limiter of plan free on s, with a denial cache,
// whose resolver answers gold for every key while the flag it returns is
// set.
func tierLimiter(t *testing.T, s Store, free, gold Plan) (*Limiter, *atomic.Bool) {
	t.Helper()
	isGold := new(atomic.Bool)
	l, err := New(s, []Plan{free}, WithLogger(nil), WithDenialCache(100),
		WithPlanResolver(func(_ context.Context, _ string, p Plan) (Plan, error) {
			if isGold.Load() {
				return gold, nil
			}
			return p, nil
		}))
	require.NoError(t, err)
	return l, isGold
}
