package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// TestRefundWhoseReplyIsLostForgetsRememberedDenials: a settlement's
// refund runs in Redis, and its reply is lost. The Limiter cannot tell
// whether the refund landed, so it forgets the key's remembered denials
// as for a refund it saw: the next request is asked of Redis, which
// holds the refunded tokens. Under the Fallback policy the Settle is
// answered by the fallback (Refunded 0); under FailClosed it fails, and
// its retry finds the hold settled (ErrNotHeld).
func TestRefundWhoseReplyIsLostForgetsRememberedDenials(t *testing.T) {
	for name, addr := range lostReplyServers() {
		for _, policy := range []breaker.FailurePolicy{breaker.Fallback, breaker.FailClosed} {
			t.Run(name+"/"+policy.String(), func(t *testing.T) {
				testRefundWhoseReplyIsLost(t, addr(t), policy)
			})
		}
	}
}

// lostReplyServers returns the Redis servers a test of a lost reply
// runs on, each started for the test that asks for its address:
// miniredis, and a real Redis if one is reachable.
func lostReplyServers() map[string]func(*testing.T) string {
	return map[string]func(*testing.T) string{
		"miniredis": func(t *testing.T) string {
			mr := miniredis.RunT(t)
			mr.SetTime(time.UnixMicro(t0))
			return mr.Addr()
		},
		"redis": func(t *testing.T) string { return redistest.Addr(t) },
	}
}

func testRefundWhoseReplyIsLost(t *testing.T, addr string, policy breaker.FailurePolicy) {
	ctx := context.Background()
	c := redistest.NewClient(t, &redis.Options{Addr: addr, MaxRetries: -1})
	rs := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	l, err := New(rs, []Plan{llm}, WithLogger(nil), WithDenialCache(100), WithFailurePolicy(policy))
	require.NoError(t, err)
	warm, err := l.Reserve(ctx, "other", 1) // loads the settle script: the refund is one EVALSHA
	require.NoError(t, err)
	_, err = warm.Cancel(ctx)
	require.NoError(t, err)

	r, err := l.Reserve(ctx, "k", 1000)
	require.NoError(t, err)
	for range 2 {
		d, err := l.AllowN(ctx, "k", 10)
		require.NoError(t, err)
		require.False(t, d.Allowed)
	}
	d, err := l.AllowN(ctx, "k", 10)
	require.NoError(t, err)
	require.Equal(t, SourceCache, d.Source, "the denial is remembered")

	lost := &lostReplyHook{sha: rs.settleScript.SHA(), ranFirst: true}
	lost.armed.Store(true)
	c.AddHook(lost)
	_, err = r.Settle(ctx, 500)
	if policy == breaker.FailClosed {
		require.ErrorIs(t, err, ErrStoreUnavailable)
		_, err = r.Settle(ctx, 500)
		require.ErrorIs(t, err, ErrNotHeld, "the first try refunded")
	} else {
		require.NoError(t, err)
	}
	p, err := l.PeekN(ctx, "k", 10)
	require.NoError(t, err)
	require.True(t, p.Allowed, "Redis holds the refund")
	a, err := l.AllowN(ctx, "k", 10)
	require.NoError(t, err)
	assert.True(t, a.Allowed, "the refund whose reply was lost is seen at once; source %v, RetryAfter %v", a.Source, a.RetryAfter)
}
