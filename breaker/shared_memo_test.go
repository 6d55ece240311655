package breaker

import (
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestSharedOpenCostsNothing: an open breaker answers without Redis, and
// without allocating, until its open time ends.
func TestSharedOpenCostsNothing(t *testing.T) {
	m := newMini(t)
	b := m.shared(t, fastSettings)
	trip(t, b, "k")
	trips := b.Stats().RoundTrips
	allocs := testing.AllocsPerRun(1000, func() {
		tk, err := b.Acquire(ctx, "k")
		if !errors.Is(err, ErrOpen) || tk.RetryAfter <= 0 || tk.RetryAfter > time.Second {
			t.Fatalf("Acquire = %+v, %v", tk, err)
		}
	})
	assert.Equal(t, 0.0, allocs)
	assert.Equal(t, trips, b.Stats().RoundTrips, "no round trip while open")

	m.advance(999 * time.Millisecond)
	_, err := b.Acquire(ctx, "k")
	require.ErrorIs(t, err, ErrOpen)
	assert.Equal(t, trips, b.Stats().RoundTrips)
	m.advance(time.Millisecond)
	tk, err := b.Acquire(ctx, "k")
	require.NoError(t, err)
	assert.True(t, tk.Probe())
	assert.Equal(t, trips+1, b.Stats().RoundTrips)
}

// TestSharedCacheClosed: with CacheClosedFor, a closed breaker costs at
// most 0.05 round trips per call, and the outcomes still trip it.
func TestSharedCacheClosed(t *testing.T) {
	m := newMini(t)
	set := SharedSettings{MinCalls: 20, FailureRate: 0.5, OpenFor: time.Second, CacheClosedFor: 50 * time.Millisecond}
	b := m.shared(t, set)
	const calls = 2000
	for i := range calls {
		if i%100 == 0 {
			m.advance(50 * time.Millisecond) // 100 calls per 50 ms
		}
		require.NoError(t, call(t, b, "k", Success))
	}
	perCall := float64(b.Stats().RoundTrips) / calls
	assert.LessOrEqual(t, perCall, 0.05)
	t.Logf("%.4f round trips per call", perCall)

	// The last 100 successes go with the next round trip, so they count
	// in the window then: outcomes arrive up to CacheClosedFor late.
	m.advance(11 * time.Second)
	for range 200 {
		require.NoError(t, call(t, b, "k", Failure), "the cache grants for up to 50 ms")
	}
	m.advance(50 * time.Millisecond)
	_, err := b.Acquire(ctx, "k")
	require.ErrorIs(t, err, ErrOpen, "the batch sent with the next round trip trips it")
}

// TestSharedLogsOncePerTransition: one line per transition, by the
// instance that made it, and never the key.
func TestSharedLogsOncePerTransition(t *testing.T) {
	m := newMini(t)
	var mu sync.Mutex
	var lines []string
	log := slog.New(slog.NewTextHandler(writerFunc(func(p []byte) (int, error) {
		mu.Lock()
		defer mu.Unlock()
		lines = append(lines, string(p))
		return len(p), nil
	}), nil))
	a, err := NewShared(m.c, fastSettings, WithLogger(log))
	require.NoError(t, err)
	a.now = m.clock.now
	b := m.shared(t, fastSettings)
	trip(t, a, "secret@example.com")
	_, err = b.Acquire(ctx, "secret@example.com")
	require.ErrorIs(t, err, ErrOpen)
	m.advance(time.Second)
	p, err := a.Acquire(ctx, "secret@example.com")
	require.NoError(t, err)
	require.NoError(t, p.Done(ctx, Success))
	mu.Lock()
	defer mu.Unlock()
	require.Len(t, lines, 3, "%q", lines)
	assert.Contains(t, lines[0], "closed → open")
	assert.Contains(t, lines[1], "open → half-open")
	assert.Contains(t, lines[2], "half-open → closed")
	for _, l := range lines {
		assert.NotContains(t, l, "secret")
	}
	assert.Equal(t, uint64(1), a.Stats().Trips)
	assert.Equal(t, [3]uint64{1, 1, 1}, a.Stats().Entered)
	assert.Equal(t, [3]uint64{}, b.Stats().Entered)
}
