package tollgate

import (
	"context"
	"math"
	"sync"
	"time"
)

// defaultLeaseTTL is how long a lease lives unless WithLeaseTTL says
// otherwise; maxLeaseTTL bounds WithLeaseTTL: a lease is for a hot key,
// whose tokens other instances should not wait minutes for.
const (
	defaultLeaseTTL = time.Second
	maxLeaseTTL     = time.Minute
)

// leases are a Limiter's leases of plans with Plan.Lease, on a
// RedisStore. A lease is a reservation of Plan.Lease tokens of one key,
// taken in Redis like any decision, whose tokens the Limiter then hands
// out one decision at a time without asking Redis; when it runs out, or
// its TTL passes, the next decision settles it with the tokens handed
// out, which gives the unused rest back, and takes a new one. A sweeper
// gives back the leases no decision came for.
type leases struct {
	l   *Limiter
	ttl time.Duration

	mu     sync.Mutex
	m      map[leaseKey]*lease
	names  sync.Map // the plan names a lease was ever taken for: string to struct{}
	closed bool
	sweep  sync.Once     // starts the sweeper at the first lease
	stop   chan struct{} // closed by close
	done   sync.WaitGroup
}

// leaseKey names a lease: a key and the plan it leases.
type leaseKey struct{ key, plan string }

// lease is one key's lease of one plan.
type lease struct {
	// renew is held, as a lock that a caller's context can give up on, by
	// the one caller that gives the lease back and takes the next.
	renew chan struct{}

	mu      sync.Mutex    // guards what follows
	r       *Reservation  // nil: no lease held
	left    int64         // tokens not yet handed out
	ends    int64         // when the lease stops serving, on the Limiter's clock
	ended   bool          // the sweeper found it past ends
	next    *Reservation  // the lease taken ahead, to serve when r runs out
	fetched chan struct{} // non-nil while a goroutine takes next; closed when it is done
	backoff int64         // until when no lease is taken, after Redis had too few tokens
	gone    bool          // dropped from the map: look the lease up again
	dropped bool          // by Reset: what it held, or a take under way brings, is not given back
}

// reservation returns a lease's reservation of n tokens of key. Its hold
// lives 4 TTLs, past the longest a lease is held (one taken ahead serves
// after the one before, each up to 1.5 TTLs, and is given back within
// half a TTL more), so that the tombstones of leases given back leave
// Redis soon; a hold that expired first refunds nothing, which only
// under-admits. given says that AllowPlans's caller gave the plans.
func (ls *leases) reservation(a *leaseAsk, n int64) *Reservation {
	rv := ls.l.newReservation(a.key, n)
	rv.hold.ttl, rv.hold.lease, rv.hold.given = ls.holdTTL(), true, a.given
	rv.as = a.as
	return rv
}

// holdTTL returns how long a lease's hold lives: 4 lease TTLs.
func (ls *leases) holdTTL() time.Duration { return 4 * ls.ttl }

// hold takes the lease rv of plans in the store, behind its breaker and
// failure policy, as Reserve would, and counts it if it was granted.
func (ls *leases) hold(ctx context.Context, rv *Reservation, plans []Plan) error {
	rv.hold.plans = plans
	o := op{key: rv.key, n: rv.n, mode: modeHold, plans: plans, hold: &rv.hold}
	if err := ls.l.ask(ctx, &rv.result, &o, ls.l.now()); err != nil {
		return err
	}
	ls.l.held(rv)
	return nil
}

func newLeases(l *Limiter, ttl time.Duration) *leases {
	return &leases{l: l, ttl: ttl, m: map[leaseKey]*lease{}, stop: make(chan struct{})}
}

// serve serves a decision of cost on plans, one plan, from the lease of
// key, taking a new lease when it has too few tokens, if the plan leases
// (leasable). A lease of the plan's name taken for another plan is given
// back first, whether the plan leases or not; so it is for each plan of a
// chain, a Reserve or an Acquire, which no lease serves (retireOthers). It
// reports whether it decided into *r; when not, the request goes to the
// store as usual: the plan takes no lease, Redis had fewer tokens than a
// lease, or the Limiter is closed.
func (ls *leases) serve(ctx context.Context, r *Result, q *request) (bool, error) {
	if len(q.plans) != 1 || q.mode != modeTake {
		return false, ls.retireOthers(ctx, q)
	}
	if !leasable(&q.plans[0], q.n) && !ls.leased(q.plans[0].Name) {
		return false, nil
	}
	a := leaseAsk{key: q.key, cost: q.n, plans: q.plans, given: q.given}
	if ls.l.denials != nil {
		a.pk = planKey(q)
	}
	if ls.l.resolver != nil {
		a.as = resolverKey(ctx, q.key)
	}
	return ls.decide(ctx, r, a)
}

// decide is serve for a, a decision on one plan. a goes by value: a
// decision the lease serves, the common case, allocates nothing.
func (ls *leases) decide(ctx context.Context, r *Result, a leaseAsk) (bool, error) {
	key, plans := a.key, a.plans
	leasing := a.leasing()
	for {
		e := ls.lookup(key, plans[0].Name, leasing)
		if e == nil {
			return false, nil
		}
		if leasing {
			served, backingOff := ls.spend(e, r, &a)
			if served || backingOff {
				return served, nil
			}
		} else if !e.holdsOther(&plans[0]) {
			return false, nil
		}
		select {
		case e.renew <- struct{}{}:
		case <-ctx.Done():
			return true, ctx.Err()
		}
		decided, again, err := ls.takeDetached(ctx, e, r, a)
		if !again {
			return decided, err
		}
	}
}

// get returns the lease of plan for key, new if there is none; nil once
// the Limiter is closed.
func (ls *leases) get(key, plan string) *lease {
	k := leaseKey{key, plan}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if ls.closed {
		return nil
	}
	e := ls.m[k]
	if e == nil {
		e = &lease{renew: make(chan struct{}, 1)}
		ls.m[k] = e
		ls.names.LoadOrStore(plan, struct{}{})
		ls.sweep.Do(func() {
			ls.done.Add(1)
			go ls.sweeper()
		})
	}
	return e
}

// spend hands out cost tokens of e's lease into *r, if it holds them and
// the sweeper has not ended it. It reads no clock: a lease serves until
// the sweeper, every half TTL, finds it past its end. Once half of
// the lease is left, a goroutine takes the next one ahead, of what the
// lease has handed out, so that the tokens held stay at most a lease and
// no request waits for Redis while a lease follows a lease. backingOff
// reports a key that takes no lease for now (Redis had too few tokens),
// whose requests go to Redis without queueing for the next lease.
func (ls *leases) spend(e *lease, r *Result, a *leaseAsk) (served, backingOff bool) {
	cost, plans := a.cost, a.plans
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.r == nil && !e.gone {
		return false, ls.l.now() < e.backoff
	}
	if e.gone || e.ended || !e.fits(&plans[0]) {
		return false, false
	}
	if e.left < cost {
		if e.next == nil {
			return false, false
		}
		ls.giveBack(e.r, e.left)
		e.r, e.left, e.ends, e.next = e.next, e.next.n, ls.l.now()+int64(ls.ttl), nil
		if e.left < cost {
			return false, false
		}
	}
	e.left -= cost
	e.result(r, SourceLease)
	if size := plans[0].Lease; e.next == nil && e.fetched == nil && e.left <= size/2 {
		e.fetched = make(chan struct{})
		ls.done.Add(1)
		go ls.fetch(e, e.r, size-e.left, *a)
	}
	return true, false
}

// fetch takes the next lease of e, of n tokens, ahead of need, to follow
// the lease cur; if cur is gone meanwhile, it gives it back. Until it
// closes e.fetched, the sweeper neither ends nor drops e, and a take of e
// waits for it (sweepOnce, take).
func (ls *leases) fetch(e *lease, cur *Reservation, n int64, a leaseAsk) {
	defer ls.done.Done()
	ctx, cancel := context.WithTimeout(context.Background(), ls.ttl+time.Second)
	defer cancel()
	rv := ls.reservation(&a, n)
	err := ls.hold(ctx, rv, a.plans)
	ok := err == nil && rv.result.Allowed && rv.result.Source == SourceStore
	e.mu.Lock()
	defer e.mu.Unlock()
	close(e.fetched)
	e.fetched = nil
	switch {
	case ok && !e.gone && e.r == cur:
		e.next = rv
	case e.dropped: // by Reset, which filled the bucket: given back, it would overfill it
	case err == nil && rv.result.Allowed:
		ls.giveBack(rv, n) // not needed any more, or from the fallback
	}
}

// result writes the Result of a decision the lease served: the
// reservation's, as of when it was taken, allowed, with Remaining counting
// the tokens the lease still holds.
func (e *lease) result(r *Result, src Source) {
	*r = e.r.result
	r.Source = src
	r.Remaining += e.left
}

// take gives e's lease back and, if q's plan leases, takes a new one,
// deciding the request from it for its caller unless the caller left (w).
// A lease of another plan is given back before the store decides under
// the new one. again reports that e left the map meanwhile, or that the
// lease taken ahead came back, so the caller must look the lease up
// again. The caller holds e.renew; ctx is the
// take's own.
func (ls *leases) take(ctx context.Context, e *lease, r *Result, q *leaseAsk, w *handoff) (decided, again bool, err error) {
	now, leasing := ls.l.now(), q.leasing()
	e.mu.Lock()
	if e.gone {
		e.mu.Unlock()
		return false, true, nil
	}
	if leasing && e.r != nil && e.left >= q.cost && !e.ended && e.fits(&q.plans[0]) { // another caller took one meanwhile
		if w.claim() {
			e.left -= q.cost
			e.result(r, SourceLease)
		}
		e.mu.Unlock()
		return true, false, nil
	}
	if leasing && e.r == nil && now < e.backoff {
		e.mu.Unlock()
		return false, false, nil
	}
	old, left, next, stale := e.r, e.left, e.next, !e.fits(&q.plans[0])
	if f := e.fetched; f != nil && ctx.Err() == nil {
		// The lease being taken ahead is the plan's of the lease in force:
		// wait for it, then look again, so that it serves the plan if it
		// stays, and goes back with the rest before a new plan decides.
		// Replaced now, the lease would be out of reach of both.
		e.mu.Unlock()
		awaitClosed(ctx, f)
		return false, true, nil
	}
	e.r, e.left, e.next, e.ended = nil, 0, nil, false
	e.mu.Unlock()
	ls.retire(ctx, old, left, next, stale)
	if !leasing {
		return false, false, nil
	}
	if q.pk != "" { // asked of the store: denials under the plan's other parameters are stale
		ls.l.denials.Supersede(q.key, q.pk)
	}
	size := q.plans[0].Lease
	rv := ls.reservation(q, size)
	if err := ls.hold(ctx, rv, q.plans); err != nil {
		return true, false, err
	}
	if !rv.result.Allowed || rv.result.Source != SourceStore {
		// Too few tokens in Redis for a lease, or Redis failing: decide
		// each request as usual until a lease could pass, or for a TTL.
		if rv.result.Allowed {
			ls.giveBack(rv, size)
		}
		wait := rv.result.RetryAfter
		if rv.result.Allowed || wait <= 0 {
			wait = ls.ttl
		}
		e.mu.Lock()
		e.backoff = now + int64(wait)
		e.mu.Unlock()
		return false, false, nil
	}
	return ls.install(e, rv, r, q.cost, w), false, nil
}

// awaitClosed returns once ch is closed or ctx ends.
func awaitClosed(ctx context.Context, ch <-chan struct{}) {
	select {
	case <-ch:
	case <-ctx.Done():
	}
}

// giveBack settles a lease that handed out all but left of its tokens,
// on a goroutine of its own, so that no request waits for it: the unused
// rest goes back to Redis (Limiter.giveBack). A settlement that fails
// until the give-back gives up leaves those tokens taken, which costs
// other instances no more than the lease did; they refill as usual.
func (ls *leases) giveBack(r *Reservation, left int64) {
	ls.l.giveBack(context.Background(), r, r.n-left)
}

// sweeper gives back, every half TTL, the leases that ended with no
// decision to take the next one, and forgets the keys that hold none.
func (ls *leases) sweeper() {
	defer ls.done.Done()
	tick := time.NewTicker(ls.ttl / 2)
	defer tick.Stop()
	for {
		select {
		case <-ls.stop:
			return
		case <-tick.C:
			ls.sweepOnce(ls.l.now(), false)
		}
	}
}

// sweepOnce ends the leases past their end by now, and drops those it
// ended before, giving their rest back, and the keys with no lease and no
// backoff. It passes over a key whose next lease is being taken. Closing,
// it waits for those, and drops every lease.
func (ls *leases) sweepOnce(now int64, closing bool) {
	ls.mu.Lock()
	defer ls.mu.Unlock()
	for k, e := range ls.m {
		if closing {
			e.renew <- struct{}{}
		} else {
			select {
			case e.renew <- struct{}{}:
			default:
				continue
			}
		}
		e.mu.Lock()
		switch {
		case !closing && e.fetched != nil:
			// Its next lease is being taken: dropped now, that lease would
			// come back to no key. A later sweep drops both.
		case !closing && e.r != nil && now >= e.ends && !e.ended:
			// Ended: the next decision takes a new lease; the sweep after
			// gives it back if none comes.
			e.ended = true
		case closing || (e.r == nil && now >= e.backoff) || e.ended:
			e.gone = true
			delete(ls.m, k)
			if e.r != nil {
				ls.giveBack(e.r, e.left)
				e.r = nil
			}
			if e.next != nil {
				ls.giveBack(e.next, e.next.n)
				e.next = nil
			}
		}
		e.mu.Unlock()
		<-e.renew
	}
}

// close gives every lease back and stops the sweeper, then waits for the
// takes under way to finish; Limiter.Close then waits for the give-backs.
// A decision that took its lease before close gives it back here; one
// that comes after goes to Redis as usual.
func (ls *leases) close() {
	ls.mu.Lock()
	if ls.closed {
		ls.mu.Unlock()
		return
	}
	ls.closed = true
	close(ls.stop)
	ls.mu.Unlock()
	ls.sweepOnce(math.MaxInt64, true)
	ls.done.Wait()
}
