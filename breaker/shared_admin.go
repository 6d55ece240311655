package breaker

import (
	"context"
	"errors"
	"fmt"
	"sync/atomic"
	"time"
)

// This file holds the CircuitBreaker interface, the admin operations and
// the stats of a Shared breaker.

// CircuitBreaker is a breaker asked with Allow and told each call's outcome
// with RecordSuccess or RecordFailure, without tickets. *Shared implements
// it; its Acquire and Ticket.Done are the form that fences.
type CircuitBreaker interface {
	Allow(ctx context.Context, key string) (bool, error)
	RecordSuccess(ctx context.Context, key string) error
	RecordFailure(ctx context.Context, key string) error
	State(ctx context.Context, key string) (State, error)
}

var _ CircuitBreaker = (*Shared)(nil)

// Allow is the CircuitBreaker form of Acquire: it reports whether a call may go
// through, and false with a nil error when the breaker refuses it. Report
// the call with RecordSuccess or RecordFailure.
//
// This form cannot fence: a record counts against whatever generation is
// current when it arrives, so a call that started before the breaker
// opened may count after it closed. A half-open probe's lease is kept by
// this instance and used by its next record for the key. Prefer Acquire.
func (b *Shared) Allow(ctx context.Context, key string) (bool, error) {
	t, err := b.Acquire(ctx, key)
	if errors.Is(err, ErrOpen) {
		return false, nil
	}
	if err != nil {
		return false, err
	}
	switch {
	case t.Probe():
		b.mu.Lock()
		if len(b.probes) >= maxKeys {
			b.probes = map[string][]Ticket{}
		}
		b.probes[key] = append(b.probes[key], t)
		b.mu.Unlock()
	case t.t.mode == modeCached:
		// The record will find the same cached state, or fall back to an
		// unfenced round trip: nothing to keep.
	}
	return true, nil
}

// RecordSuccess reports a call that Allow let through and that succeeded.
func (b *Shared) RecordSuccess(ctx context.Context, key string) error {
	return b.record(ctx, key, Success)
}

// RecordFailure reports a call that Allow let through and that failed.
func (b *Shared) RecordFailure(ctx context.Context, key string) error {
	return b.record(ctx, key, Failure)
}

// record reports an outcome of the CircuitBreaker form: with a probe lease this instance
// holds for key if it has one, else unfenced, counted only while the
// breaker is closed.
func (b *Shared) record(ctx context.Context, key string, o Outcome) error {
	if err := checkKey(key); err != nil {
		return err
	}
	for {
		b.mu.Lock()
		q := b.probes[key]
		var t Ticket
		if len(q) > 0 {
			t = q[0]
			if len(q) == 1 {
				delete(b.probes, key)
			} else {
				b.probes[key] = q[1:]
			}
		}
		b.mu.Unlock()
		if t.t == nil {
			break
		}
		if err := t.Done(ctx, o); !errors.Is(err, ErrStale) {
			return err
		}
		// The lease expired: the outcome counts as an unfenced one.
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	now := b.now()
	m := b.memo(key)
	tk := &ticket{b: b, key: key, m: m, gen: -1, start: now}
	if until := m.closedUntilOf(); until != 0 && now < until {
		tk.mode, tk.gen = modeCached, m.gen.Load()
	} else if b.health.State() != Closed {
		tk.mode = modeLocal
	}
	err := Ticket{t: tk}.Done(ctx, o)
	if errors.Is(err, ErrStale) {
		return nil // unfenced: not counted while open or half-open, as documented
	}
	return err
}

// State returns the state of key's breaker as Redis holds it: one round
// trip, read only. While Redis fails it returns what the failure policy
// decides by: the Fallback breaker's state, or what the instance last
// read; and ErrStoreUnavailable under FailClosed.
func (b *Shared) State(ctx context.Context, key string) (State, error) {
	snap, err := b.Inspect(ctx, key)
	if err != nil && !errors.Is(err, ErrStoreUnavailable) {
		return Closed, err
	}
	if err != nil {
		if b.policy == FailClosed {
			return Closed, err
		}
		return b.localState(key), nil
	}
	return snap.State, nil
}

// localState returns key's state as this instance knows it without Redis.
func (b *Shared) localState(key string) State {
	b.mu.RLock()
	lc, m := b.local[key], b.memos[key]
	b.mu.RUnlock()
	if lc != nil {
		lc.mu.Lock()
		defer lc.mu.Unlock()
		return State(lc.c.state)
	}
	if m != nil {
		return State(m.state.Load())
	}
	return Closed
}

// Snapshot is a breaker's state in Redis, as Inspect reads it.
type Snapshot struct {
	// State is the breaker's state. An open breaker whose open time has
	// ended reads as Open until a call turns it half-open.
	State State
	// Generation grows by one at every state change. A key that was
	// never written, or expired while closed, is generation 0.
	Generation int64
	// RetryAfter is how long an open breaker stays open.
	RetryAfter time.Duration
	// Forced is true for a breaker that ForceOpen holds open.
	Forced bool
	// Trips counts the trips from closed to open since the last Reset, or
	// since the key last expired.
	Trips int64
	// Calls, Failures and Slow count the calls of a closed breaker in the
	// current window.
	Calls, Failures, Slow int64
}

// Inspect reads key's breaker from Redis, without changing it. A key that
// holds data a Shared breaker did not write reads as a closed breaker with
// ErrForeignValue. Redis failing is ErrStoreUnavailable under every policy.
func (b *Shared) Inspect(ctx context.Context, key string) (Snapshot, error) {
	return b.admin(ctx, key, opRead)
}

// ForceOpen opens key's breaker and holds it open, across the fleet, until
// ForceClosed or Reset. Other instances see it at their next round trip
// for the key: at once for a closed breaker without CacheClosedFor.
func (b *Shared) ForceOpen(ctx context.Context, key string) error {
	_, err := b.admin(ctx, key, opForceOpen)
	return err
}

// ForceClosed closes key's breaker with an empty window, and keeps its
// trip count. Instances that remember the breaker open (until its open
// time, or OpenFor for a forced one) refuse calls until then.
func (b *Shared) ForceClosed(ctx context.Context, key string) error {
	_, err := b.admin(ctx, key, opForceClosed)
	return err
}

// Reset closes key's breaker and forgets its counts and trips; the
// generation still grows, so no ticket granted before counts after it.
func (b *Shared) Reset(ctx context.Context, key string) error {
	_, err := b.admin(ctx, key, opReset)
	return err
}

// admin runs an admin op or a read on key, around the failure policy.
func (b *Shared) admin(ctx context.Context, key string, op int) (Snapshot, error) {
	if err := checkKey(key); err != nil {
		return Snapshot{}, err
	}
	if err := ctx.Err(); err != nil {
		return Snapshot{}, err
	}
	now := b.now()
	r, _, err := b.run(ctx, key, b.memo(key), input{op: op}, now)
	if err != nil {
		var cerr callerError
		if errors.As(err, &cerr) {
			return Snapshot{}, cerr.err
		}
		return Snapshot{}, fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
	}
	snap := Snapshot{
		State: State(r.state), Generation: r.gen, RetryAfter: time.Duration(r.wait) * time.Microsecond,
		Forced: r.held == 1, Trips: r.trips, Calls: r.calls, Failures: r.failures, Slow: r.slow,
	}
	if op == opRead && r.foreign == 1 {
		return snap, ErrForeignValue
	}
	return snap, nil
}

// SharedStats is a snapshot of what one Shared breaker instance has done
// since NewShared, for metrics. Counters only grow. Indexes are States. No
// field holds a key.
type SharedStats struct {
	// Granted counts the calls Acquire (or Allow) let through, by the
	// state they were granted in: [Closed] calls, [HalfOpen] probes.
	Granted [3]uint64
	// Rejected counts the calls refused with ErrOpen, by state: [Open],
	// [HalfOpen] (every probe lease taken).
	Rejected [3]uint64
	// Successes, Failures and Slow count the outcomes reported, by the
	// state the call was granted in.
	Successes, Failures, Slow [3]uint64
	// Stale counts outcomes ignored for their generation or lease.
	Stale uint64
	// Entered counts the transitions into each state that this
	// instance's calls made; every transition is made, and counted, by
	// exactly one instance. Entered[Open] includes failed probes.
	Entered [3]uint64
	// Trips counts the transitions from closed to open that this
	// instance's calls made (not forced ones).
	Trips uint64
	// RoundTrips counts the script calls sent to Redis.
	RoundTrips uint64
	// StoreErrors counts the script calls that failed through Redis
	// (not through the caller's context).
	StoreErrors uint64
	// Degraded counts the Acquire calls the failure policy decided.
	Degraded uint64
	// Foreign counts foreign values replaced at breakers' keys.
	Foreign uint64
	// Open is a gauge: the number of keys whose breaker this instance
	// currently remembers as open (it refuses their calls without Redis).
	Open int
	// Store is the state of the local breaker in front of Redis; Outage
	// is true from its trip until Redis answers again with it closed.
	Store  State
	Outage bool
}

type sharedCounters struct {
	granted, rejected, successes, failures, slow, entered [3]atomic.Uint64
	stale, trips, roundTrips, storeErrors, degraded       atomic.Uint64
	foreign                                               atomic.Uint64
}

// Stats returns what the instance has done since NewShared.
func (b *Shared) Stats() SharedStats {
	c := &b.stats
	s := SharedStats{
		Stale: c.stale.Load(), Trips: c.trips.Load(), RoundTrips: c.roundTrips.Load(),
		StoreErrors: c.storeErrors.Load(), Degraded: c.degraded.Load(), Foreign: c.foreign.Load(),
		Store: b.health.State(), Outage: b.outage.Load() != 0,
	}
	now := b.now()
	b.mu.RLock()
	for _, m := range b.memos {
		if until := m.openUntil.Load(); until != 0 && now < until {
			s.Open++
		}
	}
	b.mu.RUnlock()
	for i := range 3 {
		s.Granted[i], s.Rejected[i] = c.granted[i].Load(), c.rejected[i].Load()
		s.Successes[i], s.Failures[i], s.Slow[i] = c.successes[i].Load(), c.failures[i].Load(), c.slow[i].Load()
		s.Entered[i] = c.entered[i].Load()
	}
	return s
}

// closedUntilOf returns m's closed-cache deadline; 0 for a nil m.
func (m *memo) closedUntilOf() int64 {
	if m == nil {
		return 0
	}
	return m.closedUntil.Load()
}
