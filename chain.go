package tollgate

// chain decides cost on every plan of a chain, all or nothing, and writes
// nothing: buckets[i] is the bucket of bucket plan i, refilled to now in
// place; windows[i] is the window of window plan i (nil: empty), whose
// admitted and offered counts at now it puts in counts[i]. u is the
// request's random number for suppressed plans, in [0, 2^53). A read
// (cost 0) is allowed. scripts/limit.lua decides the same way.
func chain(plans []Plan, buckets []TokenBucket, windows []*window, counts [][2]int64, now, cost int64, u uint64) bool {
	need := cost * microTokens
	ok := true
	for i, p := range plans {
		if p.isWindow() {
			admitted, offered := windows[i].counts(now)
			counts[i] = [2]int64{admitted, offered}
			ok = ok && (cost == 0 || admits(suppression(p, admitted, offered, cost), u))
			continue
		}
		buckets[i] = buckets[i].Refill(p, now)
		ok = ok && buckets[i].Tokens >= need
	}
	return ok
}

// suppressedIn reports whether any of plans is suppressed: such a chain
// writes on every request, and draws a random number for it.
func suppressedIn(plans []Plan) bool {
	for _, p := range plans {
		if p.Suppress != 0 {
			return true
		}
	}
	return false
}
