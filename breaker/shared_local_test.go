package breaker

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSharedOutagePolicies: with Redis down, Fallback keeps an open
// breaker open until its open time ends, then probes locally; FailOpen
// grants; FailClosed refuses; decisions return to Redis on recovery.
func TestSharedOutagePolicies(t *testing.T) {
	m := newMini(t)
	fast := WithStoreBreaker(Settings{Failures: 1, Cooldown: time.Millisecond})
	fb := m.shared(t, fastSettings, fast)
	open := m.shared(t, fastSettings, fast, WithFailurePolicy(FailOpen))
	closed := m.shared(t, fastSettings, fast, WithFailurePolicy(FailClosed))
	trip(t, fb, "down")
	_, err := fb.State(ctx, "fresh") // a closed key this instance has read
	require.NoError(t, err)

	m.mr.SetError("LOADING Redis is loading the dataset in memory")
	for range 3 {
		_, err = fb.Acquire(ctx, "down")
		require.ErrorIs(t, err, ErrOpen, "open stays open without Redis")
	}
	tk, err := fb.Acquire(ctx, "fresh")
	require.NoError(t, err, "a closed breaker decides locally")
	require.NoError(t, tk.Done(ctx, Success))
	m.advance(time.Second)
	probe, err := fb.Acquire(ctx, "down")
	require.NoError(t, err, "its open time is up: a local probe")
	require.True(t, probe.Probe())
	_, err = fb.Acquire(ctx, "down")
	require.ErrorIs(t, err, ErrOpen, "one local probe")
	require.NoError(t, probe.Done(ctx, Failure))
	_, err = fb.Acquire(ctx, "down")
	require.ErrorIs(t, err, ErrOpen, "the failed local probe opened it again")
	st, err := fb.State(ctx, "down")
	require.NoError(t, err)
	assert.Equal(t, Open, st)

	_, err = open.Acquire(ctx, "other")
	require.NoError(t, err, "FailOpen grants")
	_, err = closed.Acquire(ctx, "other")
	require.ErrorIs(t, err, ErrStoreUnavailable, "FailClosed refuses")
	assert.NotContains(t, err.Error(), "other", "no key in errors")
	require.True(t, fb.Stats().Outage)
	require.Positive(t, fb.Stats().Degraded)

	m.mr.SetError("")
	time.Sleep(2 * time.Millisecond) // the store breaker's cool-down
	trips := fb.Stats().RoundTrips
	p, err := fb.Acquire(ctx, "down")
	require.NoError(t, err, "Redis's state wins again: its breaker's open time is up")
	assert.True(t, p.Probe())
	assert.Equal(t, trips+1, fb.Stats().RoundTrips)
	assert.False(t, fb.Stats().Outage)
	require.NoError(t, p.Done(ctx, Success))
	st, err = fb.State(ctx, "down")
	require.NoError(t, err)
	assert.Equal(t, Closed, st)
}

// TestSharedFallbackHoldsAForcedOpenBreaker: a breaker that ForceOpen
// holds open stays open under Fallback while Redis is down, past its
// open time: the local breaker never probes it, as Redis would not.
func TestSharedFallbackHoldsAForcedOpenBreaker(t *testing.T) {
	m := newMini(t)
	b := m.shared(t, fastSettings, WithStoreBreaker(Settings{Failures: 1, Cooldown: time.Hour}))
	require.NoError(t, b.ForceOpen(ctx, "k"))
	m.mr.SetError("LOADING Redis is loading the dataset in memory")
	granted := 0
	for range 5 {
		m.advance(fastSettings.OpenFor)
		if tk, err := b.Acquire(ctx, "k"); err == nil {
			granted++
			require.NoError(t, tk.Done(ctx, Success))
		} else {
			require.ErrorIs(t, err, ErrOpen)
		}
	}
	assert.Equal(t, 0, granted, "calls granted while forced open")
	st, err := b.State(ctx, "k")
	require.NoError(t, err)
	assert.Equal(t, Open, st)
}
