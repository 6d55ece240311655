package tollgate

import "math/rand/v2"

// window is the state of one window plan: the counts of its last k+1
// sub-windows, of width g = Plan.width() µs each. Sub-window i spans
// [i·g, (i+1)·g). At time now, in sub-window b = now/g, the plan counts
// sub-windows b−k to b: every request of the last Window, plus up to one
// sub-window before it. A sub-window that straddles the window's
// start counts in full, so no span of Window ever holds more than the
// limit.
//
// It does no I/O and reads no clock; scripts/limit.lua repeats the
// same arithmetic on a Redis hash, and a test keeps the two equal. Unlike
// TokenBucket it is changed in place: its counts are a ring, kept without
// allocating between decisions.
type window struct {
	// width and slots are the plan's sub-window width g, in µs, and k,
	// set on the first write: a window keeps the shape it was written in.
	width, slots int64
	// newest is the index of the newest sub-window written.
	newest int64
	// admitted holds the tokens admitted in sub-windows newest−k to
	// newest: that of sub-window i at i mod (k+1). It is nil for a
	// window never written, which counts nothing.
	admitted []int64
	// offered is admitted for every request that asked a suppressed
	// plan, admitted or not, each count at most maxOffered; nil for other
	// plans.
	offered []int64
	// sumAdmitted and sumOffered are the sums of the two rings, so that a
	// decision in the newest sub-window need not add them up.
	sumAdmitted, sumOffered int64
}

// ahead reports whether the newest sub-window of w lies more than k
// sub-windows ahead of now's: the clock stepped back by more than a
// window, or the window is garbage. Such a window counts everything it
// holds as if it lay in now's sub-window, as add moves it there, so that
// no step back forgets what was admitted and garbage blocks for at most
// one window. A nil window is never ahead.
func (w *window) ahead(now int64) bool {
	return w != nil && w.admitted != nil && w.newest > now/w.width+w.slots
}

// span returns the first and last sub-windows of w that count at now:
// none (first > last) if w is empty, or ahead, whose counts all count in
// now's sub-window, which its ring does not hold.
func (w *window) span(now int64) (first, last int64) {
	if w == nil || w.admitted == nil || w.ahead(now) {
		return 1, 0
	}
	// After a clock step back, sub-windows later than b still count.
	k, b := w.slots, now/w.width
	return max(b-k, w.newest-k), w.newest
}

// counts returns the tokens admitted and offered in the sub-windows that
// count at now: all it holds if it is ahead, in now's sub-window, where
// offered counts stop at maxOffered. A nil window counts nothing.
func (w *window) counts(now int64) (admitted, offered int64) {
	if w.ahead(now) {
		return w.sumAdmitted, min(w.sumOffered, maxOffered)
	}
	first, last := w.span(now)
	if first > last {
		return 0, 0
	}
	admitted, offered = w.sumAdmitted, w.sumOffered
	for i := w.newest + 1 - int64(len(w.admitted)); i < first; i++ { // sub-windows that left
		admitted -= w.admitted[w.slot(i)]
		if w.offered != nil {
			offered -= w.offered[w.slot(i)]
		}
	}
	return admitted, offered
}

// readyAt returns the first time, in µs, at which cost more tokens fit
// under the plan's Capacity, if nothing else is admitted: now if they fit
// now, otherwise the moment the oldest sub-windows that must leave have
// left, for a window ahead of now once a decision has moved its counts
// into now's sub-window (add). cost must not exceed p.Capacity.
func (w *window) readyAt(p *Plan, now, cost int64) int64 {
	total, _ := w.counts(now)
	if total+cost <= p.Capacity {
		return now
	}
	if w.ahead(now) { // all its counts leave with now's sub-window
		return w.leaves(now / w.width)
	}
	first, last := w.span(now)
	for i := first; i < last; i++ {
		total -= w.admitted[w.slot(i)]
		if total+cost <= p.Capacity {
			return w.leaves(i)
		}
	}
	// Once all have left, cost fits: checkCost keeps it within Capacity.
	return w.leaves(last)
}

// slot returns the index in the rings of sub-window i: i mod (k+1), never
// negative, also for the small times of tests.
func (w *window) slot(i int64) int64 {
	n := int64(len(w.admitted))
	return (i%n + n) % n
}

// leaves returns the time, in µs, at which sub-window i stops counting:
// when the current sub-window is i+k+1.
func (w *window) leaves(i int64) int64 {
	return (i + 1 + w.slots) * w.width
}

// resetAt returns the time, in µs, at which the window counts nothing
// admitted: when the newest sub-window with a count leaves (now's, if the
// window is ahead), or now if none counts.
func (w *window) resetAt(now int64) int64 {
	if w.ahead(now) && w.sumAdmitted != 0 {
		return w.leaves(now / w.width)
	}
	first, last := w.span(now)
	for i := last; i >= first; i-- {
		if w.admitted[w.slot(i)] != 0 {
			return w.leaves(i)
		}
	}
	return now
}

// emptyAt returns the time, in µs, at which every count the window
// holds, offered ones included, has stopped counting: when a store may
// forget it.
func (w *window) emptyAt() int64 {
	if w == nil || w.admitted == nil {
		return 0
	}
	return w.leaves(w.newest)
}

// add records admitted and offered tokens in the sub-window of now,
// allocating the ring on the first write, clearing sub-windows that no
// longer count, and moving the counts of a window ahead of now into
// now's sub-window, where they count for one more window. An offered
// count stops at maxOffered.
func (w *window) add(p *Plan, now, admitted, offered int64) {
	if w.admitted == nil {
		w.width, w.slots = p.width(), p.slots()
	}
	k, b := w.slots, now/w.width
	n := k + 1
	switch {
	case w.admitted == nil:
		w.admitted = make([]int64, n)
		if p.Suppress != 0 {
			w.offered = make([]int64, n)
		}
		w.newest = b
	case w.newest > b+k: // ahead: its sums stay, in now's sub-window
		clear(w.admitted)
		clear(w.offered)
		w.admitted[b%n] = w.sumAdmitted
		if w.offered != nil {
			w.sumOffered = min(w.sumOffered, maxOffered)
			w.offered[b%n] = w.sumOffered
		}
		w.newest = b
	case b > w.newest:
		for i := w.newest + 1; i <= min(b, w.newest+n); i++ {
			w.sumAdmitted -= w.admitted[i%n]
			w.admitted[i%n] = 0
			if w.offered != nil {
				w.sumOffered -= w.offered[i%n]
				w.offered[i%n] = 0
			}
		}
		w.newest = b
	}
	w.admitted[b%n] += admitted
	w.sumAdmitted += admitted
	if w.offered != nil {
		o := min(w.offered[b%n]+offered, maxOffered)
		w.sumOffered += o - w.offered[b%n]
		w.offered[b%n] = o
	}
}

// maxOffered is the most a suppressed window counts as offered in one
// sub-window, 2^46 tokens: the sum over its at most 65 sub-windows then
// stays below 2^53, which a Lua number holds exactly, where a million
// refusals of the largest Capacity pass it. Past it a request's chance
// to pass is below Capacity ÷ 2^46, less than 1.3 in 10,000.
const maxOffered = 1 << 46

// carry returns a window of plan p holding, in the sub-window of now, what
// old, a window of another shape, still counts at now: a plan changed
// its Window, Slots or Suppress. Its counts then leave later than they
// would have, never sooner, so the change cannot admit more than either
// shape allows. An old window without offered counts
// (wasSuppressed false) lends its admitted counts as offered ones.
// scripts/limit.lua carries the same way.
func carry(old *window, wasSuppressed bool, p *Plan, now int64) *window {
	admitted, offered := old.counts(now)
	if !wasSuppressed {
		offered = admitted
	}
	w := &window{}
	w.add(p, now, admitted, offered)
	return w
}

// fromBucket returns a window of plan p holding, in the sub-window of
// now, what bucket b, kept for a plan of the name that was a token
// bucket, has used of p: p's capacity less the whole tokens b holds as
// stored, never below 0. The plan changed kind; what the bucket has left
// is what the window has left, never more. Offered counts, if p
// is suppressed, start equal to the admitted ones. scripts/limit.lua
// reads a bucket alike.
func fromBucket(b TokenBucket, p *Plan, now int64) *window {
	used := p.Capacity - min(p.Capacity, b.Tokens/microTokens)
	w := &window{}
	w.add(p, now, used, used)
	return w
}

// fromWindow returns the bucket of plan p that window w, kept for a plan
// of the name and of capacity c that was a sliding window, reads as at
// now: holding what w has left, c less what it counts, at most p's
// capacity, never below 0, stamped now; or full, if nothing w holds
// counts any more, as a store that forgot w reads it (Redis expires its
// key a millisecond or two later). Such a bucket inherits no version:
// the change of kind carries it over instead.
// scripts/bucket.lua reads a window alike.
func fromWindow(w *window, c int64, p *Plan, now int64) TokenBucket {
	if w.emptyAt() <= now {
		return fullBucket(*p, now)
	}
	admitted, _ := w.counts(now)
	return TokenBucket{Tokens: min(p.Capacity, max(0, c-admitted)) * microTokens, Stamp: now}
}

// suppression returns the probability, 0 to 1, that a suppressed plan
// refuses cost more tokens, with admitted and offered counted in its
// window: 0 up to the soft limit S (Capacity), 1 past the hard limit H,
// and in between 1 − p, where p = S ÷ the offered load including this
// request, tapered by (H − admitted − cost + 1) ÷ (H − S). The first
// factor alone brings the admitted rate to S but lets the count wander
// above it, since nothing pulls it back; the taper pulls harder the
// further above S the count is. For a plan that is not suppressed it is 0 up to Capacity and
// 1 past it.
func suppression(p *Plan, admitted, offered, cost int64) float64 {
	switch {
	case admitted+cost <= p.Capacity:
		return 0
	case p.Suppress == 0 || admitted+cost > p.hardLimit():
		return 1
	}
	// offered ≥ admitted, so both quotients are at most 1. Go and Lua
	// compute the same doubles in the same order; the conversion keeps Go
	// from fusing the multiply and subtract, which Lua cannot.
	h := p.hardLimit()
	taper := float64(h-admitted-cost+1) / float64(h-p.Capacity)
	return 1 - float64(float64(p.Capacity)/float64(offered+cost)*taper)
}

// randomScale is 2^53: the random number a suppressed decision draws is a
// whole number below it, and a request with refusal probability f passes
// iff that number is at least f × 2^53, a product computed exactly.
const randomScale = 1 << 53

// admits reports whether a window plan takes cost tokens, given the
// random number u in [0, 2^53) drawn for the request.
func admits(factor float64, u uint64) bool {
	return float64(u) >= factor*randomScale
}

// random53 draws a suppressed decision's random number: a whole number in
// [0, 2^53), uniform. The stores draw it in Go and pass it to the script,
// since Lua's math.random is reseeded on every call before Redis 7.0.
func random53() uint64 {
	return rand.Uint64() >> 11
}
