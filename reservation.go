package tollgate

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// defaultHoldTTL is how long a reservation's hold lives unless WithHoldTTL
// says otherwise.
const defaultHoldTTL = 15 * time.Minute

// Reservation is a cost taken now and settled later, when the real cost is
// known: the tokens of an LLM answer, the bytes of a download. Reserve
// takes the most it may cost, exactly as AllowN would, and Settle then
// refunds what was not used or charges what was used beyond it. It is
// safe for concurrent use; it is settled at most once.
type Reservation struct {
	l      *Limiter
	key    string
	n      int64
	result Result
	hold   hold
	as     string     // the key a plan resolver was given for it (ResolveAs); "" for key
	resets uint64     // the Limiter's count of Resets before the hold was taken (resetMarks.taken)
	table  *planTable // the Limiter's plans before the hold was taken: their history (refundScale)

	mu      sync.Mutex
	settled bool
}

// hold is what Reserve asks of the store that decides it: to keep the
// tokens it takes as a hold, to settle later. The store that grants it
// fills in where, and until when.
type hold struct {
	ttl   time.Duration
	plans []Plan
	skip  uint64 // bit i: the reservation took nothing from plan i (a shadowed plan that would deny)

	lease bool // a lease's: Stats counts the decisions it serves, not it
	given bool // plans AllowPlans's caller gave: settled with them (plansInForce)

	store   Store  // the store that granted it; nil when none did (FailOpen)
	id      string // a RedisStore's name for it
	at      int64  // when the store decided it, µs on its clock (Redis's for a RedisStore); 0 if unknown
	expires int64  // a MemoryStore's: when it expires, µs on its clock

	backs *giveBacks // the Limiter's, which a give-back of the hold joins
}

// accept takes the plans of the decision that a hold is for: token
// buckets only, for now.
func (h *hold) accept(plans []Plan) error {
	if windowIn(plans) {
		return fmt.Errorf("%w: reservations take token-bucket plans only, not windows", ErrInvalidPlan)
	}
	h.plans = plans
	return nil
}

// granted records that store s granted the hold, until expires (µs on a
// MemoryStore's clock; a RedisStore's hold expires in Redis).
func (h *hold) granted(s Store, expires int64) {
	h.store, h.expires = s, expires
}

// Settlement is the outcome of settling a reservation.
type Settlement struct {
	// Result describes the buckets after settling, as Peek would:
	// Allowed says whether one token would be taken now, and RetryAfter
	// counts any debt.
	Result
	// Refunded is the number of tokens given back to each plan: the
	// tokens reserved and not used. A bucket refilled meanwhile keeps no
	// more than its capacity, so it may gain less. 0 when the hold was
	// gone, or the store was down.
	Refunded int64
	// Charged is the number of tokens used beyond the reservation, taken
	// from each plan, below empty if need be: a bucket in debt refills
	// from below zero. Debt is capped at one capacity.
	Charged int64
	// Uncharged is the part of Charged, in whole tokens, that the
	// plan with the least room could not take because its debt would have
	// passed one capacity. Stats counts it too.
	Uncharged int64
}

// Reserve takes n tokens now from the bucket of every named plan for key,
// or from none of them, exactly as AllowN does, and holds them until
// Settle says how many were used. If the reservation's Result is not
// Allowed, nothing was taken and there is nothing to settle.
//
// Reserve the most a request may cost, and no more than the smallest
// capacity of its enforced plans (ErrInvalidCost): a reservation larger
// than a bucket never passes. A shadowed plan smaller than it would deny
// it, and is held nothing. Reservations take token-bucket plans only; a
// window plan gets ErrInvalidPlan. A store, or a fallback store, other than
// a MemoryStore or RedisStore gets errors.ErrUnsupported.
//
// Errors are AllowN's. A caller whose context ends while the store takes
// the hold gets its context's error, and the hold, if granted, is given
// back; so is a hold whose reply Redis sent too late, or not at all, once
// Redis runs it. A hold that is never settled costs nothing beyond the
// tokens taken, which refill as usual.
func (l *Limiter) Reserve(ctx context.Context, key string, n int64, plans ...string) (*Reservation, error) {
	if !l.holds {
		return nil, errUnsupported(modeHold)
	}
	r := l.newReservation(key, n)
	if l.resolver != nil {
		r.as = resolverKey(ctx, key) // settled later, maybe on a context without it
	}
	if err := l.reserve(ctx, r, plans); err != nil {
		return nil, err
	}
	return r, nil
}

// request is the decision r asks for: to hold its tokens.
func (r *Reservation) request() *request {
	return &request{op: op{key: r.key, n: r.n, mode: modeHold, hold: &r.hold}}
}

// newReservation returns a reservation of n tokens of key, for decide to
// fill in.
func (l *Limiter) newReservation(key string, n int64) *Reservation {
	return &Reservation{l: l, key: key, n: n, resets: l.resets.taken(), table: l.table.Load(), hold: hold{ttl: l.holdTTL, backs: &l.backs}}
}

// held counts r, decided, if it was granted, and notes the plans it took
// nothing from.
func (l *Limiter) held(r *Reservation) {
	if r.result.Allowed {
		l.stats.reservations.held.Add(1)
		r.hold.skip = untaken(&r.result)
	}
}

// untaken returns the plans an allowed decision took nothing from, as bit
// i for plan i: the shadowed plans that would have denied.
func untaken(r *Result) uint64 {
	if r.chain == nil {
		if r.ShadowDenied {
			return 1
		}
		return 0
	}
	var skip uint64
	for i, pr := range r.chain {
		if pr.WouldDeny {
			skip |= 1 << i
		}
	}
	return skip
}

// OK reports whether the reservation was granted: its tokens were taken.
func (r *Reservation) OK() bool {
	return r.result.Allowed
}

// Result returns the decision Reserve made, as AllowN would report it.
func (r *Reservation) Result() Result {
	return r.result
}

// Settle settles the reservation with the tokens actually used, at least 0,
// once, atomically on every plan:
//   - fewer than reserved: the rest is refunded to every plan, up to its
//     capacity;
//   - more than reserved: the excess is charged to every plan, as debt
//     where the tokens are not there, up to one capacity of debt; the rest
//     is reported as Uncharged.
//
// Settle runs on a context of its own, as Permit.Release does: a caller
// whose context ended (a client that hung up once the work was done)
// still settles, bounded by ctx's deadline or 2 seconds, whichever is
// later.
//
// Errors: ErrNotHeld for a reservation that took nothing, and for a
// second Settle or Cancel, which change nothing; ErrHoldExpired when the hold outlived WithHoldTTL, Redis lost it, or it
// held data tollgate did not write: then nothing is
// refunded and the excess is still charged, and the Settlement tells it;
// ErrInvalidCost for an actual below 0 or above 9,007,199,254; and, under
// FailClosed, ErrStoreUnavailable, after which Settle may be called
// again.
//
// While the store fails, the Fallback policy charges the excess to the
// fallback store and drops the refund, which errs on the safe side, and
// FailOpen settles nothing; the Settlement's Source tells which. A
// reservation granted by the fallback store is settled there; one granted
// by FailOpen, or to an exempt key (ErrExempt), held nothing, and its
// Settle changes nothing. A refund makes this Limiter forget the key's
// remembered denials, also one whose reply was lost, which may have
// landed; other instances see it once the RetryAfter they remember has
// passed.
//
// The buckets are adjusted with the plans in force at Settle, of the names
// the reservation was decided on (after SetPlans, or a plan resolver
// (WithPlanResolver) that now answers another tier), so a refund refills at
// today's rate; a plan whose name is gone, or that the resolver now exempts
// or fails on, is settled as it was reserved, and one whose name is a
// window or a concurrency plan now is left alone. A reservation of a key
// that this Limiter reset (Limiter.Reset) since it was taken, or that any
// Limiter sharing its RedisStore or MemoryStore reset, or the store's own
// Reset, is refunded nothing, and its excess still charged: the buckets
// Reset filled hold its tokens already. So is one reserved under a lower
// Version of a plan than a plan of its name with InheritReset, which fills
// the bucket as Reset does, that is in force at Settle or that the
// Limiter's plans (New, SetPlans) held at any time, even one replaced
// before it wrote the bucket: plans taken back to a lower version refund
// nothing to the reservations taken under it. Across a plan of its name
// with InheritProportional and a higher Version, the refund is scaled
// as the bucket's tokens were, rounded down to a token and never up, so
// that it gives back no more than the bucket would hold had the
// reservation never taken it; for a chain, by the least scale of its
// plans, so the others may get back less. It is refunded nothing where
// the Limiter's plans cannot tell the scale: a plan name forgotten past
// 4,096 others, or a plan without a Version.
func (r *Reservation) Settle(ctx context.Context, actual int64) (Settlement, error) {
	return r.settle(ctx, actual, false)
}

// settle is Settle, or a give-back (giveBack), which no failure policy
// answers: it fails with ErrStoreUnavailable while the store fails.
func (r *Reservation) settle(ctx context.Context, actual int64, giveBack bool) (Settlement, error) {
	if !r.result.Allowed {
		return Settlement{}, ErrNotHeld
	}
	if actual < 0 || actual > maxCapacity {
		return Settlement{}, fmt.Errorf("%w: %d tokens used is out of range", ErrInvalidCost, actual)
	}
	ctx, cancel := detach(ctx, detachTimeout)
	defer cancel()
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.settled {
		return Settlement{}, ErrNotHeld
	}
	st, err := r.l.settle(ctx, r, actual, giveBack)
	if err == nil || errors.Is(err, ErrHoldExpired) || errors.Is(err, ErrNotHeld) {
		r.settled = true
	}
	return st, err
}

// Cancel is Settle with 0 tokens used: it refunds the whole reservation.
func (r *Reservation) Cancel(ctx context.Context) (Settlement, error) {
	return r.Settle(ctx, 0)
}
