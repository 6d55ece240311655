package tollgate

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
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
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// fleetHolds counts the permits a fleet of Limiters holds at once, as its
// holders see them: one more after a granted Acquire returns, one fewer
// before its Release. It keeps the most held in each phase of a run,
// which is at most what the stores held then.
type fleetHolds struct {
	held    atomic.Int64
	phase   atomic.Int64
	most    [3]atomic.Int64
	sources [3][SourceFallback + 1]atomic.Int64 // grants by phase and source
}

// took counts a permit granted by source.
func (f *fleetHolds) took(src Source) {
	n := f.held.Add(1)
	ph := f.phase.Load()
	f.sources[ph][src].Add(1)
	for {
		m := f.most[ph].Load()
		if n <= m || f.most[ph].CompareAndSwap(m, n) {
			return
		}
	}
}

// hold runs Acquire(1) → 20 ms → Release on l until stop closes.
func (f *fleetHolds) hold(t *testing.T, l *Limiter, stop <-chan struct{}) {
	ctx := context.Background()
	for {
		select {
		case <-stop:
			return
		default:
		}
		p, err := l.Acquire(ctx, "shared", 1, "inflight")
		if !assert.NoError(t, err, "Fallback decides while Redis is down") {
			return
		}
		if !p.OK() {
			time.Sleep(time.Millisecond)
			continue
		}
		f.took(p.Result().Source)
		// Long enough that permits Redis granted are still held when
		// the fallback begins to grant.
		time.Sleep(20 * time.Millisecond)
		f.held.Add(-1)
		// Redis gone, or back without the permits it had: the permits are
		// no longer held either way.
		if err := p.Release(ctx); err != nil && !errors.Is(err, ErrStoreUnavailable) && !errors.Is(err, ErrPermitLost) {
			assert.NoError(t, err)
		}
	}
}

// TestAcquireFleetHoldsAboutCapacityThroughAnOutage runs 4 Limiters of a
// fleet (WithFleet) on one key of a concurrency plan, 16 holders each,
// kills their Redis (SIGKILL), runs on the fallback, then restarts Redis
// (empty) and runs on. While Redis is down the fleet holds at most 1.25 ×
// capacity permits at once: each Limiter's fallback grants its share less
// the permits it still holds from Redis.
//
// Once Redis is back the bound is 2 × capacity: Redis restarted empty
// knows nothing of the permits the fallbacks still hold until renewals
// move them in, and the Limiters come back at different times. Each
// Limiter's share is that of the fleet it counted before the restart, not
// of the few instances the empty Redis has seen beat since.
func TestAcquireFleetHoldsAboutCapacityThroughAnOutage(t *testing.T) {
	srv := redistest.StartServer(t)
	const capacity = 40 // a share of 10 for each of 4
	plans := []Plan{{Name: "inflight", Capacity: capacity, Concurrency: true}}
	prefix := redistest.KeyPrefix()
	var fleet []*Limiter
	for range 4 {
		opt := redistest.FailFast(srv.Addr())
		// A dead Redis refuses at once; a slow one under -race on a busy
		// machine is not an outage.
		opt.ReadTimeout, opt.WriteTimeout = time.Second, time.Second
		c := redistest.NewClient(t, opt)
		l, err := New(NewRedisStore(c, WithKeyPrefix(prefix)), plans, WithLogger(nil),
			WithFleet(50*time.Millisecond), WithBreaker(breaker.Settings{Cooldown: 50 * time.Millisecond}),
			WithPermitLease(300*time.Millisecond))
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.Close() })
		fleet = append(fleet, l)
	}
	require.Eventually(t, func() bool {
		for _, l := range fleet {
			if l.Stats().FleetSize != 4 {
				return false
			}
		}
		return true
	}, 5*time.Second, 10*time.Millisecond, "every Limiter counts the fleet")

	var f fleetHolds
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for _, l := range fleet {
		for range 16 {
			wg.Go(func() { f.hold(t, l, stop) })
		}
	}
	time.Sleep(500 * time.Millisecond)
	f.phase.Store(1)
	srv.Kill()
	time.Sleep(time.Second)
	f.phase.Store(2)
	srv.Restart()
	time.Sleep(time.Second)
	close(stop)
	wg.Wait()

	for ph, name := range []string{"redis", "fallback", "redis again"} {
		t.Logf("%s: most held %d; granted by store %d, by fallback %d", name, f.most[ph].Load(),
			f.sources[ph][SourceStore].Load(), f.sources[ph][SourceFallback].Load())
	}
	assert.LessOrEqual(t, f.most[0].Load(), int64(capacity), "Redis holds the capacity")
	assert.LessOrEqual(t, f.most[1].Load(), int64(capacity*5/4), "Redis down: the fleet holds about one capacity")
	assert.LessOrEqual(t, f.most[2].Load(), int64(2*capacity), "Redis back: its capacity and the fallbacks' shares")
	assert.Positive(t, f.sources[1][SourceFallback].Load(), "the fallback granted permits")
	assert.Positive(t, f.sources[2][SourceStore].Load(), "Redis granted permits again")
}

// lostReplies is a go-redis hook that loses the reply of the next
// acquire's script call, after Redis ran it, and fails release calls
// while failRelease is set.
type lostReplies struct{ acquire, failRelease atomic.Bool }

func (*lostReplies) DialHook(next redis.DialHook) redis.DialHook { return next }
func (*lostReplies) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
func (h *lostReplies) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		a := cmd.Args()
		if cmd.Name() != "evalsha" {
			return next(ctx, cmd)
		}
		argv := a[3+a[2].(int):]
		lost := &net.OpError{Op: "read", Net: "tcp", Err: os.ErrDeadlineExceeded}
		release := argv[0] == int64(0) && argv[1] == 0 // permit.lua: no lease, no adoption
		switch {
		case release && h.failRelease.Load():
			cmd.SetErr(lost)
			return lost
		case !release && len(argv) == 6 && h.acquire.CompareAndSwap(true, false): // limit.lua, one plan
			_ = next(ctx, cmd)
			cmd.SetErr(lost)
			return lost
		}
		return next(ctx, cmd)
	}
}

// TestFallbackGrantOutlivesTheLostReplysRelease loses the reply of an
// Acquire that Redis ran: its permits are released by its holder id in
// the background, while the fallback grants the caller's under an id of
// its own, which the renewals then move into Redis. The background
// release, landing after that, frees the lost call's permits only: the
// caller keeps its slot.
func TestFallbackGrantOutlivesTheLostReplysRelease(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(t0))
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	h := &lostReplies{}
	c.AddHook(h)
	plan := Plan{Name: "c", Capacity: 1, Concurrency: true}
	l, err := New(NewRedisStore(c, WithoutBatching()), []Plan{plan}, WithLogger(nil),
		WithPermitLease(300*time.Millisecond), WithBreaker(breaker.Settings{Failures: 1, Cooldown: 10 * time.Millisecond}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	h.acquire.Store(true)
	h.failRelease.Store(true)
	p, err := l.Acquire(ctx, "k", 1, "c")
	require.NoError(t, err)
	require.True(t, p.OK())
	require.Equal(t, SourceFallback, p.Result().Source)
	require.Eventually(t, func() bool {
		r, err := l.Acquire(ctx, "other", 1, "c") // the probe that closes the breaker
		if err == nil && r.OK() {
			_ = r.Release(ctx)
		}
		return err == nil && r.Result().Source == SourceStore
	}, 5*time.Second, 5*time.Millisecond)
	require.Eventually(t, func() bool { return l.Stats().Permits.Adopted == 1 }, 5*time.Second, 5*time.Millisecond)
	h.failRelease.Store(false)          // the background release lands now
	time.Sleep(1500 * time.Millisecond) // p's holder still works
	q, err := l.Acquire(ctx, "k", 1, "c")
	require.NoError(t, err)
	require.False(t, q.OK(), "capacity 1: the caller's permit is still held")
	require.NoError(t, p.Release(ctx))
}

// gatedStore wraps a flakyStore; a call on a key in gates waits until its
// channel is closed, then answers with the error errs holds for the key
// (nil: the inner store's answer).
type gatedStore struct {
	*flakyStore
	gates map[string]chan struct{}
	errs  map[string]error
}

func (g *gatedStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if gate, ok := g.gates[key]; ok {
		<-gate
		if err := g.errs[key]; err != nil {
			return Result{}, err
		}
		return g.flakyStore.inner.Take(ctx, key, cost, plans)
	}
	return g.flakyStore.Take(ctx, key, cost, plans)
}

// TestStaleFailureDoesNotReopenTheProbingBreaker: a call let through
// before the breaker tripped, which fails while a probe is under way, is
// of a past generation: it neither reopens the breaker nor keeps the
// probe's success from closing it.
func TestStaleFailureDoesNotReopenTheProbingBreaker(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		ctx := context.Background()
		down := errors.New("down")
		g := &gatedStore{flakyStore: newFlakyStore(),
			gates: map[string]chan struct{}{"old": make(chan struct{}), "probe": make(chan struct{})},
			errs:  map[string]error{"old": down}}
		l := newTestLimiter(t, g, WithBreaker(breaker.Settings{Failures: 2, Cooldown: 50 * time.Millisecond}))
		done := make(chan struct{})
		go func() { _, _ = l.Allow(ctx, "old"); done <- struct{}{} }() // let through while closed
		synctest.Wait()
		g.fail(down)
		for range 2 {
			_, _ = l.Allow(ctx, "k")
		}
		require.Equal(t, breaker.Open, l.health.one.State(), "2 failures trip it")
		time.Sleep(50 * time.Millisecond)
		go func() { _, _ = l.Allow(ctx, "probe"); done <- struct{}{} }()
		synctest.Wait()
		require.Equal(t, breaker.HalfOpen, l.health.one.State(), "the probe is under way")
		close(g.gates["old"]) // the call from before the trip fails now
		<-done
		assert.Equal(t, breaker.HalfOpen, l.health.one.State(), "a call from before the trip does not reopen it")
		close(g.gates["probe"]) // the probe succeeds
		<-done
		assert.Equal(t, breaker.Closed, l.health.one.State(), "the probe's success closes it")
		assert.EqualValues(t, 1, l.health.one.Entered(breaker.Open), "one trip")
	})
}

// TestOutageLinesAlternate: an outage that ends while another begins logs
// its recovery before the next outage's start, so that the lines
// alternate: the end is queued under the same lock as the next start,
// and the queue is logged in order.
func TestOutageLinesAlternate(t *testing.T) {
	logs := &logCounter{}
	rs, _, _ := newMiniredisStore(t)
	l := newTestLimiter(t, rs, WithLogger(slog.New(logs)))
	quietLater := int64(time.Hour) // far past every failure's quiet period
	for i := range 2000 {
		var wg sync.WaitGroup
		wg.Go(func() { l.tripped(errors.New("down")) })
		wg.Go(func() { l.recovered(quietLater + int64(i)) })
		wg.Wait()
	}
	l.recovered(quietLater * 2)
	logs.mu.Lock()
	defer logs.mu.Unlock()
	for i, level := range logs.levels {
		want := slog.LevelWarn
		if i%2 == 1 {
			want = slog.LevelInfo
		}
		require.Equal(t, want, level, "line %d of %d", i, len(logs.levels))
	}
}

// ctxStore is a healthy store on which a call on the key "wait" waits
// until the caller's context ends, and returns the context's error, as
// go-redis does with ContextTimeoutEnabled.
type ctxStore struct{ *flakyStore }

func (c ctxStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if key == "wait" {
		<-ctx.Done()
		return Result{}, ctx.Err()
	}
	return c.flakyStore.Take(ctx, key, cost, plans)
}

// TestProbeCutShortByItsCallerIsAbandoned: a probe whose caller gives up
// before a healthy store answers tells nothing of the store: the next
// call probes, and closes the breaker. No call could succeed while the
// breaker was open, so the time it was open is no cooldown without a
// success; only a probe that waited a cooldown itself blames the store.
func TestProbeCutShortByItsCallerIsAbandoned(t *testing.T) {
	const cooldown = 50 * time.Millisecond
	for name, c := range map[string]struct {
		after  time.Duration // the caller gives up after
		cancel bool          // by cancelling, not by a deadline
		want   breaker.State // after the next call
	}{
		"cancelled":            {time.Millisecond, true, breaker.Closed},
		"deadline":             {time.Millisecond, false, breaker.Closed},
		"waited a cooldown":    {cooldown, false, breaker.Open},
		"cancelled a cooldown": {cooldown, true, breaker.Open},
	} {
		t.Run(name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				f := ctxStore{newFlakyStore()}
				l := newTestLimiter(t, f, WithBreaker(breaker.Settings{Failures: 2, Cooldown: cooldown}))
				f.fail(errors.New("down"))
				for range 2 {
					_, _ = l.Allow(context.Background(), "k")
				}
				require.Equal(t, breaker.Open, l.health.one.State(), "2 failures trip it")
				f.fail(nil)
				time.Sleep(cooldown)
				ctx, cancel := context.WithTimeout(context.Background(), c.after)
				if c.cancel {
					ctx, cancel = context.WithCancel(context.Background())
					time.AfterFunc(c.after, cancel)
				}
				_, err := l.Allow(ctx, "wait") // the probe
				cancel()
				require.Error(t, err, "the caller gets its context's error")
				_, _ = l.Allow(context.Background(), "k")
				assert.Equal(t, c.want, l.health.one.State())
				assert.EqualValues(t, 1, l.health.one.Entered(breaker.Open), "one trip")
			})
		})
	}
}

// TestCallersDeadlineOnAFallbackOfAnotherProcess: a caller whose deadline
// passes while a fallback of another process (a RedisStore given to
// WithFallback) decides gets its context's error, as it would from the
// store, not ErrStoreUnavailable: its own deadline is no outage.
func TestCallersDeadlineOnAFallbackOfAnotherProcess(t *testing.T) {
	mr := miniredis.RunT(t)
	mr.SetError("LOADING Redis is loading the dataset in memory")
	store := NewRedisStore(redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1}))
	hung := redis.NewClient(&redis.Options{Addr: silentServer(t), MaxRetries: -1, ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = hung.Close() })
	l, err := New(store, testPlans, WithLogger(nil), WithDenialCache(0), WithFallback(NewRedisStore(hung)),
		WithBreaker(breaker.Settings{Failures: 1, Cooldown: time.Hour}))
	require.NoError(t, err)
	for i := range 2 { // the store fails, then its breaker is open
		ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
		_, err = l.Allow(ctx, "k")
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, "call %d", i+1)
		assert.NotErrorIs(t, err, ErrStoreUnavailable, "call %d", i+1)
	}
}
