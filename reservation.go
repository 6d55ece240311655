package tollgate

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/tollgate-go/tollgate/breaker"
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
	as     string // the key a plan resolver was given for it (ResolveAs); "" for key
	resets uint64 // the Limiter's count of Resets before the hold was taken (resetMarks.taken)

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
	return &Reservation{l: l, key: key, n: n, resets: l.resets.taken(), hold: hold{ttl: l.holdTTL, backs: &l.backs}}
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
// remembered denials; other instances see it once the RetryAfter they
// remember has passed.
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
// nothing to the reservations taken under it.
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

// settle settles r with actual tokens used, on the store that granted it,
// behind the breaker and, unless it is a give-back, the failure policy
// when that store can fail.
func (l *Limiter) settle(ctx context.Context, r *Reservation, actual int64, giveBack bool) (st Settlement, err error) {
	if r.hold.store == nil { // granted by FailOpen, or exempt (ErrExempt): nothing was held
		return Settlement{Result: r.result}, nil
	}
	h := r.hold
	o := settleOp{key: r.key, hold: &h, n: r.n, used: actual}
	o.plans, h.skip = l.plansInForce(ctx, r)
	// Held until the refund reached the store, so that no Reset of the
	// key comes between the look at its marks and the refund.
	order := l.resets.order(r.key)
	order.RLock()
	defer order.RUnlock()
	// Reset, or a new version's reset, filled the buckets without the rest.
	if l.resets.since(r.key, r.resets) || resetsByVersion(r.hold.plans, o.plans, h.skip, &l.table.Load().resets) {
		o.used = max(actual, r.n)
	}
	var status settleStatus
	if isLocal(h.store) || h.store == l.fallback {
		st, status, err = l.settleWhereHeld(ctx, o, r.result.Source)
	} else {
		st, status, err = l.settleGuarded(ctx, o, giveBack)
	}
	if err != nil {
		return Settlement{}, err
	}
	l.stats.reservations.count(&st, status)
	if st.Refunded > 0 && l.denials != nil {
		l.denials.Forget(r.key)
	}
	switch status {
	case holdSettled:
		return st, ErrNotHeld
	case holdGone:
		return st, ErrHoldExpired
	case holdBad:
		return st, fmt.Errorf("%w: the hold held data tollgate did not write", ErrHoldExpired)
	}
	return st, nil
}

// settleWhereHeld settles o on the store that granted its hold, a store
// of this process or the fallback store, without the store's breaker: the
// fallback, which decided on this instance's share (WithFleet), may
// answer while the store fails, and its failures and successes tell
// nothing of the store. The Settlement reports src, the Source of the
// reservation.
func (l *Limiter) settleWhereHeld(ctx context.Context, o settleOp, src Source) (Settlement, settleStatus, error) {
	if o.hold.store == l.fallback {
		o.plans = l.fallbackShare(o.plans)
	}
	st, status, err := o.hold.store.(settler).settle(ctx, o)
	if err != nil { // only a fallback of another process fails
		return Settlement{}, 0, fmt.Errorf("%w: the fallback store failed: %w", ErrStoreUnavailable, err)
	}
	st.Source = src
	return st, status, nil
}

// settleGuarded settles o on the store that granted its hold, one that
// can fail, behind the breaker; while it fails, the failure policy
// settles it, unless it is a give-back (giveBack), which then fails as
// under FailClosed.
func (l *Limiter) settleGuarded(ctx context.Context, o settleOp, giveBack bool) (st Settlement, status settleStatus, err error) {
	n := l.health.forKey(ctx, o.key, o.plans)
	cause := errBreakerOpen
	if gen, ok, probe := n.b.Admit(); ok {
		callerErr, storeErr := l.call(ctx, &st.Result, pass{n, gen, probe, l.now()}, func() (err error) {
			st, status, err = o.hold.store.(settler).settle(ctx, o)
			return err
		})
		switch {
		case callerErr != nil:
			return Settlement{}, 0, callerErr
		case storeErr == nil:
			return st, status, nil
		}
		cause = storeErr
	}
	switch {
	case giveBack:
		return Settlement{}, 0, fmt.Errorf("%w: %w", ErrStoreUnavailable, cause)
	case l.policy == breaker.FailOpen:
		return Settlement{Result: failOpenResult(o.plans)}, holdLive, nil
	case l.policy == breaker.FailClosed:
		return Settlement{}, 0, fmt.Errorf("%w: %w", ErrStoreUnavailable, cause)
	}
	// The fallback store holds no hold of the store's: it charges the
	// excess as for a hold gone (named anew, so that no tombstone of an
	// earlier one in a RedisStore answers for it), and drops the refund.
	gone := hold{skip: o.hold.skip, id: newHoldID(), ttl: time.Millisecond}
	o.hold, o.plans = &gone, l.fallbackShare(o.plans)
	st, _, err = l.fallback.(settler).settle(ctx, o)
	if err != nil {
		return Settlement{}, 0, fmt.Errorf("%w: fallback store failed too: %w", ErrStoreUnavailable, err)
	}
	st.Source = SourceFallback
	return st, holdLive, nil
}

// plansInForce returns the plans a settlement of r adjusts, and the plans
// it leaves alone (bit i for plan i, as hold.skip): for each plan the
// reservation was decided on, the plan of that name that a decision on r's
// key would use now (SetPlans, WithPlanResolver), so that a refund refills,
// and a debt accrues, at the rate in force. A plan whose name left the
// table, or that the resolver exempts or fails on, keeps the reservation's;
// so does its Shadow flag, since the reservation took from it or not by
// that flag (hold.skip). A plan of the name that is a window or a
// concurrency plan now is left alone: the bucket the reservation took from
// is gone, and writing one would replace the window's counts or the permits
// held. The plans of a lease that AllowPlans took are its caller's, which
// the Limiter cannot look up: they are kept as they were.
func (l *Limiter) plansInForce(ctx context.Context, r *Reservation) (_ []Plan, skip uint64) {
	was, skip := r.hold.plans, r.hold.skip
	if r.hold.given {
		return was, skip
	}
	if r.as != "" && r.as != r.key {
		ctx = ResolveAs(ctx, r.key, r.as) // the resolver sees the key it saw at Reserve
	}
	t := l.table.Load()
	var now []Plan // a copy, once a plan differs
	for i := range was {
		e := t.byName[was[i].Name]
		if e == nil {
			continue
		}
		p := e.one[0]
		if l.resolver != nil {
			if l.callResolver(ctx, r.key, &p, &p) != nil {
				continue
			}
			v, err := l.variantOf(e, &p)
			if err != nil {
				continue
			}
			p = v.one[0]
		}
		p.Shadow = was[i].Shadow
		if p.isWindow() || p.Concurrency {
			skip |= 1 << i
			continue
		}
		if p == was[i] {
			continue
		}
		if now == nil {
			now = slices.Clone(was)
		}
		now[i] = p
	}
	if now == nil {
		return was, skip
	}
	return now, skip
}
