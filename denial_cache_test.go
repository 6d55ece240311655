package tollgate

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// countingStore counts the calls that reach a MemoryStore. Not being a
// *MemoryStore itself, it gets the denial cache by default, like RedisStore.
type countingStore struct {
	inner *MemoryStore
	calls atomic.Int64
}

func newCountingStore() *countingStore { return &countingStore{inner: NewMemoryStore()} }

func (c *countingStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	c.calls.Add(1)
	return c.inner.Take(ctx, key, cost, plans)
}

func (c *countingStore) Reset(ctx context.Context, key string, plans []Plan) error {
	return c.inner.Reset(ctx, key, plans)
}

func TestDenialCacheSparesTheStore(t *testing.T) {
	ctx := context.Background()
	s := newCountingStore()
	l := newTestLimiter(t, s)
	_, err := l.AllowN(ctx, "hot", 4, "gold")
	require.NoError(t, err)
	var last time.Duration
	for i := 0; i < 1000; i++ {
		r, err := l.Allow(ctx, "hot", "gold")
		require.NoError(t, err)
		require.False(t, r.Allowed)
		require.Equal(t, SourceStore, r.Source)
		if i > 0 {
			assert.LessOrEqual(t, r.RetryAfter, last, "RetryAfter counts down")
		}
		last = r.RetryAfter
	}
	assert.Equal(t, int64(2), s.calls.Load(), "one call to drain, one to learn the denial")

	// A costlier request must get its own, longer wait from the store.
	r0, err := l.AllowN(ctx, "hot", 3, "gold")
	require.NoError(t, err)
	assert.Greater(t, r0.RetryAfter, time.Second, "cost 3 waits 1.5 s, not cost 1's 0.5 s")

	// A cheaper request may pass where the remembered one may not.
	_, err = l.AllowN(ctx, "cheap", 4, "gold")
	require.NoError(t, err)
	time.Sleep(600 * time.Millisecond) // 1.2 tokens refill
	r, err := l.AllowN(ctx, "cheap", 2, "gold")
	require.NoError(t, err)
	require.False(t, r.Allowed)
	r, err = l.AllowN(ctx, "cheap", 1, "gold")
	require.NoError(t, err)
	assert.True(t, r.Allowed, "a remembered denial of cost 2 must not deny cost 1")

	// Reset forgets.
	require.NoError(t, l.Reset(ctx, "hot"))
	r, err = l.Allow(ctx, "hot", "gold")
	require.NoError(t, err)
	assert.True(t, r.Allowed)
}

func TestDenialCacheEndsWhenTheRequestCouldPass(t *testing.T) {
	ctx := context.Background()
	s := newCountingStore()
	l, err := New(s, []Plan{{Name: "fast", Capacity: 1, Rate: 50}}, WithLogger(nil))
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.False(t, r.Allowed)
	time.Sleep(r.RetryAfter)
	r, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.True(t, r.Allowed, "the cache must let the request through once it could pass")
}

// TestDenialCacheHotKeyRoundTrips hammers one key whose traffic is almost
// all denied, and counts the store calls per decision.
func TestDenialCacheHotKeyRoundTrips(t *testing.T) {
	ctx := context.Background()
	s := newCountingStore()
	// Capacity 25 holds half a second of refill, so a loaded machine's
	// pause loses no token and the lower bound stays honest.
	p := Plan{Name: "p", Capacity: 25, Rate: 50}
	l, err := New(s, []Plan{p}, WithLogger(nil))
	require.NoError(t, err)
	var allowed, decisions atomic.Int64
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(500 * time.Millisecond)
	for g := 0; g < 8; g++ {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				r, err := l.Allow(ctx, "attacked", "p")
				if err != nil {
					t.Error(err)
					return
				}
				decisions.Add(1)
				if r.Allowed {
					allowed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	bound := float64(p.Capacity) + p.Rate*time.Since(start).Seconds()
	perDecision := float64(s.calls.Load()) / float64(decisions.Load())
	t.Logf("%d decisions, %d allowed (bound %.1f), %d store calls: %.4f per decision", decisions.Load(), allowed.Load(), bound, s.calls.Load(), perDecision)
	assert.Less(t, float64(allowed.Load())/float64(decisions.Load()), 0.01, "the test must be a denial flood")
	assert.LessOrEqual(t, perDecision, 0.05)
	assert.LessOrEqual(t, float64(allowed.Load()), bound, "no over-admission")
	assert.GreaterOrEqual(t, float64(allowed.Load()), 0.8*bound, "the cache must not starve the key")
}

func TestDenialCacheIsBounded(t *testing.T) {
	c := newDenialCache(100)
	for i := 0; i < 10_000; i++ {
		c.put(string(rune('a'+i%26))+time.Duration(i).String(), "p", 1, Result{RetryAfter: time.Hour}, c.now())
	}
	assert.LessOrEqual(t, len(c.keys), 100)
}

func TestDenialCacheOffForMemoryStore(t *testing.T) {
	l := newTestLimiter(t, NewMemoryStore())
	assert.Nil(t, l.denials)
	l = newTestLimiter(t, NewMemoryStore(), WithDenialCache(10))
	assert.NotNil(t, l.denials)
	l = newTestLimiter(t, newCountingStore(), WithDenialCache(0))
	assert.Nil(t, l.denials)
}

func TestDenialCacheRefusesDenialsOlderThanAReset(t *testing.T) {
	c := newDenialCache(10)
	asked := c.now()
	c.forget("k") // a Reset while the denied request was in flight
	c.put("k", "p", 1, Result{RetryAfter: time.Hour}, asked)
	_, ok := c.get("k", "p", 1)
	assert.False(t, ok, "a denial asked before the Reset may be stale")
	c.put("k", "p", 1, Result{RetryAfter: time.Hour}, c.now())
	_, ok = c.get("k", "p", 1)
	assert.True(t, ok)
}

func TestDenialCacheBoundsEachKey(t *testing.T) {
	c := newDenialCache(10)
	for cost := int64(1); cost <= 1000; cost++ {
		c.put("k", "p", cost, Result{RetryAfter: time.Hour}, c.now())
	}
	assert.LessOrEqual(t, len(c.keys["k"]), maxDenialsPerKey)
	_, ok := c.get("k", "p", 1000)
	assert.True(t, ok, "the newest denial is kept")
}

func TestDenialCacheOwnsItsResults(t *testing.T) {
	ctx := context.Background()
	l := newTestLimiter(t, newCountingStore())
	_, err := l.AllowN(ctx, "k", 4, "gold", "daily")
	require.NoError(t, err)
	r1, err := l.Allow(ctx, "k", "gold", "daily")
	require.NoError(t, err)
	require.False(t, r1.Allowed)
	r1.Plans[0].Plan = "scribbled"
	r2, err := l.Allow(ctx, "k", "gold", "daily")
	require.NoError(t, err)
	assert.Equal(t, "gold", r2.Plans[0].Plan)
	r2.Plans[0].Plan = "scribbled"
	r3, err := l.Allow(ctx, "k", "gold", "daily")
	require.NoError(t, err)
	assert.Equal(t, "gold", r3.Plans[0].Plan)
}
