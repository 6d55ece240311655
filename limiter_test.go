package tollgate

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var testPlans = []Plan{
	{Name: "gold", Capacity: 4, Rate: 2},
	{Name: "daily", Capacity: 100, Rate: Per(100, 24*time.Hour)},
}

// flakyStore wraps a MemoryStore and fails while err is set.
type flakyStore struct {
	mu    sync.Mutex
	err   error
	calls int
	inner *MemoryStore
}

func newFlakyStore() *flakyStore { return &flakyStore{inner: NewMemoryStore()} }

func (f *flakyStore) fail(err error) {
	f.mu.Lock()
	f.err = err
	f.mu.Unlock()
}

func (f *flakyStore) Calls() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.calls
}

func (f *flakyStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	f.mu.Lock()
	f.calls++
	err := f.err
	f.mu.Unlock()
	if err != nil {
		return Result{}, err
	}
	return f.inner.Take(ctx, key, cost, plans)
}

func (f *flakyStore) Reset(ctx context.Context, key string, plans []Plan) error {
	return f.inner.Reset(ctx, key, plans)
}

// logCounter counts log records by level, from minLevel up.
type logCounter struct {
	minLevel slog.Level
	mu       sync.Mutex
	levels   []slog.Level
	text     bytes.Buffer
}

func (c *logCounter) Enabled(_ context.Context, l slog.Level) bool { return l >= c.minLevel }
func (c *logCounter) WithAttrs([]slog.Attr) slog.Handler           { return c }
func (c *logCounter) WithGroup(string) slog.Handler                { return c }
func (c *logCounter) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.levels = append(c.levels, r.Level)
	c.text.WriteString(r.Message + "\n")
	return nil
}

func (c *logCounter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.levels)
}

func newTestLimiter(t *testing.T, store Store, opts ...Option) *Limiter {
	t.Helper()
	l, err := New(store, testPlans, append([]Option{WithLogger(nil)}, opts...)...)
	require.NoError(t, err)
	return l
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
		{"capacity too large", []Plan{{Name: "a", Capacity: MaxCapacity + 1, Rate: 1e9}}},
		{"zero rate", []Plan{{Name: "a", Capacity: 1, Rate: 0}}},
		{"negative rate", []Plan{{Name: "a", Capacity: 1, Rate: -1}}},
		{"NaN rate", []Plan{{Name: "a", Capacity: 1, Rate: math.NaN()}}},
		{"infinite rate", []Plan{{Name: "a", Capacity: 1, Rate: math.Inf(1)}}},
		{"refill slower than MaxRefillPeriod", []Plan{{Name: "a", Capacity: 1000, Rate: 1e-9}}},
		{"duplicate names", []Plan{{Name: "a", Capacity: 1, Rate: 1}, {Name: "a", Capacity: 2, Rate: 1}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(NewMemoryStore(), tt.plans)
			assert.ErrorIs(t, err, ErrInvalidPlan)
		})
	}
	_, err := New(nil, testPlans)
	assert.ErrorIs(t, err, ErrInvalidOption)
	_, err = New(NewMemoryStore(), testPlans, WithFailurePolicy(FailurePolicy(9)))
	assert.ErrorIs(t, err, ErrInvalidOption)
	_, err = New(NewMemoryStore(), []Plan{{Name: "edge", Capacity: MaxCapacity, Rate: 1e9}})
	assert.NoError(t, err, "the largest capacity is valid")
}

func TestBadRequests(t *testing.T) {
	ctx := context.Background()
	const secret = "alice@example.com"
	l := newTestLimiter(t, NewMemoryStore())
	tests := []struct {
		name  string
		key   string
		cost  int64
		plans []string
		want  error
	}{
		{"empty key", "", 1, nil, ErrInvalidKey},
		{"key too long", secret + strings.Repeat("x", MaxKeyLen), 1, nil, ErrInvalidKey},
		{"unknown plan", secret, 1, []string{"platinum"}, ErrUnknownPlan},
		{"unknown plan in chain", secret, 1, []string{"gold", "platinum"}, ErrUnknownPlan},
		{"plan named twice", secret, 1, []string{"gold", "gold"}, ErrUnknownPlan},
		{"zero cost", secret, 0, nil, ErrInvalidCost},
		{"negative cost", secret, -1, nil, ErrInvalidCost},
		{"cost above capacity", secret, 5, []string{"gold"}, ErrInvalidCost},
		{"cost above a chained capacity", secret, 5, []string{"daily", "gold"}, ErrInvalidCost},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := l.AllowN(ctx, tt.key, tt.cost, tt.plans...)
			require.ErrorIs(t, err, tt.want)
			assert.NotContains(t, err.Error(), secret, "keys stay out of error text")
			assert.True(t, strings.HasPrefix(err.Error(), "tollgate: "), err.Error())
		})
	}
	// The edges that are valid.
	_, err := l.AllowN(ctx, strings.Repeat("k", MaxKeyLen), 4, "gold")
	assert.NoError(t, err)
	_, err = l.Peek(ctx, "x")
	assert.NoError(t, err)
	assert.ErrorIs(t, l.Reset(ctx, ""), ErrInvalidKey)
	_, err = l.Wait(ctx, "", 1)
	assert.ErrorIs(t, err, ErrInvalidKey)
}

func TestBadRequestsReachNoStoreEvenWhenOpen(t *testing.T) {
	f := newFlakyStore()
	f.fail(errors.New("down"))
	l := newTestLimiter(t, f, WithFailurePolicy(FailOpen))
	for i := 0; i < 5; i++ {
		_, _ = l.Allow(context.Background(), "k")
	}
	_, err := l.Allow(context.Background(), "")
	assert.ErrorIs(t, err, ErrInvalidKey, "FailOpen must not admit a bad key")
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
		assert.Len(t, r.Plans, 2)
	}
}

func TestResetRefillsStoreAndFallback(t *testing.T) {
	ctx := context.Background()
	f := newFlakyStore()
	l := newTestLimiter(t, f, WithBreaker(BreakerSettings{Failures: 1, Cooldown: time.Hour}))
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

func TestFailurePolicies(t *testing.T) {
	ctx := context.Background()
	down := errors.New("connection refused")
	t.Run("fallback", func(t *testing.T) {
		f := newFlakyStore()
		f.fail(down)
		l := newTestLimiter(t, f)
		for i := 0; i < 4; i++ {
			r, err := l.Allow(ctx, "k", "gold")
			require.NoError(t, err)
			assert.True(t, r.Allowed)
			assert.Equal(t, SourceFallback, r.Source)
		}
		r, err := l.Allow(ctx, "k", "gold")
		require.NoError(t, err)
		assert.False(t, r.Allowed, "the fallback enforces the plan")
	})
	t.Run("fail open", func(t *testing.T) {
		f := newFlakyStore()
		f.fail(down)
		l := newTestLimiter(t, f, WithFailurePolicy(FailOpen))
		for i := 0; i < 10; i++ {
			r, err := l.Allow(ctx, "k", "gold", "daily")
			require.NoError(t, err)
			assert.True(t, r.Allowed)
			assert.Equal(t, SourceFailOpen, r.Source)
			assert.Len(t, r.Plans, 2)
		}
	})
	t.Run("fail closed", func(t *testing.T) {
		f := newFlakyStore()
		f.fail(down)
		l := newTestLimiter(t, f, WithFailurePolicy(FailClosed))
		_, err := l.Allow(ctx, "k")
		assert.ErrorIs(t, err, ErrStoreUnavailable)
		assert.ErrorIs(t, err, down, "the cause is kept")
	})
}

func TestBreakerSkipsDeadStoreAndProbes(t *testing.T) {
	ctx := context.Background()
	f := newFlakyStore()
	f.fail(errors.New("down"))
	l := newTestLimiter(t, f, WithBreaker(BreakerSettings{Failures: 3, Cooldown: 50 * time.Millisecond}))
	for i := 0; i < 100; i++ {
		_, err := l.Allow(ctx, "k")
		require.NoError(t, err)
	}
	assert.Equal(t, 3, f.Calls(), "after 3 failures the store is not called")
	assert.Equal(t, BreakerOpen, l.breaker.current())

	time.Sleep(60 * time.Millisecond)
	_, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, 4, f.Calls(), "one probe after the cooldown")
	assert.Equal(t, BreakerOpen, l.breaker.current(), "a failed probe reopens")

	f.fail(nil)
	time.Sleep(60 * time.Millisecond)
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, SourceStore, r.Source)
	assert.Equal(t, BreakerClosed, l.breaker.current())
	_, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, 6, f.Calls())
}

func TestOutageLoggedOnce(t *testing.T) {
	ctx := context.Background()
	logs := &logCounter{}
	f := newFlakyStore()
	l, err := New(f, testPlans, WithLogger(slog.New(logs)), WithBreaker(BreakerSettings{Cooldown: time.Millisecond}))
	require.NoError(t, err)
	f.fail(errors.New("down"))
	for i := 0; i < 200; i++ {
		_, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		if i%50 == 0 {
			time.Sleep(2 * time.Millisecond) // let probes fail too
		}
	}
	assert.Equal(t, []slog.Level{slog.LevelWarn}, logs.levels)
	f.fail(nil)
	time.Sleep(2 * time.Millisecond)
	for i := 0; i < 10; i++ {
		_, err := l.Allow(ctx, "k")
		require.NoError(t, err)
	}
	assert.Equal(t, []slog.Level{slog.LevelWarn, slog.LevelInfo}, logs.levels)
	assert.Contains(t, logs.text.String(), "recovered")
}

func TestCallerCancellationIsNotAnOutage(t *testing.T) {
	f := newFlakyStore()
	logs := &logCounter{}
	l, err := New(f, testPlans, WithLogger(slog.New(logs)), WithBreaker(BreakerSettings{Failures: 1}))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	f.fail(context.Canceled)
	for i := 0; i < 5; i++ {
		_, err := l.Allow(ctx, "k")
		assert.ErrorIs(t, err, context.Canceled)
	}
	assert.Equal(t, 5, f.Calls(), "the breaker stayed closed")
	assert.Equal(t, 0, logs.count())
	assert.Equal(t, BreakerClosed, l.breaker.current())
}

func TestWait(t *testing.T) {
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
	l, err := New(NewMemoryStore(), []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1e6}})
	require.NoError(t, err)
	allocs := testing.AllocsPerRun(1000, func() {
		_, _ = l.Allow(ctx, "user-42", "p")
	})
	assert.Equal(t, 0.0, allocs)
}

func TestSourceAndPolicyStrings(t *testing.T) {
	assert.Equal(t, []string{"store", "fallback", "fail-open", "unknown"},
		[]string{SourceStore.String(), SourceFallback.String(), SourceFailOpen.String(), Source(9).String()})
	assert.Equal(t, []string{"fallback", "fail-open", "fail-closed", "unknown"},
		[]string{Fallback.String(), FailOpen.String(), FailClosed.String(), FailurePolicy(9).String()})
	assert.Equal(t, []string{"closed", "open", "half-open", "unknown"},
		[]string{BreakerClosed.String(), BreakerOpen.String(), BreakerHalfOpen.String(), BreakerState(9).String()})
}

func TestDebugLogsDecisionsWithoutKey(t *testing.T) {
	logs := &logCounter{minLevel: slog.LevelDebug}
	l, err := New(NewMemoryStore(), testPlans, WithLogger(slog.New(logs)))
	require.NoError(t, err)
	_, err = l.Allow(context.Background(), "alice@example.com")
	require.NoError(t, err)
	assert.Equal(t, []slog.Level{slog.LevelDebug}, logs.levels)
	assert.NotContains(t, logs.text.String(), "alice")
}

// recordingObserver records what it is told.
type recordingObserver struct {
	NopObserver
	mu        sync.Mutex
	decisions []Decision
	storeErrs []error
	fallback  []bool
	breaker   []BreakerState
}

func (o *recordingObserver) ObserveDecision(d Decision) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.decisions = append(o.decisions, d)
}

func (o *recordingObserver) ObserveStore(_ time.Duration, err error) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.storeErrs = append(o.storeErrs, err)
}

func (o *recordingObserver) ObserveFallback(active bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.fallback = append(o.fallback, active)
}

func (o *recordingObserver) ObserveBreaker(_, to BreakerState) {
	o.mu.Lock()
	defer o.mu.Unlock()
	o.breaker = append(o.breaker, to)
}

func TestObserverSeesDecisionsOutagesAndBreaker(t *testing.T) {
	ctx := context.Background()
	obs := &recordingObserver{}
	f := newFlakyStore()
	l := newTestLimiter(t, f, WithObserver(obs), WithBreaker(BreakerSettings{Failures: 2, Cooldown: time.Millisecond}))
	_, err := l.AllowN(ctx, "k", 4, "gold")
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k", "gold", "daily")
	require.NoError(t, err)
	down := errors.New("down")
	f.fail(down)
	for i := 0; i < 3; i++ {
		_, err = l.Allow(ctx, "k")
		require.NoError(t, err)
	}
	f.fail(nil)
	time.Sleep(2 * time.Millisecond)
	_, err = l.Peek(ctx, "k")
	require.NoError(t, err)
	_, err = l.Allow(ctx, "") // errors are not decisions
	require.Error(t, err)

	assert.Equal(t, []Decision{
		{Plan: "gold", Allowed: true, Source: SourceStore, Cost: 4},
		{Plan: "gold", Allowed: false, Source: SourceStore, Cost: 1},
		{Plan: "gold", Allowed: true, Source: SourceFallback, Cost: 1},
		{Plan: "gold", Allowed: true, Source: SourceFallback, Cost: 1},
		{Plan: "gold", Allowed: true, Source: SourceFallback, Cost: 1},
		{Plan: "gold", Allowed: true, Source: SourceStore, Cost: 0},
	}, obs.decisions)
	assert.Equal(t, []error{nil, nil, down, down, nil}, obs.storeErrs, "the open breaker skipped one call")
	assert.Equal(t, []bool{true, false}, obs.fallback)
	assert.Equal(t, []BreakerState{BreakerOpen, BreakerHalfOpen, BreakerClosed}, obs.breaker)
}

func TestObserverSeesScriptLoads(t *testing.T) {
	obs := &countingScriptObserver{}
	_, mr, _ := newMiniredisStore(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer c.Close()
	s := NewRedisStore(c, WithRedisObserver(obs))
	_, err := s.Take(context.Background(), "k", 1, []Plan{gold})
	require.NoError(t, err)
	assert.Equal(t, int64(1), obs.loads.Load())
}

type countingScriptObserver struct {
	NopObserver
	loads atomic.Int64
}

func (o *countingScriptObserver) ObserveScriptLoad() { o.loads.Add(1) }

func BenchmarkObserverOverhead(b *testing.B) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		opts []Option
	}{
		{"none", nil},
		{"nop", []Option{WithObserver(NopObserver{})}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			l, _ := New(NewMemoryStore(), benchPlan, tc.opts...)
			b.ReportAllocs()
			for b.Loop() {
				_, _ = l.Allow(ctx, "user-1")
			}
		})
	}
}

// panickyStore panics while armed.
type panickyStore struct {
	*flakyStore
	armed atomic.Bool
}

func (p *panickyStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if p.armed.Load() {
		panic("store bug")
	}
	return p.flakyStore.Take(ctx, key, cost, plans)
}

func TestPanickingProbeReleasesTheBreaker(t *testing.T) {
	ctx := context.Background()
	s := &panickyStore{flakyStore: newFlakyStore()}
	l := newTestLimiter(t, s, WithFailurePolicy(FailClosed), WithBreaker(BreakerSettings{Failures: 1, Cooldown: time.Millisecond}))
	s.fail(errors.New("down"))
	_, err := l.Allow(ctx, "k")
	require.ErrorIs(t, err, ErrStoreUnavailable)
	time.Sleep(2 * time.Millisecond)
	s.armed.Store(true)
	assert.Panics(t, func() { _, _ = l.Allow(ctx, "k") }, "the probe panics")
	s.armed.Store(false)
	s.fail(nil)
	time.Sleep(2 * time.Millisecond)
	_, err = l.Allow(ctx, "k")
	assert.NoError(t, err, "the next call probes again and closes the breaker")
	assert.Equal(t, BreakerClosed, l.breaker.current())
}

// panickyObserver panics once in each reporting method it is armed for.
type panickyObserver struct {
	NopObserver
	fallback, breaker atomic.Bool
}

func (o *panickyObserver) ObserveFallback(bool) {
	if o.fallback.CompareAndSwap(true, false) {
		panic("observer bug")
	}
}

func (o *panickyObserver) ObserveBreaker(_, _ BreakerState) {
	if o.breaker.CompareAndSwap(true, false) {
		panic("observer bug")
	}
}

func TestPanickingObserverLocksNothing(t *testing.T) {
	ctx := context.Background()
	obs := &panickyObserver{}
	f := newFlakyStore()
	l := newTestLimiter(t, f, WithObserver(obs), WithBreaker(BreakerSettings{Failures: 1, Cooldown: time.Millisecond}))
	f.fail(errors.New("down"))
	obs.fallback.Store(true)
	assert.Panics(t, func() { _, _ = l.Allow(ctx, "k") })
	f.fail(nil)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; i < 3; i++ {
			_, _ = l.Allow(ctx, "k")
			time.Sleep(2 * time.Millisecond)
		}
	}()
	select {
	case <-done:
	case <-time.After(2 * time.Second):
		t.Fatal("a decision hung after an Observer panicked")
	}

	// A panic while reporting Open→HalfOpen undoes the change, so the
	// breaker cannot stay half-open with no probe.
	f.fail(errors.New("down"))
	_, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, BreakerOpen, l.breaker.current())
	time.Sleep(2 * time.Millisecond)
	obs.breaker.Store(true)
	assert.Panics(t, func() { _, _ = l.Allow(ctx, "k") })
	assert.Equal(t, BreakerOpen, l.breaker.current())
}
