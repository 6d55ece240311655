package breaker

import (
	"math"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestConsecutiveFailuresTrip(t *testing.T) {
	b := New(Settings{Failures: 3})
	assert.False(t, b.Failure())
	assert.False(t, b.Failure())
	b.Success() // resets the run
	assert.False(t, b.Failure())
	assert.False(t, b.Failure())
	assert.True(t, b.Failure(), "the third in a row trips")
	assert.Equal(t, Open, b.State())
	assert.False(t, b.Failure(), "an open breaker trips no more")
	assert.Equal(t, uint64(1), b.Entered(Open))
}

func TestFailureRateTripsAPartialOutage(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := New(Settings{Failures: 3, FailureRate: 0.5, MinCalls: 20, Window: time.Second})
		// Every other call fails: no run of 3, but half the calls.
		for i := 0; i < 19; i++ {
			if i%2 == 0 {
				require.False(t, b.Failure(), "call %d: fewer than MinCalls", i)
			} else {
				b.Success()
			}
			time.Sleep(time.Millisecond)
		}
		assert.Equal(t, Closed, b.State())
		b.Success()
		assert.True(t, b.Failure(), "21 calls, 11 failed")
		assert.Equal(t, Open, b.State())

		time.Sleep(b.Settings().Cooldown)
		_, probe := b.Allow()
		require.True(t, probe)
		b.Success()
		require.Equal(t, Closed, b.State())
		assert.False(t, b.Failure(), "a closed breaker starts a fresh window")
	})
}

func TestFailureRateBelowThresholdDoesNotTrip(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := New(Settings{FailureRate: 0.5, MinCalls: 20, Window: time.Second})
		for i := 0; i < 1000; i++ {
			if i%3 == 0 {
				require.False(t, b.Failure(), "call %d", i)
			} else {
				b.Success()
			}
			time.Sleep(time.Millisecond)
		}
		assert.Equal(t, Closed, b.State())
	})
}

func TestWindowForgetsOldFailures(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := New(Settings{Failures: 100, FailureRate: 0.5, MinCalls: 4, Window: time.Second})
		for i := 0; i < 3; i++ {
			require.False(t, b.Failure())
		}
		b.Success() // 4 calls, 3 failed, but the run is broken
		time.Sleep(1100 * time.Millisecond)
		// The old failures have left the window: 1 failure in 4 calls.
		b.Success()
		b.Success()
		b.Success()
		assert.False(t, b.Failure())
		assert.Equal(t, Closed, b.State())
	})
}

func TestCooldownProbeAndClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := New(Settings{Failures: 1, Cooldown: 100 * time.Millisecond})
		require.True(t, b.Failure())
		ok, _ := b.Allow()
		assert.False(t, ok, "open")
		time.Sleep(100 * time.Millisecond)
		ok, probe := b.Allow()
		assert.True(t, ok && probe, "one probe after the cooldown")
		ok, _ = b.Allow()
		assert.False(t, ok, "only one")
		assert.False(t, b.Failure(), "a failed probe re-opens; it is no trip")
		assert.Equal(t, Open, b.State())
		time.Sleep(100 * time.Millisecond)
		ok, probe = b.Allow()
		require.True(t, ok && probe)
		b.Success()
		assert.Equal(t, Closed, b.State())
		assert.Equal(t, uint64(1), b.Entered(Open))
		assert.Equal(t, uint64(2), b.Entered(HalfOpen))
		assert.Equal(t, uint64(1), b.Entered(Closed))
	})
}

func TestAbandonLetsTheNextCallProbe(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := New(Settings{Failures: 1, Cooldown: time.Second})
		b.Failure()
		time.Sleep(time.Second)
		_, probe := b.Allow()
		require.True(t, probe)
		b.Abandon()
		_, probe = b.Allow()
		assert.True(t, probe, "no second cooldown")
	})
}

func TestExactlyOneProbe(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := New(Settings{Failures: 1, Cooldown: time.Millisecond})
		b.Failure()
		time.Sleep(time.Millisecond)
		var wg sync.WaitGroup
		var mu sync.Mutex
		probes := 0
		for range 64 {
			wg.Go(func() {
				if _, probe := b.Allow(); probe {
					mu.Lock()
					probes++
					mu.Unlock()
				}
			})
		}
		wg.Wait()
		assert.Equal(t, 1, probes)
	})
}

func TestSettings(t *testing.T) {
	assert.Equal(t, Settings{Failures: 3, FailureRate: 0.5, MinCalls: 20, Window: 10 * time.Second, Cooldown: 500 * time.Millisecond},
		New(Settings{}).Settings())
	assert.True(t, Settings{}.Valid())
	for _, bad := range []Settings{
		{Failures: -1}, {MinCalls: -1}, {Cooldown: -1}, {Window: -time.Second}, {Window: time.Nanosecond},
		{FailureRate: -0.1}, {FailureRate: 1.5}, {FailureRate: math.NaN()},
	} {
		assert.False(t, bad.Valid(), "%+v", bad)
	}
	assert.Equal(t, "half-open", HalfOpen.String())
	assert.Equal(t, "unknown", State(7).String())
}

// Failures is an int and Valid accepts any Failures >= 0, but
// Failure compares the run with int32(Failures). math.MaxInt truncates to
// -1, so a breaker meant to rely on the rate rule alone ("never trip on a
// run") trips at the first failure; 1<<32 truncates to 0, the same.
func TestHugeFailuresDoesNotTripAtOnce(t *testing.T) {
	for _, failures := range []int{math.MaxInt, 1 << 32, 1 << 31} {
		s := Settings{Failures: failures, MinCalls: 1000}
		require.True(t, s.Valid(), "Failures %d is a valid setting", failures)
		b := New(s)
		for i := 0; i < 10; i++ {
			if !assert.False(t, b.Failure(), "Failures %d: failure %d of a run of 10 tripped", failures, i+1) {
				break
			}
		}
	}
}

// the breaker's clock is time.Since(epoch). A Breaker (or a
// Limiter) made outside a synctest bubble and used inside one reads a
// negative clock there (the bubble's clock starts in 2000), and count
// indexes window[slot%steps] with a negative slot: index out of range.
func TestNegativeClockDoesNotPanic(t *testing.T) {
	b := New(Settings{Failures: 100})
	synctest.Test(t, func(t *testing.T) {
		require.Negative(t, b.now(), "the clock reads negative in a bubble")
		assert.NotPanics(t, func() { b.Failure() })
		assert.NotPanics(t, func() { b.Success() })
	})
}

// TestOutcomesCountInTheirGeneration: calls admitted before a trip report
// while the breaker probes and after it closed again; only the probe's
// outcome moves the breaker, and the stale ones count nothing.
func TestOutcomesCountInTheirGeneration(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := New(Settings{Failures: 2, Cooldown: 100 * time.Millisecond})
		var old [4]uint64
		for i := range old {
			gen, ok, probe := b.Admit()
			require.True(t, ok && !probe)
			old[i] = gen
		}
		b.FailureIn(old[0])
		require.True(t, b.FailureIn(old[1]), "2 failures trip it")
		time.Sleep(100 * time.Millisecond)
		gen, ok, probe := b.Admit()
		require.True(t, ok && probe)
		require.NotEqual(t, old[0], gen, "the probe is of a new generation")

		assert.False(t, b.FailureIn(old[2]))
		assert.Equal(t, HalfOpen, b.State(), "a stale failure does not reopen it")
		b.SuccessIn(old[3])
		assert.Equal(t, HalfOpen, b.State(), "a stale success does not close it")
		b.SuccessIn(gen)
		require.Equal(t, Closed, b.State(), "the probe's success closes it")

		closed, _, _ := b.Admit()
		b.FailureIn(old[2])
		b.FailureIn(old[3])
		assert.Equal(t, Closed, b.State(), "stale failures count nothing in the new closed generation")
		b.FailureIn(closed)
		assert.True(t, b.FailureIn(closed), "the new generation's own failures trip it")
		time.Sleep(100 * time.Millisecond)
		gen, _, probe = b.Admit()
		require.True(t, probe)
		assert.False(t, b.FailureIn(gen), "a failed probe reopens; it is no trip")
		assert.Equal(t, Open, b.State(), "the probe's failure counts")
		assert.Equal(t, uint64(2), b.Entered(Open))
	})
}

// TestUnfencedOutcomesCountInTheCurrentGeneration: Success and Failure,
// without a generation, act on whatever state the breaker is in, as
// before Admit.
func TestUnfencedOutcomesCountInTheCurrentGeneration(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := New(Settings{Failures: 1, Cooldown: 100 * time.Millisecond})
		require.True(t, b.Failure())
		time.Sleep(100 * time.Millisecond)
		_, probe := b.Allow()
		require.True(t, probe)
		b.Failure()
		assert.Equal(t, Open, b.State())
		time.Sleep(100 * time.Millisecond)
		_, probe = b.Allow()
		require.True(t, probe)
		b.Success()
		assert.Equal(t, Closed, b.State())
	})
}

// TestAbandonInEndsOnlyItsOwnProbe: a probe that Admit let through ends
// in AbandonIn, which, like SuccessIn and FailureIn, acts only in its
// generation. Here an unfenced Success closed the breaker under the
// probe, which then tripped and let a second probe through: the first
// probe's abandonment must not end the second's, or a third call would
// probe while the second is under way.
func TestAbandonInEndsOnlyItsOwnProbe(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		b := New(Settings{Failures: 1, Cooldown: 100 * time.Millisecond})
		require.True(t, b.Failure())
		time.Sleep(100 * time.Millisecond)
		first, _, probe := b.Admit()
		require.True(t, probe)
		b.Success() // a call let through by Allow before the trip
		require.Equal(t, Closed, b.State())
		require.True(t, b.Failure())
		time.Sleep(100 * time.Millisecond)
		second, _, probe := b.Admit()
		require.True(t, probe)

		b.AbandonIn(first) // the first probe's caller gave up
		assert.Equal(t, HalfOpen, b.State(), "the second probe is still under way")
		_, ok, _ := b.Admit()
		assert.False(t, ok, "no third call while it is")
		b.AbandonIn(second)
		_, ok, probe = b.Admit()
		assert.True(t, ok && probe, "abandoned, the next call probes at once")
	})
}
