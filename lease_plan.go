package tollgate

import "context"

// fits reports whether e's lease, if it holds one, was taken for plan p:
// a lease serves only the plan it was taken for, so that a plan change
// (SetPlans, a resolver's new tier, a new Version) is decided by the
// store under the new plan. The caller holds e.mu.
func (e *lease) fits(p *Plan) bool {
	if e.r == nil {
		return true
	}
	was := &e.r.hold.plans[0]
	return was == p || *was == *p // the same table entry's plan, mostly
}

// holdsOther reports whether e holds a lease taken for a plan other than p.
func (e *lease) holdsOther(p *Plan) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return !e.fits(p)
}

// leased reports whether a lease was ever taken for a plan named name:
// only then may a decision on a plan of that name that takes no lease
// find one to give back.
func (ls *leases) leased(name string) bool {
	_, ok := ls.names.Load(name)
	return ok
}

// lookup returns the lease of plan for key: new if there is none and
// create is set, else nil; nil once the Limiter is closed.
func (ls *leases) lookup(key, plan string, create bool) *lease {
	if create {
		return ls.get(key, plan)
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	return ls.m[leaseKey{key, plan}]
}

// retire gives back a lease that a take replaces, old, of which left
// tokens were not handed out, and next, taken ahead of it. If its plan is
// no longer the key's (stale), it does so before it returns, on ctx, so
// that the store decides under the new plan only once the rest is back,
// refunded up to the new plan's capacity; else on goroutines of their
// own.
func (ls *leases) retire(ctx context.Context, old *Reservation, left int64, next *Reservation, stale bool) {
	if !stale {
		if old != nil {
			ls.giveBack(old, left)
		}
		if next != nil {
			ls.giveBack(next, next.n)
		}
		return
	}
	if old != nil {
		_, _ = old.Settle(ctx, old.n-left)
	}
	if next != nil {
		_, _ = next.Settle(ctx, 0)
	}
}

// drop forgets key's leases of plans, after Reset filled their buckets,
// without giving back what they hold: the bucket was filled without
// those tokens, and giving them back would overfill it. A take under way
// for one of them keeps nothing either. The holds expire in Redis.
func (ls *leases) drop(key string, plans []Plan) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for i := range plans {
		k := leaseKey{key, plans[i].Name}
		e := ls.m[k]
		if e == nil {
			continue
		}
		delete(ls.m, k)
		e.mu.Lock()
		e.gone, e.dropped = true, true
		e.r, e.left, e.next = nil, 0, nil
		e.mu.Unlock()
	}
}

// retireOthers gives back, before the store decides q, a decision no lease
// serves (a chain, a Reserve, an Acquire), the key's leases of q's plans'
// names that were taken for other plans: their rest goes back before the
// store decides under the plans in force, as for a decision a lease serves.
func (ls *leases) retireOthers(ctx context.Context, q *request) error {
	var r Result // written by no take that leases none
	for i := range q.plans {
		if !ls.leased(q.plans[i].Name) {
			continue
		}
		a := leaseAsk{key: q.key, cost: q.n, plans: q.plans[i : i+1], given: q.given, keep: true}
		if _, err := ls.decide(ctx, &r, a); err != nil {
			return err
		}
	}
	return nil
}
