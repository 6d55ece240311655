//go:build chaos

package chaos

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// fleetPlan is the plan of the fleet scenario: a burst large enough that
// a quarter of it is still a burst, and a refill that counts too.
var fleetPlan = tollgate.Plan{Name: "fleet", Capacity: 100, Rate: 50}

// TestChaosFleetOutage kills the Redis of four instances that share one
// key, with the load spread evenly over them, and counts what their
// fallbacks admit while it is down: with WithFleet, each enforces a
// quarter of the plan, and the fleet about one plan (bound: 1.25 ×);
// without it, each enforces the whole plan, and the fleet four. Then
// Redis comes back, and decisions return to it as they always did.
func TestChaosFleetOutage(t *testing.T) {
	chaosPrologue(t, true)
	down := pick(time.Second, 5*time.Second)
	for _, withFleet := range []bool{true, false} {
		name := map[bool]string{true: "fleet", false: "no-fleet"}[withFleet]
		t.Run(name, func(t *testing.T) {
			srv := redistest.StartServer(t)
			prefix := redistest.KeyPrefix()
			var insts []*tollgate.Limiter
			for range 4 {
				opts := []tollgate.Option{tollgate.WithLogger(nil)}
				if withFleet {
					opts = append(opts, tollgate.WithFleet(50*time.Millisecond))
				}
				s := tollgate.NewRedisStore(redistest.NewClient(t, pooled(redistest.FailFast(srv.Addr()))), tollgate.WithKeyPrefix(prefix))
				l, err := tollgate.New(s, []tollgate.Plan{fleetPlan}, opts...)
				require.NoError(t, err)
				t.Cleanup(func() { assert.NoError(t, l.Close()) })
				insts = append(insts, l)
			}
			if withFleet {
				require.True(t, eventually(5*time.Second, 10*time.Millisecond, func() bool {
					for _, l := range insts {
						if l.Stats().FleetSize != 4 {
							return false
						}
					}
					return true
				}), "every instance counts the fleet")
			}
			srv.Kill()

			ctx := context.Background()
			admitted, decisions := 0, 0
			began := time.Now()
			var last time.Time
			for time.Since(began) < down { // round robin: the load spread evenly
				for _, l := range insts {
					r, err := l.Allow(ctx, "shared")
					require.NoError(t, err)
					require.NotEqual(t, tollgate.SourceStore, r.Source, "Redis is down")
					decisions++
					if r.Allowed {
						admitted++
					}
				}
				last = time.Now()
				time.Sleep(time.Millisecond)
			}
			limit := float64(fleetPlan.Capacity) + fleetPlan.Rate*last.Sub(began).Seconds()
			chaosLine(t, "fleet-outage", "fleet", withFleet, "instances", len(insts), "admitted", admitted,
				"limit", limit, "ratio", float64(admitted)/limit, "decisions", decisions, "down", last.Sub(began))
			if withFleet {
				assert.LessOrEqual(t, float64(admitted), 1.25*limit, "the fleet admits about one plan")
				assert.Greater(t, float64(admitted), 0.5*limit, "and does not starve")
			} else {
				assert.Greater(t, float64(admitted), 2*limit, "each instance alone admits a whole plan")
			}

			srv.Restart()
			require.True(t, eventually(recoveryBound, 10*time.Millisecond, func() bool {
				for _, l := range insts {
					r, err := l.Allow(ctx, "other")
					if err != nil || r.Source != tollgate.SourceStore {
						return false
					}
				}
				return true
			}), "decisions return to Redis")
		})
	}
}
