// Package breaker holds the circuit breaker that a tollgate.Limiter puts in
// front of its store: after repeated store failures it stops calling the
// store for a cool-down, then lets one call probe whether the store is back.
//
// A Breaker is local to one process and lock-free: a closed breaker costs
// one atomic load per call, an open one a read of the monotonic clock.
package breaker

import (
	"sync/atomic"
	"time"
)

// Settings configures a Breaker. Zero fields mean their defaults.
type Settings struct {
	// Failures is the number of consecutive failures that open the
	// breaker. The default is 3.
	Failures int
	// Cooldown is how long the breaker stays open before it lets one call
	// through to probe: success closes it, failure opens it for another
	// Cooldown. The default is 500ms, so that calls return to a recovered
	// store soon (0.3 s after a short outage in tollgate's chaos suite; up
	// to 1.5 s after a long one, go-redis's re-dial pace).
	Cooldown time.Duration
}

// State is the state of a Breaker.
type State int32

const (
	// Closed means calls go through.
	Closed State = iota
	// Open means calls are refused until the cool-down has passed.
	Open
	// HalfOpen means one call is probing; the others are refused.
	HalfOpen
)

// String returns "closed", "open" or "half-open".
func (s State) String() string {
	switch s {
	case Closed:
		return "closed"
	case Open:
		return "open"
	case HalfOpen:
		return "half-open"
	}
	return "unknown"
}

// Breaker is a circuit breaker. It is safe for concurrent use; the zero
// value is not usable, call New.
type Breaker struct {
	failures int32
	cooldown time.Duration
	epoch    time.Time // openedAt counts from here, on the monotonic clock

	state    atomic.Int32 // State
	failed   atomic.Int32 // consecutive failures while closed
	openedAt atomic.Int64 // ns since epoch of the last opening

	// entered counts transitions by the state they entered: a failed
	// probe enters Open again, an abandoned one does not count.
	entered [3]atomic.Uint64
}

// New returns a closed Breaker configured by s.
func New(s Settings) *Breaker {
	b := &Breaker{failures: int32(s.Failures), cooldown: s.Cooldown, epoch: time.Now()}
	if b.failures < 1 {
		b.failures = 3
	}
	if b.cooldown <= 0 {
		b.cooldown = 500 * time.Millisecond
	}
	return b
}

// Now reads the Breaker's monotonic clock, in nanoseconds since New. It is
// cheaper than time.Now, which reads the wall clock too.
func (b *Breaker) Now() int64 { return int64(time.Since(b.epoch)) }

// Allow reports whether a call may go through, and whether that call is
// the probe, which must end in Success, Failure or Abandon. When the
// cool-down has passed, exactly one caller probes.
func (b *Breaker) Allow() (ok, probe bool) {
	switch State(b.state.Load()) {
	case Closed:
		return true, false
	case Open:
		if b.Now()-b.openedAt.Load() < int64(b.cooldown) {
			return false, false
		}
		ok = b.transition(Open, HalfOpen)
		return ok, ok
	}
	return false, false
}

// Success records a call that succeeded: it closes a half-open breaker.
func (b *Breaker) Success() {
	if b.failed.Load() != 0 {
		b.failed.Store(0)
	}
	if State(b.state.Load()) == HalfOpen {
		b.transition(HalfOpen, Closed)
	}
}

// Failure records a failed call: the last of Failures in a row opens a
// closed breaker, and a failed probe opens it again.
func (b *Breaker) Failure() {
	switch State(b.state.Load()) {
	case HalfOpen:
		b.openedAt.Store(b.Now())
		b.transition(HalfOpen, Open)
	case Closed:
		if b.failed.Add(1) >= b.failures {
			// The time first, so that no caller sees an open breaker with
			// a stale opening time and probes at once.
			b.openedAt.Store(b.Now())
			b.transition(Closed, Open)
		}
	}
}

// Abandon ends a probe that told nothing, such as one its caller
// cancelled: the breaker opens again with its cool-down already over, so
// the next call probes. Only the probe may call it. It is not counted as a
// transition.
func (b *Breaker) Abandon() {
	b.state.CompareAndSwap(int32(HalfOpen), int32(Open))
}

// State returns the current state.
func (b *Breaker) State() State {
	return State(b.state.Load())
}

// Entered returns how many times the breaker has entered state s since New.
func (b *Breaker) Entered(s State) uint64 {
	if s < Closed || s > HalfOpen {
		return 0
	}
	return b.entered[s].Load()
}

// transition moves the breaker from one state to another if it is in the
// first, and reports whether it moved. Exactly one caller wins a race.
func (b *Breaker) transition(from, to State) bool {
	if !b.state.CompareAndSwap(int32(from), int32(to)) {
		return false
	}
	b.entered[to].Add(1)
	return true
}
