// Package tollgate is a distributed token-bucket rate limiter for Go services
// that run as many instances. Every instance shares one bucket per key and
// plan, kept in Redis and updated by one atomic Lua script per decision, with
// Redis TIME as the only clock. A local MemoryStore serves single instances
// and decides for a while when Redis is down.
//
// A Limiter holds named plans (a capacity and a refill rate). One call may
// chain several plans, for example a burst limit and a daily quota, and then
// consumes from all of them or from none:
//
//	lim, err := tollgate.New(tollgate.NewRedisStore(client), []tollgate.Plan{
//		{Name: "gold", Capacity: 20, Rate: 10},
//		{Name: "daily", Capacity: 10_000, Rate: tollgate.Per(10_000, 24*time.Hour)},
//	})
//	res, err := lim.Allow(ctx, apiKey, "gold", "daily")
//	if err == nil && !res.Allowed {
//		// deny; retry after res.RetryAfter
//	}
//
// A cost known only afterwards, such as an LLM answer's tokens, is
// reserved at its most with Reserve and settled with Reservation.Settle,
// which refunds the unused rest or charges the excess as debt.
//
// Being limited is a Result, not an error. Errors mean bad input or, under
// FailClosed, an unavailable store. The net/http middleware is in package
// httplimit; Limiter.Stats feeds the metrics adapters.
package tollgate

import (
	"context"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

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
	store    Store
	fallback Store // nil unless the policy is Fallback
	policy   FailurePolicy
	mem      *MemoryStore // the store, when it is a MemoryStore
	health   *health      // the store's breakers; nil when the store is a MemoryStore
	denials  *denialcache.Cache[Result]
	log      *slog.Logger
	debug    bool // log every decision: the logger had debug enabled at New
	holdTTL  time.Duration

	table     atomic.Pointer[planTable] // New's plans, or SetPlans's
	resolver  PlanResolver              // nil: none
	shadowAll bool                      // WithShadow
	others    otherPlans                // AllowPlans's plans not in the table
	fleet     *fleet                    // WithFleet; nil: none
	leases    *leases                   // Plan.Lease's, on a RedisStore; nil on other stores

	epoch       time.Time // the Limiter's clock, and its denial cache's, counts from here
	stats       counters
	outage      outage
	lastSuccess atomic.Int64 // the last store call that succeeded, on the Limiter's clock
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
	l := &Limiter{store: store, stats: newCounters(), epoch: time.Now()}
	c := config{log: slog.Default(), holdTTL: defaultHoldTTL, leaseTTL: defaultLeaseTTL}
	for _, o := range opts {
		o(&c)
	}
	l.resolver, l.shadowAll = c.resolver, c.shadow
	if err := l.SetPlans(plans); err != nil {
		return nil, err
	}
	if !c.breaker.Valid() {
		return nil, fmt.Errorf("%w: breaker settings out of range", ErrInvalidOption)
	}
	if c.policy < Fallback || c.policy > FailClosed {
		return nil, fmt.Errorf("%w: unknown failure policy %d", ErrInvalidOption, c.policy)
	}
	if c.holdTTL < time.Millisecond || c.holdTTL > MaxRefillPeriod {
		return nil, fmt.Errorf("%w: hold TTL %v is outside 1ms to MaxRefillPeriod", ErrInvalidOption, c.holdTTL)
	}
	if c.leaseTTL < time.Millisecond || c.leaseTTL > maxLeaseTTL {
		return nil, fmt.Errorf("%w: lease TTL %v is outside 1ms to 1m", ErrInvalidOption, c.leaseTTL)
	}
	if err := wiringError(c.fallback); err != nil {
		return nil, fmt.Errorf("fallback store: %w", err)
	}
	l.policy, l.log, l.holdTTL = c.policy, c.log, c.holdTTL
	l.debug = l.log.Enabled(context.Background(), slog.LevelDebug)
	keys := defaultDenialCacheKeys
	if m, ok := store.(*MemoryStore); ok {
		l.mem, keys = m, 0
	} else {
		l.health = newHealth(store, c.breaker)
	}
	if c.denialKeys != nil {
		keys = *c.denialKeys
	}
	if keys > 0 {
		l.denials = denialcache.New[Result](keys, l.epoch)
	}
	if l.policy == Fallback {
		l.fallback = c.fallback
		if l.fallback == nil {
			l.fallback = NewMemoryStore()
		}
	}
	if _, ok := store.(*RedisStore); ok && canHold(store, l.fallback) {
		l.leases = newLeases(l, c.leaseTTL)
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

// wiringError returns the mistake a store was built with, which it would
// otherwise report on every call: a RedisStore with a nil client or a
// braced key prefix; or a typed nil store. A nil s is none: no mistake.
func wiringError(s Store) error {
	if s != nil && isnil.Value(s) {
		return fmt.Errorf("%w: nil store", ErrInvalidOption)
	}
	if rs, ok := s.(*RedisStore); ok {
		return rs.err
	}
	return nil
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

// Allow is AllowN with cost 1.
func (l *Limiter) Allow(ctx context.Context, key string, plans ...string) (r Result, err error) {
	err = l.decide(ctx, &r, key, 1, 1, plans, nil)
	return r, err
}

// AllowN takes cost tokens, at least 1, from the bucket of every named plan
// for key, or from none of them if any plan lacks the tokens; with no plan
// named, from the first plan given to New. Being denied is a Result with
// Allowed false, not an error.
//
// Errors: ErrInvalidKey, ErrUnknownPlan, ErrInvalidCost (below 1, or above
// a plan's capacity), the caller's own context error, ErrResolver and
// ErrInvalidPlan from a PlanResolver (WithPlanResolver), and, under
// FailClosed only, ErrStoreUnavailable.
func (l *Limiter) AllowN(ctx context.Context, key string, cost int64, plans ...string) (r Result, err error) {
	err = l.decide(ctx, &r, key, cost, 1, plans, nil)
	return r, err
}

// Peek reports the buckets of key without taking a token: Allowed says
// whether one token would be taken now, RetryAfter is the exact wait until
// it would, and Remaining and ResetAfter describe the buckets.
func (l *Limiter) Peek(ctx context.Context, key string, plans ...string) (r Result, err error) {
	err = l.decide(ctx, &r, key, 0, 0, plans, nil)
	return r, err
}

// Reset makes the buckets of key for the named plans full again, in the
// store and in the fallback store, and forgets the key's remembered
// denials. With no plan named, it resets every plan of the Limiter. Other
// instances' denial caches see the Reset once the RetryAfter they
// remember has passed.
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
	}
	if l.fallback != nil {
		if err := l.fallback.Reset(ctx, key, plans); err != nil {
			return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
		}
	}
	if err := l.store.Reset(ctx, key, plans); err != nil {
		if isCallerError(err) || ctx.Err() != nil {
			return err
		}
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
	}
	if l.denials != nil {
		l.denials.Forget(key) // also refuses denials asked before the Reset
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
