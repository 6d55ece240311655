package tollgate

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/tollgate-go/tollgate/breaker"
)

// This file holds how a Limiter settles a reservation: on the store that
// granted its hold, behind that store's breaker or not, with the plans in
// force for its key.

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
	// Reset, or a new version's reset, filled the buckets without the rest;
	// a proportional version scaled what they held, and the refund with it.
	now := &l.table.Load().history
	switch {
	case l.resets.since(r.key, r.resets) || resetsByVersion(r.hold.plans, o.plans, h.skip, now):
		o.used = max(actual, r.n)
	case actual < r.n && !h.given:
		o.used = r.n - scaleRefund(r.n-actual, refundScale(r.hold.plans, h.skip, &r.table.history, now))
	}
	if o.used < r.n && l.denials != nil {
		// A refund may land though its reply is lost (the call failed, the
		// failure policy answered, or a retry finds the hold settled):
		// forget the key's denials once one was asked, not once one was
		// seen. Deferred, so that it follows the refund.
		defer l.denials.Forget(r.key)
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
