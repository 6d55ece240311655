package tollgate

import "math/bits"

// capacityArg is plan p's capacity as the script takes it: negative for a
// shadowed plan (see scripts/limit.lua).
func capacityArg(p *Plan) int64 {
	if p.Shadow {
		return -p.Capacity
	}
	return p.Capacity
}

// shadowMask returns the bits that a would-be denial of plans may set:
// bit i for shadowed plan i.
func shadowMask(plans []Plan) uint64 {
	var m uint64
	for i := range min(len(plans), maxChain) {
		if plans[i].Shadow {
			m |= 1 << i
		}
	}
	return m
}

// overCost returns the shadowed plans whose capacity is below n, bit i for
// plan i: they would deny a request for n tokens whatever their buckets
// hold, where an enforced plan refuses it (ErrInvalidCost).
func overCost(n int64, plans []Plan) uint64 {
	var m uint64
	for i := range min(len(plans), maxChain) {
		if plans[i].Shadow && plans[i].Capacity < n {
			m |= 1 << i
		}
	}
	return m
}

// without returns, in a new slice, plans but those that bit i of skip
// names for plan i.
func without(plans []Plan, skip uint64) []Plan {
	rest := make([]Plan, 0, len(plans))
	for i := range plans {
		if skip>>i&1 == 0 {
			rest = append(rest, plans[i])
		}
	}
	return rest
}

// withOver makes *r, the Result of a decision on plans but those that bit
// i of over names for plan i, or an allowed Result if none was decided,
// the Result of the decision on plans. The plans of over, shadowed and of
// a capacity below the cost, were not asked: each is reported as would
// deny, with RetryAfter 0, since no wait lets it pass, and as full
// (Remaining its capacity, ResetAfter 0), since nothing of its bucket was
// read, as FailOpen reports a bucket. They bind only when every plan is
// shadowed. A store of another package, whose Result tells of fewer
// plans than it was asked about, keeps its PlanResults.
func (r *Result) withOver(plans []Plan, over uint64) {
	var asked []PlanResult
	if rest := len(plans) - bits.OnesCount64(over); rest > 0 {
		if asked = r.PlanResults(); len(asked) != rest {
			r.ShadowDenied, r.chain = true, asked
			return
		}
	}
	chain := make([]PlanResult, len(plans))
	enforced := false // some plan is enforced
	for i := range plans {
		p := &plans[i]
		enforced = enforced || !p.Shadow
		if over>>i&1 == 0 {
			chain[i], asked = asked[0], asked[1:]
			continue
		}
		chain[i] = PlanResult{Plan: p.Name, Limit: p.Capacity, Remaining: p.Capacity, Rate: p.Rate, Window: p.Window, Shadow: true, WouldDeny: true}
	}
	r.ShadowDenied = true
	if !enforced { // the binding plan may be one of over
		b := chain[binding(chain, true, false, 0)]
		r.Plan, r.Limit, r.Remaining, r.RetryAfter, r.ResetAfter = b.Plan, b.Limit, b.Remaining, b.RetryAfter, b.ResetAfter
		r.Rate, r.Window, r.shadow = b.Rate, b.Window, true
	}
	if len(plans) > 1 {
		r.chain = chain
	}
}
