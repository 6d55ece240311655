package tollgate

import (
	"context"
	"fmt"
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
		{inheritAsIs, 3},
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

// TestResetAppliesOnceThoughTheKeyExpires has an instance of an
// unversioned plan and one of a version that inherits by reset take turns
// on one key: the old drains it, then the new, and then the key sits idle
// for longer than a full refill, eight times. The reset is a capacity
// granted once; losing the version with an expired key must not grant it
// again on every turn. Admissions stay within 2 × capacity + rate ×
// elapsed for idle spells shorter and longer than the version outlives
// the bucket, on the MemoryStore, on the script (miniredis, whose keys
// expire as the test moves its clock) and on a real Redis when there is
// one.
func TestResetAppliesOnceThoughTheKeyExpires(t *testing.T) {
	old := Plan{Name: "p", Capacity: 20, Rate: 200}
	next := Plan{Name: "p", Capacity: 20, Rate: 200, Version: 2, Inherit: InheritReset}
	// turns returns the admissions of eight turns, and the µs from the
	// first decision to the last; idle moves the clock on.
	turns := func(t *testing.T, stores [2]Store, idle func()) int64 {
		admitted := int64(0)
		for turn := range 8 {
			if turn > 0 {
				idle()
			}
			for i, p := range []Plan{old, next} {
				for range 2 * next.Capacity {
					r, err := stores[i].Take(context.Background(), "k", 1, []Plan{p})
					require.NoError(t, err)
					if !r.Allowed {
						break
					}
					admitted++
				}
			}
		}
		return admitted
	}
	bound := func(elapsed int64) float64 {
		return float64(2*next.Capacity) + next.Rate*float64(elapsed)/1e6
	}
	for _, idle := range []int64{110_000, 150_000, 210_000, 250_000, 1_000_000} { // µs; a full refill is 100 ms
		t.Run(fmt.Sprint("idle ", idle/1000, "ms"), func(t *testing.T) {
			rs, mr, setTime := newMiniredisStore(t)
			now := t0
			ms := newClockedMemoryStore(&now)
			step := func() {
				now += idle
				setTime(now)
				mr.FastForward(time.Duration(idle) * time.Microsecond)
			}
			for name, stores := range map[string][2]Store{"memory": {ms, ms}, "script": {rs, rs}} {
				start := now
				admitted := turns(t, stores, step)
				t.Logf("%s: %d admitted; bound %.0f", name, admitted, bound(now-start))
				assert.LessOrEqual(t, float64(admitted), bound(now-start), "%s: %d admitted in %d µs", name, admitted, now-start)
			}
		})
	}
	t.Run("redis", func(t *testing.T) {
		addr := redistest.Addr(t)
		prefix := redistest.KeyPrefix()
		var stores [2]Store
		for i := range stores {
			stores[i] = NewRedisStore(redistest.NewClient(t, &redis.Options{Addr: addr}), WithKeyPrefix(prefix))
		}
		probe := redistest.NewClient(t, &redis.Options{Addr: addr})
		start := redistest.Time(t, probe)
		admitted := turns(t, stores, func() { time.Sleep(110 * time.Millisecond) })
		elapsed := redistest.Time(t, probe) - start
		t.Logf("%d admitted; bound %.1f", admitted, bound(elapsed))
		assert.LessOrEqual(t, float64(admitted), bound(elapsed), "%d admitted in %d µs", admitted, elapsed)
	})
}

// TestResetForgetsTheVersion: Reset deletes a versioned bucket with its
// version, in Redis and in the MemoryStore, so the key starts afresh: the
// plan in force reads a full bucket and inherits nothing on top of it,
// and writes its version anew.
func TestResetForgetsTheVersion(t *testing.T) {
	ctx := context.Background()
	v1 := Plan{Name: "p", Capacity: 10, Rate: 0.001, Version: 1}
	v2 := Plan{Name: "p", Capacity: 20, Rate: 0.001, Version: 2, Inherit: InheritAdditive}
	eachStore(t, []Plan{v2}, func(t *testing.T, l clockedLimiter) {
		_, err := l.AllowPlans(ctx, "k", 5, v1)
		require.NoError(t, err)
		r, err := l.AllowPlans(ctx, "k", 1, v2)
		require.NoError(t, err)
		require.Equal(t, int64(14), r.Remaining, "5 left, 10 gained, 1 taken")
		require.NoError(t, l.Reset(ctx, "k"))
		if l.rs != nil {
			assert.False(t, l.mr.Exists(l.rs.Key("k", "p")), "the bucket and its version are gone")
		} else {
			assert.Zero(t, l.store.(*MemoryStore).Len(), "the bucket and its version are gone")
		}
		r, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, int64(19), r.Remaining, "a full bucket of 20, and nothing inherited")
		r, err = l.AllowPlans(ctx, "k", 1, v1)
		require.NoError(t, err)
		assert.Equal(t, int64(9), r.Remaining, "clamped to 10, 1 taken: version 1, below the 2 written, inherits nothing")
	}, WithDenialCache(0))
}

// TestFenceOfASlowerPlanStaysBounded: a bucket written by a plan with a
// version, then by a plan of the name that refills thousands of times
// slower, outlives its refill by at most maxRefillPeriod. The fence was
// max(capacities) ÷ rate: 3.2×10^19 µs here, past an int64, so the
// MemoryStore counted the drained key as full, and miniredis, on a PX
// past 292 years, dropped it at once, so the next decision found it full.
func TestFenceOfASlowerPlanStaysBounded(t *testing.T) {
	ctx := context.Background()
	v1 := Plan{Name: "p", Capacity: 10000, Rate: 1, Version: 1}
	slow := Plan{Name: "p", Capacity: 1, Rate: Per(1, maxRefillPeriod)}
	f := bucketVersion{pv: 1, c: v1.Capacity}.fence(&slow)
	assert.Equal(t, maxRefillPeriod.Microseconds(), f, "bounded, and not negative")
	eachStore(t, []Plan{slow}, func(t *testing.T, l clockedLimiter) {
		_, err := l.AllowPlans(ctx, "k", 1, v1)
		require.NoError(t, err)
		r, err := l.AllowPlans(ctx, "k", 1, slow)
		require.NoError(t, err)
		require.True(t, r.Allowed)
		l.advance(time.Second)
		r, err = l.Peek(ctx, "k")
		require.NoError(t, err)
		assert.Zero(t, r.Remaining, "the slow plan's only token is still taken")
	}, WithDenialCache(0))
}

// TestNewVersionsResetVoidsTheRefundsOfEarlierReservations: a reservation
// of 1,000 of a plan of 1,000, then SetPlans to version 2 with
// InheritReset, whose first decision fills the bucket, and 1,000
// admitted. The reservation's Cancel would fill that bucket a second
// time, as a refund after Reset would (before: 1,000 refunded, 2,000
// admitted at one instant). A version that inherits otherwise, or one
// the reservation was taken under, keeps the refund.
func TestNewVersionsResetVoidsTheRefundsOfEarlierReservations(t *testing.T) {
	ctx := context.Background()
	for _, tt := range []struct {
		name     string
		at, next Plan // the plan at Reserve, and in force at Cancel
		refunded int64
	}{
		{"reset", llm, Plan{Name: "tpm", Capacity: 1000, Rate: llm.Rate, Version: 2, Inherit: InheritReset}, 0},
		{"additive", llm, Plan{Name: "tpm", Capacity: 1000, Rate: llm.Rate, Version: 2, Inherit: InheritAdditive}, 1000},
		{"reset before the reservation",
			Plan{Name: "tpm", Capacity: 1000, Rate: llm.Rate, Version: 2, Inherit: InheritReset},
			Plan{Name: "tpm", Capacity: 1000, Rate: llm.Rate, Version: 2, Inherit: InheritReset}, 1000},
	} {
		t.Run(tt.name, func(t *testing.T) {
			eachStore(t, []Plan{tt.at}, func(t *testing.T, l clockedLimiter) {
				r, err := l.Reserve(ctx, "k", 1000)
				require.NoError(t, err)
				require.True(t, r.OK())
				require.NoError(t, l.SetPlans([]Plan{tt.next}))
				var admitted int64
				admit := func() {
					a, err := l.AllowN(ctx, "k", 1000)
					require.NoError(t, err)
					if a.Allowed {
						admitted += 1000
					}
				}
				admit()
				st, err := r.Cancel(ctx)
				require.NoError(t, err)
				assert.Equal(t, tt.refunded, st.Refunded)
				admit()
				assert.Equal(t, int64(1000), admitted, "1,000 admitted since the reservation, of a capacity of 1,000")
			})
		})
	}
}

// TestAResetBetweenVersionsVoidsTheRefund: a reservation of 1,000 of a
// plan of 1,000 at version 1, then SetPlans to version 2 with
// InheritReset, whose first decisions fill the bucket and admit 1,000,
// then SetPlans to version 3, which inherits otherwise, or by way of a
// table without the name, before the reservation is cancelled. The plan
// in force at the Cancel does not reset, but version 2 did in between:
// the refund would fill the bucket a second time. Whatever is admitted
// after the Cancel, at the same instant, is beyond the capacity. A
// reservation taken under version 2 keeps its refund; one whose version
// 2 never wrote the bucket is refunded nothing too, which under-admits.
func TestAResetBetweenVersionsVoidsTheRefund(t *testing.T) {
	ctx := context.Background()
	v := func(version uint32, how Inheritance) Plan {
		return Plan{Name: "tpm", Capacity: 1000, Rate: llm.Rate, Version: version, Inherit: how}
	}
	other := Plan{Name: "rpm", Capacity: 10, Rate: 1}
	for _, tt := range []struct {
		name     string
		at       Plan     // the plan at Reserve
		then     [][]Plan // the tables put in force before the Cancel, the last in force at it
		admit    bool     // whether 1,000 are admitted under the first of then, which applies its inheritance
		refunded int64
	}{
		{"as-is", v(1, 0), [][]Plan{{v(2, InheritReset)}, {v(3, 0)}}, true, 0},
		{"proportional", v(1, 0), [][]Plan{{v(2, InheritReset)}, {v(3, InheritProportional)}}, true, 0},
		{"a table without the name", v(1, 0), [][]Plan{{v(2, InheritReset)}, {other}, {v(3, 0)}}, true, 0},
		{"reset never written", v(1, 0), [][]Plan{{v(2, InheritReset)}, {v(3, 0)}}, false, 0},
		{"reserved under the reset", v(2, InheritReset), [][]Plan{{v(3, 0)}}, false, 1000},
	} {
		t.Run(tt.name, func(t *testing.T) {
			eachStore(t, []Plan{tt.at}, func(t *testing.T, l clockedLimiter) {
				r, err := l.Reserve(ctx, "k", 1000)
				require.NoError(t, err)
				require.True(t, r.OK())
				var admitted int64
				for i, plans := range tt.then {
					require.NoError(t, l.SetPlans(plans))
					if i == 0 && tt.admit {
						a, err := l.AllowN(ctx, "k", 1000)
						require.NoError(t, err)
						require.True(t, a.Allowed, "the new version's first decision fills the bucket")
						admitted += 1000
					}
				}
				st, err := r.Cancel(ctx)
				require.NoError(t, err)
				assert.Equal(t, tt.refunded, st.Refunded)
				var after int64
				for range 2000 {
					a, err := l.Allow(ctx, "k")
					require.NoError(t, err)
					if !a.Allowed {
						break
					}
					after++
				}
				t.Logf("refunded %d; %d admitted before the Cancel, %d after", st.Refunded, admitted, after)
				assert.LessOrEqual(t, admitted+after, int64(1000), "admitted since the reservation, of a capacity of 1,000")
				assert.Equal(t, tt.refunded, after, "the refund, and nothing more, admitted after the Cancel")
			}, WithDenialCache(0))
		})
	}
}

// TestResetVersionsStayBounded: tables of reset plans of ever new names
// carry at most maxHistoryNames names over beyond their own; the versions
// of those they drop still count, for every name.
func TestResetVersionsStayBounded(t *testing.T) {
	var old *planTable
	for round := range 3 {
		plans := make([]Plan, maxHistoryNames)
		for i := range plans {
			plans[i] = Plan{Name: fmt.Sprint(round, "/", i), Capacity: 1, Rate: 1, Version: uint32(round + 1), Inherit: InheritReset}
		}
		old = &planTable{plans: plans, history: historyAfter(old, plans)}
		assert.LessOrEqual(t, len(old.history.byName), len(plans)+maxHistoryNames, "round %d", round)
	}
	dropped := uint32(0) // the highest version of the names no longer kept
	for round := range 3 {
		for i := range maxHistoryNames {
			name := fmt.Sprint(round, "/", i)
			assert.GreaterOrEqual(t, old.history.resetOf(name), uint32(round+1), "%s's version, or the floor of those dropped", name)
			if _, kept := old.history.byName[name]; !kept {
				dropped = max(dropped, uint32(round+1))
			}
		}
	}
	assert.NotZero(t, dropped, "some names were dropped")
	assert.Equal(t, dropped, old.history.floor, "the dropped names' highest version")
}
