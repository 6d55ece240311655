package tollgate

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redisscript"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// shadowed returns p in dry run.
func shadowed(p Plan) Plan {
	p.Shadow = true
	return p
}

// TestShadowBucketEqualsEnforcedTwin feeds the same trace to a shadowed
// plan and to its enforced twin, on the script (miniredis, its TIME set
// per step) and on the MemoryStore (its clock set alike): the shadowed
// plan allows everything, says "would deny" exactly where the twin
// denies, reports what the twin reports, and keeps the same state. The
// two stores agree on every Result.
func TestShadowBucketEqualsEnforcedTwin(t *testing.T) {
	ctx := context.Background()
	steps := 2000
	if testing.Short() {
		steps = 400
	}
	third := Plan{Name: "third", Capacity: 3, Rate: 1.0 / 3}
	roomy := Plan{Name: "roomy", Capacity: 1000, Window: time.Minute} // never denies here
	for _, tt := range []struct {
		name  string
		plans []Plan // the first is shadowed on one key, enforced on its twin
	}{
		{"b", []Plan{{Name: "b", Capacity: 5, Rate: 2}}},
		{"w", []Plan{{Name: "w", Capacity: 5, Window: time.Second, Slots: 4}}},
		// A rate that leaves a fraction of a micro-token to carry: the
		// twin's wait is measured from the stamp as stored, also when
		// chained with a window, which the MemoryStore decides apart.
		{"third", []Plan{third}},
		{"third chained with a window", []Plan{third, roomy}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rs, _, setTime := newMiniredisStore(t)
			now := t0
			ms := newClockedMemoryStore(&now)
			rng := rand.New(rand.NewPCG(1, 2))
			p := tt.plans[0]
			shadowPlans := append([]Plan{shadowed(p)}, tt.plans[1:]...)
			denied := 0
			for step := range steps {
				now += rng.Int64N(400_000) // µs
				setTime(now)
				cost := 1 + rng.Int64N(2)
				var results [2][2]Result // by store, shadowed then enforced
				for i, s := range []Store{rs, ms} {
					sh, err := s.Take(ctx, "shadow", cost, shadowPlans)
					require.NoError(t, err)
					en, err := s.Take(ctx, "twin", cost, tt.plans)
					require.NoError(t, err)
					results[i] = [2]Result{sh, en}
					require.True(t, sh.Allowed, "step %d: a shadowed plan never denies", step)
					require.Equal(t, !en.Allowed, sh.ShadowDenied, "step %d: would deny exactly where the twin denies", step)
					// The window, which the twin's denials leave alone, may differ.
					want := en.PlanResults()[0]
					want.Shadow, want.WouldDeny = true, !en.Allowed
					require.Equal(t, want, sh.PlanResults()[0], "step %d, store %d", step, i)
				}
				require.Equal(t, results[0], results[1], "step %d: the script and the MemoryStore agree", step)
				if results[0][1].Allowed {
					continue
				}
				denied++
			}
			assert.Greater(t, denied, steps/20, "the trace must push past the limit")
			assert.Less(t, denied, steps-steps/20, "and admit too")
			shadowState, twinState := storedAt(t, rs.client, rs.Key("shadow", p.Name)), storedAt(t, rs.client, rs.Key("twin", p.Name))
			assert.Equal(t, twinState, shadowState, "the stored state is the twin's")
		})
	}
}

// TestShadowedVersionsMatchTheirTwins: a new version of a plan every 25
// steps, inheriting by reset, addition or proportion in turn, and the
// unversioned plan, take turns at random on a shadowed key and on its
// enforced twin, on the script and on the MemoryStore. A shadowed version
// inherits once, as its twin does, and keeps the version it wrote: it
// would deny exactly where the twin denies, and its stored bucket,
// version included, is the twin's.
func TestShadowedVersionsMatchTheirTwins(t *testing.T) {
	ctx := context.Background()
	unversioned := Plan{Name: "v", Capacity: 4, Rate: 0.5}
	inherits := []Inheritance{InheritReset, InheritAdditive, InheritProportional}
	rs, _, setTime := newMiniredisStore(t)
	now := t0
	ms := newClockedMemoryStore(&now)
	rng := rand.New(rand.NewPCG(3, 4))
	denied := 0
	for step := range 500 {
		now += rng.Int64N(300_000) // µs
		setTime(now)
		v := uint32(1 + step/25)
		p := Plan{Name: "v", Capacity: 4 + int64(v%3)*2, Rate: 0.5, Version: v, Inherit: inherits[v%3]}
		if rng.IntN(3) == 0 {
			p = unversioned
		}
		for _, s := range []Store{rs, ms} {
			sh, err := s.Take(ctx, "shadow", 1, []Plan{shadowed(p)})
			require.NoError(t, err)
			en, err := s.Take(ctx, "twin", 1, []Plan{p})
			require.NoError(t, err)
			require.True(t, sh.Allowed, "step %d", step)
			require.Equal(t, !en.Allowed, sh.ShadowDenied, "step %d: would deny exactly where the twin denies", step)
			want := en.PlanResults()[0]
			want.Shadow, want.WouldDeny = true, !en.Allowed
			require.Equal(t, []PlanResult{want}, sh.PlanResults(), "step %d", step)
			if s == Store(rs) && !en.Allowed {
				denied++
			}
		}
	}
	assert.Greater(t, denied, 50, "the trace must push past the limit")
	assert.Less(t, denied, 450, "and admit too")
	assert.Equal(t, storedBucket(t, rs.client, rs.Key("twin", "v")), storedBucket(t, rs.client, rs.Key("shadow", "v")))
	assert.Equal(t, int64(20), storedBucket(t, rs.client, rs.Key("shadow", "v")).Version)
}

// In a chain, shadowed plans never deny and never bind while a plan is
// enforced; the enforced plans decide, and the shadowed plan's bucket is
// drained only when the request is allowed and it fits.
func TestShadowInAChain(t *testing.T) {
	ctx := context.Background()
	for _, s := range []Store{NewMemoryStore(), func() Store { rs, _, _ := newMiniredisStore(t); return rs }()} {
		enforced := Plan{Name: "e", Capacity: 3, Rate: 0.001}
		shadow := Plan{Name: "s", Capacity: 1, Rate: 0.001, Shadow: true}
		plans := []Plan{shadow, enforced}
		var got []bool
		for range 4 {
			r, err := s.Take(ctx, "k", 1, plans)
			require.NoError(t, err)
			got = append(got, r.Allowed)
			assert.Equal(t, "e", r.Plan, "the enforced plan binds")
			prs := r.PlanResults()
			assert.Equal(t, r.ShadowDenied, prs[0].WouldDeny)
			assert.False(t, prs[1].WouldDeny)
		}
		assert.Equal(t, []bool{true, true, true, false}, got, "the enforced plan decides")
		r, err := s.Take(ctx, "k", 0, plans)
		require.NoError(t, err)
		assert.Equal(t, int64(0), r.PlanResults()[0].Remaining, "the shadowed plan was drained once, when it fit")
		assert.True(t, r.ShadowDenied, "a read tells that the shadowed plan would deny")
		assert.False(t, r.Allowed, "the enforced plan is empty")
	}
}

// WithShadow shadows every plan, including those of SetPlans and
// AllowPlans: nothing is denied, every decision reaches the store, and
// Stats counts the would-be denials per plan.
func TestWithShadowNeverDenies(t *testing.T) {
	ctx := context.Background()
	s := newCountingStore()
	l, err := New(s, testPlans, WithLogger(nil), WithShadow())
	require.NoError(t, err)
	for range 10 {
		r, err := l.Allow(ctx, "k", "gold")
		require.NoError(t, err)
		require.True(t, r.Allowed)
		require.Equal(t, SourceStore, r.Source, "no denial is remembered: every decision reaches the store")
	}
	assert.Equal(t, int64(10), s.calls.Load())
	r, err := l.AllowPlans(ctx, "k", 1, Plan{Name: "other", Capacity: 1, Rate: 0.001})
	require.NoError(t, err)
	assert.True(t, r.Allowed)
	_, err = l.AllowPlans(ctx, "k", 1, Plan{Name: "other", Capacity: 1, Rate: 0.001})
	require.NoError(t, err)
	require.NoError(t, l.SetPlans([]Plan{{Name: "gold", Capacity: 1, Rate: 0.001}}))
	p, _ := l.Plan("gold")
	assert.True(t, p.Shadow)

	st := l.Stats()
	assert.Equal(t, "gold", st.Plans[0].Plan)
	assert.Equal(t, uint64(6), st.Plans[0].ShadowDenied, "10 asked of a bucket of 4")
	assert.Equal(t, uint64(10), st.Plans[0].Allowed[SourceStore])
	assert.Equal(t, "other", st.Plans[2].Plan)
	assert.Equal(t, uint64(1), st.Plans[2].ShadowDenied)
}

// The script reports a shadowed plan's would-be denial as a bit next to
// the allowed flag; a bit for an enforced plan is a bad reply.
func TestShadowReplyBits(t *testing.T) {
	plans := []Plan{{Name: "e", Capacity: 1, Rate: 1}, {Name: "s", Capacity: 1, Rate: 1, Shadow: true}}
	buckets := make([]TokenBucket, 2)
	allowed, _, wd, err := parseReply(buckets, nil, []any{int64(1 + 2*2), t0, int64(0), t0, int64(0), t0}, plans, 1)
	require.NoError(t, err)
	assert.True(t, allowed)
	assert.Equal(t, uint64(2), wd)
	_, _, _, err = parseReply(buckets, nil, []any{int64(1 + 2*1), t0, int64(0), t0, int64(0), t0}, plans, 1)
	assert.ErrorIs(t, err, redisscript.ErrBadReply)
}

// On a real Redis, a shadowed plan that would deny is reported and left
// as it was, next to an enforced plan that is drained.
func TestShadowOnRealRedis(t *testing.T) {
	ctx := context.Background()
	c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
	s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	plans := []Plan{{Name: "e", Capacity: 100, Rate: 0.001}, {Name: "s", Capacity: 1, Rate: 0.001, Shadow: true},
		{Name: "w", Capacity: 1, Window: time.Hour, Shadow: true}}
	r, err := s.Take(ctx, "k", 1, plans)
	require.NoError(t, err)
	require.False(t, r.ShadowDenied)
	before := c.Get(ctx, s.Key("k", "s")).Val()
	r, err = s.Take(ctx, "k", 1, plans)
	require.NoError(t, err)
	assert.True(t, r.Allowed)
	assert.True(t, r.ShadowDenied)
	prs := r.PlanResults()
	assert.Equal(t, []bool{false, true, true}, []bool{prs[0].WouldDeny, prs[1].WouldDeny, prs[2].WouldDeny})
	assert.Equal(t, int64(98), prs[0].Remaining)
	assert.Equal(t, before, c.Get(ctx, s.Key("k", "s")).Val(), "left as it was")
}

// storedAt returns what key holds: a bucket's string or a window's hash.
func storedAt(t testing.TB, c redis.Cmdable, key string) any {
	t.Helper()
	if v, err := c.Get(context.Background(), key).Result(); err == nil {
		return v
	}
	h, err := c.HGetAll(context.Background(), key).Result()
	require.NoError(t, err)
	require.NotEmpty(t, h)
	return h
}

// In a chain, a would-be denial is counted under the shadowed plan that
// would have denied, not the plan that bound the decision.
func TestShadowDenialsCountedByThePlanThatWouldDeny(t *testing.T) {
	l, err := New(NewMemoryStore(), []Plan{{Name: "now", Capacity: 10, Rate: 1}, {Name: "next", Capacity: 1, Rate: 0.001, Shadow: true}}, WithLogger(nil))
	require.NoError(t, err)
	for range 3 {
		_, err := l.Allow(context.Background(), "k", "now", "next")
		require.NoError(t, err)
	}
	st := l.Stats()
	assert.Equal(t, []uint64{0, 2}, []uint64{st.Plans[0].ShadowDenied, st.Plans[1].ShadowDenied})
	assert.Equal(t, uint64(3), st.Plans[0].Allowed[SourceStore], "the enforced plan bound every decision")
}

// BenchmarkShadow compares a shadowed plan with the same plan enforced,
// on the memory store: allowed (the bucket has the tokens), and refused
// (an empty bucket: denied when enforced, would-deny when shadowed).
func BenchmarkShadow(b *testing.B) {
	ctx := context.Background()
	for _, bc := range []struct {
		name     string
		capacity int64
	}{{"allowed", 1 << 30}, {"refused", 1}} { // refused: 10 tokens/s, spent at once
		for _, shadow := range []bool{false, true} {
			b.Run(bc.name+"/"+map[bool]string{false: "enforced", true: "shadow"}[shadow], func(b *testing.B) {
				l, err := New(NewMemoryStore(), []Plan{{Name: "p", Capacity: bc.capacity, Rate: 10, Shadow: shadow}})
				require.NoError(b, err)
				_, _ = l.Allow(ctx, "user-1")
				b.ReportAllocs()
				for b.Loop() {
					_, _ = l.Allow(ctx, "user-1")
				}
			})
		}
	}
}

// A shadowed plan whose capacity is below the cost would deny the request
// whatever its bucket holds, where an enforced one refuses it
// (ErrInvalidCost): the enforced plans alone decide, and the shadowed plan
// is reported as would deny and keeps its tokens, when taking, reading,
// reserving and acquiring, on the MemoryStore and on the script.
func TestShadowedPlanBelowTheCostWouldDeny(t *testing.T) {
	ctx := context.Background()
	e := Plan{Name: "e", Capacity: 100, Rate: 0.001}
	s := Plan{Name: "s", Capacity: 10, Rate: 0.001, Shadow: true}
	w := Plan{Name: "w", Capacity: 10, Window: time.Hour, Shadow: true}
	tiny := Plan{Name: "tiny", Capacity: 10, Rate: 0.001}
	c := Plan{Name: "c", Capacity: 100, Concurrency: true}
	rs, mr, _ := newMiniredisStore(t)
	for name, store := range map[string]Store{"memory": NewMemoryStore(), "script": rs} {
		t.Run(name, func(t *testing.T) {
			l, err := New(store, []Plan{e, s, w, tiny, c}, WithLogger(nil))
			require.NoError(t, err)
			wouldDeny := func(p Plan) PlanResult {
				return PlanResult{Plan: p.Name, Limit: 10, Remaining: 10, Rate: p.Rate, Window: p.Window, Shadow: true, WouldDeny: true}
			}
			r, err := l.AllowN(ctx, "k", 20, "e", "s", "w")
			require.NoError(t, err)
			assert.True(t, r.Allowed)
			assert.True(t, r.ShadowDenied)
			assert.Equal(t, []any{"e", int64(80)}, []any{r.Plan, r.Remaining}, "the enforced plan binds")
			assert.Equal(t, []PlanResult{{Plan: "e", Limit: 100, Remaining: 80, ResetAfter: r.ResetAfter, Rate: 0.001}, wouldDeny(s), wouldDeny(w)}, r.PlanResults())

			r, err = l.PeekN(ctx, "k", 20, "e", "s")
			require.NoError(t, err)
			assert.Equal(t, []bool{true, true}, []bool{r.Allowed, r.ShadowDenied})

			rv, err := l.Reserve(ctx, "k", 20, "e", "s")
			require.NoError(t, err)
			require.True(t, rv.OK())
			assert.True(t, rv.Result().ShadowDenied)
			st, err := rv.Settle(ctx, 5)
			require.NoError(t, err)
			assert.Equal(t, int64(15), st.Refunded)

			p, err := l.Acquire(ctx, "k", 20, "c", "s")
			require.NoError(t, err)
			require.True(t, p.OK())
			assert.True(t, p.Result().ShadowDenied)
			require.NoError(t, p.Release(ctx))

			r, err = l.Peek(ctx, "k", "e", "s", "w")
			require.NoError(t, err)
			prs := r.PlanResults()
			assert.Equal(t, []int64{75, 10, 10}, []int64{prs[0].Remaining, prs[1].Remaining, prs[2].Remaining}, "nothing taken from s and w")

			_, err = l.AllowN(ctx, "k", 20, "e", "tiny")
			assert.ErrorIs(t, err, ErrInvalidCost, "an enforced plan below the cost")

			stats := l.Stats()
			assert.Equal(t, []uint64{0, 3, 1}, []uint64{stats.Plans[0].ShadowDenied, stats.Plans[1].ShadowDenied, stats.Plans[2].ShadowDenied})
		})
	}
	assert.False(t, mr.Exists(rs.Key("k", "s")), "the script never wrote s")
	assert.False(t, mr.Exists(rs.Key("k", "w")))
}

// A Limiter whose plans are all shadowed (WithShadow) allows a request
// above a plan's capacity, reported as would deny, on the store and on
// the fallback's share while the store fails.
func TestWithShadowAllowsACostAboveTheCapacity(t *testing.T) {
	ctx := context.Background()
	plan := Plan{Name: "p", Capacity: 100, Rate: 0.001}
	mr := miniredis.RunT(t)
	l := newFleetLimiter(t, mr, []Plan{plan, {Name: "q", Capacity: 1000, Rate: 0.001}}, WithShadow())
	l.fleet.size.Store(4)
	for _, down := range []bool{false, true} {
		if down {
			mr.SetError("LOADING Redis is loading the dataset in memory")
		}
		r, err := l.AllowN(ctx, "k", 200)
		require.NoError(t, err, "down %v", down)
		assert.Equal(t, []any{true, true, "p", int64(100)}, []any{r.Allowed, r.ShadowDenied, r.Plan, r.Limit})
		r, err = l.AllowN(ctx, "k", 200, "p", "q")
		require.NoError(t, err, "down %v", down)
		assert.Equal(t, []bool{true, true, false}, []bool{r.Allowed, r.PlanResults()[0].WouldDeny, r.PlanResults()[1].WouldDeny})
	}
	assert.Equal(t, uint64(4), l.Stats().Plans[0].ShadowDenied)
}

// The denial cache and leases answer for the enforced plans alone: a
// remembered denial, and a lease, are reported with the shadowed plan
// below the cost as would deny.
func TestShadowedPlanBelowTheCostBesideCacheAndLease(t *testing.T) {
	ctx := context.Background()
	s := Plan{Name: "s", Capacity: 10, Rate: 0.001, Shadow: true}
	for _, tt := range []struct {
		name string
		e    Plan
		want Source
	}{
		{"cache", Plan{Name: "e", Capacity: 20, Rate: 0.001}, SourceCache},
		{"lease", Plan{Name: "e", Capacity: 200, Rate: 0.001, Lease: 100}, SourceLease},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rs, _, _ := newMiniredisStore(t)
			l, err := New(rs, []Plan{tt.e, s}, WithLogger(nil), WithDenialCache(100))
			require.NoError(t, err)
			t.Cleanup(func() { _ = l.Close() })
			var r Result
			for range 3 {
				r, err = l.AllowN(ctx, "k", 20, "e", "s")
				require.NoError(t, err)
			}
			assert.Equal(t, tt.want, r.Source)
			assert.Equal(t, []bool{true, false, true}, []bool{r.ShadowDenied, r.PlanResults()[0].WouldDeny, r.PlanResults()[1].WouldDeny})
		})
	}
}

// summaryStore is a Store of another package that answers with the
// exported fields of a Result alone, as one on another database must: it
// cannot tell of each plan of a chain (PlanResults has one element). It
// allows everything, and tells of the first plan.
type summaryStore struct{ Store }

func (summaryStore) Take(_ context.Context, _ string, _ int64, plans []Plan) (Result, error) {
	return Result{Allowed: true, Plan: plans[0].Name, Limit: plans[0].Capacity, Remaining: plans[0].Capacity}, nil
}

// TestShadowedPlanBelowTheCostOnAStoreOfAnotherPackage: a chain of two
// enforced plans and a shadowed plan below the cost, on a store that tells
// of one plan, is decided by the store and reported with the shadowed
// plan's would-be denial; the PlanResults are the store's. Before: a
// panic (index out of range), building one PlanResult per plan.
func TestShadowedPlanBelowTheCostOnAStoreOfAnotherPackage(t *testing.T) {
	ctx := context.Background()
	plans := []Plan{{Name: "a", Capacity: 100, Rate: 1}, {Name: "b", Capacity: 100, Rate: 1}, {Name: "s", Capacity: 10, Rate: 1, Shadow: true}}
	l, err := New(summaryStore{NewMemoryStore()}, plans, WithLogger(nil))
	require.NoError(t, err)
	var r Result
	require.NotPanics(t, func() { r, err = l.AllowN(ctx, "k", 20, "a", "b", "s") })
	require.NoError(t, err)
	assert.Equal(t, []any{true, true, "a"}, []any{r.Allowed, r.ShadowDenied, r.Plan})
	assert.Equal(t, []PlanResult{{Plan: "a", Limit: 100, Remaining: 100}}, r.PlanResults(), "the store's, which tell of one plan")
}
