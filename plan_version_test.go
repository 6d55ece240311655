package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

func TestVersionValidation(t *testing.T) {
	for name, p := range map[string]Plan{
		"inheritance without a version": {Name: "a", Capacity: 1, Rate: 1, Inherit: InheritAdditive},
		"unknown inheritance":           {Name: "a", Capacity: 1, Rate: 1, Version: 1, Inherit: numInheritances},
		"version on a window":           {Name: "a", Capacity: 1, Window: time.Second, Version: 1},
	} {
		_, err := New(NewMemoryStore(), []Plan{p})
		assert.ErrorIs(t, err, ErrInvalidPlan, name)
	}
	_, err := New(NewMemoryStore(), []Plan{{Name: "a", Capacity: 1, Rate: 1, Version: 1}})
	assert.NoError(t, err, "a version alone is as-is")
}

// TestInheritanceAgrees has the script (miniredis) and the MemoryStore take
// a bucket of 10 with 4 tokens left over to a plan of 20 at a higher
// version, by each strategy, and demands the tokens bucket4j's strategies
// give, the same from both, once: a second decision at that version
// inherits nothing more.
func TestInheritanceAgrees(t *testing.T) {
	ctx := context.Background()
	old := Plan{Name: "p", Capacity: 10, Rate: 0.001, Version: 1}
	for _, tt := range []struct {
		how  Inheritance
		want int64 // tokens left after the change and one more taken
	}{
		{InheritAsIs, 3},
		{InheritProportional, 7},
		{InheritReset, 19},
		{InheritAdditive, 13},
	} {
		t.Run(tt.how.String(), func(t *testing.T) {
			next := Plan{Name: "p", Capacity: 20, Rate: 0.001, Version: 2, Inherit: tt.how}
			rs, _, setTime := newMiniredisStore(t)
			now := t0
			ms := newClockedMemoryStore(&now)
			var got [2][]int64
			for i, s := range []Store{rs, ms} {
				_, err := s.Take(ctx, "k", 6, []Plan{old})
				require.NoError(t, err)
				for _, p := range []Plan{next, next, old, next} {
					now += 1000
					setTime(now)
					r, err := s.Take(ctx, "k", 1, []Plan{p})
					require.NoError(t, err)
					require.True(t, r.Allowed)
					got[i] = append(got[i], r.Remaining)
				}
			}
			assert.Equal(t, got[0], got[1], "the script and the MemoryStore agree")
			clamped := min(tt.want-1, old.Capacity) - 1 // the old plan clamps, and never lowers the version
			assert.Equal(t, []int64{tt.want, tt.want - 1, clamped, clamped - 1}, got[0], "inherited once")
		})
	}
}

// TestAdditiveChangeAppliesOnceUnderFlipFlop has an instance of the old
// plan and one of the new, additive at a higher version, alternate on one
// key for 10^4 steps: the capacity gained is added exactly once (an
// additive change applied on every touch would mint 100 tokens per
// alternation), and admissions stay within the transition bound. It runs
// on the MemoryStore, and on a real Redis when there is one.
func TestAdditiveChangeAppliesOnceUnderFlipFlop(t *testing.T) {
	old := Plan{Name: "api", Capacity: 100, Rate: 0.001, Version: 1}
	next := Plan{Name: "api", Capacity: 200, Rate: 0.001, Version: 2, Inherit: InheritAdditive}
	run := func(t *testing.T, stores [2]Store) int {
		var limiters [2]*Limiter
		for i, p := range []Plan{old, next} {
			l, err := New(stores[i], []Plan{p}, WithFailurePolicy(breaker.FailClosed), WithLogger(nil), WithDenialCache(0))
			require.NoError(t, err)
			limiters[i] = l
		}
		admitted := 0
		for step := range 10_000 {
			r, err := limiters[step%2].Allow(context.Background(), "k")
			require.NoError(t, err)
			if r.Allowed {
				admitted++
			}
		}
		return admitted
	}
	// The old plan takes 1 of 100; the new adds 100 once and takes 1 of
	// 199; the old clamps 198 to 100 and takes 1; then 99 are left for
	// both. No whole token accrues at 0.001/s in the few seconds it runs.
	const want = 102
	t.Run("memory", func(t *testing.T) {
		ms := NewMemoryStore()
		assert.Equal(t, want, run(t, [2]Store{ms, ms}))
	})
	t.Run("redis", func(t *testing.T) {
		addr := redistest.Addr(t)
		prefix := redistest.KeyPrefix()
		var stores [2]Store
		for i := range stores {
			stores[i] = NewRedisStore(redistest.NewClient(t, &redis.Options{Addr: addr}), WithKeyPrefix(prefix))
		}
		assert.Equal(t, want, run(t, stores))
		c := redistest.NewClient(t, &redis.Options{Addr: addr})
		b := storedBucket(t, c, stores[0].(*RedisStore).Key("k", "api"))
		assert.Equal(t, int64(2), b.Version, "the version is never lowered")
	})
}
