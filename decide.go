package tollgate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// decide makes one decision into *r. It is a pipeline of steps, each
// readable alone: look the plans up, validate the request, resolve the
// plans for the key (WithPlanResolver), answer a remembered denial from
// the cache, ask the store behind its breaker and failure policy (a
// MemoryStore, which cannot fail, directly), and record the decision.
// Allow, AllowN and Peek pass the Result they return, so it is built in
// place rather than copied up the steps. h is nil but for Reserve, whose
// hold the store that grants it fills in.
func (l *Limiter) decide(ctx context.Context, r *Result, key string, cost, minCost int64, names []string, h *hold) error {
	t := l.table.Load()
	plans, entry := t.defaults.one, t.defaults
	if len(names) > 0 {
		var err error
		if plans, entry, err = t.resolve(names); err != nil {
			return err
		}
	}
	if err := checkKey(key); err != nil {
		return err
	}
	if l.resolver != nil {
		var err error
		if plans, entry, err = l.resolveFor(ctx, t, key, plans, entry); err != nil {
			if errors.Is(err, ErrExempt) {
				*r = exemptResult(plans)
				return nil
			}
			return err
		}
	}
	return l.decideOn(ctx, r, t, key, cost, minCost, plans, entry, h, false)
}

// decideOn makes one decision on plans, resolved, into *r. entry is the
// plan's when there is one plan, and nil for a chain; h is decide's.
// given says that the caller gave the plans (AllowPlans): a lease taken
// for them is settled with them, not with the plans in force of their
// names (plansInForce).
func (l *Limiter) decideOn(ctx context.Context, r *Result, t *planTable, key string, cost, minCost int64, plans []Plan, entry *planEntry, h *hold, given bool) error {
	if err := checkCost(cost, minCost, plans); err != nil {
		return err
	}
	if len(plans) > maxShadowIndex {
		if err := checkShadow(plans); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	if h != nil {
		if err := h.accept(plans); err != nil {
			return err
		}
	} else if l.leases != nil && len(plans) == 1 && plans[0].Lease >= cost && cost > 0 {
		if decided, err := l.leases.decide(ctx, r, t, key, cost, plans, entry, given); decided || err != nil {
			if err == nil {
				l.record(ctx, r, cost, entry, t)
			}
			return err
		}
	}
	// Suppressed plans write on every request, so a remembered denial
	// would not be the store's answer.
	cache := l.denials != nil && cost > 0 && !suppressedIn(plans)
	var pk string   // the denial cache's name for plans
	var asked int64 // when the store was asked, on the Limiter's clock, which the cache shares
	if l.denials != nil {
		pk, asked = planKey(plans, entry), l.now()
		if l.cached(r, key, pk, cost, asked, cache) {
			if h == nil || !h.lease {
				l.record(ctx, r, cost, entry, t)
			}
			return nil
		}
	}
	if l.mem != nil { // a MemoryStore cannot fail: no breaker, no policy
		if h != nil {
			l.mem.holdInto(r, key, cost, plans, h)
		} else {
			l.mem.takeInto(r, key, cost, plans)
		}
	} else {
		if l.denials == nil {
			asked = l.now()
		}
		if err := l.ask(ctx, r, key, cost, plans, asked, h); err != nil {
			return err
		}
	}
	if cache {
		l.remember(key, pk, cost, r, asked)
	}
	if h == nil || !h.lease {
		l.record(ctx, r, cost, entry, t)
	}
	return nil
}

// resolve maps plan names to the table's plans, and returns the entry of a
// single plan.
func (t *planTable) resolve(names []string) ([]Plan, *planEntry, error) {
	if len(names) == 1 {
		if e, ok := t.byName[names[0]]; ok {
			return e.one, e, nil
		}
		return nil, nil, fmt.Errorf("%w: %q", ErrUnknownPlan, names[0])
	}
	plans := make([]Plan, len(names))
	for i, name := range names {
		e, ok := t.byName[name]
		if !ok {
			return nil, nil, fmt.Errorf("%w: %q", ErrUnknownPlan, name)
		}
		for _, q := range plans[:i] {
			if q.Name == name {
				return nil, nil, fmt.Errorf("%w: plan %q is named twice in one call", ErrInvalidPlan, name)
			}
		}
		plans[i] = e.one[0]
	}
	return plans, nil, nil
}

// planKey names the plans of a request for the denial cache by their
// fingerprints, so that a remembered denial answers only for the same
// parameters: a raised limit (a resolver's tier upgrade, SetPlans) is
// asked of the store at once, and a request under a plan's other
// parameters forgets the key's denials under the old ones, which a round
// trip back would find stale. One plan, the common case, costs nothing.
func planKey(plans []Plan, entry *planEntry) string {
	if entry != nil {
		return entry.fp
	}
	fps := make([]string, len(plans))
	for i, p := range plans {
		fps[i] = fingerprint(p)
	}
	return strings.Join(fps, ",") // a comma is in no fingerprint
}

// cached answers the request from a remembered denial, as of now, and
// reports whether there was one. A request that no denial may answer
// (may is false) is not looked up: the cache only forgets the key's
// denials under other parameters of its plans, which the store's answer
// supersedes.
func (l *Limiter) cached(r *Result, key, pk string, cost, now int64, may bool) bool {
	if !may {
		l.denials.Supersede(key, pk)
		return false
	}
	at, until, ok := l.denials.Get(key, pk, cost, now, r)
	if !ok {
		return false
	}
	elapsed := time.Duration(now - at)
	r.Source = SourceCache
	r.RetryAfter = time.Duration(until - now)
	r.ResetAfter = max(0, r.ResetAfter-elapsed)
	if r.chain != nil {
		chain := make([]PlanResult, len(r.chain)) // the caller owns its Result
		for i, pr := range r.chain {
			pr.RetryAfter = max(0, pr.RetryAfter-elapsed)
			pr.ResetAfter = max(0, pr.ResetAfter-elapsed)
			chain[i] = pr
		}
		r.chain = chain
	}
	return true
}

// remember keeps a denial the store gave to a request sent at asked. The
// store read its clock after asked, so counting RetryAfter from asked ends
// the denial no later than the store would: the round trip must not delay
// admissions.
func (l *Limiter) remember(key, pk string, cost int64, r *Result, asked int64) {
	if r.Allowed || r.Source != SourceStore || r.RetryAfter <= 0 {
		return
	}
	res := *r
	if res.chain != nil {
		res.chain = append([]PlanResult(nil), res.chain...) // the caller owns its Result
	}
	l.denials.Put(key, pk, cost, res, asked, asked+int64(r.RetryAfter))
}

// errBreakerOpen is the cause of ErrStoreUnavailable while the breaker
// keeps calls from the store.
var errBreakerOpen = errors.New("circuit breaker open")

// ask has a store that can fail decide, behind the breaker. While the
// store fails, the failure policy decides instead.
// start is when the decision asked, on the Limiter's clock: the store
// call is timed from it.
func (l *Limiter) ask(ctx context.Context, r *Result, key string, cost int64, plans []Plan, start int64, h *hold) error {
	b := l.health.forKey(ctx, key, plans)
	ok, probe := b.Allow()
	if !ok {
		return l.degrade(ctx, r, key, cost, plans, h, errBreakerOpen)
	}
	callerErr, storeErr := l.call(ctx, r, b, probe, start, func() error {
		return take(ctx, r, l.store, key, cost, plans, h)
	})
	switch {
	case callerErr != nil:
		*r = Result{}
		return callerErr
	case storeErr != nil:
		return l.degrade(ctx, r, key, cost, plans, h, storeErr)
	}
	return nil
}

// call makes op, a call to the store that puts its outcome in *r, times
// it, and judges a failure: the breaker hears it, unless the caller's own
// doing ended the call. It returns the error the caller gets instead of
// an answer, or the store's failure, for the failure policy to answer.
// probe says whether this call is the breaker's probe; start is when the
// decision asked, on the Limiter's clock.
func (l *Limiter) call(ctx context.Context, r *Result, b *breaker.Breaker, probe bool, start int64, op func() error) (callerErr, storeErr error) {
	// A probe must end in Success, Failure or Abandon, or the breaker stays
	// half-open for ever: also when the store panics or its goroutine
	// exits (runtime.Goexit, which recover does not see). Every way out
	// after the store returns ends it.
	returned := false
	if probe {
		defer func() {
			if !returned {
				b.Abandon()
			}
		}()
	}
	err := op()
	returned = true
	now := l.now()
	elapsed := time.Duration(now - start)
	if err == nil {
		l.stats.storeCall(r, elapsed, nil)
		if now-l.lastSuccess.Load() > int64(time.Millisecond) {
			l.lastSuccess.Store(now) // to the ms: a write per call would make cores wait
		}
		b.Success()
		if l.outage.active() {
			l.recovered(now)
		}
		return nil, nil
	}
	callerErr, storeFailed := l.blame(ctx, err, now)
	if !storeFailed {
		l.stats.storeCall(r, elapsed, nil)
		if probe {
			b.Abandon()
		}
		return callerErr, nil
	}
	l.stats.storeCall(r, elapsed, err)
	l.outage.failed(now)
	if b.Failure() {
		l.tripped(err)
	}
	if callerErr != nil {
		return callerErr, nil
	}
	return nil, err
}

// take has s take, with the Result in *r. The stores of this package skip
// the checks the Limiter has made: 238 of the 7,958 instructions of a Redis
// decision's client work (callgrind, BenchmarkLimiterAllow/redis/client-only).
// A MemoryStore also builds the Result in place: through the Store
// interface a pointer to it would escape to the heap, and the Result was
// copied up the call chain (BenchmarkLimiterAllow/memory).
// A hold, for Reserve, goes to a MemoryStore or RedisStore, which Reserve
// checked the stores are.
func take(ctx context.Context, r *Result, s Store, key string, cost int64, plans []Plan, h *hold) (err error) {
	switch s := s.(type) {
	case *MemoryStore:
		if h != nil {
			s.holdInto(r, key, cost, plans, h)
		} else {
			s.takeInto(r, key, cost, plans)
		}
	case *RedisStore:
		if h != nil {
			*r, err = s.hold(ctx, key, cost, plans, h)
		} else {
			*r, err = s.take(ctx, key, cost, plans)
		}
	default:
		*r, err = s.Take(ctx, key, cost, plans)
	}
	return err
}

// deadlineSlack is how close to its deadline a caller may be for a store
// call that timed out to count as cut short by the caller: the store's
// client may time out at the deadline a moment before the context's own
// timer marks it done.
const deadlineSlack = time.Millisecond

// blame judges a store call that failed with err at now (the Limiter's
// clock). It returns the error to give the caller instead of a decision,
// nil when the failure policy should decide, and whether the store failed.
//
//   - Bad input is the caller's alone.
//   - An error Redis answered (OOM, READONLY, a bad reply) is the store's,
//     however close the caller's deadline.
//   - A call that ended after the caller's context did, or that timed out
//     within deadlineSlack of the caller's deadline, was cut short by the
//     caller: the caller gets its context's error, and the store is not
//     blamed, so that impatient callers cannot open the breaker on a
//     healthy store. Unless no store call has succeeded for a cooldown:
//     then the store is hung or too slow for every caller, and is blamed
//     too.
func (l *Limiter) blame(ctx context.Context, err error, now int64) (callerErr error, storeFailed bool) {
	if isCallerError(err) {
		return err, false
	}
	var rerr *redisscript.Error
	answered := errors.As(err, &rerr) || errors.Is(err, ErrBadReply)
	cerr := ctx.Err()
	if cerr == nil && !answered {
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= deadlineSlack {
			cerr = context.DeadlineExceeded
		}
	}
	switch {
	case cerr == nil:
		return nil, true
	case errors.Is(err, cerr):
		callerErr = err
	default:
		callerErr = cerr
	}
	starved := now-l.lastSuccess.Load() >= int64(l.health.settings.Cooldown)
	return callerErr, answered || starved
}

// degrade decides by the failure policy, without the store, into *r.
func (l *Limiter) degrade(ctx context.Context, r *Result, key string, cost int64, plans []Plan, h *hold, cause error) error {
	switch l.policy {
	case FailOpen:
		*r = failOpenResult(plans)
		return nil
	case FailClosed:
		*r = Result{}
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, cause)
	}
	// The share holds at least the tokens asked about: a read for n
	// (PeekN's cost of -n) as much as a take of n.
	if err := take(ctx, r, l.fallback, key, cost, share(plans, l.fleetSize(), asked(cost)), h); err != nil {
		*r = Result{}
		return fmt.Errorf("%w: fallback store failed too: %w", ErrStoreUnavailable, err)
	}
	r.Source = SourceFallback
	return nil
}

// tripped logs the start of an outage when the breaker trips, once: a
// partial outage trips the breaker again after each probe that closed it,
// and those trips are counted for the line that ends the outage.
func (l *Limiter) tripped(err error) {
	if !l.outage.begin(time.Now().UnixNano()) {
		return
	}
	l.log.Warn("tollgate: store failing; deciding by failure policy until it recovers",
		"policy", l.policy.String(), "error", err)
}

// recovered logs the end of an outage, once: at a success when the breaker
// is closed and no call has failed for two cool-downs before now (the
// Limiter's clock).
func (l *Limiter) recovered(now int64) {
	if !l.health.closed() {
		return
	}
	start, failed, trips, ok := l.outage.end(now, 2*int64(l.health.settings.Cooldown))
	if ok {
		l.log.Info("tollgate: store recovered", "outage", time.Duration(time.Now().UnixNano()-start),
			"failed_calls", failed, "trips", trips)
	}
}

// record counts a decision that took tokens, under its binding plan, and
// the would-be denials of its shadowed plans, and logs it at debug level
// if the logger wants that. entry is the plan's when one plan was asked,
// and nil for a chain, whose binding plan t names, or else the Limiter's
// other plans (AllowPlans).
func (l *Limiter) record(ctx context.Context, r *Result, cost int64, entry *planEntry, t *planTable) {
	if cost > 0 {
		bound := entry
		if bound == nil { // a chain: the binding plan's
			bound = l.entryOf(t, r.Plan)
		}
		if bound != nil { // nil: a foreign store named none of ours
			bound.counts.decisions.count(r)
		}
		if r.ShadowDenied {
			l.countShadow(r, entry, t)
		}
	}
	if l.debug {
		l.logDecision(ctx, r)
	}
}

// logDecision logs a decision at debug level, never its key. It is a
// function of its own so that record, without it, stays small.
func (l *Limiter) logDecision(ctx context.Context, r *Result) {
	l.log.LogAttrs(ctx, slog.LevelDebug, "tollgate: decision", slog.String("plan", r.Plan),
		slog.Bool("allowed", r.Allowed), slog.Int64("remaining", r.Remaining),
		slog.Duration("retry_after", r.RetryAfter), slog.String("source", r.Source.String()))
}
