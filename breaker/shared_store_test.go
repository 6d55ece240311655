package breaker

import (
	"context"
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
