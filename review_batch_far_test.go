package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestBatchBringsBackAFarStampAsACallOfItsOwn plants a drained bucket
// with its stamp an hour ahead (ADR 29), then sends a denial, a read and
// another denial on it in one batch, and the same one call each: the
// batch writes the stamp back as the calls do, and answers alike.
func TestBatchBringsBackAFarStampAsACallOfItsOwn(t *testing.T) {
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(t0))
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	batched := NewRedisStore(c, WithKeyPrefix("batched"), WithBatching())
	plain := NewRedisStore(c, WithKeyPrefix("plain"))
	far := TokenBucket{Tokens: 1_500_000, Stamp: t0 + time.Hour.Microseconds()}
	for _, s := range []*RedisStore{batched, plain} {
		plantBucket(t, c, s.Key("a", gold.Name), far)
	}
	reqs := []batchReq{
		{"a", 0, []Plan{gold}},
		{"a", 2, []Plan{gold}},
		{"a", 0, []Plan{gold}},
		{"a", 1, []Plan{gold}},
		{"a", 2, []Plan{gold}},
	}
	got, errs := gather(t, batched, background(len(reqs)), reqs)()
	for i, r := range reqs {
		require.NoError(t, errs[i], "request %d", i)
		want, err := plain.Take(context.Background(), r.key, r.cost, r.plans)
		require.NoError(t, err)
		assert.Equal(t, want, got[i], "request %d: %+v", i, r)
	}
	assert.False(t, got[1].Allowed)
	assert.True(t, got[3].Allowed, "1.5 tokens kept")
	assert.Equal(t, storedAt(t, c, plain.Key("a", gold.Name)), storedAt(t, c, batched.Key("a", gold.Name)))
	r, err := plain.Take(context.Background(), "a", 0, []Plan{gold})
	require.NoError(t, err)
	assert.Equal(t, 2*time.Second+250*time.Millisecond, r.RetryAfter, "brought back to a full refill (2 s) ahead, 0.5 token left, 0.25 s from a token")
}
