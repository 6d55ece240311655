package tollgate

import (
	"sync"
	"sync/atomic"
	"time"
)

// BreakerSettings configures the circuit breaker in front of a Limiter's
// store. Zero fields mean their defaults.
type BreakerSettings struct {
	// Failures is the number of consecutive store failures that open the
	// breaker. While open, decisions skip the store and follow the failure
	// policy at once. The default is 3.
	Failures int
	// Cooldown is how long the breaker stays open before it lets one call
	// through to probe the store: success closes it, failure opens it for
	// another Cooldown. The default is 500ms, so decisions return to the
	// store soon after its recovery (0.3 s after a short outage in the
	// chaos suite; up to 1.5 s after a long one, go-redis's re-dial pace).
	Cooldown time.Duration
}

// BreakerState is the state of a circuit breaker.
type BreakerState int32

const (
	// BreakerClosed means calls go to the store.
	BreakerClosed BreakerState = iota
	// BreakerOpen means calls skip the store.
	BreakerOpen
	// BreakerHalfOpen means one call is probing the store; the others skip it.
	BreakerHalfOpen
)

// String returns "closed", "open" or "half-open".
func (s BreakerState) String() string {
	switch s {
	case BreakerClosed:
		return "closed"
	case BreakerOpen:
		return "open"
	case BreakerHalfOpen:
		return "half-open"
	}
	return "unknown"
}

// breaker is a lock-free circuit breaker: a closed breaker costs one atomic
// load per call, and an open one a clock read.
type breaker struct {
	failures int32
	cooldown time.Duration
	onChange func(from, to BreakerState) // nil, or called after each transition
	reportMu sync.Mutex                  // orders transitions with their reports

	epoch    time.Time    // openedAt counts from here, on the monotonic clock
	state    atomic.Int32 // BreakerState
	failed   atomic.Int32 // consecutive failures while closed
	openedAt atomic.Int64 // ns since epoch of the last opening
}

// now reads the monotonic clock only: an open breaker reads it on every
// call, and time.Now would read the wall clock too.
func (b *breaker) now() int64 { return int64(time.Since(b.epoch)) }

func newBreaker(s BreakerSettings) *breaker {
	b := &breaker{failures: int32(s.Failures), cooldown: s.Cooldown, epoch: time.Now()}
	if b.failures < 1 {
		b.failures = 3
	}
	if b.cooldown <= 0 {
		b.cooldown = 500 * time.Millisecond
	}
	return b
}

// allow reports whether a call may go to the store, and whether that call
// is the probe. When the cooldown has passed, exactly one caller probes.
func (b *breaker) allow() (ok, probe bool) {
	switch BreakerState(b.state.Load()) {
	case BreakerClosed:
		return true, false
	case BreakerOpen:
		if b.now()-b.openedAt.Load() < int64(b.cooldown) {
			return false, false
		}
		ok = b.transition(BreakerOpen, BreakerHalfOpen)
		return ok, ok
	}
	return false, false
}

// success records a call the store answered.
func (b *breaker) success() {
	if b.failed.Load() != 0 {
		b.failed.Store(0)
	}
	if BreakerState(b.state.Load()) == BreakerHalfOpen {
		b.transition(BreakerHalfOpen, BreakerClosed)
	}
}

// failure records a store failure.
func (b *breaker) failure() {
	switch BreakerState(b.state.Load()) {
	case BreakerHalfOpen:
		b.openedAt.Store(b.now())
		b.transition(BreakerHalfOpen, BreakerOpen)
	case BreakerClosed:
		if b.failed.Add(1) >= b.failures {
			// The time first, so that no caller sees an open breaker with
			// a stale opening time and probes at once.
			b.openedAt.Store(b.now())
			b.transition(BreakerClosed, BreakerOpen)
		}
	}
}

// abandon ends a probe that told nothing, such as one cancelled by its
// caller: the breaker opens again with its cooldown already over, so the
// next call probes. Only the probe may call it.
func (b *breaker) abandon() {
	b.transition(BreakerHalfOpen, BreakerOpen)
}

// current returns the state, for logs and tests.
func (b *breaker) current() BreakerState {
	return BreakerState(b.state.Load())
}

// transition moves the breaker from one state to another if it is in the
// first, and reports whether it moved. Exactly one caller wins a race.
func (b *breaker) transition(from, to BreakerState) bool {
	if b.onChange == nil {
		return b.state.CompareAndSwap(int32(from), int32(to))
	}
	// With an observer, the change and its report happen under one lock,
	// so reports arrive in the order of the changes: a gauge that followed
	// them could otherwise end on a state the breaker has left.
	b.reportMu.Lock()
	defer b.reportMu.Unlock()
	if !b.state.CompareAndSwap(int32(from), int32(to)) {
		return false
	}
	reported := false
	defer func() {
		if !reported { // the observer panicked: undo, or a probe could stick
			b.state.CompareAndSwap(int32(to), int32(from))
		}
	}()
	b.onChange(from, to)
	reported = true
	return true
}
