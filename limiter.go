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
// Being limited is a Result, not an error. Errors mean bad input or, under
// FailClosed, an unavailable store.
package tollgate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
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

// FailurePolicy says how a Limiter decides while its store fails.
type FailurePolicy int

const (
	// Fallback lets a local fallback store decide (Source SourceFallback):
	// each instance then enforces the plans on its own, so the whole fleet
	// may admit up to one plan's worth per instance. It is the default.
	Fallback FailurePolicy = iota
	// FailOpen allows every request (Source SourceFailOpen).
	FailOpen
	// FailClosed returns ErrStoreUnavailable.
	FailClosed
)

// String returns "fallback", "fail-open" or "fail-closed".
func (p FailurePolicy) String() string {
	switch p {
	case Fallback:
		return "fallback"
	case FailOpen:
		return "fail-open"
	case FailClosed:
		return "fail-closed"
	}
	return "unknown"
}

// Option configures a Limiter.
type Option func(*config)

// config collects the options of New.
type config struct {
	policy     FailurePolicy
	fallback   Store
	breaker    BreakerSettings
	log        *slog.Logger
	obs        Observer
	denialKeys *int // nil: the default
}

// WithFailurePolicy sets what a Limiter does while its store fails. The
// default is Fallback.
func WithFailurePolicy(p FailurePolicy) Option {
	return func(c *config) { c.policy = p }
}

// WithFallback sets the store that decides under the Fallback policy. The
// default is a NewMemoryStore().
func WithFallback(s Store) Option {
	return func(c *config) { c.fallback = s }
}

// WithBreaker configures the circuit breaker in front of the store. The
// default is BreakerSettings{}: 3 failures, 500ms cooldown.
func WithBreaker(s BreakerSettings) Option {
	return func(c *config) { c.breaker = s }
}

// WithLogger sets where a Limiter reports outages: one warning when the
// store starts failing, one info line with the duration when it recovers.
// If the logger has the debug level enabled when New runs, every decision
// is also logged at debug level (plan, outcome, source; never the key).
// nil discards everything. The default is slog.Default().
func WithLogger(log *slog.Logger) Option {
	return func(c *config) {
		if log == nil {
			log = slog.New(slog.DiscardHandler)
		}
		c.log = log
	}
}

// WithDenialCache bounds the keys whose denials the Limiter remembers, and
// 0 turns the cache off. A remembered denial answers the same request (key,
// plans and cost) without the store until the RetryAfter the store gave has
// passed; before then the store would deny it too, so the cache never
// admits and never denies what the store would admit, except after a Reset
// by another instance, which is seen once that RetryAfter has passed. A key
// under attack then costs the store about one call per refill, not one per
// request. The default is DefaultDenialCacheKeys, or 0 when the store is a
// MemoryStore, which is as fast as the cache.
func WithDenialCache(keys int) Option {
	return func(c *config) { c.denialKeys = &keys }
}

// WithObserver sets an Observer of the Limiter's decisions, store calls,
// outages and breaker. The default is none, which costs nothing.
func WithObserver(o Observer) Option {
	return func(c *config) { c.obs = o }
}

// Limiter applies named plans to keys through a Store, and decides by its
// FailurePolicy while the store fails. It is safe for concurrent use.
type Limiter struct {
	store    Store
	fallback Store

	// taker and fallbackTaker skip the stores' own checks where they can:
	// the Limiter has made them.
	taker, fallbackTaker checkedTaker

	// local is the store when it is a MemoryStore and neither an Observer
	// nor the denial cache wants to hear of its calls: it never fails, so
	// its decisions skip the breaker and the failure policy.
	local *MemoryStore

	policy  FailurePolicy
	breaker *breaker
	log     *slog.Logger
	denials *denialCache // nil when off
	debug   bool         // log every decision: the logger had debug enabled at New
	obs     Observer

	// byName maps a plan name to a one-element slice, so a decision on one
	// plan builds no slice.
	byName   map[string][]Plan
	defaults []Plan

	outageStart atomic.Int64 // UnixNano when the current outage began; 0 when none
	outageMu    sync.Mutex   // orders outage changes with their reports
}

var _ RateLimiter = (*Limiter)(nil)

// New returns a Limiter that keeps the buckets of plans in store. Plans are
// checked here (ErrInvalidPlan), so later calls only look them up by name.
// A call that names no plan uses plans[0].
func New(store Store, plans []Plan, opts ...Option) (*Limiter, error) {
	if store == nil {
		return nil, fmt.Errorf("%w: nil store", ErrInvalidOption)
	}
	if len(plans) == 0 {
		return nil, fmt.Errorf("%w: no plans", ErrInvalidPlan)
	}
	l := &Limiter{store: store, byName: make(map[string][]Plan, len(plans))}
	for _, p := range plans {
		if err := p.validate(); err != nil {
			return nil, err
		}
		if _, dup := l.byName[p.Name]; dup {
			return nil, fmt.Errorf("%w: name %q appears twice", ErrInvalidPlan, p.Name)
		}
		l.byName[p.Name] = []Plan{p}
	}
	l.defaults = l.byName[plans[0].Name]

	c := config{log: slog.Default()}
	for _, o := range opts {
		o(&c)
	}
	if c.policy < Fallback || c.policy > FailClosed {
		return nil, fmt.Errorf("%w: unknown failure policy %d", ErrInvalidOption, c.policy)
	}
	l.policy, l.log, l.obs = c.policy, c.log, c.obs
	l.debug = l.log.Enabled(context.Background(), slog.LevelDebug)
	l.breaker = newBreaker(c.breaker)
	if l.obs != nil {
		l.breaker.onChange = l.obs.ObserveBreaker
	}
	keys := DefaultDenialCacheKeys
	if _, local := store.(*MemoryStore); local {
		keys = 0
	}
	if c.denialKeys != nil {
		keys = *c.denialKeys
	}
	if keys > 0 {
		l.denials = newDenialCache(keys)
	}
	l.fallback = c.fallback
	if l.policy == Fallback && l.fallback == nil {
		l.fallback = NewMemoryStore()
	}
	l.taker = takerOf(store)
	if m, ok := store.(*MemoryStore); ok && l.obs == nil && l.denials == nil {
		l.local = m
	}
	if l.fallback != nil {
		l.fallbackTaker = takerOf(l.fallback)
	}
	return l, nil
}

// Plan returns the plan named name, and whether there is one.
func (l *Limiter) Plan(name string) (Plan, bool) {
	p, ok := l.byName[name]
	if !ok {
		return Plan{}, false
	}
	return p[0], true
}

// resolve maps plan names to plans; no names mean the default plan.
func (l *Limiter) resolve(names []string) ([]Plan, error) {
	switch len(names) {
	case 0:
		return l.defaults, nil
	case 1:
		if p, ok := l.byName[names[0]]; ok {
			return p, nil
		}
		return nil, fmt.Errorf("%w: %q", ErrUnknownPlan, names[0])
	}
	plans := make([]Plan, len(names))
	for i, name := range names {
		p, ok := l.byName[name]
		if !ok {
			return nil, fmt.Errorf("%w: %q", ErrUnknownPlan, name)
		}
		for _, q := range plans[:i] {
			if q.Name == name {
				return nil, fmt.Errorf("%w: %q named twice", ErrUnknownPlan, name)
			}
		}
		plans[i] = p[0]
	}
	return plans, nil
}

// Allow is AllowN with cost 1.
func (l *Limiter) Allow(ctx context.Context, key string, plans ...string) (Result, error) {
	return l.decide(ctx, key, 1, 1, plans)
}

// AllowN takes cost tokens, at least 1, from the bucket of every named plan
// for key, or from none of them if any plan lacks the tokens; with no plan
// named, from the first plan given to New. Being denied is a Result with
// Allowed false, not an error.
//
// Errors: ErrInvalidKey, ErrUnknownPlan, ErrInvalidCost (below 1, or above
// a plan's capacity), the caller's own context error, and, under
// FailClosed only, ErrStoreUnavailable.
func (l *Limiter) AllowN(ctx context.Context, key string, cost int64, plans ...string) (Result, error) {
	return l.decide(ctx, key, cost, 1, plans)
}

// Peek reports the buckets of key without taking a token. Its Result is
// always Allowed; Remaining and ResetAfter describe the buckets.
func (l *Limiter) Peek(ctx context.Context, key string, plans ...string) (Result, error) {
	return l.decide(ctx, key, 0, 0, plans)
}

// decide is small enough to inline into Allow, AllowN and Peek, so that
// the Result is built where they return it instead of being copied there.
func (l *Limiter) decide(ctx context.Context, key string, cost, minCost int64, names []string) (r Result, err error) {
	err = l.decideInto(ctx, &r, key, cost, minCost, names)
	return r, err
}

// decideInto makes the decision into *r and reports it.
func (l *Limiter) decideInto(ctx context.Context, r *Result, key string, cost, minCost int64, names []string) error {
	err := l.makeDecision(ctx, r, key, cost, minCost, names)
	if err == nil && (l.obs != nil || l.debug) {
		l.report(ctx, r, cost)
	}
	return err
}

// report tells the Observer and the debug log of a decision.
func (l *Limiter) report(ctx context.Context, r *Result, cost int64) {
	if l.obs != nil {
		l.obs.ObserveDecision(Decision{Plan: r.Plan, Allowed: r.Allowed, Source: r.Source, Cost: cost})
	}
	if l.debug {
		l.log.LogAttrs(ctx, slog.LevelDebug, "tollgate: decision", slog.String("plan", r.Plan),
			slog.Bool("allowed", r.Allowed), slog.Int64("remaining", r.Remaining),
			slog.Duration("retry_after", r.RetryAfter), slog.String("source", r.Source.String()))
	}
}

// makeDecision makes the decision into *r.
func (l *Limiter) makeDecision(ctx context.Context, r *Result, key string, cost, minCost int64, names []string) (err error) {
	plans := l.defaults
	if len(names) > 0 {
		if plans, err = l.resolve(names); err != nil {
			return err
		}
	}
	if err := checkKey(key); err != nil {
		return err
	}
	if err := checkCost(cost, minCost, plans); err != nil {
		return err
	}
	if l.local != nil {
		l.local.takeInto(r, key, cost, plans)
		return nil
	}
	var pk string   // the denial cache's name for plans
	var asked int64 // when the store was asked, on the denial cache's clock
	if l.denials != nil && cost > 0 {
		pk = planKey(names)
		// Read before the lookup, asked is earlier than the store call
		// by more than it has to be, which only ends a denial sooner.
		asked = l.denials.now()
		if res, ok := l.denials.getAt(key, pk, cost, asked); ok {
			*r = res
			return nil
		}
	}
	ok, probe := l.breaker.allow()
	if !ok {
		return l.degraded(ctx, r, key, cost, plans, errBreakerOpen)
	}
	if probe {
		// A probe that ends in a panic (the store's, or an Observer's)
		// must not hold the breaker half-open for ever.
		defer func() {
			if p := recover(); p != nil {
				l.breaker.abandon()
				panic(p)
			}
		}()
	}
	err = l.callStore(ctx, r, key, cost, plans)
	switch {
	case err == nil:
		l.breaker.success()
		l.recovered()
		if l.denials != nil && cost > 0 && !r.Allowed && r.RetryAfter > 0 {
			l.denials.put(key, pk, cost, *r, asked)
		}
		return nil
	case isCallerError(err):
		if probe {
			l.breaker.abandon()
		}
		return err
	case ctx.Err() != nil:
		// The caller gave up; that says nothing about the store.
		if probe {
			l.breaker.abandon()
		}
		*r = Result{}
		if !errors.Is(err, ctx.Err()) {
			err = ctx.Err()
		}
		return err
	}
	l.breaker.failure()
	l.failing(err)
	return l.degraded(ctx, r, key, cost, plans, err)
}

// callStore calls the store, timing the call when an Observer wants it.
func (l *Limiter) callStore(ctx context.Context, r *Result, key string, cost int64, plans []Plan) error {
	if l.obs == nil {
		return takeInto(ctx, r, l.taker, key, cost, plans)
	}
	start := l.breaker.now() // monotonic only: time.Now reads the wall clock too
	err := takeInto(ctx, r, l.taker, key, cost, plans)
	failure := err
	if err != nil && (isCallerError(err) || ctx.Err() != nil) {
		failure = nil
	}
	l.obs.ObserveStore(time.Duration(l.breaker.now()-start), failure)
	return err
}

var errBreakerOpen = errors.New("circuit breaker open")

// degraded decides by the failure policy, without the store, into *r.
func (l *Limiter) degraded(ctx context.Context, r *Result, key string, cost int64, plans []Plan, cause error) error {
	switch l.policy {
	case FailOpen:
		*r = failOpenResult(plans)
		return nil
	case FailClosed:
		*r = Result{}
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, cause)
	}
	if err := takeInto(ctx, r, l.fallbackTaker, key, cost, plans); err != nil {
		*r = Result{}
		return fmt.Errorf("%w: fallback store failed too: %w", ErrStoreUnavailable, err)
	}
	r.Source = SourceFallback
	return nil
}

// failing logs and reports the start of an outage, once.
func (l *Limiter) failing(err error) {
	if l.outageStart.Load() != 0 {
		return
	}
	if l.reportOutage(func() bool { return l.outageStart.CompareAndSwap(0, time.Now().UnixNano()) }, true) {
		l.log.Warn("tollgate: store failing; deciding by failure policy until it recovers",
			"policy", l.policy.String(), "error", err)
	}
}

// recovered logs and reports the end of an outage, once.
func (l *Limiter) recovered() {
	if l.outageStart.Load() == 0 {
		return
	}
	var start int64
	if l.reportOutage(func() bool { start = l.outageStart.Swap(0); return start != 0 }, false) {
		l.log.Info("tollgate: store recovered", "outage", time.Duration(time.Now().UnixNano()-start))
	}
}

// reportOutage makes an outage change and reports it to the Observer under
// one lock, so reports arrive in the order of the changes, and reports
// whether change changed anything.
func (l *Limiter) reportOutage(change func() bool, active bool) bool {
	l.outageMu.Lock()
	defer l.outageMu.Unlock()
	changed := change()
	if changed && l.obs != nil {
		l.obs.ObserveFallback(active)
	}
	return changed
}

// Reset makes the buckets of key for the named plans full again, in the
// store and in the fallback store. With no plan named, it resets every plan
// of the Limiter.
func (l *Limiter) Reset(ctx context.Context, key string, plans ...string) error {
	if err := checkKey(key); err != nil {
		return err
	}
	ps, err := l.resolve(plans)
	if err != nil {
		return err
	}
	if len(plans) == 0 {
		ps = make([]Plan, 0, len(l.byName))
		for _, p := range l.byName {
			ps = append(ps, p[0])
		}
	}
	if l.fallback != nil {
		if err := l.fallback.Reset(ctx, key, ps); err != nil {
			return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
		}
	}
	if err := l.store.Reset(ctx, key, ps); err != nil {
		if isCallerError(err) || ctx.Err() != nil {
			return err
		}
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
	}
	if l.denials != nil {
		l.denials.forget(key) // also refuses denials asked before the Reset
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
