package tollgate

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// reviewVariants are plans of two names with other parameters, versions
// and shadows: debt run up under one is read by another.
var reviewVariants = [][]Plan{
	{
		{Name: "a", Capacity: 10, Rate: 0.1},
		{Name: "a", Capacity: 10, Rate: 5},
		{Name: "a", Capacity: 3, Rate: 1.0 / 3},
		{Name: "a", Capacity: 50, Rate: 0.01, Version: 1, Inherit: InheritProportional},
		{Name: "a", Capacity: 7, Rate: 7.77, Version: 2, Inherit: InheritAdditive},
		{Name: "a", Capacity: 10, Rate: 5, Shadow: true},
		{Name: "a", Capacity: 20, Rate: 2, Version: 3, Inherit: InheritReset},
	},
	{
		{Name: "b", Capacity: 40, Rate: 3},
		{Name: "b", Capacity: 4, Rate: 0.5},
		{Name: "b", Capacity: 40, Rate: 3, Shadow: true},
		{Name: "b", Capacity: 40, Rate: 3, Version: 1},
	},
	{
		{Name: "w", Capacity: 5, Window: time.Second},
	},
}

// farAhead counts the decisions that met a stamp more than a full refill
// ahead (ADR 29).
var farAhead atomic.Int64

// TestStoresAgreeOnPlanVariants runs random decisions, reads (cost 0 and
// PeekN's -n), reservations and settlements on a MemoryStore and on the
// scripts (miniredis, which expires nothing here, as the MemoryStore
// forgets nothing), with plans of one name that differ in rate, capacity,
// version and shadow, windows chained with them, and clock steps back:
// debt run up under one plan is read by another, and stamps more than a
// full refill ahead are brought back and written back on denials. Both
// must answer alike.
func TestStoresAgreeOnPlanVariants(t *testing.T) {
	for seed := uint64(1); seed <= 16; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { runVariants(t, seed) })
	}
	require.Positive(t, farAhead.Load(), "some decisions met a stamp too far ahead")
}

func runVariants(t *testing.T, seed uint64) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 11))
	rs, _, setTime := newMiniredisStore(t)
	now := t0
	ms := newClockedMemoryStore(&now)
	rs.random, ms.random = sameDraws(), sameDraws()
	type pair struct {
		n        int64
		mem, red hold
		plans    []Plan
		skip     uint64
	}
	var holds []*pair
	pick := func(windows bool) []Plan {
		var plans []Plan
		for gi, g := range reviewVariants {
			if gi == 2 && !windows {
				continue
			}
			if rng.IntN(2) == 0 || (gi == 0 && len(plans) == 0) {
				plans = append(plans, g[rng.IntN(len(g))])
			}
		}
		rng.Shuffle(len(plans), func(i, j int) { plans[i], plans[j] = plans[j], plans[i] })
		return plans
	}
	minCap := func(plans []Plan) int64 {
		c := int64(1 << 40)
		for _, p := range plans {
			c = min(c, p.Capacity)
		}
		return c
	}
	for i := 0; i < 300; i++ {
		switch op := rng.IntN(10); {
		case op < 2: // the clock
			step := rng.Int64N(3_000_000)
			if rng.IntN(6) == 0 {
				step = -rng.Int64N(20_000_000)
			}
			now += step
			setTime(now)
		case op < 5: // a decision or a read
			plans := pick(true)
			c := minCap(plans)
			cost := rng.Int64N(c+1) - rng.Int64N(2)*rng.Int64N(c+1)
			if cost < 0 && len(plans) > 0 {
				cost = max(cost, -c)
			}
			var m Result
			for _, q := range plans {
				sh := ms.shard("k")
				if e := sh.keys["k"]; e != nil && !q.isWindow() {
					if b := e.find(&q); b != nil && b.win == nil && b.ver.inherit(b.TokenBucket, &q, now).tooFarAhead(&q, now) {
						farAhead.Add(1)
					}
				}
			}
			ms.takeInto(&m, "k", cost, plans)
			r, err := rs.take(ctx, "k", cost, plans)
			require.NoError(t, err)
			require.Equal(t, m, r, "op %d: take %d on %v", i, cost, plans)
		case op < 8: // reserve
			plans := pick(false)
			n := 1 + rng.Int64N(minCap(plans))
			p := &pair{n: n, mem: hold{ttl: time.Hour}, red: hold{ttl: time.Hour}, plans: plans}
			var m Result
			ms.holdInto(&m, "k", n, plans, &p.mem)
			r, err := rs.hold(ctx, "k", n, plans, &p.red)
			require.NoError(t, err)
			require.Equal(t, m, r, "op %d: reserve %d on %v", i, n, plans)
			if m.Allowed {
				p.skip = untaken(&m)
				p.red.skip = p.skip
				holds = append(holds, p)
			}
		default: // settle, maybe with other variants of the names
			if len(holds) == 0 {
				continue
			}
			j := rng.IntN(len(holds))
			p := holds[j]
			holds = append(holds[:j], holds[j+1:]...)
			plans := p.plans
			if rng.IntN(2) == 0 {
				plans = append([]Plan(nil), plans...)
				for k := range plans {
					for _, g := range reviewVariants {
						if g[0].Name == plans[k].Name {
							v := g[rng.IntN(len(g))]
							v.Shadow = plans[k].Shadow
							plans[k] = v
						}
					}
				}
			}
			actual := rng.Int64N(3 * p.n)
			m, ms1 := ms.settle("k", plans, p.skip, p.n, actual, p.mem.expires)
			r, rs1, err := rs.settle(ctx, "k", plans, &p.red, p.n, actual)
			require.NoError(t, err)
			require.Equal(t, ms1, rs1, "op %d", i)
			require.Equal(t, m, r, "op %d: settle %d of %d on %v", i, actual, p.n, plans)
		}
	}
}
