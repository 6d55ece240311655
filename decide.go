package tollgate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"
)

// decide makes one decision into *r, in steps each readable alone: find
// the plans (plansFor), check the request, answer it (answer), then
// record the decision. Allow, AllowN and Peek pass the Result they
// return, so it is built in place rather than copied up the steps.
func (l *Limiter) decide(ctx context.Context, r *Result, q *request) error {
	if err := checkKey(q.key); err != nil {
		return err
	}
	if l.resolver != nil && !q.given {
		if err := l.plansFor(ctx, q); err != nil {
			if errors.Is(err, ErrExempt) {
				return exempt(ctx, r, q)
			}
			return err
		}
	}
	if err := l.check(ctx, q); err != nil {
		return err
	}
	var err error
	if q.over != 0 {
		err = l.answerWithout(ctx, r, q)
	} else {
		err = l.answer(ctx, r, q)
	}
	if err != nil {
		return err
	}
	l.record(ctx, r, q)
	return nil
}

// answer decides q, checked, into *r: serve it from a lease, answer a
// remembered denial, or ask the store behind its breaker and failure
// policy, then remember a denial.
func (l *Limiter) answer(ctx context.Context, r *Result, q *request) error {
	if l.leases != nil && q.mode != modeRead { // every mode that takes tokens
		if served, err := l.leases.serve(ctx, r, q); served || err != nil {
			return err
		}
	}
	cache := l.cacheable(q)
	var asked int64 // on the Limiter's clock, read once: a store of this process is not timed
	if cache || l.mem == nil {
		asked = l.now()
	}
	if l.denials != nil {
		q.pk = planKey(q)
		if l.cached(r, q, cache, asked) {
			return nil
		}
	}
	if l.mem != nil { // a store of this process cannot fail: no breaker, no policy
		l.mem.decideIn(r, &q.op)
	} else if err := l.ask(ctx, r, &q.op, asked); err != nil {
		return err
	}
	if cache {
		l.remember(r, q, asked)
	}
	return nil
}

// answerWithout answers q on its plans but the shadowed ones below its
// cost (q.over), which would deny it whatever their buckets hold: no
// layer sees them, so nothing is taken from them, and the Result reports
// them as would deny (withOver). A request on such plans alone asks
// nothing.
func (l *Limiter) answerWithout(ctx context.Context, r *Result, q *request) error {
	rest := *q
	rest.plans, rest.entry = without(q.plans, q.over), nil
	if len(rest.plans) == 0 {
		*r = Result{Allowed: true}
	} else if err := l.answer(ctx, r, &rest); err != nil {
		return err
	}
	r.withOver(q.plans, q.over)
	return nil
}

// named decides q on the plans named names, the table's first plan for
// none, into *r. names stay out of the request, whose content escapes to
// the heap: a caller's variadic names then stay on its stack.
func (l *Limiter) named(ctx context.Context, r *Result, q *request, names []string) error {
	q.table = l.table.Load()
	q.plans, q.entry = q.table.defaults.one, q.table.defaults
	if len(names) > 0 {
		var err error
		if q.plans, q.entry, err = q.table.resolve(names); err != nil {
			return err
		}
	}
	return l.decide(ctx, r, q)
}

// exempt answers q, whose key the resolver exempts from every plan:
// allowed, without the store, unless its cost is below 1 or its caller's
// context has ended, which get their errors as for any key.
func exempt(ctx context.Context, r *Result, q *request) error {
	if q.n < 1 {
		return checkCost(q.n, nil, 0)
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	*r = exemptResult(q.plans)
	return nil
}

// plansFor has the resolver choose q's plans for q's key
// (WithPlanResolver). It returns ErrExempt, with q's plans as asked, when
// the resolver exempts the key from every plan. An Acquire whose key it
// exempts from every concurrency plan named takes the tokens of the plans
// left, and holds no permit.
func (l *Limiter) plansFor(ctx context.Context, q *request) error {
	permits := q.mode == modeAcquire && permitsIn(q.plans)
	var err error
	q.plans, q.entry, err = l.resolveFor(ctx, q.table, q.key, q.plans, q.entry)
	if err == nil && permits && !permitsIn(q.plans) {
		q.mode = modeTake
	}
	return err
}

// check checks q against its plans, and the caller's context, and notes
// in q.over the shadowed plans whose capacity is below q's cost, which
// decide sets aside (answerWithout).
func (l *Limiter) check(ctx context.Context, q *request) error {
	if q.n != 1 { // one token fits every plan, which was checked when it was given
		q.over = overCost(q.n, q.plans)
		if err := checkCost(q.n, q.plans, q.over); err != nil {
			return err
		}
	}
	if err := checkChain(q.plans); err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	switch {
	case q.mode == modeHold:
		if permitsIn(q.plans) {
			return fmt.Errorf("%w: %w", ErrInvalidPlan, errNoPermitPlan)
		}
		return q.hold.accept(q.plans)
	case (q.mode == modeAcquire) != permitsIn(q.plans):
		return fmt.Errorf("%w: %w", ErrInvalidPlan, errNoPermitPlan)
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
		return nil, nil, unknownPlan(names[0])
	}
	plans := make([]Plan, len(names))
	for i, name := range names {
		e, ok := t.byName[name]
		if !ok {
			return nil, nil, unknownPlan(name)
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

// unknownPlan is the error of a name no plan has.
func unknownPlan(name string) error {
	return fmt.Errorf("%w: %q", ErrUnknownPlan, name)
}

// cacheable reports whether the denial cache may answer q, and remember
// its denial: a read takes nothing, so its answer is no denial to
// remember, and suppressed plans write on every request, so a remembered
// denial would not be the store's answer.
func (l *Limiter) cacheable(q *request) bool {
	return l.denials != nil && q.mode != modeRead && q.mode != modeAcquire && !suppressedIn(q.plans)
}

// planKey names the plans of q for the denial cache by their fingerprints,
// so that a remembered denial answers only for the same parameters: a
// raised limit (a resolver's tier upgrade, SetPlans) is asked of the store
// at once, and a request under a plan's other parameters forgets the
// key's denials under the old ones, which a round trip back would find
// stale. One plan, the common case, costs nothing.
func planKey(q *request) string {
	if q.entry != nil {
		return q.entry.fp
	}
	fps := make([]string, len(q.plans))
	for i, p := range q.plans {
		fps[i] = fingerprint(p)
	}
	return strings.Join(fps, ",") // a comma is in no fingerprint
}

// cached answers q from a remembered denial, as of now, and reports
// whether there was one. A request that no denial may answer (may is
// false: a read, or a suppressed plan) is not looked up: the cache only
// forgets the key's denials under other parameters of its plans, which
// the store's answer supersedes.
func (l *Limiter) cached(r *Result, q *request, may bool, now int64) bool {
	if !may {
		l.denials.Supersede(q.key, q.pk)
		return false
	}
	at, until, ok := l.denials.Get(q.key, q.pk, q.n, now, r)
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

// remember keeps a denial the store gave to q, asked at asked. The store
// read its clock after asked, so counting RetryAfter from asked ends the
// denial no later than the store would: the round trip must not delay
// admissions.
func (l *Limiter) remember(r *Result, q *request, asked int64) {
	if r.Allowed || r.Source != SourceStore || r.RetryAfter <= 0 {
		return
	}
	res := *r
	if res.chain != nil {
		res.chain = append([]PlanResult(nil), res.chain...) // the caller owns its Result
	}
	l.denials.Put(q.key, q.pk, q.n, res, asked, asked+int64(r.RetryAfter))
}

// record counts a decision that took tokens, under its binding plan, and
// the would-be denials of its shadowed plans, and logs it at debug level
// if the logger wants that. A chain counts under its binding plan, which
// q's table names, or else the Limiter's other plans (AllowPlans).
func (l *Limiter) record(ctx context.Context, r *Result, q *request) {
	if q.mode != modeRead {
		bound := q.entry
		if bound == nil { // a chain: the binding plan's
			bound = l.entryOf(q.table, r.Plan)
		}
		if bound != nil { // nil: a foreign store named none of ours
			bound.counts.decisions.count(r)
		}
		if r.ShadowDenied {
			l.countShadow(r, q.entry, q.table)
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
