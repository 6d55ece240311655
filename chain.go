package tollgate

import "fmt"

// maxChain is the most plans one decision may chain: the scripts report
// would-be denials, and a settlement names the plans it skips, as bits of
// one whole number, which a Lua number holds exactly up to 2^53, next to
// the allowed bit.
const maxChain = 52

// checkChain rejects a chain of more plans than the scripts can report.
func checkChain(plans []Plan) error {
	if len(plans) > maxChain {
		return fmt.Errorf("%w: a decision may chain at most %d plans, got %d", ErrInvalidPlan, maxChain, len(plans))
	}
	return nil
}

// chain decides cost on every plan of a chain, all or nothing, and writes
// nothing: buckets[i] is the bucket of bucket plan i, refilled to now in
// place, and, for concurrency plan i, its free permits as tokens;
// windows[i] is the window of window plan i (nil: empty). u is the
// request's random number for suppressed plans, in [0, 2^53). A read
// (cost 0) is allowed. A shadowed plan that would deny does not: bit i
// of wd says so for plan i. scripts/limit.lua decides the same way.
func chain(plans []Plan, buckets []TokenBucket, windows []*window, now, cost int64, u uint64) (ok bool, wd uint64) {
	need := cost * microTokens
	ok = true
	for i := range plans {
		fits := true
		if p := &plans[i]; p.isWindow() {
			admitted, offered := windows[i].counts(now)
			fits = cost <= 0 || admits(suppression(p, admitted, offered, cost), u)
		} else if p.Concurrency {
			fits = buckets[i].Tokens >= need
		} else {
			buckets[i] = buckets[i].refill(p, now)
			fits = buckets[i].Tokens >= need
		}
		switch {
		case fits:
		case plans[i].Shadow:
			wd |= 1 << i
		default:
			ok = false
		}
	}
	return ok, wd
}

// suppressedIn reports whether any of plans is suppressed: such a chain
// writes on every request, and draws a random number for it.
func suppressedIn(plans []Plan) bool {
	for i := range plans {
		if plans[i].Suppress != 0 {
			return true
		}
	}
	return false
}

// permitsIn reports whether any of plans is a concurrency plan.
func permitsIn(plans []Plan) bool {
	for i := range plans {
		if plans[i].Concurrency {
			return true
		}
	}
	return false
}

// windowIn reports whether any of plans is a window plan.
func windowIn(plans []Plan) bool {
	for i := range plans {
		if plans[i].isWindow() {
			return true
		}
	}
	return false
}
