package breaker

import (
	"context"
	"errors"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// realRedis returns a client of a real Redis: TOLLGATE_REDIS_ADDR, else
// one on 127.0.0.1:6379 if it answers, else a server of the test's own;
// the test is skipped when there is none. Keys go under a random prefix,
// and nothing is flushed.
func realRedis(t testing.TB) (*redis.Client, string) {
	t.Helper()
	redistest.SkipIfShort(t)
	addr := os.Getenv("TOLLGATE_REDIS_ADDR")
	if addr == "" {
		if conn, err := net.DialTimeout("tcp", "127.0.0.1:6379", 100*time.Millisecond); err == nil {
			_ = conn.Close()
			addr = "127.0.0.1:6379"
		} else {
			addr = redistest.Addr(t)
		}
	}
	c := redistest.NewClient(t, patient(addr))
	if err := c.Ping(context.Background()).Err(); err != nil {
		t.Skipf("no Redis at %s: %v", addr, err)
	}
	prefix := redistest.KeyPrefix()
	t.Cleanup(func() { // open and forced breakers would stay a day, or for ever
		iter := c.Scan(context.Background(), 0, prefix+":*", 1000).Iterator()
		for iter.Next(context.Background()) {
			c.Del(context.Background(), iter.Val())
		}
	})
	return c, prefix
}

// patient returns client options for a Redis that other work on this
// machine may slow down: README's fail-fast timeouts would turn a slow
// dial into an outage, and these tests are about the shared state, not
// outages (TestRedisKilledUnderLoad is).
func patient(addr string) *redis.Options {
	o := redistest.FailFast(addr)
	o.DialTimeout, o.ReadTimeout, o.WriteTimeout, o.PoolTimeout = 5*time.Second, 5*time.Second, 5*time.Second, 5*time.Second
	return o
}

// fleet returns n Shared breakers, each with its own client of addr, as n
// processes would have. They fail closed, so that a Redis failure shows as
// an error rather than as a local decision.
func fleet(t testing.TB, addr, prefix string, n int, s SharedSettings, opts ...SharedOption) []*Shared {
	t.Helper()
	bs := make([]*Shared, n)
	for i := range bs {
		c := redistest.NewClient(t, patient(addr))
		b, err := NewShared(c, s, append([]SharedOption{WithPrefix(prefix), WithLogger(nil), WithFailurePolicy(FailClosed)}, opts...)...)
		require.NoError(t, err)
		bs[i] = b
	}
	return bs
}

// TestRedisProbesFleetWide: 4 instances × 16 goroutines race Acquire at the
// end of the open time; each half-open generation grants exactly Probes
// leases.
func TestRedisProbesFleetWide(t *testing.T) {
	c, prefix := realRedis(t)
	for _, probes := range []int{1, 3} {
		set := SharedSettings{MinCalls: 4, OpenFor: 150 * time.Millisecond, Probes: probes, ProbeTimeout: 10 * time.Second}
		bs := fleet(t, c.Options().Addr, prefix, 4, set)
		key := "probes-" + string(rune('0'+probes))
		for round := range 3 {
			trip(t, bs[0], key)
			var mu sync.Mutex
			var granted []Ticket
			var wg sync.WaitGroup
			deadline := time.Now().Add(400 * time.Millisecond)
			for _, b := range bs {
				for range 16 {
					wg.Add(1)
					go func() {
						defer wg.Done()
						for time.Now().Before(deadline) {
							tk, err := b.Acquire(ctx, key)
							if errors.Is(err, ErrOpen) {
								time.Sleep(time.Millisecond)
								continue
							}
							if !assert.NoError(t, err) {
								return
							}
							if !tk.Probe() {
								assert.Fail(t, "a closed call granted", "round %d", round)
								return
							}
							mu.Lock()
							granted = append(granted, tk)
							mu.Unlock()
						}
					}()
				}
			}
			wg.Wait()
			require.Len(t, granted, probes, "round %d: leases granted fleet-wide", round)
			t.Logf("Probes %d, round %d: %d leases granted to 64 racing goroutines", probes, round, len(granted))
			for _, tk := range granted {
				assert.Equal(t, granted[0].Generation(), tk.Generation())
				require.NoError(t, tk.Done(ctx, Success))
			}
			st, err := bs[1].State(ctx, key)
			require.NoError(t, err)
			require.Equal(t, Closed, st, "round %d", round)
		}
	}
}

// TestRedisDeadProber: the instance holding the lease is gone; another
// probes after ProbeTimeout, and the old holder's late success is ignored.
func TestRedisDeadProber(t *testing.T) {
	c, prefix := realRedis(t)
	set := SharedSettings{MinCalls: 4, OpenFor: 50 * time.Millisecond, ProbeTimeout: 200 * time.Millisecond}
	bs := fleet(t, c.Options().Addr, prefix, 2, set)
	dead, live := bs[0], bs[1]
	trip(t, live, "k")
	time.Sleep(60 * time.Millisecond)
	lost, err := dead.Acquire(ctx, "k")
	require.NoError(t, err)
	require.True(t, lost.Probe())
	start := time.Now()
	var probe Ticket
	for {
		probe, err = live.Acquire(ctx, "k")
		if err == nil {
			break
		}
		require.ErrorIs(t, err, ErrOpen)
		time.Sleep(5 * time.Millisecond)
	}
	waited := time.Since(start)
	t.Logf("the next probe came %v after the dead prober took the lease (ProbeTimeout 200ms)", waited)
	assert.GreaterOrEqual(t, waited, 190*time.Millisecond)
	assert.Less(t, waited, time.Second)
	require.True(t, probe.Probe())
	require.ErrorIs(t, lost.Done(ctx, Success), ErrStale)
	require.NoError(t, probe.Done(ctx, Success))
	st, err := dead.State(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, Closed, st)
}

// TestRedisDilution: 1 of 10 instances failing every call does not trip a
// breaker set to 50 %; all 10 failing trip it within the window.
func TestRedisDilution(t *testing.T) {
	c, prefix := realRedis(t)
	set := SharedSettings{Window: 10 * time.Second, MinCalls: 20, FailureRate: 0.5}
	bs := fleet(t, c.Options().Addr, prefix, 10, set)
	// The instances' calls interleave, in 20 rounds of one call each: the
	// rule is about the fleet's traffic, and one instance's 20 failures
	// before anyone else's call would trip it, rightly.
	run := func(failing int) {
		for range 20 {
			var wg sync.WaitGroup
			for i, b := range bs {
				wg.Add(1)
				go func() {
					defer wg.Done()
					o := Success
					if i < failing {
						o = Failure
					}
					err := call(t, b, "dilute", o)
					if !errors.Is(err, ErrOpen) && !errors.Is(err, ErrStale) {
						assert.NoError(t, err)
					}
				}()
			}
			wg.Wait()
		}
	}
	run(1)
	snap, err := bs[0].Inspect(ctx, "dilute")
	require.NoError(t, err)
	assert.Equal(t, Closed, snap.State)
	assert.Equal(t, int64(200), snap.Calls)
	assert.Equal(t, int64(20), snap.Failures)
	require.NoError(t, bs[0].Reset(ctx, "dilute"))
	run(10)
	snap, err = bs[0].Inspect(ctx, "dilute")
	require.NoError(t, err)
	assert.Equal(t, Open, snap.State)
	assert.Equal(t, int64(1), snap.Trips)
}

// TestRedisClockSkew: instances whose clocks are an hour ahead or behind
// see the same open time: only Redis's clock decides.
func TestRedisClockSkew(t *testing.T) {
	c, prefix := realRedis(t)
	set := SharedSettings{MinCalls: 4, OpenFor: 300 * time.Millisecond}
	bs := fleet(t, c.Options().Addr, prefix, 3, set)
	for i, skew := range []time.Duration{time.Hour, -time.Hour, 0} {
		epoch := time.Now().Add(skew)
		bs[i].now = func() int64 { return int64(time.Since(epoch)) } // skewed, still monotonic
	}
	trip(t, bs[0], "skew")
	for _, b := range bs[1:] {
		tk, err := b.Acquire(ctx, "skew")
		require.ErrorIs(t, err, ErrOpen)
		assert.InDelta(t, float64(300*time.Millisecond), float64(tk.RetryAfter), float64(50*time.Millisecond))
	}
	time.Sleep(310 * time.Millisecond)
	p, err := bs[1].Acquire(ctx, "skew")
	require.NoError(t, err)
	assert.True(t, p.Probe())
}

// TestRedisKilledUnderLoad: Redis is killed while an open breaker is under
// load; it stays open until its time is up, decisions return to Redis after
// restart, and no goroutine is left behind.
func TestRedisKilledUnderLoad(t *testing.T) {
	ignore := goleak.IgnoreCurrent()
	srv := redistest.StartServer(t)
	prefix := redistest.KeyPrefix()
	set := SharedSettings{MinCalls: 4, OpenFor: 600 * time.Millisecond, ProbeTimeout: 100 * time.Millisecond}
	opts := redistest.FailFast(srv.Addr())
	c := redis.NewClient(opts)
	b, err := NewShared(c, set, WithPrefix(prefix), WithLogger(nil),
		WithStoreBreaker(Settings{Failures: 1, Cooldown: 50 * time.Millisecond}))
	require.NoError(t, err)
	trip(t, b, "k")
	opened := time.Now()
	srv.Kill()

	var granted, refused atomic.Int64
	var firstGrant atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				select {
				case <-stop:
					return
				default:
				}
				tk, err := b.Acquire(ctx, "k")
				if errors.Is(err, ErrOpen) {
					refused.Add(1)
					time.Sleep(time.Millisecond)
					continue
				}
				if !assert.NoError(t, err) {
					return
				}
				granted.Add(1)
				firstGrant.CompareAndSwap(0, int64(time.Since(opened)))
				_ = tk.Done(ctx, Success)
			}
		}()
	}
	time.Sleep(800 * time.Millisecond)
	// The instance counts the open time from when it sent the call that
	// tripped the breaker, a round trip before opened: never later than
	// Redis would end it, and at most that round trip earlier.
	assert.GreaterOrEqual(t, time.Duration(firstGrant.Load()), 590*time.Millisecond, "open until its time is up")
	assert.True(t, b.Stats().Outage)
	srv.Restart()
	deadline := time.Now().Add(5 * time.Second)
	for b.Stats().Outage && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	close(stop)
	wg.Wait()
	assert.False(t, b.Stats().Outage, "decisions returned to Redis")
	before := b.Stats().RoundTrips
	require.NoError(t, call(t, b, "k", Success))
	assert.Greater(t, b.Stats().RoundTrips, before)
	t.Logf("granted %d, refused %d, first grant after %v", granted.Load(), refused.Load(), time.Duration(firstGrant.Load()))
	require.NoError(t, c.Close())
	goleak.VerifyNone(t, ignore,
		goleak.IgnoreAnyFunction("github.com/tollgate-go/tollgate/internal/redistest.(*Server).launchLocked.func1"))
}

// TestRedisCluster: each breaker is one key in its key's slot, so the
// script runs on a real 3-master Cluster, for keys whose braces would move
// a naive hash tag too.
func TestRedisCluster(t *testing.T) {
	cl := redistest.StartCluster(t, 3, 0)
	c := cl.Client(t, &redis.ClusterOptions{})
	b, err := NewShared(c, SharedSettings{MinCalls: 2, OpenFor: time.Minute}, WithLogger(nil), WithFailurePolicy(FailClosed))
	require.NoError(t, err)
	for _, key := range []string{"hooks.a.example", "user:{42}", "}x{", "=y", "tenant-7"} {
		trip(t, b, key)
		snap, err := b.Inspect(ctx, key)
		require.NoError(t, err)
		assert.Equal(t, Open, snap.State, "key %q", key)
		require.NoError(t, b.Reset(ctx, key))
		require.NoError(t, call(t, b, key, Success))
	}
	assert.Equal(t, uint64(0), b.Stats().StoreErrors)
}
