package tollgate

import (
	"context"
	"time"
)

// leaseAsk is a decision that a lease may serve: its key and cost, and
// its plans, one, resolved, and whether its caller gave them
// (AllowPlans).
type leaseAsk struct {
	key   string
	cost  int64
	plans []Plan
	given bool
	as    string // the key a plan resolver was given (ResolveAs), for the lease's settlement
	pk    string // the denial cache's name for the plan; empty when the cache is off
	keep  bool   // takes no lease whatever its plan: a plan of a chain, a Reserve or an Acquire
}

// leasing reports whether a takes a lease: its plan leases its cost,
// and it is no plan of a chain, a Reserve or an Acquire.
func (a *leaseAsk) leasing() bool {
	return !a.keep && leasable(&a.plans[0], a.cost)
}

// leasable reports whether a decision of cost on plan p takes a lease:
// p leases at least cost and is enforced. A shadowed plan takes none, so
// that it reports, request by request, what its enforced twin would.
func leasable(p *Plan, cost int64) bool {
	return p.Lease >= cost && !p.Shadow
}

// takeDetached is take on a context of its own, bounded by a TTL and a
// second, on a goroutine that holds e.renew until the take is done. A
// caller whose ctx ends first gets its error at once, and the take,
// finished without it, is kept as the key's lease or given back. The
// caller holds e.renew, which passes to the goroutine.
func (ls *leases) takeDetached(ctx context.Context, e *lease, r *Result, a leaseAsk) (decided, again bool, err error) {
	q := &a // the take's goroutine shares it: on the heap, once per lease taken
	e.mu.Lock()
	gone := e.gone // Close or Reset dropped it: no goroutine may start
	if !gone {
		// Counted while e, not gone, is in the map: Close's sweep then
		// waits for e.renew, which the goroutine holds, before it waits
		// for ls.done, so the count never starts from zero under a Wait.
		ls.done.Add(1)
	}
	e.mu.Unlock()
	if gone {
		<-e.renew
		return false, true, nil
	}
	w := &handoff{done: make(chan struct{})}
	var out struct { // the take's, the caller's once w.done is closed
		r              Result
		decided, again bool
		err            error
	}
	tctx, cancel := detach(ctx, ls.ttl+time.Second)
	go func() {
		defer ls.done.Done()
		defer cancel()
		out.decided, out.again, out.err = ls.take(tctx, e, &out.r, q, w)
		<-e.renew
		close(w.done)
	}()
	select {
	case <-w.done:
	case <-ctx.Done():
		if w.abandon() {
			return true, false, ctx.Err()
		}
		<-w.done // claimed: the decision is the caller's
	}
	*r = out.r
	return out.decided, out.again, out.err
}

// install makes rv, a lease just taken, e's lease, and decides the
// request of cost from it into *r if its caller still waits (w), which it
// reports. If Reset dropped e meanwhile, rv is not kept, and its rest not
// given back: the bucket Reset filled may hold those tokens already.
func (ls *leases) install(e *lease, rv *Reservation, r *Result, cost int64, w *handoff) bool {
	now := ls.l.now()
	e.mu.Lock()
	defer e.mu.Unlock()
	charged := w.claim()
	if !charged {
		cost = 0
	}
	if e.gone {
		if !e.dropped {
			ls.giveBack(rv, rv.n-cost)
		}
		if charged {
			*r = rv.result
			r.Remaining += rv.n - cost
		}
		return charged
	}
	e.r, e.left, e.ends = rv, rv.n-cost, now+int64(ls.ttl)
	if charged {
		e.result(r, SourceStore)
	}
	return charged
}
