package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSettleLeavesAWindowOfTheNameAlone: a reservation on bucket plan
// "x", then SetPlans makes "x" a window of 10 a minute, which admits 10.
// Settling the reservation must not replace the window's counts with a
// bucket: the window would then count nothing and admit 10 more within
// its minute.
func TestSettleLeavesAWindowOfTheNameAlone(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{{Name: "x", Capacity: 10, Rate: 1}}, func(t *testing.T, l clockedLimiter) {
		rv, err := l.Reserve(ctx, "k", 5)
		require.NoError(t, err)
		require.True(t, rv.OK())
		require.NoError(t, l.SetPlans([]Plan{{Name: "x", Capacity: 10, Window: time.Minute}}))
		admitted := 0
		for range 10 {
			r, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			if r.Allowed {
				admitted++
			}
		}
		require.Equal(t, 10, admitted)
		_, _ = rv.Settle(ctx, 0) // a refund of 5
		for range 10 {
			r, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			if r.Allowed {
				admitted++
			}
		}
		assert.Equal(t, 10, admitted, "the window of 10 a minute admitted more within its minute")
	}, WithDenialCache(0))
}
