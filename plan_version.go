package tollgate

import (
	"fmt"
	"math"
)

// Inheritance says what a token bucket's tokens become when a plan of a
// higher Plan.Version takes it over, as bucket4j's
// TokensInheritanceStrategy does. Old and new are the capacities before
// and after, in tokens. The zero Inheritance, the default, keeps the
// tokens, clamped to the new capacity: what every plan change does
// without a version.
type Inheritance uint8

// inheritAsIs is the zero Inheritance.
const inheritAsIs Inheritance = 0

const (
	// InheritProportional keeps the bucket as full as it was: tokens ×
	// new ÷ old, rounded down to a micro-token.
	InheritProportional Inheritance = iota + 1
	// InheritReset fills the bucket to the new capacity.
	InheritReset
	// InheritAdditive keeps the tokens, clamped to the new capacity, and
	// adds the capacity gained, max(0, new − old): an upgrade grants its
	// extra burst at once.
	InheritAdditive

	numInheritances = iota + 1
)

// String returns "as-is", "proportional", "reset" or "additive".
func (h Inheritance) String() string {
	switch h {
	case inheritAsIs:
		return "as-is"
	case InheritProportional:
		return "proportional"
	case InheritReset:
		return "reset"
	case InheritAdditive:
		return "additive"
	}
	return "unknown"
}

// validateVersion checks Version and Inherit: a strategy other than
// as-is must be fenced by a version, or it would apply on every touch,
// and windows have none.
func (p Plan) validateVersion() error {
	switch {
	case p.Inherit >= numInheritances:
		return fmt.Errorf("%w: unknown inheritance %d", ErrInvalidPlan, p.Inherit)
	case p.Inherit != inheritAsIs && p.Version == 0:
		return fmt.Errorf("%w: inheritance %s needs a version above 0, or it would apply on every decision", ErrInvalidPlan, p.Inherit)
	case p.Version != 0 && p.isWindow():
		return fmt.Errorf("%w: versions are for token buckets", ErrInvalidPlan)
	}
	return nil
}

// versionedIn reports whether any of plans has a version: such a chain
// takes the script's wide argument layout, which has room for it.
func versionedIn(plans []Plan) bool {
	for i := range plans {
		if plans[i].Version != 0 {
			return true
		}
	}
	return false
}

// versionArg is plan p's version and inheritance as the script takes
// them: version × 4 + inheritance, below 2^34.
func versionArg(p *Plan) int64 {
	return int64(p.Version)*4 + int64(p.Inherit)
}

// bucketVersion is what a bucket keeps of the versioned plans that wrote
// it: the highest version (pv), never lowered, and the capacity of the
// last versioned write (c, in tokens; 0 if none), as the script keeps
// the hash fields pv and c.
type bucketVersion struct {
	pv uint32
	c  int64
}

// written returns v after plan p wrote the bucket.
func (v bucketVersion) written(p *Plan) bucketVersion {
	if p.Version == 0 {
		return v
	}
	return bucketVersion{pv: max(v.pv, p.Version), c: p.Capacity}
}

// fence returns how long, in µs, a bucket that holds version v outlives
// its refill under plan p, the plan that wrote it last: one full refill
// of the larger of p's capacity and v.c at p's rate, at most
// maxRefillPeriod, or 0 if v holds no version. A version that left with its bucket would let a reset or an
// additive change apply again; kept this long, the capacity such a
// change grants again is at most what the rate would have refilled
// while the bucket stood full. scripts/bucket.lua adds the same to a
// versioned bucket's expiry.
func (v bucketVersion) fence(p *Plan) int64 {
	if v.pv == 0 {
		return 0
	}
	return int64(math.Min(math.Floor(float64(max(p.Capacity, v.c)*microTokens)/p.Rate), float64(maxRefillPeriod.Microseconds())))
}

// inherit returns bucket b as plan p reads it: taken over by p.Inherit
// if p's version is above the bucket's, else as it is. The capacity it
// had is the last versioned write's, or p's own if none is known. The
// script does the same arithmetic on the same doubles.
func (v bucketVersion) inherit(b TokenBucket, p *Plan, now int64) TokenBucket {
	if p.Version <= v.pv {
		return b
	}
	full, old := p.Capacity*microTokens, p.Capacity*microTokens
	if v.c > 0 {
		old = v.c * microTokens
	}
	switch p.Inherit {
	case InheritProportional:
		b.Tokens = int64(math.Floor(float64(float64(b.Tokens)/float64(old)) * float64(full)))
	case InheritReset:
		return TokenBucket{Tokens: full, Stamp: now}
	case InheritAdditive:
		b.Tokens = min(b.Tokens, full) + max(0, full-old)
	}
	return b
}

// resetsByVersion reports whether a version's reset may have filled a
// bucket that a hold decided on was took its tokens from since, so that
// the bucket holds them already, as after Reset: for some plan i of was,
// unless bit i of skip leaves it alone, a plan of its name with
// InheritReset and a higher Version than was[i]'s is in force at the
// settlement, now[i], or was in the Limiter's table at any time (h).
// now and was name the same plans, index by index.
func resetsByVersion(was, now []Plan, skip uint64, h *planHistory) bool {
	for i := range min(len(was), len(now)) {
		if skip&(1<<i) != 0 {
			continue
		}
		v := h.resetOf(was[i].Name)
		if now[i].Inherit == InheritReset {
			v = max(v, now[i].Version)
		}
		if v > was[i].Version {
			return true
		}
	}
	return false
}

// refundScale returns the share of a refund to a hold decided on was that
// the buckets may take back: at most what the proportional versions of
// their names, since then (history then) and up to the settlement (now),
// made of the tokens the hold took, so that a refund gives back no more
// than the bucket would hold had the hold never taken them. One refund
// serves every plan of a chain: the least share of the plans, unless bit
// i of skip leaves plan i alone, so that the other plans may get back
// less than they lent. 1 if no proportional version came since; 0 if the
// history cannot tell (the name was forgotten since, or unknown then, or
// was's plan had no Version, whose bucket kept an older capacity).
func refundScale(was []Plan, skip uint64, then, now *planHistory) float64 {
	share := 1.0
	for i := range was {
		if skip&(1<<i) != 0 {
			continue
		}
		a, b := then.byName[was[i].Name], now.byName[was[i].Name]
		switch {
		case a.born == b.born && a.props == b.props:
			continue // no proportional version since
		case a.born == 0 || a.born != b.born || was[i].Version == 0:
			return 0
		}
		share = min(share, b.scale/a.scale)
	}
	return share
}

// scaleRefund returns refund tokens × share, rounded down to a token.
func scaleRefund(refund int64, share float64) int64 {
	if share >= 1 {
		return refund
	}
	return int64(math.Floor(float64(refund) * share))
}
