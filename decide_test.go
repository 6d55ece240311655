package tollgate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// flakyStore wraps a MemoryStore and fails while err is set.
type flakyStore struct {
	mu    sync.Mutex
	err   error
	calls int
	inner *MemoryStore
}

func newFlakyStore() *flakyStore { return &flakyStore{inner: NewMemoryStore()} }

// logCounter counts log records by level, from minLevel up.
type logCounter struct {
	minLevel slog.Level
	mu       sync.Mutex
	levels   []slog.Level
	text     bytes.Buffer
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
		{"plan named twice", secret, 1, []string{"gold", "gold"}, ErrInvalidPlan},
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
	l := newTestLimiter(t, f, WithFailurePolicy(breaker.FailOpen))
	for i := 0; i < 5; i++ {
		_, _ = l.Allow(context.Background(), "k")
	}
	_, err := l.Allow(context.Background(), "")
	assert.ErrorIs(t, err, ErrInvalidKey, "breaker.FailOpen must not admit a bad key")
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
		l := newTestLimiter(t, f, WithFailurePolicy(breaker.FailOpen))
		for i := 0; i < 10; i++ {
			r, err := l.Allow(ctx, "k", "gold", "daily")
			require.NoError(t, err)
			assert.True(t, r.Allowed)
			assert.Equal(t, SourceFailOpen, r.Source)
			assert.Len(t, r.PlanResults(), 2)
		}
	})
	t.Run("fail closed", func(t *testing.T) {
		f := newFlakyStore()
		f.fail(down)
		l := newTestLimiter(t, f, WithFailurePolicy(breaker.FailClosed))
		_, err := l.Allow(ctx, "k")
		assert.ErrorIs(t, err, ErrStoreUnavailable)
		assert.ErrorIs(t, err, down, "the cause is kept")
	})
}

// TestBreakerSkipsDeadStoreAndProbes runs in a bubble: the breaker's
// cooldown passes on synctest's fake clock.
func TestBreakerSkipsDeadStoreAndProbes(t *testing.T) {
	synctest.Test(t, testBreakerSkipsDeadStoreAndProbes)
}

func testBreakerSkipsDeadStoreAndProbes(t *testing.T) {
	ctx := context.Background()
	f := newFlakyStore()
	f.fail(errors.New("down"))
	l := newTestLimiter(t, f, WithBreaker(breaker.Settings{Failures: 3, Cooldown: 50 * time.Millisecond}))
	for i := 0; i < 100; i++ {
		_, err := l.Allow(ctx, "k")
		require.NoError(t, err)
	}
	assert.Equal(t, 3, f.Calls(), "after 3 failures the store is not called")
	assert.Equal(t, breaker.Open, l.health.one.State())

	time.Sleep(60 * time.Millisecond)
	_, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, 4, f.Calls(), "one probe after the cooldown")
	assert.Equal(t, breaker.Open, l.health.one.State(), "a failed probe reopens")

	f.fail(nil)
	time.Sleep(60 * time.Millisecond)
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, SourceStore, r.Source)
	assert.Equal(t, breaker.Closed, l.health.one.State())
	_, err = l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, 6, f.Calls())
}

// TestOutageLoggedOnce runs in a bubble: the breaker's cooldown passes on
// synctest's fake clock.
func TestOutageLoggedOnce(t *testing.T) {
	synctest.Test(t, testOutageLoggedOnce)
}

func testOutageLoggedOnce(t *testing.T) {
	ctx := context.Background()
	logs := &logCounter{}
	f := newFlakyStore()
	l, err := New(f, testPlans, WithLogger(slog.New(logs)), WithBreaker(breaker.Settings{Cooldown: time.Millisecond}))
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
	for _, store := range []Store{newFlakyStore(), NewMemoryStore()} {
		l := newTestLimiter(t, store)
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		r, err := l.AllowN(ctx, "k", 4, "gold")
		assert.ErrorIs(t, err, context.Canceled, "%T", store)
		assert.Equal(t, Result{}, r)
		r, err = l.Peek(context.Background(), "k", "gold")
		require.NoError(t, err)
		assert.Equal(t, int64(4), r.Remaining, "%T: nothing consumed", store)
	}

	// A store call that fails as the caller's context ends, or once its
	// deadline has passed while the context's timer has yet to mark it
	// done, is the caller's doing.
	f := newFlakyStore()
	logs := &logCounter{}
	l, err := New(f, testPlans, WithLogger(slog.New(logs)), WithBreaker(breaker.Settings{Failures: 1}))
	require.NoError(t, err)
	timeout := &net.OpError{Op: "read", Err: os.ErrDeadlineExceeded}
	f.fail(timeout)
	for i := 0; i < 5; i++ {
		ctx := pastDeadline{context.Background(), time.Now().Add(-time.Microsecond)}
		r, err := l.Allow(ctx, "k")
		assert.ErrorIs(t, err, context.DeadlineExceeded)
		assert.Equal(t, Result{}, r, "no fallback decision")
	}
	assert.Equal(t, 5, f.Calls(), "the breaker stayed closed")
	assert.Equal(t, 0, logs.count())
	assert.Equal(t, breaker.Closed, l.health.one.State())
	s := l.Stats()
	assert.Empty(t, s.StoreErrors)
	assert.Zero(t, s.Plans[0].Allowed[SourceFallback])

	// The same error well before the deadline is the store's.
	ctx, cancel := context.WithTimeout(context.Background(), time.Hour)
	defer cancel()
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, SourceFallback, r.Source)
	assert.Equal(t, breaker.Open, l.health.one.State())
}

// pastDeadline is a context whose deadline has passed while its Err is
// still nil, as a context is for a moment before its timer fires.
type pastDeadline struct {
	context.Context
	deadline time.Time
}

func (c pastDeadline) Deadline() (time.Time, bool) { return c.deadline, true }

func TestDebugLogsDecisionsWithoutKey(t *testing.T) {
	logs := &logCounter{minLevel: slog.LevelDebug}
	l, err := New(NewMemoryStore(), testPlans, WithLogger(slog.New(logs)))
	require.NoError(t, err)
	_, err = l.Allow(context.Background(), "alice@example.com")
	require.NoError(t, err)
	assert.Equal(t, []slog.Level{slog.LevelDebug}, logs.levels)
	assert.NotContains(t, logs.text.String(), "alice")
}

// panickyStore panics while armed.
type panickyStore struct {
	*flakyStore
	armed atomic.Bool
}

// TestPanickingProbeReleasesTheBreaker runs in a bubble: the breaker's
// cooldown passes on synctest's fake clock.
func TestPanickingProbeReleasesTheBreaker(t *testing.T) {
	synctest.Test(t, testPanickingProbeReleasesTheBreaker)
}

func testPanickingProbeReleasesTheBreaker(t *testing.T) {
	ctx := context.Background()
	s := &panickyStore{flakyStore: newFlakyStore()}
	l := newTestLimiter(t, s, WithFailurePolicy(breaker.FailClosed), WithBreaker(breaker.Settings{Failures: 1, Cooldown: time.Millisecond}))
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
	assert.Equal(t, breaker.Closed, l.health.one.State())
}

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

// TestDenialCacheSparesTheStore runs in a bubble: the refill passes on
// synctest's fake clock.
func TestDenialCacheSparesTheStore(t *testing.T) {
	synctest.Test(t, testDenialCacheSparesTheStore)
}

func testDenialCacheSparesTheStore(t *testing.T) {
	ctx := context.Background()
	s := newCountingStore()
	l := newTestLimiter(t, s)
	// The fake clock stands still, and the denial cache refuses a denial
	// asked at the very instant it was made (as one that may predate a
	// Reset): step off that instant, as a real clock always has.
	time.Sleep(time.Nanosecond)
	_, err := l.AllowN(ctx, "hot", 4, "gold")
	require.NoError(t, err)
	var last time.Duration
	for i := 0; i < 1000; i++ {
		r, err := l.Allow(ctx, "hot", "gold")
		require.NoError(t, err)
		require.False(t, r.Allowed)
		want := SourceCache // the store's first denial answers the rest
		if i == 0 {
			want = SourceStore
		}
		require.Equal(t, want, r.Source)
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

// TestDenialCacheEndsWhenTheRequestCouldPass runs in a bubble: the denial
// ends on synctest's fake clock, exactly at RetryAfter.
func TestDenialCacheEndsWhenTheRequestCouldPass(t *testing.T) {
	synctest.Test(t, testDenialCacheEndsWhenTheRequestCouldPass)
}

func testDenialCacheEndsWhenTheRequestCouldPass(t *testing.T) {
	ctx := context.Background()
	s := newCountingStore()
	l, err := New(s, []Plan{{Name: "fast", Capacity: 1, Rate: 50}}, WithLogger(nil))
	require.NoError(t, err)
	// The fake clock stands still, and the denial cache refuses a denial
	// asked at the very instant it was made (as one that may predate a
	// Reset): step off that instant, as a real clock always has.
	time.Sleep(time.Nanosecond)
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

func TestDenialCacheOffForMemoryStore(t *testing.T) {
	l := newTestLimiter(t, NewMemoryStore())
	assert.Nil(t, l.denials)
	l = newTestLimiter(t, NewMemoryStore(), WithDenialCache(10))
	assert.NotNil(t, l.denials)
	l = newTestLimiter(t, newCountingStore(), WithDenialCache(0))
	assert.Nil(t, l.denials)
}

func TestDenialCacheOwnsItsResults(t *testing.T) {
	ctx := context.Background()
	l := newTestLimiter(t, newCountingStore())
	_, err := l.AllowN(ctx, "k", 4, "gold", "daily")
	require.NoError(t, err)
	r1, err := l.Allow(ctx, "k", "gold", "daily")
	require.NoError(t, err)
	require.False(t, r1.Allowed)
	r1.PlanResults()[0].Plan = "scribbled"
	r2, err := l.Allow(ctx, "k", "gold", "daily")
	require.NoError(t, err)
	assert.Equal(t, "gold", r2.PlanResults()[0].Plan)
	r2.PlanResults()[0].Plan = "scribbled"
	r3, err := l.Allow(ctx, "k", "gold", "daily")
	require.NoError(t, err)
	assert.Equal(t, "gold", r3.PlanResults()[0].Plan)
}

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

func (c *logCounter) Enabled(_ context.Context, l slog.Level) bool { return l >= c.minLevel }

func (c *logCounter) WithAttrs([]slog.Attr) slog.Handler { return c }

func (c *logCounter) WithGroup(string) slog.Handler { return c }

func (c *logCounter) Handle(_ context.Context, r slog.Record) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.levels = append(c.levels, r.Level)
	c.text.WriteString(r.Message)
	r.Attrs(func(a slog.Attr) bool {
		c.text.WriteString(" " + a.String())
		return true
	})
	c.text.WriteString("\n")
	return nil
}

func (c *logCounter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.levels)
}

func (p *panickyStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if p.armed.Load() {
		panic("store bug")
	}
	return p.flakyStore.Take(ctx, key, cost, plans)
}

// writeFailingStore fails every call that would take tokens, and answers
// reads, as Redis does under OOM with noeviction or as a read-only replica.
type writeFailingStore struct {
	*MemoryStore
	err error
}

func (s *writeFailingStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if cost > 0 && s.err != nil {
		return Result{}, s.err
	}
	return s.MemoryStore.Take(ctx, key, cost, plans)
}

func TestPartialOutageLogsOncePerOutage(t *testing.T) {
	for _, policy := range []breaker.FailurePolicy{breaker.Fallback, breaker.FailClosed} {
		// synctest's clock moves only when every goroutine waits: one
		// millisecond a step, however slow the machine.
		synctest.Test(t, func(t *testing.T) {
			ctx := context.Background()
			logs := &logCounter{}
			s := &writeFailingStore{NewMemoryStore(), &redisscript.Error{Class: "OOM"}}
			l, err := New(s, testPlans, WithLogger(slog.New(logs)), WithFailurePolicy(policy),
				WithBreaker(breaker.Settings{Cooldown: 50 * time.Millisecond}))
			require.NoError(t, err)
			for i := 0; i < 1000; i++ {
				time.Sleep(time.Millisecond)
				// Reads succeed, and would reset a count of consecutive
				// failures; cooldowns pass and probes close the breaker.
				key := fmt.Sprint("k", i%7)
				r, err := l.Peek(ctx, key)
				if err == nil {
					assert.Contains(t, []Source{SourceStore, SourceFallback}, r.Source)
				} else {
					require.Equal(t, breaker.FailClosed, policy)
					require.ErrorIs(t, err, ErrStoreUnavailable)
				}
				r, err = l.Allow(ctx, key)
				if policy == breaker.FailClosed {
					require.ErrorIs(t, err, ErrStoreUnavailable, "decision %d", i)
					continue
				}
				require.NoError(t, err, "decision %d", i)
				require.Equal(t, SourceFallback, r.Source, "decision %d", i)
			}
			assert.Equal(t, []slog.Level{slog.LevelWarn}, logs.levels, "one line for the whole outage:\n%s", logs.text.String())
			st := l.Stats()
			assert.True(t, st.Outage, "the outage shows while it lasts")
			assert.GreaterOrEqual(t, st.BreakerOpened, uint64(2), "the failure rate trips the breaker after each probe closes it")

			s.err = nil
			time.Sleep(110 * time.Millisecond) // two cooldowns without a failure
			for i := 0; i < 10; i++ {
				r, err := l.Allow(ctx, fmt.Sprint("healed", i))
				require.NoError(t, err)
				assert.True(t, r.Allowed)
			}
			assert.Equal(t, []slog.Level{slog.LevelWarn, slog.LevelInfo}, logs.levels)
			assert.Contains(t, logs.text.String(), "trips=")
			assert.False(t, l.Stats().Outage)
		})
	}
}

type goexitStore struct {
	failing, goexit atomic.Bool
	calls           atomic.Int64
	inner           *MemoryStore
}

func (s *goexitStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	s.calls.Add(1)
	if s.goexit.Load() {
		runtime.Goexit()
	}
	if s.failing.Load() {
		return Result{}, errors.New("down")
	}
	return s.inner.Take(ctx, key, cost, plans)
}

func (s *goexitStore) Reset(ctx context.Context, key string, plans []Plan) error {
	return s.inner.Reset(ctx, key, plans)
}

// ask guards the probe with recover, which catches panics but not
// runtime.Goexit: a probe whose store call ends its goroutine that way
// leaves the breaker half-open for ever, and every later call goes to the
// failure policy although the store is healthy again.
func TestProbeEndedByGoexitDoesNotHoldTheBreaker(t *testing.T) {
	s := &goexitStore{inner: NewMemoryStore()}
	l := newTestLimiter(t, s, WithBreaker(breaker.Settings{Failures: 1, Cooldown: time.Millisecond}))
	s.failing.Store(true)
	_, err := l.Allow(context.Background(), "k")
	require.NoError(t, err)
	require.Equal(t, breaker.Open, l.health.one.State())

	time.Sleep(2 * time.Millisecond)
	s.goexit.Store(true)
	done := make(chan struct{})
	go func() {
		defer close(done)
		_, _ = l.Allow(context.Background(), "k") // the probe
	}()
	<-done
	s.goexit.Store(false)
	s.failing.Store(false)

	time.Sleep(5 * time.Millisecond)
	r, err := l.Allow(context.Background(), "k")
	require.NoError(t, err)
	assert.Equal(t, SourceStore, r.Source, "the store is healthy; breaker state %v", l.health.one.State())
}

// callersFault blames the caller for any store error once the
// caller's deadline has passed, however long after it the call failed. A
// Redis that hangs (SIGSTOP, a partition without RST) behind a go-redis
// client that does not cut calls at the context's deadline (the default,
// ContextTimeoutEnabled false) fails every call at its ReadTimeout, after
// the deadline of every caller with less time than that: the breaker never
// hears a failure, nothing falls back, and every request waits the full
// ReadTimeout for ever. A call that ran well past its caller's deadline was
// cut by the store's own timeout, not by the caller.
func TestHungRedisTripsTheBreakerForImpatientCallers(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	t.Cleanup(func() { _ = ln.Close() })
	go func() { // accepts, reads, never answers: a hung Redis
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				buf := make([]byte, 4096)
				for {
					if _, err := c.Read(buf); err != nil {
						_ = c.Close()
						return
					}
				}
			}()
		}
	}()
	client := redis.NewClient(&redis.Options{Addr: ln.Addr().String(), ReadTimeout: 200 * time.Millisecond,
		MaxRetries: -1, Protocol: 2})
	t.Cleanup(func() { _ = client.Close() })
	l := newTestLimiter(t, NewRedisStore(client))

	var took time.Duration
	for i := 0; i < 6; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
		start := time.Now()
		_, _ = l.Allow(ctx, "k")
		took = time.Since(start)
		cancel()
	}
	s := l.Stats()
	t.Logf("last call took %v; store calls %d, errors %v", took, s.StoreCalls, s.StoreErrors)
	assert.NotZero(t, s.BreakerOpened, "6 calls failed at the client's 200ms ReadTimeout, 180ms after their callers' deadlines: the breaker must hear them")
	assert.Less(t, took, 100*time.Millisecond, "once open, the breaker spares callers the hung store")
}

// callersFault turns every store error into the caller's
// context.DeadlineExceeded once the deadline is within 1 ms, whatever the
// error. An error Redis answered (READONLY from a demoted master, OOM,
// NOPERM) arrives in a fraction of a millisecond and was not cut short by
// any deadline; yet for a caller with about a millisecond left it is
// returned as DeadlineExceeded (while ctx.Err() is nil), the failure
// policy is skipped, and the breaker never hears of it. Services with
// millisecond budgets then never fail over.
func TestRedisErrorReplyNearTheDeadlineIsTheStores(t *testing.T) {
	f := newFlakyStore()
	f.fail(&redisscript.Error{Class: "READONLY"})
	l := newTestLimiter(t, f, WithFailurePolicy(breaker.FailOpen), WithBreaker(breaker.Settings{Failures: 1}))
	// 0.9 ms left, as a context is before its timer fires; a fixed
	// deadline keeps a slow machine from ending it for real.
	ctx := pastDeadline{context.Background(), time.Now().Add(900 * time.Microsecond)}
	r, err := l.Allow(ctx, "k")
	assert.NoError(t, err, "READONLY is no deadline: breaker.FailOpen decides")
	assert.Equal(t, SourceFailOpen, r.Source)
	assert.Equal(t, breaker.Open, l.health.one.State(), "the breaker hears the failure")
}

// clockedStores returns, by name, makers of a RedisStore on miniredis and
// of a MemoryStore, each with a function that moves the store's clock on
// and leaves the Limiter's, and its denial cache's, where they are.
func clockedStores() map[string]func(t *testing.T) (Store, func(time.Duration)) {
	return map[string]func(t *testing.T) (Store, func(time.Duration)){
		"redis": func(t *testing.T) (Store, func(time.Duration)) {
			mr := miniredis.RunT(t)
			now := time.Now()
			mr.SetTime(now)
			c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
			t.Cleanup(func() { _ = c.Close() })
			return NewRedisStore(c), func(d time.Duration) { now = now.Add(d); mr.SetTime(now) }
		},
		"memory": func(*testing.T) (Store, func(time.Duration)) {
			m := NewMemoryStore()
			var now atomic.Int64
			now.Store(time.Now().UnixMicro())
			m.fakeNow = now.Load
			return m, func(d time.Duration) { now.Add(d.Microseconds()) }
		},
	}
}

// drainAndRemember takes key's two tokens of a plan that refills once an
// hour, has the next request denied, and checks that the Limiter
// remembers the denial.
func drainAndRemember(t *testing.T, l *Limiter, key string) {
	t.Helper()
	ctx := context.Background()
	for range 2 {
		r, err := l.Allow(ctx, key)
		require.NoError(t, err)
		require.True(t, r.Allowed)
	}
	r, err := l.Allow(ctx, key)
	require.NoError(t, err)
	require.False(t, r.Allowed)
	r, err = l.Allow(ctx, key)
	require.NoError(t, err)
	require.False(t, r.Allowed)
	require.Equal(t, SourceCache, r.Source, "the denial is remembered")
}

// A key asked under plans of other names keeps its remembered denials:
// their buckets are not the same, and a limit per route keyed by client
// must not send every request to the store.
func TestDenialCacheKeepsDenialsOfOtherPlanNames(t *testing.T) {
	ctx := context.Background()
	s := newCountingStore()
	l := newTestLimiter(t, s)
	time.Sleep(time.Millisecond) // off the instant of New: see testDenialCacheSparesTheStore
	_, err := l.AllowN(ctx, "k", 4, "gold")
	require.NoError(t, err)
	_, err = l.AllowN(ctx, "k", 100, "daily")
	require.NoError(t, err)
	for range 100 {
		for _, name := range []string{"gold", "daily"} {
			r, err := l.AllowN(ctx, "k", 2, name)
			require.NoError(t, err)
			require.False(t, r.Allowed)
		}
	}
	assert.Equal(t, int64(4), s.calls.Load(), "two takes and one denial per plan")
}

// TestDenialCacheAndWindows: a window's denial writes nothing, so its
// RetryAfter is exact and the Limiter remembers it as it remembers a
// bucket's; a suppressed window writes on every request, so none of its
// requests is answered from the cache.
func TestDenialCacheAndWindows(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	var calls scriptCounter
	rs.client.AddHook(&calls)
	win := Plan{Name: "w", Capacity: 2, Window: time.Minute}
	sup := Plan{Name: "s", Capacity: 2, Window: time.Minute, Suppress: 2}
	l, err := New(rs, []Plan{win, sup}, WithLogger(nil))
	require.NoError(t, err)
	time.Sleep(time.Millisecond) // off the instant of New: see testDenialCacheSparesTheStore
	// The first call loads the script (NOSCRIPT, then EVAL): count after it.
	_, err = l.Peek(ctx, "other", "w")
	require.NoError(t, err)
	sent := calls.alone.Load()
	for i := range 6 {
		r, err := l.Allow(ctx, "k", "w")
		require.NoError(t, err)
		assert.Equal(t, i < 2, r.Allowed, "request %d", i)
		if i == 2 {
			assert.Equal(t, SourceStore, r.Source, "the window's denial")
			assert.Greater(t, r.RetryAfter, 55*time.Second, "until the sub-window of the two leaves")
		}
	}
	assert.Equal(t, sent+3, calls.alone.Load(), "two admissions and one denial reach Redis; the rest are remembered")
	for i := range 10 {
		r, err := l.Allow(ctx, "k", "s")
		require.NoError(t, err)
		assert.Equal(t, SourceStore, r.Source, "suppressed request %d", i)
	}
	assert.Equal(t, sent+13, calls.alone.Load(), "every request of a suppressed window reaches Redis")
}

// TestFallbackDenialsAreNotRemembered: the cache remembers only the
// store's denials. One the fallback gave, from a bucket of its own, says
// nothing of Redis's: the next request asks Redis again, and once Redis
// answers it admits what its bucket holds.
func TestFallbackDenialsAreNotRemembered(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	c, calls := countedClient(t, &redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	l, err := New(NewRedisStore(c), []Plan{{Name: "slow", Capacity: 2, Rate: Per(2, time.Hour)}}, WithLogger(nil),
		WithBreaker(breaker.Settings{Failures: 1000})) // every call goes to Redis
	require.NoError(t, err)
	time.Sleep(time.Millisecond) // off the instant of New: see testDenialCacheSparesTheStore
	mr.SetError("LOADING Redis is loading the dataset in memory")
	for i := range 5 {
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, SourceFallback, r.Source, "request %d", i)
		assert.Equal(t, i < 2, r.Allowed, "request %d: the fallback's own bucket of 2", i)
	}
	assert.Equal(t, int64(5), calls.alone.Load(), "every request asked Redis first")
	mr.SetError("")
	for i := range 2 {
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, SourceStore, r.Source, "request %d", i)
		assert.True(t, r.Allowed, "request %d: Redis's bucket is full", i)
	}
}

// TestAcquireExemptFromItsConcurrencyPlans: a resolver that exempts a key
// from the concurrency plan of an Acquire's chain leaves it out, as it
// does any plan: the rate plans left decide, and the Permit holds no
// permit. Before, every such Acquire was ErrInvalidPlan, as if the caller
// had named no concurrency plan.
func TestAcquireExemptFromItsConcurrencyPlans(t *testing.T) {
	ctx := context.Background()
	unlimited := func(_ context.Context, key string, p Plan) (Plan, error) {
		if key == "batch" && p.Concurrency {
			return Plan{}, ErrExempt
		}
		return p, nil
	}
	rs, _, _ := newMiniredisStore(t)
	for name, s := range map[string]Store{"memory": NewMemoryStore(), "miniredis": rs} {
		t.Run(name, func(t *testing.T) {
			l, err := New(s, permitPlans, WithLogger(nil), WithPlanResolver(unlimited))
			require.NoError(t, err)
			t.Cleanup(func() { _ = l.Close() })
			granted := 0
			for range 7 {
				p, err := l.Acquire(ctx, "batch", 1, "inflight", "daily")
				require.NoError(t, err)
				if p.OK() {
					granted++
					require.NoError(t, p.Release(ctx), "a Permit that holds nothing")
				}
			}
			require.Equal(t, 5, granted, "daily's 5 tokens, and no permit")
			require.Zero(t, l.Stats().Plans[0].PermitsHeld)
		})
	}
}
