package tollgate

import (
	"context"
	"fmt"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redisscript"
	"github.com/tollgate-go/tollgate/internal/redistest"
	"go.uber.org/goleak"
)

// batchReq is one Take of a batching test.
type batchReq struct {
	key   string
	cost  int64
	plans []Plan
}

// gather makes s's batcher hold its call slots, starts one Take per
// request, each once the one before waits in the batcher, so that they
// wait in order, and returns a function that sends them as one batch and
// returns their answers.
func gather(t *testing.T, s *RedisStore, ctxs []context.Context, reqs []batchReq) (flush func() ([]Result, []error)) {
	t.Helper()
	return batchOf(t, s, len(reqs), func(i int) (Result, error) {
		return s.Take(ctxs[i], reqs[i].key, reqs[i].cost, reqs[i].plans)
	})
}

// batchOf is gather for n decisions of any caller of s, such as a
// Limiter on it: decide(i) makes decision i.
func batchOf(t *testing.T, s *RedisStore, n int, decide func(i int) (Result, error)) (flush func() ([]Result, []error)) {
	t.Helper()
	b := s.batch
	b.mu.Lock()
	b.inFlight = b.limit // every slot taken: the decisions wait
	b.mu.Unlock()
	results, errs := make([]Result, n), make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { results[i], errs[i] = decide(i) })
		for waiting := false; !waiting; {
			b.mu.Lock()
			waiting = len(b.pending) == i+1
			b.mu.Unlock()
			time.Sleep(100 * time.Microsecond) // not a timed assertion: waits for the goroutine to queue
		}
	}
	return func() ([]Result, []error) {
		b.mu.Lock()
		b.inFlight = 1 // one call under way, which ends now
		b.mu.Unlock()
		b.release() // the first waiting caller sends them all
		wg.Wait()
		return results, errs
	}
}

// fewSlots gives s, if it batches, minCalls call slots, so that a test's
// few callers wait and ride in batches as many callers would on a pool
// of connections; it returns s.
func fewSlots(s *RedisStore) *RedisStore {
	if s.batch != nil {
		s.batch.slots, s.batch.limit = minCalls, minCalls
	}
	return s
}

func background(n int) []context.Context {
	ctxs := make([]context.Context, n)
	for i := range ctxs {
		ctxs[i] = context.Background()
	}
	return ctxs
}

// batchAgainstCalls sends reqs as one batch through batched, and one call
// each through plain, on the same Redis at the same Redis time; it demands
// the same Result for each, and returns the batch's.
func batchAgainstCalls(t *testing.T, batched, plain *RedisStore, reqs []batchReq) []Result {
	t.Helper()
	got, errs := gather(t, batched, background(len(reqs)), reqs)()
	for i, r := range reqs {
		require.NoError(t, errs[i], "request %d", i)
		want, err := plain.Take(context.Background(), r.key, r.cost, r.plans)
		require.NoError(t, err)
		assert.Equal(t, want, got[i], "request %d: %+v", i, r)
	}
	return got
}

// TestBatchDecidesAsCallsOfTheirOwn sends buckets, windows, chains,
// denials and reads, several on one key, as one batch, and the same
// requests one call each to another prefix of the same miniredis at the
// same Redis time: every Result is the same, and so is the state after.
func TestBatchDecidesAsCallsOfTheirOwn(t *testing.T) {
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(t0))
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	batched := NewRedisStore(c, WithKeyPrefix("batched"))
	plain := NewRedisStore(c, WithKeyPrefix("plain"))
	window := Plan{Name: "minute", Capacity: 3, Window: time.Minute}
	reqs := []batchReq{
		{"a", 3, []Plan{gold}},
		{"a", 2, []Plan{gold}}, // denied: 1 left
		{"b", 1, testPlans},
		{"a", 1, []Plan{gold}},
		{"w", 2, []Plan{window}},
		{"w", 2, []Plan{gold, window}}, // the window refuses: gold keeps its tokens
		{"w", 1, []Plan{gold, window}},
		{"a", 0, []Plan{gold}},
		{"b", 0, testPlans},
	}
	got := batchAgainstCalls(t, batched, plain, reqs)
	assert.False(t, got[1].Allowed)
	assert.False(t, got[5].Allowed)
	for _, r := range reqs {
		for _, p := range r.plans {
			assert.Equal(t, storedAt(t, c, plain.Key(r.key, p.Name)), storedAt(t, c, batched.Key(r.key, p.Name)), "%s %s", r.key, p.Name)
		}
	}
	assert.Equal(t, int64(1), batched.scripts.limitMany.Loads(), "the nine went in one script call")
	assert.Zero(t, batched.scripts.takeMany.Loads(), "a batch of lean and other decisions runs the general script")
}

// TestBatchLoneCallerSendsAlone decides with an idle batcher: the decision
// is sent at once with the plain script, and the batcher is idle after.
func TestBatchLoneCallerSendsAlone(t *testing.T) {
	mr := miniredis.RunT(t)
	s := NewRedisStore(redis.NewClient(&redis.Options{Addr: mr.Addr()}))
	for i := 0; i < 3; i++ {
		r, err := s.Take(context.Background(), "k", 1, []Plan{gold})
		require.NoError(t, err)
		assert.Equal(t, int64(3-i), r.Remaining)
	}
	assert.Equal(t, int64(1), s.scripts.take.Loads(), "the lean decision alone, loaded once")
	assert.Zero(t, s.scripts.takeMany.Loads(), "no batch was sent")
	assert.Zero(t, s.batch.inFlight)
	assert.Empty(t, s.batch.pending)
}

// TestBatchLightLoadGoesAlone runs 8 callers on a client with a pool of
// 20 connections: none ever waits for a call slot, so every decision is a
// script call of its own, as without batching.
func TestBatchLightLoadGoesAlone(t *testing.T) {
	c, h := countedClient(t, &redis.Options{Addr: miniredis.RunT(t).Addr(), PoolSize: 20})
	s := NewRedisStore(c)
	// Found to have no functions, and loaded: no FCALL, NOSCRIPT or EVAL
	// from here.
	_, err := s.Take(context.Background(), "warm", 1, []Plan{gold})
	require.NoError(t, err)
	h.alone.Store(0)
	takeFromEach(t, s, 8, 50)
	assert.Equal(t, int64(400), h.alone.Load(), "one script call per decision")
}

// TestBatchHeavyLoadRidesInBatches runs 64 callers on miniredis, which
// runs a script call far slower than its callers ask: decisions wait, and
// ride in batches of several. With a pool of 160 connections, a 16-core
// host's default, as many calls as callers could be under way, and none
// would wait, but more than maxCalls calls are never under way at once.
func TestBatchHeavyLoadRidesInBatches(t *testing.T) {
	for _, pool := range []int{20, 160} {
		t.Run(strconv.Itoa(pool), func(t *testing.T) {
			c, h := countedClient(t, &redis.Options{Addr: miniredis.RunT(t).Addr(), PoolSize: pool})
			s := NewRedisStore(c)
			takeFromEach(t, s, 64, 20)
			t.Logf("1280 decisions in %d script calls", h.alone.Load())
			assert.Less(t, h.alone.Load(), int64(1280/4), "decisions ride in batches of 4 or more on average")
		})
	}
}

// TestBatchCallSlotsFollowThePool checks the most calls a batcher keeps
// under way: the client's pool size, from minCalls to maxCalls.
func TestBatchCallSlotsFollowThePool(t *testing.T) {
	for pool, want := range map[int]int{1: minCalls, 4: 4, 16: 16, 20: maxCalls, 160: maxCalls} {
		s := NewRedisStore(redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", PoolSize: pool}))
		assert.Equal(t, want, s.batch.slots, "pool %d", pool)
		assert.Equal(t, want, s.batch.limit, "pool %d", pool)
	}
}

// takeFromEach has callers goroutines each take one token, on gold, from
// each of each keys of their own in turn, and waits for them.
func takeFromEach(t *testing.T, s *RedisStore, callers, each int) {
	t.Helper()
	var wg sync.WaitGroup
	for g := range callers {
		wg.Go(func() {
			for i := range each {
				_, err := s.Take(context.Background(), "k"+strconv.Itoa(g*each+i), 1, []Plan{gold})
				assert.NoError(t, err)
			}
		})
	}
	wg.Wait()
}

// TestBatchLimitFollowsTheLoad steps the batcher's call slots by hand:
// calls that end while a decision waits lower the limit, one each, and
// give their slots up until no more calls than the limit are under way;
// at minCalls, the slot passes to the waiting decision. Calls that end
// while none wait raise the limit again.
func TestBatchLimitFollowsTheLoad(t *testing.T) {
	b := &batcher{slots: 20, limit: 20, inFlight: 20}
	w := &scriptCall{done: make(chan struct{}, 1)}
	b.pending = []*scriptCall{w}
	for want := 19; want >= minCalls; want-- {
		b.release()
		assert.Equal(t, want, b.limit)
		assert.Equal(t, want, b.inFlight, "the slot is given up")
		require.Len(t, b.pending, 1)
	}
	b.release()
	assert.Equal(t, minCalls, b.limit)
	assert.Equal(t, minCalls, b.inFlight, "the slot passes on")
	assert.Empty(t, b.pending)
	assert.True(t, w.lead)
	assert.Len(t, w.done, 1, "the waiting caller is woken to send")
	b.release()
	b.release()
	assert.Equal(t, minCalls+2, b.limit)
	assert.Zero(t, b.inFlight)
}

// TestBatchCancelledCallerFailsNoOther cancels one of three waiting
// callers: it gets its context's error at once, without waiting for the
// batch, takes nothing, and the other two are decided.
func TestBatchCancelledCallerFailsNoOther(t *testing.T) {
	mr := miniredis.RunT(t)
	s := NewRedisStore(redis.NewClient(&redis.Options{Addr: mr.Addr()}))
	ctxs := background(3)
	var cancel context.CancelFunc
	ctxs[1], cancel = context.WithCancel(context.Background())
	reqs := []batchReq{{"a", 1, []Plan{gold}}, {"b", 4, []Plan{gold}}, {"c", 1, []Plan{gold}}}
	flush := gather(t, s, ctxs, reqs)
	cancel()
	for withdrawn := false; !withdrawn; { // returns while the slots are still held
		s.batch.mu.Lock()
		withdrawn = len(s.batch.pending) == 2
		s.batch.mu.Unlock()
		time.Sleep(100 * time.Microsecond)
	}
	got, errs := flush()
	assert.ErrorIs(t, errs[1], context.Canceled)
	for _, i := range []int{0, 2} {
		require.NoError(t, errs[i])
		assert.True(t, got[i].Allowed)
	}
	r, err := s.Take(context.Background(), "b", 0, []Plan{gold})
	require.NoError(t, err)
	assert.Equal(t, gold.Capacity, r.Remaining, "the cancelled request took nothing")
}

// TestBatchLeavesOutEndedContexts sends a batch in which one caller's
// context ended after it was queued: that request takes nothing and gets
// its context's error; the others are decided.
func TestBatchLeavesOutEndedContexts(t *testing.T) {
	mr := miniredis.RunT(t)
	s := NewRedisStore(redis.NewClient(&redis.Options{Addr: mr.Addr()}))
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	calls := []*scriptCall{
		{Call: redisscript.Call{Keys: []string{s.Key("a", gold.Name)}, Args: s.args(1, []Plan{gold})}, ctx: context.Background(), done: make(chan struct{}, 1)},
		{Call: redisscript.Call{Keys: []string{s.Key("b", gold.Name)}, Args: s.args(4, []Plan{gold})}, ctx: ended, done: make(chan struct{}, 1)},
	}
	s.batch.send(calls)
	require.NoError(t, calls[0].Err)
	assert.ErrorIs(t, calls[1].Err, context.Canceled)
	assert.False(t, mr.Exists(s.Key("b", gold.Name)), "nothing written for the ended context")
	assert.True(t, mr.Exists(s.Key("a", gold.Name)))
}

// TestBatchOutageReachesEachCaller fails the batch's script call: each
// caller gets the error, reduced to its class.
func TestBatchOutageReachesEachCaller(t *testing.T) {
	mr := miniredis.RunT(t)
	s := NewRedisStore(redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1}))
	reqs := []batchReq{{"secret-a", 1, []Plan{gold}}, {"secret-b", 1, []Plan{gold}}}
	flush := gather(t, s, background(2), reqs)
	mr.SetError("LOADING Redis is loading the dataset in memory; key 'secret-a'")
	_, errs := flush()
	for _, err := range errs {
		var rerr *redisscript.Error
		require.ErrorAs(t, err, &rerr)
		assert.Equal(t, "LOADING", rerr.Class)
		assert.NotContains(t, err.Error(), "secret")
	}
}

func TestBatchingOnClusterSendsEachDecision(t *testing.T) {
	cluster := redis.NewClusterClient(&redis.ClusterOptions{Addrs: []string{"127.0.0.1:1"}})
	t.Cleanup(func() { _ = cluster.Close() })
	ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
	t.Cleanup(func() { _ = ring.Close() })
	assert.Nil(t, NewRedisStore(cluster).batch)
	assert.Nil(t, NewRedisStore(ring).batch)
	plain := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { _ = plain.Close() })
	assert.NotNil(t, NewRedisStore(plain).batch)
	assert.NotNil(t, NewRedisStore(embeddedClient{plain}).batch, "a client that embeds a *redis.Client names its one server")
	assert.Nil(t, NewRedisStore(plain, WithoutBatching()).batch)
}

// embeddedClient and embeddedCluster are clients of a program's own that
// embed go-redis's, as instrumented wrappers do.
type (
	embeddedClient  struct{ *redis.Client }
	embeddedCluster struct{ *redis.ClusterClient }
)

// TestBatchingNeverSpansSlotsOfAClusterBehindAnotherClient decides under
// load through clients that hide a Cluster from a type switch: go-redis's
// auto-pipeliner of a ClusterClient, and a wrapper that embeds one. A
// batch would put keys of many slots in one script call, which Redis
// refuses with CROSSSLOT: every decision must be a call of its own.
func TestBatchingNeverSpansSlotsOfAClusterBehindAnotherClient(t *testing.T) {
	cluster := redistest.StartCluster(t, 1, 0).Client(t, &redis.ClusterOptions{PoolSize: 4})
	ap, err := cluster.AutoPipeline()
	require.NoError(t, err)
	for name, c := range map[string]redis.UniversalClient{"auto-pipeliner": ap, "wrapper": embeddedCluster{cluster}} {
		t.Run(name, func(t *testing.T) {
			s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
			var failed atomic.Int64
			var wg sync.WaitGroup
			for g := range 32 {
				wg.Go(func() {
					for i := range 20 {
						if _, err := s.Take(context.Background(), "k"+strconv.Itoa(g*20+i), 1, []Plan{gold}); err != nil {
							failed.Add(1)
						}
					}
				})
			}
			wg.Wait()
			assert.Zero(t, failed.Load(), "decisions failed of 640")
		})
	}
}

// evalCalls returns the EVALSHA and EVAL calls a Redis has answered.
func evalCalls(t *testing.T, c *redis.Client) int64 {
	t.Helper()
	info, err := c.Info(context.Background(), "commandstats").Result()
	require.NoError(t, err)
	n := int64(0)
	for _, line := range strings.Split(info, "\r\n") {
		if rest, ok := strings.CutPrefix(line, "cmdstat_eval"); ok {
			_, rest, _ = strings.Cut(rest, "calls=")
			calls, _, _ := strings.Cut(rest, ",")
			v, err := strconv.ParseInt(calls, 10, 64)
			require.NoError(t, err)
			n += v
		}
	}
	return n
}

// TestBatchingExactOnRealRedis runs 4 batching Limiters, each with its own
// client and 16 goroutines, on one key and on 8 keys for half a second on
// a redis-server of its own: admitted stays within capacity + rate ×
// elapsed per key, elapsed from Redis TIME, no decision fails, and fewer
// script calls than decisions reach Redis.
func TestBatchingExactOnRealRedis(t *testing.T) {
	srv := redistest.StartServer(t)
	probe := srv.Client(t)
	for _, nkeys := range []int{1, 8} {
		t.Run(strconv.Itoa(nkeys)+"-keys", func(t *testing.T) {
			prefix := redistest.KeyPrefix()
			plans := []Plan{{Name: "p", Capacity: 20, Rate: 400}}
			var limiters []*Limiter
			for i := 0; i < 4; i++ {
				// 16 callers on 4 connections: most decisions wait, and ride in batches.
				l, err := New(NewRedisStore(redistest.NewClient(t, &redis.Options{Addr: srv.Addr(), PoolSize: 4}), WithKeyPrefix(prefix)),
					plans, WithFailurePolicy(breaker.FailClosed), WithLogger(nil), WithDenialCache(0))
				require.NoError(t, err)
				limiters = append(limiters, l)
			}
			allowed := make([]atomic.Int64, nkeys)
			var ta tally
			calls := evalCalls(t, probe)
			start := redistest.Time(t, probe)
			deadline := time.Now().Add(500 * time.Millisecond)
			var wg sync.WaitGroup
			for _, l := range limiters {
				for g := 0; g < 16; g++ {
					wg.Go(func() {
						for i := g; time.Now().Before(deadline); i++ {
							r, err := l.Allow(context.Background(), "k"+strconv.Itoa(i%nkeys))
							ta.record(r, err)
							if err == nil && r.Allowed {
								allowed[i%nkeys].Add(1)
							}
						}
					})
				}
			}
			wg.Wait()
			end := redistest.Time(t, probe)
			calls = evalCalls(t, probe) - calls
			require.Zero(t, ta.errs.Load(), "first error: %v", ta.firstErr.Load())
			decisions := ta.allowed.Load() + ta.denied.Load()
			bound := float64(plans[0].Capacity) + plans[0].Rate*float64(end-start)/1e6
			t.Logf("%d decisions in %d script calls; bound %.1f a key", decisions, calls, bound)
			for k := range allowed {
				t.Logf("key %d: %d admitted", k, allowed[k].Load())
				assert.LessOrEqual(t, float64(allowed[k].Load()), bound, "key %d", k)
				assert.Greater(t, float64(allowed[k].Load()), 0.8*bound, "key %d: refills must be admitted", k)
			}
			assert.Less(t, calls, decisions, "decisions were batched")
		})
	}
}

// TestBatchDecidesAtOneRedisTimeOnRealRedis sends decisions on 16 keys as
// one batch: the script reads Redis TIME once, so every bucket is stamped
// with the same µs, which 16 reads of TIME on a real clock would not give.
// Decisions sent alone each read TIME again: the next batch is later.
func TestBatchDecidesAtOneRedisTimeOnRealRedis(t *testing.T) {
	c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
	s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	plans := []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1}}
	stamps := func(first int) []int64 {
		reqs := make([]batchReq, 16)
		for i := range reqs {
			reqs[i] = batchReq{"k" + strconv.Itoa(first+i), 1, plans}
		}
		_, errs := gather(t, s, background(len(reqs)), reqs)()
		var ts []int64
		for i, r := range reqs {
			require.NoError(t, errs[i])
			ts = append(ts, storedBucket(t, c, s.Key(r.key, "p")).Stamp)
		}
		return ts
	}
	first, second := stamps(0), stamps(16)
	for i := range first {
		assert.Equal(t, first[0], first[i], "decision %d of the first batch", i)
		assert.Equal(t, second[0], second[i], "decision %d of the second batch", i)
	}
	assert.Greater(t, second[0], first[0], "each batch reads TIME")
}

// TestBatchingNoscriptStormOnRealRedis flushes the script cache and the
// functions every 5 ms under batched load: no decision fails, under
// FailClosed.
func TestBatchingNoscriptStormOnRealRedis(t *testing.T) {
	addr := redistest.Addr(t)
	// 16 callers on 4 connections: most decisions ride in batches.
	s := NewRedisStore(redistest.NewClient(t, &redis.Options{Addr: addr, PoolSize: 4}), WithKeyPrefix(redistest.KeyPrefix()))
	l, err := New(s, []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1}}, WithFailurePolicy(breaker.FailClosed), WithLogger(nil))
	require.NoError(t, err)
	flusher := redistest.NewClient(t, &redis.Options{Addr: addr})
	var ta tally
	stop := loadUntilStopped(16, func(g, i int) { ta.record(l.Allow(context.Background(), "k"+strconv.Itoa(i%64))) })
	for end := time.Now().Add(time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		require.NoError(t, flusher.ScriptFlush(context.Background()).Err())
		require.NoError(t, flusher.FunctionFlush(context.Background()).Err())
	}
	stop()
	t.Logf("%d decisions, %d script loads", ta.allowed.Load(), s.ScriptLoads())
	require.Zero(t, ta.errs.Load(), "first error: %v", ta.firstErr.Load())
	assert.Zero(t, ta.fallback.Load())
	assert.Positive(t, s.scripts.takeMany.Loads(), "batches found their function missing and healed it")
}

// BenchmarkRedisBatching decides on 10,000 keys from 32 goroutines per
// -cpu on real Redis, each decision sent alone and batched. Its figure is
// allocations per decision, which include each batch's share; the time
// depends on what else shares the machine with Redis (bench/cmd/load
// compares throughput).
func BenchmarkRedisBatching(b *testing.B) {
	for _, tc := range []struct {
		name string
		opts []Option
	}{{"alone", []Option{WithoutBatching()}}, {"batched", nil}} {
		b.Run(tc.name, func(b *testing.B) {
			c := redis.NewClient(&redis.Options{Addr: redistest.Addr(b), PoolSize: 128})
			defer c.Close()
			l, err := New(NewRedisStore(c, append(tc.opts, WithKeyPrefix(redistest.KeyPrefix()))...), benchPlan)
			require.NoError(b, err)
			b.SetParallelism(32)
			allowParallel(b, l)
		})
	}
}

// BenchmarkRedisBatchingOneCaller is BenchmarkRedisBatching with one
// caller, deciding on 10,000 keys in turn: a lone caller never waits for
// a batch, so both send each decision alone.
func BenchmarkRedisBatchingOneCaller(b *testing.B) {
	for _, tc := range []struct {
		name string
		opts []Option
	}{{"alone", []Option{WithoutBatching()}}, {"batched", nil}} {
		b.Run(tc.name, func(b *testing.B) {
			c := redis.NewClient(&redis.Options{Addr: redistest.Addr(b)})
			defer c.Close()
			l, err := New(NewRedisStore(c, append(tc.opts, WithKeyPrefix(redistest.KeyPrefix()))...), benchPlan)
			require.NoError(b, err)
			ctx, keys := context.Background(), benchKeys(10_000)
			b.ReportAllocs()
			i := 0
			for b.Loop() {
				i++
				if _, err := l.Allow(ctx, keys[i%len(keys)]); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestBatchBringsBackAFarStampAsACallOfItsOwn plants a drained bucket
// with its stamp an hour ahead (ADR 29), then sends a denial, a read and
// another denial on it in one batch, and the same one call each: the
// batch writes the stamp back as the calls do, and answers alike.
func TestBatchBringsBackAFarStampAsACallOfItsOwn(t *testing.T) {
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(t0))
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	batched := NewRedisStore(c, WithKeyPrefix("batched"))
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
	got := batchAgainstCalls(t, batched, plain, reqs)
	assert.False(t, got[1].Allowed)
	assert.True(t, got[3].Allowed, "1.5 tokens kept")
	assert.Equal(t, storedAt(t, c, plain.Key("a", gold.Name)), storedAt(t, c, batched.Key("a", gold.Name)))
	r, err := plain.Take(context.Background(), "a", 0, []Plan{gold})
	require.NoError(t, err)
	assert.Equal(t, 2*time.Second+250*time.Millisecond, r.RetryAfter, "brought back to a full refill (2 s) ahead, 0.5 token left, 0.25 s from a token")
}

// TestBatchCarriesShadowsAndVersions sends shadowed and versioned plans,
// alone and in a chain, in one batch, and the same requests one call each:
// a shadowed plan's would-be denials, and a version's inheritance, applied
// once, come back from the batch's packed reply as from calls of their
// own, and the stored state is the same.
func TestBatchCarriesShadowsAndVersions(t *testing.T) {
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(t0))
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	batched := NewRedisStore(c, WithKeyPrefix("batched"))
	plain := NewRedisStore(c, WithKeyPrefix("plain"))
	old := Plan{Name: "v", Capacity: 4, Rate: 0.001}
	next := Plan{Name: "v", Capacity: 8, Rate: 0.001, Version: 2, Inherit: InheritReset}
	window := Plan{Name: "minute", Capacity: 1, Window: time.Minute, Shadow: true}
	reqs := []batchReq{
		{"s", 3, []Plan{shadowed(gold)}},
		{"s", 3, []Plan{shadowed(gold)}}, // would deny: 1 left
		{"v", 4, []Plan{old}},
		{"v", 1, []Plan{next}}, // version 2 resets the bucket to 8, once
		{"v", 1, []Plan{old}},  // clamps 7 to 4
		{"v", 1, []Plan{next}}, // no second reset
		{"c", 1, []Plan{gold, window}},
		{"c", 1, []Plan{gold, window}}, // the shadowed window would deny; gold admits
	}
	got := batchAgainstCalls(t, batched, plain, reqs)
	assert.True(t, got[1].Allowed)
	assert.True(t, got[1].ShadowDenied)
	assert.Equal(t, int64(7), got[3].Remaining, "reset to 8 by version 2")
	assert.Equal(t, int64(2), got[5].Remaining, "the version was kept: no second reset")
	assert.True(t, got[7].Allowed)
	assert.Equal(t, []bool{false, true}, []bool{got[7].PlanResults()[0].WouldDeny, got[7].PlanResults()[1].WouldDeny})
	for _, r := range reqs {
		for _, p := range r.plans {
			assert.Equal(t, storedAt(t, c, plain.Key(r.key, p.Name)), storedAt(t, c, batched.Key(r.key, p.Name)), "%s %s", r.key, p.Name)
		}
	}
	assert.Equal(t, int64(1), batched.scripts.limitMany.Loads(), "the eight went in one script call")
}

// TestBatchedDenialIsRemembered: a denial decided in a batch is the
// store's answer like any other. The Limiter remembers it, counted from
// when the request was sent, before it waited in the batcher, and answers
// the same request without Redis until then.
func TestBatchedDenialIsRemembered(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(t0))
	c, calls := countedClient(t, &redis.Options{Addr: mr.Addr()})
	s := NewRedisStore(c)
	l, err := New(s, []Plan{{Name: "slow", Capacity: 4, Rate: Per(4, time.Hour)}}, WithLogger(nil))
	require.NoError(t, err)
	time.Sleep(time.Millisecond) // off the instant of New: see testDenialCacheSparesTheStore
	got, errs := batchOf(t, s, 2, func(i int) (Result, error) { return l.AllowN(ctx, "k", []int64{4, 1}[i]) })()
	require.NoError(t, errs[0])
	require.NoError(t, errs[1])
	require.True(t, got[0].Allowed)
	require.False(t, got[1].Allowed, "denied in the same batch")
	require.Equal(t, int64(1), s.scripts.takeMany.Loads(), "the two went in one call")
	sent := calls.alone.Load()
	for range 3 {
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.False(t, r.Allowed)
		assert.Equal(t, SourceCache, r.Source)
		assert.Greater(t, r.RetryAfter, 14*time.Minute, "15 minutes for a token, less the time since it was sent")
	}
	assert.Equal(t, sent, calls.alone.Load(), "no request reached Redis")
}

// TestBatchOutageFallsBackPerRequest fails a batch of a Limiter's
// decisions: each request is judged on its own, and the fallback decides
// each on this instance's share of its plan (WithFleet, 4 instances).
func TestBatchOutageFallsBackPerRequest(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	s := NewRedisStore(c)
	l, err := New(s, []Plan{{Name: "p", Capacity: 100, Rate: 0.001}}, WithLogger(nil), WithFleet(time.Hour), WithDenialCache(0))
	require.NoError(t, err)
	l.fleet.close() // the test sets the fleet's size
	l.fleet.size.Store(4)
	flush := batchOf(t, s, 3, func(i int) (Result, error) { return l.AllowN(ctx, "k"+strconv.Itoa(i), 10) })
	mr.SetError("LOADING Redis is loading the dataset in memory")
	got, errs := flush()
	for i := range got {
		require.NoError(t, errs[i], "request %d", i)
		assert.Equal(t, SourceFallback, got[i].Source, "request %d", i)
		assert.Equal(t, int64(25), got[i].Limit, "request %d: the share of 4", i)
		assert.Equal(t, int64(15), got[i].Remaining, "request %d", i)
	}
	assert.Equal(t, uint64(3), l.Stats().StoreErrors["LOADING"], "one failure per request of the batch")
}

// hungScripts is a go-redis hook that holds every script call while
// hung is set, as a Redis that stopped answering would: entered receives
// when one is held, and closing gate lets them all through.
type hungScripts struct {
	hung    atomic.Bool
	entered chan struct{}
	gate    chan struct{}
}

func (*hungScripts) DialHook(next redis.DialHook) redis.DialHook { return next }
func (*hungScripts) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *hungScripts) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		switch cmd.Name() {
		case "evalsha", "eval", "fcall":
			if h.hung.Load() {
				h.entered <- struct{}{}
				<-h.gate // whatever ctx says: the server holds the reply
			}
		}
		return next(ctx, cmd)
	}
}

// TestBatchLeaderThatGivesUpIsNotHeld: the caller handed a call slot
// sends its batch, but is not held by it once its own context ends, as
// the callers waiting in the batch are not: it gets its context's error
// while the batch's call is still under way, and the others get their
// answers when it ends. The leader's decision, sent, is taken once.
func TestBatchLeaderThatGivesUpIsNotHeld(t *testing.T) {
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(t0)) // no refill between the takes and the read
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	h := &hungScripts{entered: make(chan struct{}, 4), gate: make(chan struct{})}
	c.AddHook(h)
	s := NewRedisStore(c)
	lctx, cancel := context.WithCancel(context.Background())
	ctxs := []context.Context{lctx, context.Background()}
	answers := make([]chan error, 2)
	for i := range answers {
		answers[i] = make(chan error, 1)
	}
	flush := batchOf(t, s, 2, func(i int) (Result, error) {
		r, err := s.Take(ctxs[i], []string{"a", "b"}[i], 1, []Plan{gold})
		answers[i] <- err
		return r, err
	})
	h.hung.Store(true)
	go flush()
	<-h.entered // the leader's batch is under way, and hangs
	cancel()
	select {
	case err := <-answers[0]:
		assert.ErrorIs(t, err, context.Canceled)
	case <-time.After(10 * time.Second): // not a timed assertion: the call hangs for ever
		t.Error("the leader is held by its batch's call after its context ended")
	}
	h.hung.Store(false)
	close(h.gate)
	require.NoError(t, <-answers[1], "the other caller is answered")
	r, err := s.Take(context.Background(), "a", 0, []Plan{gold})
	require.NoError(t, err)
	assert.Equal(t, gold.Capacity-1, r.Remaining, "the leader's sent decision took once")
}

// twinStep is one decision of TestBatchedLimiterAnswersAsUnbatched: it
// decides on l and returns what its caller sees, every field of it.
type twinStep func(ctx context.Context, l *Limiter) (any, error)

// twinSeen is what a caller sees of a decision: its Result, its plans'
// results, and for a Reserve or an Acquire whether it holds.
type twinSeen struct {
	OK     bool
	Result Result
	Plans  []PlanResult
}

func twinTake(key string, cost int64, plans ...string) twinStep {
	return func(ctx context.Context, l *Limiter) (any, error) {
		r, err := l.AllowN(ctx, key, cost, plans...)
		return twinSeen{OK: r.Allowed, Result: r, Plans: r.PlanResults()}, err
	}
}

func twinPeek(key string, n int64, plans ...string) twinStep {
	return func(ctx context.Context, l *Limiter) (any, error) {
		r, err := l.PeekN(ctx, key, n, plans...)
		return twinSeen{OK: r.Allowed, Result: r, Plans: r.PlanResults()}, err
	}
}

func twinReserve(key string, n int64, plans ...string) twinStep {
	return func(ctx context.Context, l *Limiter) (any, error) {
		res, err := l.Reserve(ctx, key, n, plans...)
		if err != nil {
			return nil, err
		}
		return twinSeen{OK: res.OK(), Result: res.Result(), Plans: res.Result().PlanResults()}, nil
	}
}

func twinAcquire(key string, n int64, plans ...string) twinStep {
	return func(ctx context.Context, l *Limiter) (any, error) {
		p, err := l.Acquire(ctx, key, n, plans...)
		if err != nil {
			return nil, err
		}
		return twinSeen{OK: p.OK(), Result: p.Result(), Plans: p.Result().PlanResults()}, nil
	}
}

// twinLimiters returns two Limiters on plans, each on a Redis of its
// own, miniredis or, with real, a redis-server: the first on a batching
// store, the second on one that sends each decision alone; and a function
// that sets both Redis clocks to now, in µs, at t0 at first. Suppressed
// plans draw alike on both.
func twinLimiters(t *testing.T, plans []Plan, real bool) (batched, alone *Limiter, bs *RedisStore, setNow func(now int64)) {
	t.Helper()
	var ls [2]*Limiter
	var clocks [2]func(now int64)
	for i, opts := range [][]Option{nil, {WithoutBatching()}} {
		var c *redis.Client
		if real {
			c = redistest.StartServer(t).Client(t)
		} else {
			mr := miniredis.RunT(t)
			c = redistest.NewClient(t, &redis.Options{Addr: mr.Addr(), MaxRetries: -1})
			clocks[i] = func(now int64) { mr.SetTime(time.UnixMicro(now)) }
		}
		s := NewRedisStore(c, opts...)
		s.random = sameDraws()
		if real {
			clocks[i] = func(now int64) { s.scripts = fixedClockScripts(t, now); resetBatchScripts(s) }
		}
		if i == 0 {
			bs = s
		}
		l, err := New(s, plans, WithLogger(nil), WithDenialCache(0))
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.Close() })
		ls[i] = l
	}
	setNow = func(now int64) { clocks[0](now); clocks[1](now) }
	setNow(t0)
	return ls[0], ls[1], bs, setNow
}

// fixedClockScripts returns a store's decision scripts with Redis TIME
// replaced by now, in µs, so that a real Redis decides as at that instant.
func fixedClockScripts(t *testing.T, now int64) *decisionScripts {
	t.Helper()
	const line = "  local time = redis.call('TIME')\n"
	require.Equal(t, 1, strings.Count(luaBucket, line), "bucket.lua reads TIME in readClock")
	return decisionScriptsOn(strings.Replace(luaBucket, line,
		fmt.Sprintf("  local time = {'%d', '%d'}\n", now/1_000_000, now%1_000_000), 1))
}

// resetBatchScripts has s's batcher, if any, run s's scripts.
func resetBatchScripts(s *RedisStore) {
	if s.batch != nil {
		s.batch.scripts = s.scripts
	}
}

// twinRound sends steps as one batch on batched, and one after the other
// on alone, and demands that each caller sees the same.
func twinRound(t *testing.T, round string, batched, alone *Limiter, bs *RedisStore, steps []twinStep) {
	t.Helper()
	ctx := context.Background()
	seen := make([]any, len(steps))
	_, errs := batchOf(t, bs, len(steps), func(i int) (Result, error) {
		var err error
		seen[i], err = steps[i](ctx, batched)
		return Result{}, err
	})()
	for i, step := range steps {
		want, err := step(ctx, alone)
		assert.Equal(t, err, errs[i], "%s, step %d: error", round, i)
		assert.Equal(t, want, seen[i], "%s, step %d", round, i)
	}
}

// TestBatchedLimiterAnswersAsUnbatched runs one sequence of mixed
// decisions (takes, reads, chains, windows, a suppressed window, shadowed
// plans, holds, permits, and versions after SetPlans) on two Limiters on
// fresh stores at the same Redis time: batched on one, each decision
// alone on the other. Every caller sees the same on both, every field.
func TestBatchedLimiterAnswersAsUnbatched(t *testing.T) {
	plans := []Plan{
		{Name: "gold", Capacity: 4, Rate: 2},
		{Name: "minute", Capacity: 3, Window: time.Minute},
		{Name: "sup", Capacity: 2, Window: time.Minute, Suppress: 2},
		{Name: "conc", Capacity: 2, Concurrency: true},
		{Name: "shadow", Capacity: 2, Rate: 1, Shadow: true},
		{Name: "v", Capacity: 4, Rate: 0.5, Version: 1},
	}
	for _, env := range []string{"miniredis", "redis"} {
		t.Run(env, func(t *testing.T) {
			if env == "redis" {
				redistest.SkipIfUnavailable(t)
			}
			batched, alone, bs, setNow := twinLimiters(t, plans, env == "redis")
			twinSequence(t, plans, batched, alone, bs, setNow)
		})
	}
}

// twinSequence is TestBatchedLimiterAnswersAsUnbatched on one pair of
// Limiters.
func twinSequence(t *testing.T, plans []Plan, batched, alone *Limiter, bs *RedisStore, setNow func(int64)) {
	twinRound(t, "mixed", batched, alone, bs, []twinStep{
		twinTake("a", 3, "gold"),
		twinTake("a", 2, "gold"), // denied: 1 left
		twinPeek("a", 1, "gold"),
		twinTake("b", 1, "gold", "minute"),
		twinTake("b", 3, "gold", "minute"), // the window denies
		twinPeek("b", 2, "gold", "minute"),
		twinReserve("c", 2, "gold"),
		twinReserve("c", 3, "gold"), // denied
		twinAcquire("p", 1, "conc"),
		twinAcquire("p", 2, "conc"), // one permit free
		twinAcquire("p", 1, "conc", "gold"),
		twinTake("s", 2, "shadow", "gold"),
		twinTake("s", 2, "shadow", "gold"), // the shadow would deny
		twinTake("v", 3, "v"),
		twinTake("w", 1, "sup"),
		twinTake("w", 1, "sup"),
		twinTake("w", 1, "sup"),
		twinTake("w", 1, "sup"),
	})
	next := slices.Clone(plans)
	next[5] = Plan{Name: "v", Capacity: 8, Rate: 0.5, Version: 2, Inherit: InheritProportional}
	next[0].Capacity = 6
	for _, l := range []*Limiter{batched, alone} {
		require.NoError(t, l.SetPlans(next))
	}
	setNow(t0 + 700_000)
	twinRound(t, "after SetPlans", batched, alone, bs, []twinStep{
		twinPeek("v", 1, "v"),
		twinTake("v", 1, "v"), // version 2 inherits, once
		twinTake("v", 1, "v"),
		twinTake("a", 1, "gold"),
		twinReserve("c", 1, "gold"),
		twinAcquire("p", 1, "conc"),
		twinTake("b", 1, "minute", "gold"),
		twinTake("s", 1, "gold", "shadow"),
	})
	setNow(t0 + 1_300_000)
	twinRound(t, "lean", batched, alone, bs, []twinStep{ // every one lean: the grouped batch
		twinTake("a", 1, "gold"),
		twinTake("a", 2, "gold"),
		twinTake("a", 2, "gold"),
		twinPeek("a", 1, "gold"),
		twinTake("b", 1, "gold"),
		twinTake("b", 1, "gold"),
		twinTake("new", 6, "gold"),
		twinPeek("new", 1, "gold"),
	})
	assert.Equal(t, int64(1), bs.scripts.takeMany.Loads(), "the lean round went in one call")
}

// TestBatchedErrorIsItsOwn plants keys of the wrong type and foreign
// values by hand, the same on both Redis servers of twinLimiters, and
// decides on them amid good decisions, batched on one and alone on the
// other: each caller sees the same, so a decision that fails fails no
// other in its batch, nor changes its answer.
func TestBatchedErrorIsItsOwn(t *testing.T) {
	plans := []Plan{
		{Name: "gold", Capacity: 4, Rate: 2},
		{Name: "minute", Capacity: 3, Window: time.Minute},
		{Name: "conc", Capacity: 2, Concurrency: true},
		{Name: "v", Capacity: 4, Rate: 0.5, Version: 1},
	}
	for _, env := range []string{"miniredis", "redis"} {
		t.Run(env, func(t *testing.T) {
			if env == "redis" {
				redistest.SkipIfUnavailable(t)
			}
			batched, alone, bs, _ := twinLimiters(t, plans, env == "redis")
			ctx := context.Background()
			for _, l := range []*Limiter{batched, alone} {
				s := l.store.(*RedisStore)
				require.NoError(t, s.client.RPush(ctx, s.Key("list", "gold"), "x").Err())
				require.NoError(t, s.client.RPush(ctx, s.Key("list", "minute"), "x").Err())
				require.NoError(t, s.client.RPush(ctx, s.Key("list", "conc"), "x").Err())
				require.NoError(t, s.client.RPush(ctx, s.Key("list", "v"), "x").Err())
				require.NoError(t, s.client.Set(ctx, s.Key("str", "minute"), "foreign", 0).Err())
				require.NoError(t, s.client.Set(ctx, s.Key("str", "conc"), "foreign", 0).Err())
				require.NoError(t, s.client.Set(ctx, s.Key("str", "gold"), strings.Repeat("\xff", 14), 0).Err())
				require.NoError(t, s.client.HSet(ctx, s.Key("hash", "gold"), "v", "w9/9", "1", "x").Err())
				require.NoError(t, s.client.HSet(ctx, s.Key("hash", "minute"), "v", "junk").Err())
			}
			steps := []twinStep{twinTake("a", 1, "gold")}
			for _, key := range []string{"list", "str", "hash"} {
				steps = append(steps,
					twinTake(key, 1, "gold"),
					twinTake("a", 1, "gold", "minute"),
					twinTake(key, 1, "minute"),
					twinTake(key, 1, "gold", "minute"),
					twinPeek(key, 1, "gold", "minute"),
					twinReserve(key, 1, "gold"),
					twinAcquire(key, 1, "conc"),
					twinTake(key, 1, "v"),
					twinTake("b", 1, "minute"),
				)
			}
			twinRound(t, "foreign", batched, alone, bs, steps)
			assert.Equal(t, alone.Stats().StoreErrors, batched.Stats().StoreErrors)
			t.Logf("store errors: %v", alone.Stats().StoreErrors)
		})
	}
}

// TestBatchCallersThatLeaveStrandNothing has 48 callers take, reserve and
// acquire through a batching Limiter on 2 call slots, most of them with a
// context that ends within a few ms, while their decisions wait for a
// slot, ride in a batch or lead one. After: no call slot is held, no
// decision waits, a decision alone is answered, every token reserved and
// every permit acquired is back (a hold or an acquire whose caller left
// was given back), and Close leaves no goroutine of the batcher.
func TestBatchCallersThatLeaveStrandNothing(t *testing.T) {
	for _, env := range []string{"miniredis", "redis"} {
		t.Run(env, func(t *testing.T) {
			addr := ""
			if env == "redis" {
				redistest.SkipIfUnavailable(t)
				addr = redistest.StartServer(t).Addr()
			} else {
				addr = miniredis.RunT(t).Addr()
			}
			ignore := goleak.IgnoreCurrent()
			c := redistest.NewClient(t, &redis.Options{Addr: addr, PoolSize: 2, MaxRetries: -1, ContextTimeoutEnabled: true})
			s := NewRedisStore(c)
			plans := []Plan{{Name: "p", Capacity: 1_000_000, Rate: 0.001}, {Name: "conc", Capacity: 10_000, Concurrency: true}}
			l, err := New(s, plans, WithLogger(nil), WithDenialCache(0), WithFailurePolicy(breaker.FailClosed))
			require.NoError(t, err)
			leaveWhileBatched(t, l, 48, 400*time.Millisecond)
			b := s.batch
			began := time.Now()
			defer func() { t.Logf("settled in %v", time.Since(began)) }()
			assert.Eventually(t, func() bool {
				b.mu.Lock()
				defer b.mu.Unlock()
				return b.inFlight == 0 && len(b.pending) == 0
			}, 15*time.Second, time.Millisecond, "a call slot is held, or a decision waits")
			ctx := context.Background()
			assert.Eventually(t, func() bool {
				r, err := l.PeekN(ctx, "held", 1, "p")
				return err == nil && r.Remaining == plans[0].Capacity
			}, 15*time.Second, 5*time.Millisecond, "every token reserved is back")
			t.Logf("tokens back after %v", time.Since(began))
			assert.Eventually(t, func() bool {
				p, err := l.Acquire(ctx, "held", plans[1].Capacity, "conc")
				if err != nil || !p.OK() {
					return false
				}
				return p.Release(ctx) == nil
			}, 15*time.Second, 5*time.Millisecond, "every permit acquired is back")
			require.NoError(t, l.Close())
			require.NoError(t, c.Close())
			goleak.VerifyNone(t, ignore,
				goleak.IgnoreAnyFunction("github.com/tollgate-go/tollgate/internal/redistest.(*Server).launchLocked.func1"),
				goleak.IgnoreTopFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).reaper"))
		})
	}
}

// leaveWhileBatched has callers goroutines decide on l for d: takes,
// reservations and acquisitions of key "held", most with a context that
// ends within 0 to 3 ms, some cancelled at once. A reservation or an
// acquisition granted is given back at once.
func leaveWhileBatched(t *testing.T, l *Limiter, callers int, d time.Duration) {
	t.Helper()
	var wg sync.WaitGroup
	end := time.Now().Add(d)
	for g := range callers {
		wg.Go(func() {
			for i := 0; time.Now().Before(end); i++ {
				ctx, cancel := context.WithTimeout(context.Background(), time.Duration((g+i)%4)*time.Millisecond)
				if (g+i)%7 == 0 {
					cancel()
				}
				switch i % 3 {
				case 0:
					_, _ = l.AllowN(ctx, "k"+strconv.Itoa(g), 1, "p")
				case 1:
					if r, err := l.Reserve(ctx, "held", 3, "p"); err == nil && r.OK() {
						_, err := r.Cancel(context.Background())
						assert.NoError(t, err)
					}
				case 2:
					if p, err := l.Acquire(ctx, "held", 2, "conc"); err == nil && p.OK() {
						assert.NoError(t, p.Release(context.Background()))
					}
				}
				cancel()
			}
		})
	}
	wg.Wait()
}

// lostBatchHook is a go-redis hook that, once armed, lets the next
// EVALSHA run in Redis and then fails it with a read timeout, as a reply
// lost on the way back would.
type lostBatchHook struct{ armed atomic.Bool }

func (*lostBatchHook) DialHook(next redis.DialHook) redis.DialHook { return next }
func (*lostBatchHook) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *lostBatchHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if cmd.Name() != "evalsha" || !h.armed.CompareAndSwap(true, false) {
			return next(ctx, cmd)
		}
		_ = next(ctx, cmd)
		return &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
	}
}

// TestBatchWhoseReplyIsLost runs a batch of takes, a reservation and an
// acquisition in Redis and loses its reply: each caller gets the failure
// policy's answer; the takes were taken once, and the hold and the
// permits whose callers never learnt of them are given back.
func TestBatchWhoseReplyIsLost(t *testing.T) {
	for name, addr := range lostReplyServers() {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			c := redistest.NewClient(t, &redis.Options{Addr: addr(t), MaxRetries: -1})
			s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
			plans := []Plan{{Name: "p", Capacity: 100, Rate: 0.0001}, {Name: "conc", Capacity: 3, Concurrency: true}}
			l, err := New(s, plans, WithLogger(nil), WithDenialCache(0), WithFailurePolicy(breaker.FailClosed),
				WithBreaker(breaker.Settings{Failures: 100, MinCalls: 100})) // the four failures open no breaker
			require.NoError(t, err)
			t.Cleanup(func() { _ = l.Close() })
			_, errs := batchOf(t, s, 2, func(i int) (Result, error) { // loads the batch script: the next batch is one EVALSHA
				if i == 0 {
					return l.AllowN(ctx, "warm", 1, "p")
				}
				_, err := l.Reserve(ctx, "warm", 1, "p")
				return Result{}, err
			})()
			require.NoError(t, errs[0])
			require.NoError(t, errs[1])
			hook := &lostBatchHook{}
			c.AddHook(hook)
			steps := []func() error{
				func() error { _, err := l.AllowN(ctx, "a", 10, "p"); return err },
				func() error { _, err := l.Reserve(ctx, "h", 20, "p"); return err },
				func() error { _, err := l.Acquire(ctx, "q", 2, "conc"); return err },
				func() error { _, err := l.AllowN(ctx, "a", 5, "p"); return err },
			}
			flush := batchOf(t, s, len(steps), func(i int) (Result, error) { return Result{}, steps[i]() })
			hook.armed.Store(true)
			_, errs = flush()
			for i, err := range errs {
				assert.ErrorIs(t, err, ErrStoreUnavailable, "step %d", i)
			}
			require.False(t, hook.armed.Load(), "the batch ran, and its reply was lost")
			left := func(key string) int64 {
				r, err := l.PeekN(ctx, key, 1, "p")
				require.NoError(t, err)
				return r.Remaining
			}
			assert.Equal(t, int64(85), left("a"), "the takes were taken once")
			assert.Eventually(t, func() bool { return left("h") == 100 }, 10*time.Second, time.Millisecond, "the hold is given back")
			assert.Eventually(t, func() bool {
				p, err := l.Acquire(ctx, "q", 3, "conc")
				return err == nil && p.OK() && p.Release(ctx) == nil
			}, 10*time.Second, time.Millisecond, "the permits are released")
		})
	}
}
