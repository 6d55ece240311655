package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Review of issue 15. During an outage with WithFleet, the fallback
// decides on this instance's share of each plan (capacity and rate ÷ the
// instances alive), but a settlement on the fallback used the plans in
// full: a refund refilled the fallback's bucket at the full rate (minting
// tokens beyond the share), and a charge was taken from a bucket of the
// full capacity (and so vanished at the next decision, which caps at the
// share) or as debt at the full rate (a quarter of the wait).
func TestFallbackSettlementKeepsTheFleetShare(t *testing.T) {
	ctx := context.Background()
	plan := Plan{Name: "p", Capacity: 100, Rate: 1} // a share of 4: 25 tokens, 0.25 a second
	setup := func(t *testing.T) (*Limiter, *miniredis.Miniredis, *int64) {
		mr := miniredis.RunT(t)
		now := t0
		l := newFleetLimiter(t, mr, []Plan{plan}, WithFallback(newClockedMemoryStore(&now)), WithDenialCache(0))
		l.fleet.size.Store(4)
		return l, mr, &now
	}
	admitted := func(t *testing.T, l *Limiter) int {
		n := 0
		for range 100 {
			r, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, SourceFallback, r.Source)
			if r.Allowed {
				n++
			}
		}
		return n
	}

	t.Run("refund of a hold the fallback granted", func(t *testing.T) {
		l, mr, now := setup(t)
		mr.SetError("LOADING Redis is loading the dataset in memory")
		r, err := l.Reserve(ctx, "k", 25)
		require.NoError(t, err)
		require.True(t, r.OK())
		require.Equal(t, SourceFallback, r.Result().Source)
		*now += (20 * time.Second).Microseconds() // the share refills 5 tokens
		_, err = r.Settle(ctx, 20)                // refunds 5
		require.NoError(t, err)
		assert.Equal(t, 10, admitted(t, l), "5 refilled at the share's rate + 5 refunded")
	})
	t.Run("charge of a hold the fallback granted", func(t *testing.T) {
		l, mr, _ := setup(t)
		mr.SetError("LOADING Redis is loading the dataset in memory")
		r, err := l.Reserve(ctx, "k", 10)
		require.NoError(t, err)
		require.Equal(t, SourceFallback, r.Result().Source)
		_, err = r.Settle(ctx, 30) // 15 left, 20 charged: 5 tokens of debt
		require.NoError(t, err)
		res, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.False(t, res.Allowed)
		assert.GreaterOrEqual(t, res.RetryAfter, 24*time.Second, "5 tokens of debt and 1 token, at 0.25 a second")
	})
	t.Run("charge of a hold Redis granted", func(t *testing.T) {
		l, mr, _ := setup(t)
		r, err := l.Reserve(ctx, "k", 10)
		require.NoError(t, err)
		require.Equal(t, SourceStore, r.Result().Source)
		mr.SetError("LOADING Redis is loading the dataset in memory")
		_, err = r.Settle(ctx, 30) // the fallback is charged the excess, 20, of its 25
		require.NoError(t, err)
		assert.Equal(t, 5, admitted(t, l))
	})
}
