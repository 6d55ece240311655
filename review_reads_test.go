package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestReadsDoNotBringBackAFarStamp: Peek and PeekN (cost 0 and -n) find a
// stamp more than a full refill ahead, after the clock stepped back an
// hour, and report it brought back, but write nothing (ADR 29): 3 s
// later a read still finds it a full refill ahead, not admitted.
func TestReadsDoNotBringBackAFarStamp(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{{Name: "p", Capacity: 2, Rate: 1}}, func(t *testing.T, l clockedLimiter) {
		r, err := l.AllowN(ctx, "k", 2)
		require.NoError(t, err)
		require.True(t, r.Allowed)
		l.advance(-time.Hour)
		r, err = l.Peek(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, 3*time.Second, r.RetryAfter)
		r, err = l.PeekN(ctx, "k", 2)
		require.NoError(t, err)
		assert.Equal(t, 4*time.Second, r.RetryAfter)
		l.advance(3 * time.Second)
		r, err = l.Peek(ctx, "k")
		require.NoError(t, err)
		assert.False(t, r.Allowed, "a read wrote the stamp back")
		assert.Equal(t, 3*time.Second, r.RetryAfter)
	}, WithDenialCache(0))
}
