// Package tollgate is a distributed rate limiter for Go services: token
// buckets and sliding windows shared through Redis by every instance of a
// service. Each decision is one atomic Lua script call, with Redis TIME as
// the only clock, so instances agree exactly. A MemoryStore serves a
// single instance, and decides for a while when Redis is down.
//
// A Limiter holds named plans: a token bucket (a capacity and a refill
// rate) or a sliding window (a capacity per window). One call may chain
// several plans, for example a burst limit and a daily quota, and then
// consumes from all of them or from none:
//
//	lim, err := tollgate.New(tollgate.NewRedisStore(client), []tollgate.Plan{
//		{Name: "burst", Capacity: 20, Rate: 10},
//		{Name: "daily", Capacity: 10_000, Window: 24 * time.Hour},
//	}, tollgate.WithFailurePolicy(breaker.FailClosed))
//	if err != nil {
//		return err
//	}
//	res, err := lim.Allow(ctx, apiKey, "burst", "daily")
//	if err != nil {
//		return err // bad input, or the store unavailable under FailClosed
//	}
//	if !res.Allowed {
//		// deny; the client may retry after res.RetryAfter
//	}
//
// A cost known only afterwards, such as an LLM answer's tokens, is
// reserved at its most with Reserve and settled with Reservation.Settle,
// which refunds the unused rest or charges the excess as debt.
//
// Being limited is a Result, not an error. Errors mean bad input or,
// under breaker.FailClosed, an unavailable store; the default policy,
// breaker.Fallback, decides on the fallback store meanwhile. The net/http
// middleware is in package httplimit, the gRPC interceptors in module
// grpclimit; Limiter.Stats feeds the metrics adapters.
package tollgate

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"sync/atomic"
	"time"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/denialcache"
	"github.com/tollgate-go/tollgate/internal/isnil"
)

// RateLimiter decides whether a key may proceed. *Limiter implements it;
// service code and the HTTP middleware depend on it, so tests can stub it.
type RateLimiter interface {
	// Allow is AllowN with cost 1.
	Allow(ctx context.Context, key string, plans ...string) (Result, error)
	// AllowN takes cost tokens from the bucket of every named plan for key,
	// or from none of them if any plan lacks the tokens.
	AllowN(ctx context.Context, key string, cost int64, plans ...string) (Result, error)
}

// Limiter applies named plans to keys through a Store, and decides by its
// FailurePolicy while the store fails. It is safe for concurrent use.
type Limiter struct {
	store           Store
	decider         decider      // the store, as it decides a request
	mem             *MemoryStore // the store, if it is one: of this process, it cannot fail
	holds           bool         // the store, and the fallback if any, hold reservations
	fallback        Store        // nil unless the policy is Fallback
	fallbackDecider decider      // the fallback, as it decides a request
	policy          breaker.FailurePolicy
	health          *health // the store's breakers; nil for a store of this process
	denials         *denialcache.Cache[Result]
	log             *slog.Logger
	debug           bool // log every decision: the logger had debug enabled at New
	holdTTL         time.Duration
	permitLease     time.Duration // WithPermitLease
	permitsHeld     bool          // the store, and the fallback if any, hold permits

	table     atomic.Pointer[planTable] // New's plans, or SetPlans's
	resolver  planResolver              // nil: none
	shadowAll bool                      // WithShadow
	others    otherPlans                // AllowPlans's plans not in the table
	fleet     *fleet                    // WithFleet; nil: none
	leases    *leases                   // Plan.Lease's, on a store that can fail; nil on others

	epoch  time.Time // the Limiter's clock, and its denial cache's, counts from here
	stats  counters
	outage outage
	backs  giveBacks  // the give-backs under way, which Close waits for
	resets resetMarks // the Resets of keys, which void the refunds of reservations taken before them
	book   permitBook // the permits granted and not released, which it renews
}

var _ RateLimiter = (*Limiter)(nil)

// New returns a Limiter that keeps the buckets of plans in store. Plans and
// options are checked here (ErrInvalidPlan, ErrInvalidOption), so later
// calls only look plans up by name. A call that names no plan uses
// plans[0].
func New(store Store, plans []Plan, opts ...Option) (*Limiter, error) {
	if isnil.Value(store) {
		return nil, fmt.Errorf("%w: nil store", ErrInvalidOption)
	}
	if err := wiringError(store); err != nil {
		return nil, err
	}
	c := config{log: slog.Default(), holdTTL: defaultHoldTTL, leaseTTL: defaultLeaseTTL, permitTTL: defaultPermitLease}
	if err := applyOptions(&c, takerNew, opts); err != nil {
		return nil, err
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	l := &Limiter{store: store, stats: newCounters(), epoch: time.Now(), resolver: c.resolver, shadowAll: c.shadow,
		policy: c.policy, log: c.log, holdTTL: c.holdTTL, permitLease: c.permitTTL}
	l.book.l, l.book.lease = l, c.permitTTL
	l.debug = l.log.Enabled(context.Background(), slog.LevelDebug)
	l.wire(c)
	if err := l.SetPlans(plans); err != nil {
		return nil, err
	}
	if c.fleet != nil {
		f, err := newFleet(store, *c.fleet)
		if err != nil {
			return nil, err
		}
		l.fleet = f
		go f.run()
	}
	return l, nil
}

// wire sets up, by the capabilities of the stores, what the Limiter puts
// around them: the breakers and the denial cache of a store that can fail,
// the fallback store, and leases.
func (l *Limiter) wire(c config) {
	l.decider = deciderOf(l.store)
	// Held by its type, not as a capability: through an interface the
	// caller's Result would move to the heap on every decision. deciderOf
	// already refused a store of another package that embeds one.
	l.mem, _ = l.decider.(*MemoryStore)
	keys := defaultDenialCacheKeys
	if l.mem != nil {
		keys = 0
	} else {
		l.health = newHealth(l.store, c.breaker, l.epoch)
	}
	if c.denialKeys != nil {
		keys = *c.denialKeys
	}
	if keys > 0 {
		l.denials = denialcache.New[Result](keys, l.epoch)
	}
	if l.policy == breaker.Fallback {
		l.fallback = c.fallback
		if l.fallback == nil {
			l.fallback = NewMemoryStore()
		}
		l.fallbackDecider = deciderOf(l.fallback)
	}
	l.holds = canHold(l.store) && (l.fallback == nil || canHold(l.fallback))
	l.permitsHeld = canPermit(l.store) && (l.fallback == nil || canPermit(l.fallback))
	if l.mem == nil && l.holds {
		l.leases = newLeases(l, c.leaseTTL)
	}
}

// now reads the Limiter's monotonic clock, in nanoseconds since New; the
// denial cache's reads the same.
func (l *Limiter) now() int64 { return int64(time.Since(l.epoch)) }

// Plan returns the plan named name in the current table (New, SetPlans),
// and whether there is one; shadowed if WithShadow is set.
func (l *Limiter) Plan(name string) (Plan, bool) {
	e, ok := l.table.Load().byName[name]
	if !ok {
		return Plan{}, false
	}
	return e.one[0], true
}

// DefaultPlan returns the plan that a call naming no plan uses: the first
// plan given to New, or to the latest SetPlans; shadowed if WithShadow is
// set. It is a concurrency plan for ever, or never: SetPlans keeps its
// kind.
func (l *Limiter) DefaultPlan() Plan {
	return l.table.Load().defaults.one[0]
}

// Allow is AllowN with cost 1.
func (l *Limiter) Allow(ctx context.Context, key string, plans ...string) (r Result, err error) {
	q := request{op: op{key: key, n: 1}}
	err = l.named(ctx, &r, &q, plans)
	return // a bare return keeps it small enough to be inlined, and the Result is not copied
}

// AllowN takes cost tokens, at least 1, from the bucket of every named plan
// for key, or from none of them if any plan lacks the tokens; with no plan
// named, from the first plan given to New. Being denied is a Result with
// Allowed false, not an error.
//
// Errors: ErrInvalidKey, ErrUnknownPlan, ErrInvalidCost (below 1, or above
// an enforced plan's capacity; a shadowed plan below the cost would deny),
// the caller's own context error, ErrResolver and ErrInvalidPlan from a
// plan resolver (WithPlanResolver), and, under FailClosed only,
// ErrStoreUnavailable.
func (l *Limiter) AllowN(ctx context.Context, key string, cost int64, plans ...string) (r Result, err error) {
	q := request{op: op{key: key, n: cost}}
	err = l.named(ctx, &r, &q, plans)
	return // a bare return keeps it small enough to be inlined, and the Result is not copied
}

// Peek reports the buckets of key without taking a token: Allowed says
// whether one token would be taken now, RetryAfter is the exact wait until
// it would, and Remaining and ResetAfter describe the buckets.
func (l *Limiter) Peek(ctx context.Context, key string, plans ...string) (r Result, err error) {
	return l.PeekN(ctx, key, 1, plans...)
}

// PeekN reports whether n tokens would be taken now from the bucket of
// every named plan for key, without taking them: Allowed says whether
// they would, RetryAfter is the exact wait until they would, and
// Remaining and ResetAfter describe the buckets. n must be at least 1 and
// no more than every enforced plan's capacity (ErrInvalidCost). Peek is
// PeekN of 1. For n above 1, a store other than a MemoryStore or
// RedisStore, or such a fallback store, gets errors.ErrUnsupported: the
// Store interface reads for one token.
func (l *Limiter) PeekN(ctx context.Context, key string, n int64, plans ...string) (r Result, err error) {
	if n > 1 && (!canRead(l.store) || l.fallback != nil && !canRead(l.fallback)) {
		return Result{}, errUnsupported(modeRead)
	}
	q := request{op: op{key: key, n: n, mode: modeRead}}
	err = l.named(ctx, &r, &q, plans)
	return r, err
}

// Reset makes the buckets of key for the named plans full again, in the
// store and in the fallback store, and forgets the key's remembered
// denials and leases (Plan.Lease), whose rest it does not give back: the
// bucket is full without it. For the same reason the reservations of key
// taken before it are refunded nothing when they settle, and it waits for
// the settlements of key under way (and of the few keys that share a lock
// with it) to reach the store. On a RedisStore or a MemoryStore this
// holds for the reservations and leases of every Limiter that shares the
// store: the store marks the key as reset, for the Limiter's hold TTL or
// 15 minutes, whichever is longer. With no plan
// named, it resets every plan of the Limiter but its concurrency plans,
// whose permits are their holders' until released: naming one is
// ErrInvalidPlan. A Reset that fails forgets the key's remembered denials
// too, since the store may have reset the key though its reply was lost.
// Other instances' denial caches see the Reset once the RetryAfter they
// remember has passed, and their leases serve their rest until they end.
func (l *Limiter) Reset(ctx context.Context, key string, names ...string) error {
	if err := checkKey(key); err != nil {
		return err
	}
	t := l.table.Load()
	plans := t.plans
	if len(names) > 0 {
		var err error
		if plans, _, err = t.resolve(names); err != nil {
			return err
		}
		if permitsIn(plans) {
			return fmt.Errorf("%w: %w", ErrInvalidPlan, errNoPermitPlan)
		}
	} else if permitsIn(plans) {
		plans = slices.DeleteFunc(slices.Clone(plans), func(p Plan) bool { return p.Concurrency })
	}
	err := l.resetStores(ctx, key, plans)
	// A Reset that failed may have reset the store all the same (its reply
	// lost): the key's denials go either way.
	if l.denials != nil {
		l.denials.Forget(key) // also refuses denials asked before the Reset
	}
	if err != nil {
		return err
	}
	// Past the order lock, which a lease's take may wait for while it holds
	// the lease that drop, or Close's sweep, waits for. A settlement from
	// now on finds the Reset counted, and refunds nothing.
	if l.leases != nil {
		l.leases.drop(key, plans)
	}
	return nil
}

// Wait takes cost tokens like AllowN, waiting as long as it takes for them.
// It returns at once, with ErrWaitExceedsDeadline and the denied Result, if
// ctx's deadline would pass first; it returns ctx's error if ctx ends while
// waiting. Other clients may take the tokens first; Wait then waits again.
func (l *Limiter) Wait(ctx context.Context, key string, cost int64, plans ...string) (Result, error) {
	for {
		r, err := l.AllowN(ctx, key, cost, plans...)
		if err != nil || r.Allowed {
			return r, err
		}
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) < r.RetryAfter {
			return r, ErrWaitExceedsDeadline
		}
		t := time.NewTimer(r.RetryAfter)
		select {
		case <-ctx.Done():
			t.Stop()
			return r, ctx.Err()
		case <-t.C:
		}
	}
}

// AllowPlans takes cost tokens, at least 1, from the bucket of every plan
// given for key, or from none of them if any plan lacks the tokens: it is
// AllowN for a caller that holds its plans, such as the plan of the key's
// customer tier. A plan's Name names its bucket, whether or not the
// Limiter's table has a plan of that name: plans of one name with other
// parameters share the bucket (see WithPlanResolver). The resolver is not
// asked; WithShadow applies.
//
// Plans are checked as New checks them, on every call (ErrInvalidPlan);
// the Limiter keeps up to 16 distinct plans per name, checked once, so
// that repeating them costs no allocation. Stats counts their decisions
// by name; names outside the table come after the table's plans.
//
// Errors are AllowN's, and ErrUnknownPlan when no plan is given.
func (l *Limiter) AllowPlans(ctx context.Context, key string, cost int64, plans ...Plan) (r Result, err error) {
	if len(plans) == 0 {
		return r, fmt.Errorf("%w: no plan given", ErrUnknownPlan)
	}
	t := l.table.Load()
	// The plans decided on are the Limiter's copies, never the caller's
	// slice: it stays on the caller's stack.
	var use []Plan
	var entry *planEntry
	if len(plans) == 1 {
		if entry, err = l.entryFor(t, plans[0]); err != nil {
			return r, err
		}
		use = entry.one
	} else {
		use = make([]Plan, len(plans))
		for i, p := range plans {
			e, err := l.entryFor(t, p)
			if err != nil {
				return r, err
			}
			for _, q := range use[:i] {
				if q.Name == p.Name {
					return r, fmt.Errorf("%w: plan %q is given twice in one call", ErrInvalidPlan, p.Name)
				}
			}
			use[i] = e.one[0]
		}
	}
	q := request{op: op{key: key, n: cost, plans: use}, table: t, entry: entry, given: true}
	err = l.decide(ctx, &r, &q)
	return r, err
}

// Close stops what the Limiter runs in the background: the heartbeat of
// WithFleet, the sweeper of leases (Plan.Lease), whose unused tokens it
// gives back to Redis, and the renewals of permits (Acquire), whose
// permits still held it releases, within 2 s in all: their Release then
// returns ErrNotHeld. It then waits for the lease takes and Reserve calls
// under way, and for every give-back under way (a lease's rest, a hold
// whose caller left or whose reply was lost, an acquire whose reply was
// lost), each tried for at most 5 s from its start. A take ends within the
// lease TTL and a second, a Reserve within 2 s or its caller's deadline if
// later: with Redis down, Close returns within the longest of those and
// 5 s more. The Limiter still decides after Close, without leases, its
// fallback with the fleet's size last seen; a permit acquired after Close
// is renewed until the next Close. Close is idempotent, safe to call
// concurrently, and returns nil; a Limiter without WithFleet, leased plans
// or permits held needs no Close, and gives back what it holds all the
// same.
func (l *Limiter) Close() error {
	if l.fleet != nil {
		l.fleet.close()
	}
	if l.leases != nil {
		l.leases.close()
	}
	l.book.close()
	l.backs.wait()
	return nil
}
