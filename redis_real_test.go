package tollgate

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// These tests run on real Redis: TOLLGATE_REDIS_ADDR, or servers they start
// themselves when redis-server is on PATH. Otherwise they skip, and the
// miniredis tests cover the same code.

// failFast is the go-redis configuration README recommends: a dead Redis
// costs a decision at most about 100 ms, and the breaker does the rest.
func failFast(addr string) *redis.Options {
	return &redis.Options{
		Addr:                  addr,
		DialTimeout:           100 * time.Millisecond,
		ReadTimeout:           100 * time.Millisecond,
		WriteTimeout:          100 * time.Millisecond,
		PoolTimeout:           100 * time.Millisecond,
		DialerRetries:         1,  // go-redis dials 5 times, 100 ms apart, by default
		MaxRetries:            -1, // no retries: the failure policy is the retry
		ContextTimeoutEnabled: true,
	}
}

func newRealClient(t *testing.T, opt *redis.Options) *redis.Client {
	c := redis.NewClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// redisTime reads Redis TIME in µs, the clock the script decides by.
func redisTime(t *testing.T, c redis.UniversalClient) int64 {
	tm, err := c.Time(context.Background()).Result()
	require.NoError(t, err)
	return tm.UnixMicro()
}

// hammer runs workers goroutines that call decide until stop is closed,
// and counts what they saw.
type tally struct {
	allowed, denied, errs, fallback atomic.Int64
	firstErr                        atomic.Value
}

func (ta *tally) record(r Result, err error) {
	switch {
	case err != nil:
		ta.errs.Add(1)
		ta.firstErr.CompareAndSwap(nil, err.Error())
	case r.Source != SourceStore:
		ta.fallback.Add(1)
	case r.Allowed:
		ta.allowed.Add(1)
	default:
		ta.denied.Add(1)
	}
}

// TestMultiInstanceExactOnRealRedis runs several Limiters, each with its own
// client, from many goroutines on one key for half a second, and checks the
// admitted count against capacity + rate × elapsed, elapsed read from Redis
// TIME: never above, and close below, with the denial cache off (every
// decision reaches Redis) and on (most are answered locally).
func TestMultiInstanceExactOnRealRedis(t *testing.T) {
	addr := redistest.Addr(t)
	for _, tc := range []struct {
		name  string
		cache int
	}{{"store", 0}, {"denial-cache", DefaultDenialCacheKeys}} {
		t.Run(tc.name, func(t *testing.T) {
			prefix := testPrefix(t)
			plans := []Plan{{Name: "p", Capacity: 20, Rate: 400}}
			var limiters []*Limiter
			for i := 0; i < 4; i++ {
				l, err := New(NewRedisStore(newRealClient(t, &redis.Options{Addr: addr}), WithKeyPrefix(prefix)), plans,
					WithFailurePolicy(FailClosed), WithLogger(nil), WithDenialCache(tc.cache))
				require.NoError(t, err)
				limiters = append(limiters, l)
			}
			probe := newRealClient(t, &redis.Options{Addr: addr})
			var ta tally
			start := redisTime(t, probe)
			deadline := time.Now().Add(500 * time.Millisecond)
			var wg sync.WaitGroup
			for _, l := range limiters {
				for g := 0; g < 8; g++ {
					wg.Go(func() {
						for time.Now().Before(deadline) {
							ta.record(l.Allow(context.Background(), "shared"))
						}
					})
				}
			}
			wg.Wait()
			end := redisTime(t, probe)
			require.Zero(t, ta.errs.Load(), "first error: %v", ta.firstErr.Load())
			bound := float64(plans[0].Capacity) + plans[0].Rate*float64(end-start)/1e6
			admitted := float64(ta.allowed.Load())
			t.Logf("admitted %d of %d decisions in %.3f s; bound %.1f", ta.allowed.Load(), ta.allowed.Load()+ta.denied.Load(), float64(end-start)/1e6, bound)
			assert.LessOrEqual(t, admitted, bound, "over-admission")
			assert.Greater(t, admitted, 0.8*bound, "refills must be admitted, not lost")
			assert.Positive(t, ta.denied.Load(), "the test must push past the limit")
		})
	}
}

// TestPollingRefillOnRealRedis polls every millisecond a bucket that
// refills 2 tokens a second, and demands 2 admissions a second.
func TestPollingRefillOnRealRedis(t *testing.T) {
	c := newRealClient(t, &redis.Options{Addr: redistest.Addr(t)})
	s := NewRedisStore(c, WithKeyPrefix(testPrefix(t)))
	// Capacity 2 holds a second of refill, so a loaded machine's pause in
	// polling loses no token; a floored refill would still admit nothing.
	p := []Plan{{Name: "p", Capacity: 2, Rate: 2}}
	ctx := context.Background()
	r, err := s.Take(ctx, "poll", 2, p) // empty the bucket
	require.NoError(t, err)
	require.True(t, r.Allowed)
	start := redisTime(t, c)
	admitted := 0
	for time.Since(time.UnixMicro(start)) < 2100*time.Millisecond {
		r, err := s.Take(ctx, "poll", 1, p)
		require.NoError(t, err)
		if r.Allowed {
			admitted++
		}
		time.Sleep(time.Millisecond)
	}
	elapsed := float64(redisTime(t, c)-start) / 1e6
	t.Logf("%d admitted in %.3f s of polling", admitted, elapsed)
	assert.InDelta(t, 2*elapsed, float64(admitted), 1.0)
}

// loadUntilStopped runs workers goroutines, each calling decide(g, i) with
// its number g and a count i, until the returned stop is called; stop waits
// for them to return.
func loadUntilStopped(workers int, decide func(g, i int)) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for g := 0; g < workers; g++ {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-done:
					return
				default:
				}
				decide(g, i)
			}
		})
	}
	return func() {
		close(done)
		wg.Wait()
	}
}

// ownServer returns a redis-server of the test's own, which it may flush,
// kill and restart, or skips the test.
func ownServer(t *testing.T) *redistest.Server {
	redistest.SkipIfUnavailable(t)
	return redistest.StartServer(t)
}

// TestNoscriptUnderLoad flushes the script cache over and over while many
// goroutines decide, through a plain client and through go-redis's
// auto-pipeliner, where NOSCRIPT arrives inside a pipeline. Under
// FailClosed any store failure would surface as an error, so none may.
func TestNoscriptUnderLoad(t *testing.T) {
	srv := ownServer(t)
	for _, tc := range []struct {
		name   string
		client func(c *redis.Client) redis.UniversalClient
	}{
		{"client", func(c *redis.Client) redis.UniversalClient { return c }},
		{"autopipeline", func(c *redis.Client) redis.UniversalClient {
			ap, err := c.AutoPipeline()
			require.NoError(t, err)
			return ap
		}},
		{"autopipeline-full-duplex", func(c *redis.Client) redis.UniversalClient {
			ap, err := c.AutoPipelineWithOptions(&redis.AutoPipelineOptions{FullDuplex: true})
			require.NoError(t, err)
			return ap
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := NewRedisStore(tc.client(newRealClient(t, &redis.Options{Addr: srv.Addr()})))
			// No denial cache: every decision must meet the flushed cache.
			l, err := New(store, testPlans, WithFailurePolicy(FailClosed), WithLogger(nil), WithDenialCache(0))
			require.NoError(t, err)
			admin := newRealClient(t, &redis.Options{Addr: srv.Addr()})
			var ta tally
			stop := loadUntilStopped(16, func(g, i int) {
				ta.record(l.Allow(context.Background(), fmt.Sprint("user-", i%50), "gold", "daily"))
			})
			flushes := 0
			for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); flushes++ {
				require.NoError(t, admin.ScriptFlush(context.Background()).Err())
				time.Sleep(5 * time.Millisecond)
			}
			stop()
			t.Logf("%d flushes, %d reloads, %d decisions", flushes, store.ScriptLoads(), ta.allowed.Load()+ta.denied.Load())
			assert.Zero(t, ta.errs.Load(), "first error: %v", ta.firstErr.Load())
			assert.Zero(t, ta.fallback.Load())
			assert.GreaterOrEqual(t, store.ScriptLoads(), int64(flushes/2), "the flushes must have bitten")
		})
	}
}

// TestOutageFallbackRecovery kills the Redis under load, checks that
// decisions go on from the fallback with no error, then restarts it and
// checks that decisions return to Redis: through a plain client, and
// through go-redis's auto-pipeliners, which README recommends under load.
func TestOutageFallbackRecovery(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts *redis.AutoPipelineOptions // nil: a plain client
	}{
		{"client", nil},
		{"autopipeline", redis.DefaultBlockingAutoPipelineOptions()},
		{"autopipeline-full-duplex", &redis.AutoPipelineOptions{FullDuplex: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := ownServer(t)
			var client redis.UniversalClient = newRealClient(t, failFast(srv.Addr()))
			if tc.opts != nil {
				ap, err := client.(*redis.Client).AutoPipelineWithOptions(tc.opts)
				require.NoError(t, err)
				client = ap
			}
			testOutageFallbackRecovery(t, srv, client)
		})
	}
}

func testOutageFallbackRecovery(t *testing.T, srv *redistest.Server, client redis.UniversalClient) {
	logs := &logCounter{}
	// No denial cache: every decision must meet the outage.
	l, err := New(NewRedisStore(client), testPlans, WithDenialCache(0),
		WithLogger(slog.New(logs)), WithBreaker(BreakerSettings{Failures: 3, Cooldown: 200 * time.Millisecond}))
	require.NoError(t, err)

	var (
		mu      sync.Mutex
		sources = map[Source]int{}
		errs    []error
		slowest time.Duration
		last    atomic.Int32 // the Source of the latest decision
	)
	stop := loadUntilStopped(4, func(g, i int) {
		began := time.Now()
		r, err := l.Allow(context.Background(), fmt.Sprint("user-", g, "-", i%10), "gold")
		took := time.Since(began)
		mu.Lock()
		if err != nil {
			errs = append(errs, err)
		} else {
			sources[r.Source]++
			last.Store(int32(r.Source))
		}
		slowest = max(slowest, took)
		mu.Unlock()
		time.Sleep(time.Millisecond)
	})
	waitFor := func(src Source, within time.Duration) time.Duration {
		began := time.Now()
		for time.Since(began) < within {
			if Source(last.Load()) == src {
				return time.Since(began)
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Fatalf("decisions did not move to %s within %s", src, within)
		return 0
	}
	time.Sleep(100 * time.Millisecond)
	srv.Kill()
	toFallback := waitFor(SourceFallback, 2*time.Second)
	time.Sleep(300 * time.Millisecond)
	srv.Restart()
	toStore := waitFor(SourceStore, 3*time.Second)
	time.Sleep(50 * time.Millisecond)
	stop()

	t.Logf("to fallback in %s, back to Redis in %s after restart; slowest decision %s; sources %v", toFallback, toStore, slowest, sources)
	assert.Empty(t, errs, "no error may reach the caller under Fallback")
	assert.Greater(t, sources[SourceFallback], 100, "decisions go on at full speed during the outage")
	assert.Less(t, toStore, 1500*time.Millisecond, "back to Redis within about a second")
	// One line per outage and one per recovery; a starved machine may see
	// a second, short outage after the restart.
	require.NotEmpty(t, logs.levels)
	require.Zero(t, len(logs.levels)%2, "every outage logged its recovery: %v", logs.levels)
	for i, level := range logs.levels {
		want := slog.LevelWarn
		if i%2 == 1 {
			want = slog.LevelInfo
		}
		assert.Equal(t, want, level, "outage and recovery lines alternate: %v", logs.levels)
	}
}

// adversarialKeys are keys that would break a naive key scheme: braces
// that move the hash tag, separators, the encoding marker, binary bytes.
var adversarialKeys = []string{
	"plain", "}", "{", "{}", "}{", "a}b", "{a}", "{user}:gold", "x}:gold", "=", "=YQ",
	"tollgate:{a}:gold", "\x00\xff", "ключ", strings.Repeat("}", MaxKeyLen), strings.Repeat("{", MaxKeyLen),
}

// TestClusterAdversarialKeys runs chained decisions for awkward keys on a
// 3-master Cluster: all plans of a key must share a slot, or Redis would
// answer CROSSSLOT.
func TestClusterAdversarialKeys(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	cl := redistest.StartCluster(t, 3, 0)
	client := cl.Client(t, nil)
	l, err := New(NewRedisStore(client), testPlans, WithFailurePolicy(FailClosed), WithLogger(nil))
	require.NoError(t, err)
	ctx := context.Background()
	for i, key := range adversarialKeys {
		for want := int64(3); want >= 0; want-- {
			r, err := l.Allow(ctx, key, "gold", "daily")
			require.NoError(t, err, "key %d", i)
			require.True(t, r.Allowed, "key %d", i)
			assert.Equal(t, want, r.Plans[0].Remaining, "key %d: keys must not share buckets", i)
		}
		require.NoError(t, l.Reset(ctx, key), "key %d", i)
	}

	// Keys spread over every master, and NOSCRIPT heals on each.
	for _, addr := range cl.Addrs() {
		require.NoError(t, redis.NewClient(&redis.Options{Addr: addr}).ScriptFlush(ctx).Err())
	}
	masters := map[string]bool{}
	for i := 0; i < 30; i++ {
		key := fmt.Sprint("spread-", i)
		_, err := l.Allow(ctx, key, "gold", "daily")
		require.NoError(t, err)
		masters[cl.MasterFor(key).Addr()] = true
	}
	assert.Len(t, masters, 3)
}

// TestTopologies runs the same chained decisions through every go-redis
// client kind.
func TestTopologies(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	check := func(t *testing.T, c redis.UniversalClient) {
		l, err := New(NewRedisStore(c, WithKeyPrefix(testPrefix(t))), testPlans, WithFailurePolicy(FailClosed), WithLogger(nil))
		require.NoError(t, err)
		for _, key := range []string{"a", "b}", "c{x}"} {
			for want := int64(3); want >= 0; want-- {
				r, err := l.Allow(context.Background(), key, "gold", "daily")
				require.NoError(t, err)
				require.True(t, r.Allowed)
				assert.Equal(t, want, r.Remaining)
			}
			r, err := l.Allow(context.Background(), key, "gold", "daily")
			require.NoError(t, err)
			assert.False(t, r.Allowed)
			// One token at 2/s: at most 500 ms, less the time since the drain.
			assert.LessOrEqual(t, r.RetryAfter, 500*time.Millisecond)
			assert.Greater(t, r.RetryAfter, 250*time.Millisecond)
		}
	}
	t.Run("client", func(t *testing.T) {
		check(t, newRealClient(t, &redis.Options{Addr: redistest.StartServer(t).Addr()}))
	})
	t.Run("ring", func(t *testing.T) {
		ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{
			"a": redistest.StartServer(t).Addr(), "b": redistest.StartServer(t).Addr(),
		}})
		t.Cleanup(func() { _ = ring.Close() })
		check(t, ring)
	})
	t.Run("sentinel", func(t *testing.T) {
		check(t, redistest.StartSentinel(t).Client(t, nil))
	})
	t.Run("cluster", func(t *testing.T) {
		check(t, redistest.StartCluster(t, 3, 0).Client(t, nil))
	})
}

// TestRealRedisForeignType checks the WRONGTYPE path on real Redis, whose
// pcall error shape miniredis only imitates.
func TestRealRedisForeignType(t *testing.T) {
	c := newRealClient(t, &redis.Options{Addr: redistest.Addr(t)})
	s := NewRedisStore(c, WithKeyPrefix(testPrefix(t)))
	ctx := context.Background()
	key := s.Key("k", "gold")
	require.NoError(t, c.SAdd(ctx, key, "member").Err())
	t.Cleanup(func() { c.Del(ctx, key) })
	r, err := s.Take(ctx, "k", 1, []Plan{gold})
	require.NoError(t, err)
	assert.True(t, r.Allowed)
	typ, err := c.Type(ctx, key).Result()
	require.NoError(t, err)
	assert.Equal(t, "hash", typ)
	ttl, err := c.PTTL(ctx, key).Result()
	require.NoError(t, err)
	assert.InDelta(t, float64(500*time.Millisecond), float64(ttl), float64(5*time.Millisecond))
}
