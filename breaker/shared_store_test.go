package breaker

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSharedCallerContextIsNotAnOutage: a caller's ended context is the
// caller's error, and counts neither against Redis nor against the
// downstream.
func TestSharedCallerContextIsNotAnOutage(t *testing.T) {
	m := newMini(t)
	b := m.shared(t, fastSettings, WithFailurePolicy(FailClosed))
	cctx, cancel := context.WithCancel(ctx)
	cancel()
	_, err := b.Acquire(cctx, "k")
	require.ErrorIs(t, err, context.Canceled)

	// Cancelled while Redis is working on it.
	hooked := redis.NewClient(&redis.Options{Addr: m.mr.Addr()})
	t.Cleanup(func() { _ = hooked.Close() })
	hooked.AddHook(cancelHook{})
	hb, err := NewShared(hooked, fastSettings, WithLogger(nil), WithStoreBreaker(Settings{Failures: 1}))
	require.NoError(t, err)
	for range 5 {
		cctx, cancel := context.WithCancel(ctx)
		_, err = hb.Acquire(context.WithValue(cctx, cancelKey{}, cancel), "k")
		require.ErrorIs(t, err, context.Canceled)
	}
	s := hb.Stats()
	assert.Equal(t, uint64(0), s.StoreErrors)
	assert.Equal(t, Closed, s.Store, "the store breaker heard nothing")
	assert.Equal(t, uint64(0), s.Degraded)
}

// TestSharedStoreProbeThatPanicsIsAbandoned: the store breaker's probe
// whose client panics ends, or the store breaker would stay half-open for
// ever and every call would go to the failure policy: the next call after
// it probes, and closes the store breaker.
func TestSharedStoreProbeThatPanicsIsAbandoned(t *testing.T) {
	m := newMini(t)
	pc := &panickyScripter{Scripter: m.c}
	const cooldown = 10 * time.Millisecond
	b, err := NewShared(pc, fastSettings, WithLogger(nil), WithStoreBreaker(Settings{Failures: 1, Cooldown: cooldown}))
	require.NoError(t, err)
	pc.mode.Store(1)
	_, _ = b.Acquire(ctx, "k")
	require.Equal(t, Open, b.health.State(), "a failure trips the store breaker")
	time.Sleep(2 * cooldown)
	pc.mode.Store(2)
	require.Panics(t, func() { _, _ = b.Acquire(ctx, "k") }, "the probe panics")
	pc.mode.Store(0)
	_, err = b.Acquire(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, Closed, b.health.State(), "the next call probes and closes it")
}

// TestSharedHungStoreTripsForImpatientCallers: a Redis that answers
// nothing, asked only by callers whose deadlines are shorter than its
// silence, trips the store breaker once it has been asked for a cooldown
// without an answer, or every call would wait its caller's whole
// deadline for ever. The callers still get their own context's error.
func TestSharedHungStoreTripsForImpatientCallers(t *testing.T) {
	m := newMini(t)
	pc := &panickyScripter{Scripter: m.c}
	const cooldown = 20 * time.Millisecond
	b, err := NewShared(pc, fastSettings, WithLogger(nil), WithStoreBreaker(Settings{Failures: 3, Cooldown: cooldown}))
	require.NoError(t, err)
	_, err = b.Acquire(ctx, "k0")
	require.NoError(t, err, "Redis answers")
	pc.mode.Store(3)
	waits := 0
	for i := 1; i <= 100 && b.health.State() == Closed; i++ {
		cctx, cancel := context.WithTimeout(ctx, 2*time.Millisecond)
		_, err := b.Acquire(cctx, fmt.Sprintf("k%d", i))
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded, "the caller gets its own error")
		waits++
	}
	assert.Equal(t, Open, b.health.State(), "the hung Redis trips the store breaker, after %d waits", waits)
	cctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	_, err = b.Acquire(cctx, "after")
	assert.NotErrorIs(t, err, context.DeadlineExceeded, "the failure policy answers at once")
}

// TestSharedImpatientCallersWithinACooldownAreNoOutage: callers cut short
// by their deadline, on a Shared breaker that has not heard from Redis
// yet but was made less than a cooldown ago, are the callers' doing: they
// do not trip the store breaker.
func TestSharedImpatientCallersWithinACooldownAreNoOutage(t *testing.T) {
	m := newMini(t)
	pc := &panickyScripter{Scripter: m.c}
	pc.mode.Store(3)
	b, err := NewShared(pc, fastSettings, WithLogger(nil), WithStoreBreaker(Settings{Failures: 1, Cooldown: time.Hour}))
	require.NoError(t, err)
	for i := range 3 {
		cctx, cancel := context.WithTimeout(ctx, time.Millisecond)
		_, err := b.Acquire(cctx, fmt.Sprintf("k%d", i))
		cancel()
		require.ErrorIs(t, err, context.DeadlineExceeded)
	}
	assert.Equal(t, Closed, b.health.State())
	assert.Zero(t, b.Stats().StoreErrors)
}

// TestSharedDoneWithAnEndedContextIsNoOutage: Done given a context that
// has already ended returns its error and never reaches Redis, so it
// counts nothing against Redis, however long the instance has been idle.
func TestSharedDoneWithAnEndedContextIsNoOutage(t *testing.T) {
	m := newMini(t)
	b := m.shared(t, fastSettings, WithStoreBreaker(Settings{Failures: 3}))
	var tickets []Ticket
	for range 3 {
		tk, err := b.Acquire(ctx, "k")
		require.NoError(t, err)
		tickets = append(tickets, tk)
	}
	m.advance(time.Second) // idle for longer than the store breaker's cooldown
	ended, cancel := context.WithCancel(ctx)
	cancel()
	for _, tk := range tickets {
		require.ErrorIs(t, tk.Done(ended, Success), context.Canceled)
	}
	s := b.Stats()
	assert.Equal(t, uint64(0), s.StoreErrors)
	assert.Equal(t, Closed, s.Store, "the store breaker heard nothing")
	assert.False(t, s.Outage)
}

// cancelAfterHook cancels the context of a script call once Redis has
// answered it.
type cancelAfterHook struct{ cancelHook }

func (cancelAfterHook) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		err := next(ctx, cmd)
		if cancel, ok := ctx.Value(cancelKey{}).(context.CancelFunc); ok {
			cancel()
		}
		return err
	}
}

// TestSharedCallerContextEndedAsRedisRefused: a caller whose context ended
// while Redis answered an error gets its context's error, as a Limiter's
// does, and no grant of the failure policy; Redis's answer still counts
// against Redis.
func TestSharedCallerContextEndedAsRedisRefused(t *testing.T) {
	m := newMini(t)
	hooked := redis.NewClient(&redis.Options{Addr: m.mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = hooked.Close() })
	hooked.AddHook(cancelAfterHook{})
	b, err := NewShared(hooked, fastSettings, WithLogger(nil))
	require.NoError(t, err)
	m.mr.SetError("OOM command not allowed when used memory > 'maxmemory'")
	granted := 0
	for range 3 {
		cctx, cancel := context.WithCancel(ctx)
		tk, err := b.Acquire(context.WithValue(cctx, cancelKey{}, cancel), "k")
		if err == nil {
			granted++
			require.NoError(t, tk.Done(ctx, Success))
		} else {
			require.ErrorIs(t, err, context.Canceled)
		}
	}
	assert.Equal(t, 0, granted, "grants to callers whose context ended")
	assert.Equal(t, uint64(3), b.Stats().StoreErrors, "Redis's answers count against it")
}
