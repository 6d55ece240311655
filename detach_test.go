package tollgate

import (
	"context"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// silentServer accepts connections and never answers: a hung Redis.
func silentServer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	var mu sync.Mutex
	var conns []net.Conn
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	return ln.Addr().String()
}

// A store call made on a detached context (a lease take, a Reserve) that
// outlasts the detached context's own bound is the store's failure, not
// its caller's: a caller with no deadline gets the failure policy's
// answer, as a plain decision does, not context.DeadlineExceeded.
func TestDetachedBoundIsNotTheCallersDeadline(t *testing.T) {
	if testing.Short() {
		t.Skip("waits out go-redis's 3 s read timeouts, and Close the give-backs' 5 s: about 20 s")
	}
	c := redis.NewClient(&redis.Options{Addr: silentServer(t), MaxRetries: -1}) // go-redis's 3 s read timeout
	t.Cleanup(func() { _ = c.Close() })
	leased := Plan{Name: "hot", Capacity: 100, Rate: 10, Lease: 20}
	l, err := New(NewRedisStore(c), []Plan{leased}, WithLogger(nil), WithLeaseTTL(100*time.Millisecond))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	ctx := context.Background()

	r, err := l.Allow(ctx, "k") // the lease take is detached for a TTL and a second
	require.NoError(t, err)
	assert.Equal(t, SourceFallback, r.Source)

	rv, err := l.Reserve(ctx, "k2", 1) // detached for 2 s
	require.NoError(t, err)
	assert.Equal(t, SourceFallback, rv.Result().Source)
}

// A lease taken for a caller whose plan resolver saw another key than the
// bucket's (ResolveAs, as behind httplimit) is given back under the plan
// that resolver chose for that key, however late and on whatever context
// the give-back runs.
func TestLeaseGivenBackUnderTheResolversKey(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
	t.Cleanup(func() { _ = c.Close() })
	gold := Plan{Name: "api", Capacity: 1000, Rate: 1, Lease: 20}
	l, err := New(NewRedisStore(c), []Plan{{Name: "api", Capacity: 10, Rate: 1}}, WithLogger(nil),
		WithPlanResolver(func(_ context.Context, key string, p Plan) (Plan, error) {
			if key == "key-gold" {
				return gold, nil
			}
			return p, nil
		}))
	require.NoError(t, err)
	bucket := "header:X-Api-Key:key-gold"
	ctx := ResolveAs(context.Background(), bucket, "key-gold")
	r, err := l.Allow(ctx, bucket)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	require.NoError(t, l.Close()) // gives the lease's rest back, on a context of its own
	p, err := l.Peek(ctx, bucket)
	require.NoError(t, err)
	assert.Equal(t, int64(999), p.Remaining, "the lease's 19 tokens back in the gold bucket, not clamped to the default plan")
}
