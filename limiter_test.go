package tollgate

import (
	"context"
	"errors"
	"math"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

var testPlans = []Plan{
	{Name: "gold", Capacity: 4, Rate: 2},
	{Name: "daily", Capacity: 100, Rate: Per(100, 24*time.Hour)},
}

func newTestLimiter(t *testing.T, store Store, opts ...Option) *Limiter {
	t.Helper()
	l, err := New(store, testPlans, append([]Option{WithLogger(nil)}, opts...)...)
	require.NoError(t, err)
	return l
}

func TestNewRefusesATypedNilStore(t *testing.T) {
	var m *MemoryStore
	var r *RedisStore
	for name, s := range map[string]Store{"memory": m, "redis": r} {
		_, err := New(s, testPlans)
		assert.ErrorIs(t, err, ErrInvalidOption, name)
		_, err = New(NewMemoryStore(), testPlans, WithFallback(s))
		assert.ErrorIs(t, err, ErrInvalidOption, name+" fallback")
	}
}

func TestNewRejectsBadPlans(t *testing.T) {
	tests := []struct {
		name  string
		plans []Plan
	}{
		{"no plans", nil},
		{"empty name", []Plan{{Name: "", Capacity: 1, Rate: 1}}},
		{"long name", []Plan{{Name: strings.Repeat("a", 65), Capacity: 1, Rate: 1}}},
		{"brace in name", []Plan{{Name: "a}b", Capacity: 1, Rate: 1}}},
		{"space in name", []Plan{{Name: "a b", Capacity: 1, Rate: 1}}},
		{"zero capacity", []Plan{{Name: "a", Capacity: 0, Rate: 1}}},
		{"negative capacity", []Plan{{Name: "a", Capacity: -1, Rate: 1}}},
		{"capacity too large", []Plan{{Name: "a", Capacity: maxCapacity + 1, Rate: 1e9}}},
		{"zero rate", []Plan{{Name: "a", Capacity: 1, Rate: 0}}},
		{"negative rate", []Plan{{Name: "a", Capacity: 1, Rate: -1}}},
		{"NaN rate", []Plan{{Name: "a", Capacity: 1, Rate: math.NaN()}}},
		{"infinite rate", []Plan{{Name: "a", Capacity: 1, Rate: math.Inf(1)}}},
		{"refill slower than maxRefillPeriod", []Plan{{Name: "a", Capacity: 1000, Rate: 1e-9}}},
		{"duplicate names", []Plan{{Name: "a", Capacity: 1, Rate: 1}, {Name: "a", Capacity: 2, Rate: 1}}},
		{"neither rate nor window", []Plan{{Name: "a", Capacity: 1}}},
		{"both rate and window", []Plan{{Name: "a", Capacity: 1, Rate: 1, Window: time.Second}}},
		{"negative window", []Plan{{Name: "a", Capacity: 1, Window: -time.Second}}},
		{"window under 1ms", []Plan{{Name: "a", Capacity: 1, Window: time.Millisecond - 1}}},
		{"window over maxRefillPeriod", []Plan{{Name: "a", Capacity: 1, Window: maxRefillPeriod + 1}}},
		{"negative slots", []Plan{{Name: "a", Capacity: 1, Window: time.Second, Slots: -1}}},
		{"too many slots", []Plan{{Name: "a", Capacity: 1, Window: time.Second, Slots: 65}}},
		{"slots on a bucket", []Plan{{Name: "a", Capacity: 1, Rate: 1, Slots: 4}}},
		{"hard limit below the soft one", []Plan{{Name: "a", Capacity: 10, Window: time.Second, Suppress: 0.9}}},
		{"negative suppress", []Plan{{Name: "a", Capacity: 10, Window: time.Second, Suppress: -1}}},
		{"NaN suppress", []Plan{{Name: "a", Capacity: 10, Window: time.Second, Suppress: math.NaN()}}},
		{"infinite suppress", []Plan{{Name: "a", Capacity: 10, Window: time.Second, Suppress: math.Inf(1)}}},
		{"hard limit too large", []Plan{{Name: "a", Capacity: maxCapacity, Window: time.Second, Suppress: 2}}},
		{"suppressed bucket", []Plan{{Name: "a", Capacity: 10, Rate: 1, Suppress: 1.5}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(NewMemoryStore(), tt.plans)
			assert.ErrorIs(t, err, ErrInvalidPlan)
		})
	}
	_, err := New(nil, testPlans)
	assert.ErrorIs(t, err, ErrInvalidOption)
	_, err = New(NewMemoryStore(), testPlans, WithFailurePolicy(breaker.FailurePolicy(9)))
	assert.ErrorIs(t, err, ErrInvalidOption)
	_, err = New(NewMemoryStore(), []Plan{{Name: "edge", Capacity: maxCapacity, Rate: 1e9}})
	assert.NoError(t, err, "the largest capacity is valid")
	_, err = New(NewMemoryStore(), []Plan{
		{Name: "shortest", Capacity: 1, Window: time.Millisecond, Slots: 64},
		{Name: "longest", Capacity: maxCapacity, Window: maxRefillPeriod, Slots: 1},
		{Name: "suppressed", Capacity: 100, Window: time.Minute, Suppress: 1},
	})
	assert.NoError(t, err, "window plans at the edges are valid")
}

func TestAllowDefaultsToFirstPlan(t *testing.T) {
	l := newTestLimiter(t, NewMemoryStore())
	r, err := l.Allow(context.Background(), "k")
	require.NoError(t, err)
	assert.Equal(t, "gold", r.Plan)
	assert.Equal(t, int64(3), r.Remaining)
	assert.Equal(t, SourceStore, r.Source)
}

func TestPeekTakesNothing(t *testing.T) {
	ctx := context.Background()
	l := newTestLimiter(t, NewMemoryStore())
	_, err := l.AllowN(ctx, "k", 3, "gold")
	require.NoError(t, err)
	for i := 0; i < 3; i++ {
		r, err := l.Peek(ctx, "k", "gold", "daily")
		require.NoError(t, err)
		assert.True(t, r.Allowed)
		assert.Equal(t, int64(1), r.Remaining)
		assert.Equal(t, "gold", r.Plan)
		assert.Len(t, r.PlanResults(), 2)
	}
}

func TestPeekOnADrainedBucketTellsTheWait(t *testing.T) {
	ctx := context.Background()
	now := int64(1_700_000_000_000_000)
	l := newTestLimiter(t, newClockedMemoryStore(&now))
	_, err := l.AllowN(ctx, "k", 4, "gold") // drained; 2 tokens a second
	require.NoError(t, err)
	now += 100_000 // 0.2 tokens later

	r, err := l.Peek(ctx, "k", "gold", "daily")
	require.NoError(t, err)
	assert.False(t, r.Allowed, "one token would not pass")
	assert.Equal(t, "gold", r.Plan, "the binding plan is the one that makes the caller wait")
	assert.Equal(t, 400*time.Millisecond, r.RetryAfter, "the wait until one token, as Allow would give it")
	denied, err := l.Allow(ctx, "k", "gold", "daily")
	require.NoError(t, err)
	assert.Equal(t, r.RetryAfter, denied.RetryAfter)

	now += int64(r.RetryAfter/time.Microsecond) - 1
	r, err = l.Peek(ctx, "k", "gold")
	require.NoError(t, err)
	assert.False(t, r.Allowed)
	assert.Equal(t, time.Microsecond, r.RetryAfter)
	now++
	r, err = l.Peek(ctx, "k", "gold")
	require.NoError(t, err)
	assert.True(t, r.Allowed, "at RetryAfter, and not a microsecond before")
	assert.Zero(t, r.RetryAfter)
	ok, err := l.Allow(ctx, "k", "gold")
	require.NoError(t, err)
	assert.True(t, ok.Allowed)
}

func TestResetRefillsStoreAndFallback(t *testing.T) {
	ctx := context.Background()
	f := newFlakyStore()
	l := newTestLimiter(t, f, WithBreaker(breaker.Settings{Failures: 1, Cooldown: time.Hour}))
	_, err := l.AllowN(ctx, "k", 4, "gold")
	require.NoError(t, err)
	f.fail(errors.New("down"))
	r, err := l.AllowN(ctx, "k", 4, "gold")
	require.NoError(t, err)
	require.Equal(t, SourceFallback, r.Source)
	require.Equal(t, int64(0), r.Remaining)

	require.NoError(t, l.Reset(ctx, "k"))
	r, err = l.Peek(ctx, "k", "gold")
	require.NoError(t, err)
	assert.Equal(t, int64(4), r.Remaining, "fallback bucket reset")
	f.fail(nil)
	r, err = f.Take(ctx, "k", 0, testPlans[:1])
	require.NoError(t, err)
	assert.Equal(t, int64(4), r.Remaining, "store bucket reset")
}

// TestResetWhoseReplyIsLostForgetsRememberedDenials: a Reset runs in
// Redis, and its reply is lost, so Reset fails. The key is full in Redis
// all the same: the Limiter forgets its remembered denials, as after a
// Reset it saw succeed, and the next request is asked of Redis.
func TestResetWhoseReplyIsLostForgetsRememberedDenials(t *testing.T) {
	for name, addr := range lostReplyServers() {
		t.Run(name, func(t *testing.T) { testResetWhoseReplyIsLost(t, addr(t)) })
	}
}

func testResetWhoseReplyIsLost(t *testing.T, addr string) {
	ctx := context.Background()
	c := redistest.NewClient(t, &redis.Options{Addr: addr, MaxRetries: -1})
	rs := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	slow := Plan{Name: "slow", Capacity: 2, Rate: Per(1, time.Hour)}
	l, err := New(rs, []Plan{slow}, WithLogger(nil), WithDenialCache(100))
	require.NoError(t, err)
	require.NoError(t, l.Reset(ctx, "other")) // loads the reset script: the Reset is one EVALSHA
	drainAndRemember(t, l, "k")

	lost := &lostReplyHook{sha: rs.resetScript.SHA(), ranFirst: true}
	lost.armed.Store(true)
	c.AddHook(lost)
	require.ErrorIs(t, l.Reset(ctx, "k"), ErrStoreUnavailable)
	p, err := l.Peek(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, int64(2), p.Remaining, "Redis ran the Reset")
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.True(t, r.Allowed, "the Reset whose reply was lost is seen at once; source %v, RetryAfter %v", r.Source, r.RetryAfter)
}

// TestResetKeepsTheMarkForItsLongestHold: a Limiter's Reset keeps the
// key's reset mark in Redis for as long as its holds may be settled: its
// hold TTL, or its leases' holds' (4 lease TTLs), if either is longer than
// a RedisStore's own 15 minutes. Otherwise its own reservation of an hour,
// settled after 15 minutes, would refill the bucket its Reset filled.
func TestResetKeepsTheMarkForItsLongestHold(t *testing.T) {
	ctx := context.Background()
	rs, mr, _ := newMiniredisStore(t)
	mark := rs.Key("k", resetMarkName)
	l, err := New(rs, []Plan{llm}, WithLogger(nil), WithHoldTTL(time.Hour))
	require.NoError(t, err)
	require.NoError(t, l.Reset(ctx, "k"))
	assert.Equal(t, time.Hour, mr.TTL(mark))

	leased := llm
	leased.Lease = 10
	l, err = New(rs, []Plan{leased}, WithLogger(nil), WithHoldTTL(time.Millisecond), WithLeaseTTL(time.Minute))
	require.NoError(t, err)
	assert.Equal(t, 4*time.Minute, l.longestHold(), "a lease's hold")
}

// TestWait runs in a bubble: Wait's timers and the contexts' deadlines run
// on synctest's fake clock.
func TestWait(t *testing.T) {
	synctest.Test(t, testWait)
}

func testWait(t *testing.T) {
	ctx := context.Background()
	l, err := New(NewMemoryStore(), []Plan{{Name: "fast", Capacity: 1, Rate: 50}})
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k")
	require.NoError(t, err)

	short, cancel := context.WithTimeout(ctx, time.Millisecond)
	defer cancel()
	r, err := l.Wait(short, "k", 1)
	assert.ErrorIs(t, err, ErrWaitExceedsDeadline)
	assert.False(t, r.Allowed)

	r, err = l.Wait(ctx, "k", 1)
	require.NoError(t, err)
	assert.True(t, r.Allowed)

	cancelled, cancel2 := context.WithCancel(ctx)
	go func() { time.Sleep(5 * time.Millisecond); cancel2() }()
	l2, err := New(NewMemoryStore(), []Plan{{Name: "slow", Capacity: 1, Rate: 0.01}})
	require.NoError(t, err)
	_, err = l2.Allow(ctx, "k")
	require.NoError(t, err)
	_, err = l2.Wait(cancelled, "k", 1)
	assert.ErrorIs(t, err, context.Canceled)
}

func TestAllowDoesNotAllocate(t *testing.T) {
	ctx := context.Background()
	l, err := New(NewMemoryStore(), []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1e6}, benchWindow[0]})
	require.NoError(t, err)
	for _, plan := range []string{"p", "w"} {
		_, _ = l.Allow(ctx, "user-42", plan) // the first decision stores the key
		allocs := testing.AllocsPerRun(1000, func() {
			_, _ = l.Allow(ctx, "user-42", plan)
		})
		assert.Equal(t, 0.0, allocs, "plan %s", plan)
	}
}

// benchPlan never runs dry, so every decision does the full work of an
// admission; nor does benchWindow, whose 20 sub-windows of 50 ms each
// fill as a benchmark runs.
var (
	benchPlan   = []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1}}
	benchWindow = []Plan{{Name: "w", Capacity: 1 << 30, Window: time.Second}}
)

func benchKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "user-" + strconv.Itoa(i)
	}
	return keys
}

func BenchmarkLimiterAllow(b *testing.B) {
	ctx := context.Background()
	b.Run("memory/one-key", func(b *testing.B) {
		l, _ := New(NewMemoryStore(), benchPlan)
		b.ReportAllocs()
		for b.Loop() {
			_, _ = l.Allow(ctx, "user-1")
		}
	})
	b.Run("memory/one-key-window", func(b *testing.B) {
		l, _ := New(NewMemoryStore(), benchWindow)
		b.ReportAllocs()
		for b.Loop() {
			_, _ = l.Allow(ctx, "user-1")
		}
	})
	b.Run("memory/many-keys-parallel", func(b *testing.B) {
		l, _ := New(NewMemoryStore(), benchPlan)
		allowParallel(b, l)
	})
	b.Run("memory/chained", func(b *testing.B) {
		l, _ := New(NewMemoryStore(), []Plan{benchPlan[0], {Name: "q", Capacity: 1 << 30, Rate: 1}})
		b.ReportAllocs()
		for b.Loop() {
			_, _ = l.Allow(ctx, "user-1", "p", "q")
		}
	})
	b.Run("fallback-breaker-open", func(b *testing.B) {
		f := newFlakyStore()
		f.fail(context.DeadlineExceeded)
		l, _ := New(f, benchPlan, WithLogger(nil))
		for i := 0; i < 3; i++ {
			_, _ = l.Allow(ctx, "user-1")
		}
		b.ReportAllocs()
		for b.Loop() {
			_, _ = l.Allow(ctx, "user-1")
		}
	})
	b.Run("redis/client-only", func(b *testing.B) {
		// The client's work alone: a hook answers every command with a
		// canned reply, so no byte reaches a network.
		c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
		defer c.Close()
		c.AddHook(cannedReply{[]any{int64(1), int64(1 << 50), int64(1 << 40), int64(1 << 50)}})
		l, _ := New(NewRedisStore(c), benchPlan)
		allowParallel(b, l)
	})
	b.Run("redis/parallel", func(b *testing.B) {
		c := redis.NewClient(&redis.Options{Addr: redistest.Addr(b), PoolSize: 64})
		defer c.Close()
		l, _ := New(NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix())), benchPlan)
		b.SetParallelism(32)
		allowParallel(b, l)
	})
	b.Run("redis/cluster-parallel", func(b *testing.B) {
		// Three masters of a cluster the benchmark starts: each decision is
		// one script call on its key's master (ADR 26: no batching there).
		c := redistest.StartCluster(b, 3, 0).Client(b, &redis.ClusterOptions{PoolSize: 64})
		l, _ := New(NewRedisStore(c), benchPlan)
		b.SetParallelism(32)
		allowParallel(b, l)
	})
}

// allowParallel runs Allow from parallel goroutines over 10,000 keys, each
// goroutine starting at a key of its own, and fails on any error.
func allowParallel(b *testing.B, l *Limiter) {
	ctx := context.Background()
	keys := benchKeys(10_000)
	var next atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := int(next.Add(1)) * 7919
		for pb.Next() {
			i++
			if _, err := l.Allow(ctx, keys[i%len(keys)]); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// cannedReply is a go-redis hook that answers every command with reply.
type cannedReply struct{ reply []any }

func (h cannedReply) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h cannedReply) ProcessHook(redis.ProcessHook) redis.ProcessHook {
	return func(_ context.Context, cmd redis.Cmder) error {
		cmd.(*redis.Cmd).SetVal(h.reply)
		return nil
	}
}

func (h cannedReply) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

func TestDefaultPlan(t *testing.T) {
	l := newTestLimiter(t, NewMemoryStore())
	assert.Equal(t, testPlans[0], l.DefaultPlan(), "the first plan given to New")
	require.NoError(t, l.SetPlans([]Plan{testPlans[1], testPlans[0]}))
	assert.Equal(t, testPlans[1], l.DefaultPlan(), "the first plan of the latest SetPlans")
	r, err := l.Allow(context.Background(), "k")
	require.NoError(t, err)
	assert.Equal(t, l.DefaultPlan().Name, r.Plan, "what a call that names no plan uses")
	shadowed := newTestLimiter(t, NewMemoryStore(), WithShadow())
	assert.True(t, shadowed.DefaultPlan().Shadow, "as Plan tells it")
}

// TestResetAndCloseDoNotDeadlockWithAStaleLeasesTake: a Reset of a key
// that waits for Redis while a decision gives back the key's lease of a
// plan SetPlans replaced (a settlement, which waits for the Reset) and
// Close sweeps the leases (which waits for that decision) ends, and so do
// the decision and Close. Before: the Reset, holding its key's order
// lock, waited for the leases' lock that Close's sweep held, which waited
// for the decision, which waited for the order lock: none ever returned.
func TestResetAndCloseDoNotDeadlockWithAStaleLeasesTake(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	c := rs.client.(*redis.Client)
	hook := &gateHook{held: make(chan struct{}), release: make(chan struct{})}
	c.AddHook(hook)
	big := Plan{Name: "hot", Capacity: 100, Rate: 1, Lease: 50}
	l, err := New(rs, []Plan{big}, WithLogger(nil), WithDenialCache(0))
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	e := l.leases.lookup("k", big.Name, false)
	require.NotNil(t, e, "the key holds a lease")
	require.NoError(t, l.SetPlans([]Plan{{Name: "hot", Capacity: 10, Rate: 1}}))

	done := make(chan string, 3)
	hook.armed.Store(true)
	go func() { assert.NoError(t, l.Reset(ctx, "k")); done <- "Reset" }()
	<-hook.held // the Reset holds the key's order lock, and waits for Redis's reply
	go func() { _, _ = l.Allow(ctx, "k"); done <- "Allow" }()
	for settling := false; !settling; { // the decision took the stale lease, to give it back
		e.mu.Lock()
		settling = e.r == nil && len(e.renew) == 1
		e.mu.Unlock()
	}
	go func() { assert.NoError(t, l.Close()); done <- "Close" }()
	<-l.leases.stop             // Close began closing the leases
	for l.leases.mu.TryLock() { // until its sweep holds their lock
		l.leases.mu.Unlock()
	}
	close(hook.release)
	deadline := time.After(10 * time.Second) // a deadlock detector, not a speed bound
	for range 3 {
		select {
		case who := <-done:
			t.Log(who, "returned")
		case <-deadline:
			t.Fatal("Reset, Close and a lease's give-back deadlocked")
		}
	}
}
