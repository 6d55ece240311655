package tollgate

import "time"

// Source tells who made a decision.
type Source uint8

const (
	// SourceStore means the Limiter's store decided: the shared buckets in
	// Redis, or the MemoryStore when that is the Limiter's store. A
	// request whose plans are all shadowed and below its cost, which
	// asks nothing (PlanResult.WouldDeny), reports it too.
	SourceStore Source = iota
	// SourceFallback means the store was failing, and the local fallback
	// store decided (the Fallback policy).
	SourceFallback
	// SourceFailOpen means the store was failing, and the request was
	// allowed without any bucket (the FailOpen policy).
	SourceFailOpen
	// SourceCache means the Limiter's denial cache answered with a denial
	// the store gave earlier, without asking the store (see
	// WithDenialCache).
	SourceCache
	// SourceLease means the Limiter allowed the request from tokens it
	// had leased from Redis earlier (Plan.Lease), without asking Redis.
	SourceLease

	numSources = iota // the number of Sources
)

// String returns "store", "fallback", "fail-open", "cache", "lease" or
// "exempt".
func (s Source) String() string {
	switch s {
	case SourceStore:
		return "store"
	case SourceFallback:
		return "fallback"
	case SourceFailOpen:
		return "fail-open"
	case SourceCache:
		return "cache"
	case SourceLease:
		return "lease"
	case SourceExempt:
		return "exempt"
	}
	return "unknown"
}

// PlanResult is the state of one plan's bucket after a decision.
type PlanResult struct {
	// Plan is the plan's name, for example "gold".
	Plan string
	// Limit is the plan's Capacity in tokens, for example 20.
	Limit int64
	// Remaining is the number of whole tokens left, for example 19.
	Remaining int64
	// RetryAfter is 0 when this plan has the tokens; otherwise the wait
	// until it would, for example 100ms.
	RetryAfter time.Duration
	// ResetAfter is the wait until the bucket is full again, or until a
	// window counts nothing, for example 100ms; 0 when it is full or
	// counts nothing.
	ResetAfter time.Duration
	// Suppression is, for a suppressed window plan, the probability that
	// the plan refused the request, 0 to 1, for example 0.25: 0 up to its
	// soft limit, 1 past its hard limit. It is 0 for other plans.
	Suppression float64
	// Rate and Window are those of the plan as applied, which a
	// plan resolver (WithPlanResolver) or AllowPlans may have chosen for the key, for example
	// 10 tokens per second, or a Window of 1m; what Limit is to Capacity.
	Rate   float64
	Window time.Duration
	// Shadow reports that the plan was shadowed (Plan.Shadow, WithShadow):
	// decided, and its bucket drained, as if enforced, but never denying.
	Shadow bool
	// WouldDeny reports that the shadowed plan lacked the tokens, so that
	// enforced it would have denied the request; RetryAfter is then the
	// wait it would have imposed, and its bucket was left as it was. A
	// plan whose Capacity is below the cost, which no wait lets the
	// request pass, is not asked: RetryAfter is 0, and Remaining and
	// ResetAfter tell a full bucket (Limit and 0), as nothing was read.
	WouldDeny bool
}

// Result is the outcome of one decision. Its top-level fields describe the
// binding plan: when denied, the plan that makes the caller wait longest;
// when allowed, the plan with the fewest tokens left (the first such plan on
// a tie). Shadowed plans bind only when every plan is shadowed.
type Result struct {
	// Allowed reports whether the tokens were taken. For a read (Peek,
	// or a Store's Take of cost 0), which takes nothing, it reports
	// whether one token would be taken now.
	Allowed bool
	// Source tells who decided: SourceStore, SourceCache for a remembered
	// denial, or, while the store fails, SourceFallback or SourceFailOpen.
	Source Source
	// ShadowDenied reports that a shadowed plan would have denied the
	// request had it been enforced (PlanResult.WouldDeny tells which).
	// Allowed is then decided by the enforced plans alone.
	ShadowDenied bool

	shadow bool // the binding plan is shadowed (next to the flags above, where padding was)
	// Remaining is the number of whole tokens left in the binding plan's
	// bucket, for example 19.
	Remaining int64
	// RetryAfter is 0 when allowed, unless the binding plan is shadowed
	// and would have denied; otherwise the wait until this same
	// request (for a read, a request for one token) would pass if nobody
	// else took tokens, for example 250ms. For a suppressed plan it is the
	// wait until the request would pass for certain, below the soft limit:
	// it may pass sooner, by the draw.
	RetryAfter time.Duration
	// ResetAfter is the wait until the binding plan's bucket is full again,
	// or its window counts nothing, for example 1.5s.
	ResetAfter time.Duration
	// Plan is the binding plan's name, for example "gold".
	Plan string
	// Limit is the binding plan's Capacity in tokens, for example 20.
	Limit int64
	// Suppressed reports that a suppressed window plan (Plan.Suppress)
	// was between its soft and hard limits, so that a random draw decided
	// whether it admitted the request; never for a read.
	Suppressed bool
	// Suppression is the largest PlanResult.Suppression of the plans: the
	// probability, 0 to 1, that a suppressed plan refused the request, for
	// example 0.5 when the load offered is twice the soft limit.
	Suppression float64
	// Rate and Window are the binding plan's, as applied (see PlanResult).
	Rate   float64
	Window time.Duration

	// reclaimed counts the permits of concurrency plans whose lease had
	// ended, which the decision reclaimed from holders that stopped
	// renewing them.
	reclaimed int64

	// chain holds one PlanResult per plan when more than one plan was
	// asked; for a single plan it is nil, so that the common decision
	// allocates nothing, and PlanResults builds it.
	chain []PlanResult
}

// PlanResults returns one PlanResult per plan asked, in the order asked:
// never empty for a Result a Limiter or Store returned. For a single plan
// it builds the one element from the top-level fields. The slice belongs
// to the Result, as the Result belongs to its caller.
func (r Result) PlanResults() []PlanResult {
	if r.chain != nil {
		return r.chain
	}
	return []PlanResult{{Plan: r.Plan, Limit: r.Limit, Remaining: r.Remaining, RetryAfter: r.RetryAfter, ResetAfter: r.ResetAfter,
		Suppression: r.Suppression, Rate: r.Rate, Window: r.Window, Shadow: r.shadow, WouldDeny: r.ShadowDenied}}
}

// planState is what a Result tells of one plan after a decision.
type planState struct {
	remaining              int64
	retryAfter, resetAfter time.Duration
	suppression            float64
	drawn                  bool  // a suppressed plan drew for the request
	full                   bool  // a concurrency plan had too few free permits
	reclaimed              int64 // a concurrency plan's permits whose lease had ended
}

// outcome is a store's decision on plans, from their state after it:
// buckets[i] is the stored bucket of bucket plan i, and windows[i] what
// windowState tells of window plan i (windows may be nil when no plan is
// a window); bit i of wd is set when shadowed plan i would have denied.
// cost is the op's (see op.cost), and now the store's clock, in µs.
type outcome struct {
	plans   []Plan
	buckets []TokenBucket
	windows []planState
	now     int64
	cost    int64
	allowed bool
	wd      uint64
}

// newResult describes the outcome o. Both stores build their results
// here, so they agree field by field.
func newResult(o *outcome) Result {
	var r Result
	r.describe(o)
	return r
}

// describe is newResult into *r, which it overwrites whole: the memory
// store's hot path builds its Result in place this way. A read (cost 0)
// is described as the question whether one token would pass now.
func (r *Result) describe(o *outcome) {
	plans, buckets, windows, now, cost, allowed, wd := o.plans, o.buckets, o.windows, o.now, o.cost, o.allowed, o.wd
	if len(plans) == 1 { // the common case, and hot
		p := &plans[0]
		if !p.isWindow() && !p.Concurrency {
			r.describeBucket(p, buckets[0], now, cost, allowed, wd)
			return
		}
		st := &windows[0]
		r.describePlan(p)
		r.Remaining, r.RetryAfter, r.ResetAfter = st.remaining, st.retryAfter, st.resetAfter
		r.Suppressed, r.Suppression, r.reclaimed = st.drawn, st.suppression, st.reclaimed
		r.decided(p, cost, allowed, wd)
		return
	}
	*r = Result{chain: make([]PlanResult, len(plans))}
	enforced := false // some plan is enforced
	var full uint64   // bit i: concurrency plan i had too few free permits
	for i := range plans {
		p := &plans[i]
		denied := i < 64 && wd&(1<<i) != 0
		st := o.stateOf(i, allowed && !denied)
		r.chain[i] = PlanResult{Plan: p.Name, Limit: p.Capacity, Remaining: st.remaining,
			RetryAfter: st.retryAfter, ResetAfter: st.resetAfter, Suppression: st.suppression,
			Rate: p.Rate, Window: p.Window, Shadow: p.Shadow, WouldDeny: p.Shadow && (denied || cost <= 0 && st.retryAfter > 0)}
		switch {
		case p.Shadow:
			r.ShadowDenied = r.ShadowDenied || r.chain[i].WouldDeny
		case cost <= 0 && st.retryAfter > 0:
			allowed = false
		}
		enforced = enforced || !p.Shadow
		if st.full && i < 64 {
			full |= 1 << i
		}
		r.reclaimed += st.reclaimed
		r.Suppressed = r.Suppressed || st.drawn
		r.Suppression = max(r.Suppression, st.suppression)
	}
	b := r.chain[binding(r.chain, allowed, enforced, full)]
	r.Allowed = allowed
	r.Plan, r.Limit, r.Remaining, r.RetryAfter, r.ResetAfter = b.Plan, b.Limit, b.Remaining, b.RetryAfter, b.ResetAfter
	r.Rate, r.Window, r.shadow = b.Rate, b.Window, b.Shadow
}

// binding returns the index of the plan that binds a decision on a chain
// whose plans' results are chain (see Result): the enforced plan with the
// fewest tokens left if allowed, else with the longest wait, where bit i
// of full says that concurrency plan i had too few free permits; a
// shadowed plan only when every plan is (enforced is false).
func binding(chain []PlanResult, allowed, enforced bool, full uint64) int {
	bind := -1
	for i, pr := range chain {
		if enforced && pr.Shadow {
			continue
		}
		if bind < 0 {
			bind = i
			continue
		}
		b := &chain[bind]
		// A full concurrency plan refuses with no wait to tell: it binds
		// over plans that would not refuse, and a plan's wait over it.
		refuses := pr.RetryAfter > b.RetryAfter || pr.RetryAfter == b.RetryAfter && full>>i&1 > full>>bind&1
		if allowed && pr.Remaining < b.Remaining || !allowed && refuses {
			bind = i
		}
	}
	return bind
}

// stateOf returns what a Result reports of plan i of o, allowed or not:
// the window's state as given, or the bucket's.
func (o *outcome) stateOf(i int, allowed bool) planState {
	p := &o.plans[i]
	if p.isWindow() || p.Concurrency {
		return o.windows[i]
	}
	var st planState
	st.remaining, st.retryAfter, st.resetAfter = bucketState(p, o.buckets[i], o.now, o.cost, allowed)
	return st
}

// describeBucket is describe for one bucket plan p, whose bucket after
// the decision is b: a MemoryStore's hot path, which builds no outcome.
func (r *Result) describeBucket(p *Plan, b TokenBucket, now, cost int64, allowed bool, wd uint64) {
	r.describePlan(p)
	r.Remaining, r.RetryAfter, r.ResetAfter = bucketState(p, b, now, cost, allowed && wd == 0)
	r.decided(p, cost, allowed, wd)
}

// describePlan overwrites *r whole with what it tells of plan p alone.
func (r *Result) describePlan(p *Plan) {
	*r = Result{Plan: p.Name, Limit: p.Capacity}
	r.Rate, r.Window, r.shadow = p.Rate, p.Window, p.Shadow // set apart: the literal, larger, was built in a temporary and copied
}

// decided sets Allowed and ShadowDenied of a Result of the one plan p,
// whose RetryAfter is set, after a decision that allowed or not, for
// cost, in which bit 0 of wd says that p, shadowed, would have denied.
func (r *Result) decided(p *Plan, cost int64, allowed bool, wd uint64) {
	r.ShadowDenied = p.Shadow && (wd != 0 || cost <= 0 && r.RetryAfter > 0)
	r.Allowed = allowed && (cost > 0 || r.RetryAfter == 0 || p.Shadow)
}

// bucketState returns what a Result reports of one stored bucket after a
// decision that took cost tokens from every plan if allowed, or none:
// RetryAfter is the wait until cost tokens are there, 0 if they are, and
// for a read (cost 0) the wait until one token is.
func bucketState(p *Plan, b TokenBucket, now, cost int64, allowed bool) (remaining int64, retryAfter, resetAfter time.Duration) {
	if allowed && cost > 0 {
		// Refilled to now and drained: stored and current at once, so the
		// hot path needs no second refill.
		return b.Remaining(), 0, micros(b.readyAt(p, now, p.Capacity) - now)
	}
	resetAfter = micros(b.readyWhen(p, now, p.Capacity) - now)
	retryAfter = micros(b.readyWhen(p, now, asked(cost)) - now)
	return b.refill(p, now).Remaining(), retryAfter, resetAfter
}

// windowCounts are what a decision found of one window: its counts at
// now before the decision, admitted and offered, when asked(cost) tokens
// fit in it as it was (readyAt), and when it counts nothing admitted
// after the decision (resetAt), in µs.
type windowCounts struct {
	admitted, offered int64
	readyAt, resetAt  int64
}

// windowState returns what a Result reports of one window after a
// decision that found c at now.
func windowState(p *Plan, c windowCounts, now, cost int64, allowed bool) planState {
	admitted, offered, readyAt, resetAt := c.admitted, c.offered, c.readyAt, c.resetAt
	st := planState{remaining: max(0, p.Capacity-admitted), resetAfter: micros(resetAt - now)}
	if allowed && cost > 0 {
		st.remaining = max(0, p.Capacity-admitted-cost)
	} else {
		st.retryAfter = micros(readyAt - now)
	}
	if p.Suppress != 0 {
		c := asked(cost)
		st.suppression = suppression(p, admitted, offered, c)
		st.drawn = cost > 0 && admitted+c > p.Capacity && admitted+c <= p.hardLimit()
	}
	return st
}

// failOpenResult is the decision of the FailOpen policy: allowed, with every
// bucket reported full because nothing is known of them.
func failOpenResult(plans []Plan) Result {
	buckets := make([]TokenBucket, len(plans))
	windows := make([]planState, len(plans))
	for i, p := range plans {
		buckets[i] = fullBucket(p, 0)
		windows[i].remaining = p.Capacity
	}
	r := newResult(&outcome{plans: plans, buckets: buckets, windows: windows, allowed: true})
	r.Source = SourceFailOpen
	return r
}

// asked returns how many tokens a decision of cost asks about: the cost
// it takes, or, for a read, which takes nothing, 1 token (cost 0) or n
// (cost -n, which PeekN sends).
func asked(cost int64) int64 {
	return max(cost, -cost, 1)
}

func micros(us int64) time.Duration {
	return time.Duration(us) * time.Microsecond
}
