package tollgate

import "math"

// microTokens is the number of micro-tokens in one token. Buckets count in
// micro-tokens so that fractional refills are whole numbers, exact in Go
// and in Lua (see docs/adr/0001-token-representation.md).
const microTokens = 1_000_000

// TokenBucket is the state of one plan's bucket and the arithmetic that
// refills and drains it. It does no I/O and reads no clock: every method
// takes the time, in microseconds since the Unix epoch (the unit of Redis
// TIME). MemoryStore applies it under a lock; scripts/limit.lua
// repeats the same arithmetic inside Redis, and a test keeps the two equal.
//
// A TokenBucket is a value; methods return a new state and never modify
// their receiver.
type TokenBucket struct {
	// Tokens is the number of micro-tokens held at Stamp, 0 to the plan's
	// Capacity × 1,000,000: buckets count in millionths of a token.
	Tokens int64

	// Stamp is the time of the last refill, in microseconds. It may lag the
	// time of the refill by less than the time one micro-token takes to
	// accrue: that fraction is carried to the next refill, not lost. It never
	// moves backwards.
	Stamp int64
}

// fullBucket returns a bucket holding p.Capacity tokens at now, the state of
// a key that has not been seen or whose bucket expired.
func fullBucket(p Plan, now int64) TokenBucket {
	return TokenBucket{Tokens: p.Capacity * microTokens, Stamp: now}
}

// Refill returns the bucket as of now: the tokens accrued at p.Rate since
// Stamp are added, up to p.Capacity. A now before Stamp refills nothing and
// leaves Stamp where it is, so a clock that steps back cannot mint tokens;
// but a Stamp more than a full refill (Capacity / Rate) ahead of now is
// brought back to a full refill ahead, tokens kept: a garbage
// stamp blocks a key for at most one full refill, and a debt that another
// plan of the name, with a longer refill, ran up reads as the most debt
// this plan allows, never as a full bucket. A decision that asks for
// tokens (cost > 0) and finds such a stamp writes the bucket back,
// allowed or not; a read writes nothing. Read the clock no earlier
// than the bucket's last write, as MemoryStore's lock does: a now read
// before a long pause could look like such a stamp.
func (b TokenBucket) Refill(p Plan, now int64) TokenBucket {
	return b.refill(&p, now)
}

// refill is Refill with the plan by pointer, as every caller inside the
// package passes it: a Plan has more fields than the registers that carry
// arguments, so by value it is copied through memory on every call.
func (b TokenBucket) refill(p *Plan, now int64) TokenBucket {
	full := p.Capacity * microTokens
	if now <= b.Stamp {
		b.Tokens = min(b.Tokens, full)
		if b.tooFarAhead(p, now) {
			b.Stamp = now + int64(math.Floor(float64(full)/p.Rate))
		}
		return b
	}
	if b.Tokens >= full {
		return TokenBucket{Tokens: full, Stamp: now}
	}
	// Rate in tokens per second is also micro-tokens per microsecond. The
	// explicit float64 conversion forbids fused multiply-add, which Lua
	// cannot do, so Go and Lua round identically on every platform. Only
	// whole numbers are compared and added, so no sum is ever rounded.
	gain := float64(float64(now-b.Stamp) * p.Rate)
	whole := math.Floor(gain)
	if float64(b.Tokens)+whole >= float64(full) {
		return TokenBucket{Tokens: full, Stamp: now}
	}
	stamp := now
	if gain != whole { // the division is slow, and a rate in whole micro-tokens per µs needs none
		stamp -= int64(math.Floor((gain - whole) / p.Rate)) // microseconds not yet worth a micro-token
	}
	return TokenBucket{Tokens: b.Tokens + int64(whole), Stamp: stamp}
}

// tooFarAhead reports whether the bucket's stamp is more than a full
// refill of p ahead of now: garbage, a clock that stepped back that far,
// or a debt run up under a plan of the name with a longer refill. Refill
// brings it back to a full refill ahead.
func (b TokenBucket) tooFarAhead(p *Plan, now int64) bool {
	return float64(b.Stamp-now) > float64(p.Capacity*microTokens)/p.Rate
}

// Take refills the bucket to now and takes cost tokens from it if it holds
// them. It returns the new state and whether the tokens were taken; when
// they were not, the state is only refilled. A cost of 0 takes nothing and
// always succeeds.
func (b TokenBucket) Take(p Plan, now, cost int64) (TokenBucket, bool) {
	one := [1]TokenBucket{b}
	ok, _ := takeAll([]Plan{p}, one[:], now, cost)
	return one[0], ok
}

// takeAll is Take for chained bucket plans, all or nothing: it refills
// every bucket to now, and takes cost tokens from each only if each holds
// them. A shadowed plan that lacks them does not deny: bit i of wd says
// so for plan i, whose bucket is then only refilled.
// buckets[i] is the bucket of plans[i] and is updated in place.
func takeAll(plans []Plan, buckets []TokenBucket, now, cost int64) (ok bool, wd uint64) {
	need := cost * microTokens
	ok = true
	for i := range plans {
		buckets[i] = buckets[i].refill(&plans[i], now)
		if buckets[i].Tokens < need {
			if plans[i].Shadow {
				wd |= 1 << i
			} else {
				ok = false
			}
		}
	}
	if ok && cost > 0 { // a read (cost 0, or -n for PeekN) takes nothing
		for i := range buckets {
			if wd&(1<<i) == 0 {
				buckets[i].Tokens -= need
			}
		}
	}
	return ok, wd
}

// Remaining is the number of whole tokens in the bucket as last refilled.
func (b TokenBucket) Remaining() int64 {
	return b.Tokens / microTokens
}

// ReadyAt returns the time, in microseconds, at which Take will find cost
// tokens in the bucket, assuming nothing else takes from it: now if they
// are there. It measures from Stamp, as that Take will refill, so the
// answer is exact for the bucket as stored. cost must not exceed
// p.Capacity.
func (b TokenBucket) ReadyAt(p Plan, now, cost int64) int64 {
	return b.readyWhen(&p, now, cost)
}

// readyWhen is ReadyAt with the plan by pointer (see refill).
func (b TokenBucket) readyWhen(p *Plan, now, cost int64) int64 {
	r := b.refill(p, now)
	if r.Tokens >= cost*microTokens {
		return now
	}
	if b.Stamp >= now { // nothing accrued: r is b, its stamp brought back if too far ahead
		return r.readyAt(p, now, cost)
	}
	// Not there yet: the tokens accrue from Stamp until floor(elapsed ×
	// rate) covers the deficit, which is also when a refill would reach a
	// full bucket.
	b.Tokens = min(b.Tokens, p.Capacity*microTokens)
	return b.readyAt(p, now, cost)
}

// readyAt is ReadyAt for a bucket as Refill or takeAll left it at now,
// which needs no second refill.
func (b TokenBucket) readyAt(p *Plan, now, cost int64) int64 {
	need := cost * microTokens
	if b.Tokens >= need {
		return now
	}
	return max(now, b.Stamp+accrualMicros(need-b.Tokens, p.Rate))
}

// FullAt returns the time, in microseconds, at which the bucket will be
// full again, assuming nothing takes from it.
func (b TokenBucket) FullAt(p Plan, now int64) int64 {
	return b.ReadyAt(p, now, p.Capacity)
}

// accrualMicros returns the fewest whole microseconds in which deficit
// micro-tokens accrue at rate, as Refill computes accrual: the smallest w
// with floor(w × rate) >= deficit.
func accrualMicros(deficit int64, rate float64) int64 {
	// The quotient is off by at most one unit in its last place, and every
	// value here is below 2^53, so its ceiling is off by at most one: one
	// step either way lands on the smallest w.
	d := float64(deficit)
	w := math.Ceil(d / rate)
	if w > 1 && math.Floor(float64((w-1)*rate)) >= d {
		w--
	} else if math.Floor(float64(w*rate)) < d {
		w++
	}
	return int64(w)
}

// adjust returns the bucket refilled to now with delta micro-tokens added:
// a refund when delta > 0, capped at a full bucket, and a charge when
// delta < 0, which may take the bucket below empty. What a bucket owes is
// kept as its stamp moved ahead of now, by the time the debt takes to
// accrue: a bucket in debt holds no tokens and refills nothing until its
// stamp, so its RetryAfter counts the debt. A bucket that holds tokens
// with its stamp ahead of now is not in debt but behind a clock that
// stepped back: it is adjusted at its stamp, its own time, as Refill
// keeps it. Debt is rounded up and its stamp ahead of now at most
// floor(Capacity / Rate) µs, one full refill, which Refill would bring
// back to that beyond; uncharged is the part of a charge, in micro-tokens, that
// did not fit. No adjustment mints tokens beyond delta.
// scripts/bucket.lua repeats it.
func (b TokenBucket) adjust(p Plan, now, delta int64) (_ TokenBucket, uncharged int64) {
	b = b.Refill(p, now)
	full := p.Capacity * microTokens
	at := now // the bucket's time
	balance := b.Tokens
	switch {
	case b.Stamp > now && b.Tokens == 0: // in debt: what it owes at now, rounded up
		balance = -int64(math.Ceil(float64(float64(b.Stamp-now) * p.Rate)))
	case b.Stamp > now:
		at = b.Stamp
	}
	balance += delta
	switch {
	case balance >= full:
		return TokenBucket{Tokens: full, Stamp: at}, 0
	case balance >= 0:
		return TokenBucket{Tokens: balance, Stamp: min(b.Stamp, at)}, 0
	}
	ahead := int64(math.Floor(float64(full)/p.Rate)) - (at - now) // the most a stamp may be ahead of at
	most := int64(math.Floor(float64(float64(ahead) * p.Rate)))   // the debt that accrues in ahead
	// Debt within most accrues within ahead, as accrualMicros counts; the
	// time of more may not fit an int64 of µs.
	if -balance <= most {
		return TokenBucket{Stamp: at + accrualMicros(-balance, p.Rate)}, 0
	}
	return TokenBucket{Stamp: at + ahead}, -balance - most
}
