package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestLeaseOfAllowPlansSettlesWithTheCallersPlan: AllowPlans decides on
// the plan its caller holds, and a lease it takes (Plan.Lease) is a
// reservation of that plan. Giving the lease back must adjust the bucket
// with that plan, not with the table's plan of the same name, which
// AllowPlans never decided on: the table's faster rate would refill the
// bucket at the give-back, tokens the caller's plan never accrued.
func TestLeaseOfAllowPlansSettlesWithTheCallersPlan(t *testing.T) {
	ctx := context.Background()
	rs, _, setTime := newMiniredisStore(t)
	table := Plan{Name: "api", Capacity: 100, Rate: 100}
	tier := Plan{Name: "api", Capacity: 10, Rate: 1.0 / 3600, Lease: 5} // 10 an hour
	l, err := New(rs, []Plan{table}, WithLogger(nil), WithDenialCache(0))
	require.NoError(t, err)
	r, err := l.AllowPlans(ctx, "k", 1, tier)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	require.Equal(t, SourceStore, r.Source, "the first decision takes a lease of 5")
	setTime(t0 + 10*time.Second.Microseconds())
	require.NoError(t, l.Close()) // gives back the 4 tokens not handed out

	plain := tier
	plain.Lease = 0
	l2, err := New(rs, []Plan{table}, WithLogger(nil), WithDenialCache(0))
	require.NoError(t, err)
	admitted := 1
	for range 20 {
		r, err := l2.AllowPlans(ctx, "k", 1, plain)
		require.NoError(t, err)
		if r.Allowed {
			admitted++
		}
	}
	// Capacity 10 plus 10 s at 10 an hour: 10 in all.
	assert.Equal(t, 10, admitted, "the give-back refilled the bucket at the table's rate")
}
