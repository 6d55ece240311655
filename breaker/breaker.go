// Package breaker holds two circuit breakers.
//
// Shared (shared.go) protects a service's downstreams: its state lives in
// Redis, one key per downstream, shared by every instance; see NewShared.
//
// Breaker is the local one that a tollgate.Limiter (and a Shared breaker)
// puts in front of Redis: after store failures it stops calling the store
// for a cool-down, then lets one call probe whether the store is back.
//
// A Breaker trips on either of two rules: a run of consecutive failures,
// which catches a store that is down, or a failure rate over a sliding time
// window, which catches a store that fails some calls and answers others
// (OOM under noeviction, READONLY from a demoted master), where every
// success would reset a count of consecutive failures.
//
// Each state a Breaker enters starts a generation. A caller that asks with
// Admit and reports with SuccessIn or FailureIn has its call's outcome
// counted only in the generation the call began in: a call let through
// before a trip that ends while the breaker probes neither reopens nor
// closes it, and one that ends after the breaker closed again counts
// against nothing.
//
// A Breaker is local to one process and lock-free: a closed breaker costs
// two atomic loads per successful call while no call has failed in its
// window, and a clock read and an atomic addition while one has; an open
// one costs a clock read.
package breaker

import (
	"math"
	"sync/atomic"
	"time"
)

// Settings configures a Breaker. Zero fields mean their defaults.
type Settings struct {
	// Failures is the number of consecutive failures that open the
	// breaker. The default is 3.
	Failures int
	// FailureRate is the fraction of failed calls, above 0 and at most 1,
	// that opens the breaker once Window holds at least MinCalls calls.
	// The default is 0.5.
	FailureRate float64
	// MinCalls is the fewest calls in Window for FailureRate to apply. The
	// default is 20.
	MinCalls int
	// Window is the sliding time window over which FailureRate is
	// measured, in ten steps of Window/10. The default is 10s.
	Window time.Duration
	// Cooldown is how long the breaker stays open before it lets one call
	// through to probe: success closes it, failure opens it for another
	// Cooldown. The default is 500ms, so that calls return to a recovered
	// store soon (0.3 s after a short outage in tollgate's chaos suite; up
	// to 1.5 s after a long one, go-redis's re-dial pace).
	Cooldown time.Duration
}

// withDefaults returns s with every zero field set to its default.
func (s Settings) withDefaults() Settings {
	if s.Failures < 1 {
		s.Failures = 3
	}
	s.Failures = min(s.Failures, math.MaxInt32) // as many as the counter holds
	if !(s.FailureRate > 0) || s.FailureRate > 1 {
		s.FailureRate = 0.5
	}
	if s.MinCalls < 1 {
		s.MinCalls = 20
	}
	if s.Window <= 0 {
		s.Window = 10 * time.Second
	}
	if s.Cooldown <= 0 {
		s.Cooldown = 500 * time.Millisecond
	}
	return s
}

// Valid reports whether every field is either zero (the default) or in
// range: no negative count or duration, a FailureRate in (0, 1], and a
// Window of at least 10 steps of a microsecond.
func (s Settings) Valid() bool {
	return s.Failures >= 0 && s.MinCalls >= 0 && s.Cooldown >= 0 &&
		(s.Window == 0 || s.Window >= steps*time.Microsecond) &&
		(s.FailureRate == 0 || s.FailureRate > 0 && s.FailureRate <= 1 && !math.IsNaN(s.FailureRate))
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

// steps is the number of sub-windows of the sliding window.
const steps = 10

// step counts the calls of one sub-window.
type step struct {
	slot     atomic.Int64 // which sub-window it counts: now / (Window/steps)
	calls    atomic.Uint64
	failures atomic.Uint64
}

// Breaker is a circuit breaker. It is safe for concurrent use; the zero
// value is not usable, call New.
type Breaker struct {
	s     Settings // with defaults
	width int64    // ns of one step
	epoch time.Time

	// phase holds the State in its low 2 bits and the generation, which
	// every transition increments, above them: one word, so that a caller
	// reads both at once.
	phase    atomic.Uint64
	failed   atomic.Int32 // consecutive failures while closed
	failing  atomic.Bool  // the window holds a failure
	openedAt atomic.Int64 // ns since epoch of the last opening
	window   [steps]step

	// entered counts transitions by the state they entered. A failed
	// probe opens the breaker again without counting: Entered(Open) is
	// the number of trips.
	entered [3]atomic.Uint64
}

// New returns a closed Breaker configured by s. Fields out of range (see
// Valid) mean their defaults, but for a Window under 10µs, which is used as
// it is, and Failures, which holds at most math.MaxInt32.
func New(s Settings) *Breaker {
	b := &Breaker{s: s.withDefaults(), epoch: time.Now()}
	b.width = max(int64(b.s.Window/steps), 1)
	b.clearWindow()
	return b
}

// Settings returns the breaker's settings, defaults filled in.
func (b *Breaker) Settings() Settings { return b.s }

// now reads the Breaker's monotonic clock, in nanoseconds since New. It is
// cheaper than time.Now, which reads the wall clock too.
func (b *Breaker) now() int64 { return int64(time.Since(b.epoch)) }

// Allow reports whether a call may go through, and whether that call is
// the probe, which must end in Success, Failure or Abandon. When the
// cool-down has passed, exactly one caller probes. Success and Failure
// count whatever generation the breaker is in; Admit fences.
func (b *Breaker) Allow() (ok, probe bool) {
	_, ok, probe = b.Admit()
	return ok, probe
}

// Admit is Allow that also returns the generation the call begins in, for
// SuccessIn or FailureIn to report its outcome in: an outcome counts only
// while the breaker is still in that generation. The probe ends in
// SuccessIn, FailureIn or AbandonIn. gen is 0 when ok is false.
func (b *Breaker) Admit() (gen uint64, ok, probe bool) {
	w := b.phase.Load()
	switch stateOf(w) {
	case Closed:
		return genOf(w), true, false
	case Open:
		if b.now()-b.openedAt.Load() < int64(b.s.Cooldown) {
			return 0, false, false
		}
		if b.transition(w, HalfOpen) {
			return genOf(w) + 1, true, true
		}
	}
	return 0, false, false
}

// Success records a call that succeeded: it closes a half-open breaker.
// It counts in the current generation, whenever the call began.
func (b *Breaker) Success() { b.success(b.phase.Load()) }

// SuccessIn records a call that Admit let through in generation gen and
// that succeeded, as Success does, unless the breaker has left that
// generation: then it counts nothing.
func (b *Breaker) SuccessIn(gen uint64) {
	if w := b.phase.Load(); genOf(w) == gen {
		b.success(w)
	}
}

// success records a success in phase w.
func (b *Breaker) success(w uint64) {
	if b.failed.Load() != 0 {
		b.failed.Store(0)
	}
	switch stateOf(w) {
	case Closed:
		// Successes are counted only while the window holds a failure:
		// a healthy store's calls then write nothing that every core
		// shares, and a failure rate is measured from a window's first
		// failure on.
		if b.failing.Load() {
			b.count(false)
		}
	case HalfOpen:
		// A closed breaker starts a fresh window: the failures that
		// opened it must not trip it again at the next failure. Only the
		// probe is in flight, so clearing first races with no one.
		b.clearWindow()
		b.transition(w, Closed)
	}
}

// Failure records a failed call, and reports whether it tripped the
// breaker: opened it from closed. A failed probe opens it again, which is
// not a trip. It counts in the current generation, whenever the call
// began.
func (b *Breaker) Failure() (tripped bool) { return b.failure(b.phase.Load()) }

// FailureIn records a call that Admit let through in generation gen and
// that failed, as Failure does, unless the breaker has left that
// generation: then it counts nothing and reports false.
func (b *Breaker) FailureIn(gen uint64) (tripped bool) {
	if w := b.phase.Load(); genOf(w) == gen {
		return b.failure(w)
	}
	return false
}

// failure records a failure in phase w.
func (b *Breaker) failure(w uint64) (tripped bool) {
	switch stateOf(w) {
	case HalfOpen:
		b.openedAt.Store(b.now())
		b.phase.CompareAndSwap(w, phaseOf(Open, genOf(w)+1))
	case Closed:
		calls, failures := b.count(true)
		rate := calls >= uint64(b.s.MinCalls) && float64(failures) >= b.s.FailureRate*float64(calls)
		if b.failed.Add(1) >= int32(b.s.Failures) || rate {
			// The time first, so that no caller sees an open breaker with
			// a stale opening time and probes at once.
			b.openedAt.Store(b.now())
			return b.transition(w, Open)
		}
	}
	return false
}

// Abandon ends a probe that told nothing, such as one its caller
// cancelled: the breaker opens again with its cool-down already over, so
// the next call probes. Only the probe may call it. It is not counted as a
// transition. It ends whatever probe is under way; AbandonIn fences.
func (b *Breaker) Abandon() {
	if w := b.phase.Load(); stateOf(w) == HalfOpen {
		b.phase.CompareAndSwap(w, phaseOf(Open, genOf(w)+1))
	}
}

// AbandonIn is Abandon for the probe that Admit let through in generation
// gen: it does nothing once the breaker has left that generation, so that
// it never ends a later probe.
func (b *Breaker) AbandonIn(gen uint64) {
	if w := b.phase.Load(); w == phaseOf(HalfOpen, gen) {
		b.phase.CompareAndSwap(w, phaseOf(Open, gen+1))
	}
}

// State returns the current state.
func (b *Breaker) State() State {
	return stateOf(b.phase.Load())
}

// Entered returns how many times the breaker has entered state s since
// New. Entered(Open) counts trips, not the re-openings of failed probes.
func (b *Breaker) Entered(s State) uint64 {
	if s < Closed || s > HalfOpen {
		return 0
	}
	return b.entered[s].Load()
}

// transition moves the breaker from phase w to state to, in the next
// generation, if it is still in w, and reports whether it moved. Exactly
// one caller wins a race.
func (b *Breaker) transition(w uint64, to State) bool {
	if !b.phase.CompareAndSwap(w, phaseOf(to, genOf(w)+1)) {
		return false
	}
	b.entered[to].Add(1)
	return true
}

// phaseOf returns the phase word of state s in generation gen.
func phaseOf(s State, gen uint64) uint64 { return gen<<2 | uint64(s) }

// stateOf returns the state of phase word w.
func stateOf(w uint64) State { return State(w & 3) }

// genOf returns the generation of phase word w.
func genOf(w uint64) uint64 { return w >> 2 }

// count counts a call in the current step of the window and returns the
// calls and failures of the whole window. Steps are recycled without a
// lock, so a call counted as its step is recycled may be lost: the rate is
// an estimate, which is all a breaker needs.
func (b *Breaker) count(failed bool) (calls, failures uint64) {
	slot := b.now() / b.width
	st := &b.window[uint64(slot)%steps] // Now is negative only if time.Now went back past New
	if old := st.slot.Load(); old != slot && st.slot.CompareAndSwap(old, slot) {
		st.calls.Store(0)
		st.failures.Store(0)
	}
	st.calls.Add(1)
	if failed {
		st.failures.Add(1)
		if !b.failing.Load() {
			b.failing.Store(true)
		}
	}
	for i := range b.window {
		w := &b.window[i]
		if s := w.slot.Load(); s > slot-steps && s <= slot {
			calls += w.calls.Load()
			failures += w.failures.Load()
		}
	}
	if failures == 0 {
		b.failing.Store(false) // the window's failures have slid out
	}
	return calls, failures
}

// clearWindow forgets every call counted.
func (b *Breaker) clearWindow() {
	b.failing.Store(false)
	for i := range b.window {
		b.window[i].slot.Store(math.MinInt64)
	}
}
