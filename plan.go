package tollgate

import (
	"fmt"
	"math"
	"time"
)

// MaxKeyLen is the longest key, in bytes, that a Limiter or Store accepts.
const MaxKeyLen = 1024

// maxCapacity is the largest Plan.Capacity: 2^53 micro-tokens, the largest
// whole number a Lua number holds exactly.
const maxCapacity = (1 << 53) / microTokens

// maxRefillPeriod is the longest time a plan may take to refill an empty
// bucket (Capacity / Rate): 100 years, so that every wait fits a
// time.Duration and every TTL fits Redis.
const maxRefillPeriod = 100 * 365 * 24 * time.Hour

// Default and largest Plan.Slots, and the shortest Plan.Window.
const (
	defaultSlots = 20
	maxSlots     = 64 // 64 counts and 2 fields keep Redis's hash a listpack
	minWindow    = time.Millisecond
)

// Plan is a named limit: a token bucket when Rate is set, a sliding window
// when Window is set, never both. The zero value is not valid.
//
// A token bucket holds Capacity tokens and refills at Rate: it admits at
// most Capacity + Rate × t in any span of t. A sliding window admits at
// most Capacity in any span of Window, whatever its start: it counts in
// Slots sub-windows and counts the oldest one in full until it lies wholly
// outside the window, so it never admits early, and may refuse for up to
// Window/Slots longer than an exact log would.
type Plan struct {
	// Name identifies the plan in calls and in Redis keys: 1 to 64 bytes
	// of [A-Za-z0-9_.-].
	Name string
	// Capacity is the bucket size, the largest burst, in tokens; for a
	// window plan, the most admitted in any Window: 1 to 9,007,199,254
	// (2^53 micro-tokens, the largest whole number a Lua number holds
	// exactly).
	Capacity int64
	// Rate is the refill rate of a token bucket in tokens per second:
	// positive, finite, and at least Capacity per 100 years, the longest
	// an empty bucket may take to refill. Per converts "n per duration".
	// It must be 0 for a window plan.
	Rate float64
	// Window makes the plan a sliding window of this length: 1 ms to 100
	// years, counted in whole microseconds, rounded up. It must be 0 for a
	// token bucket.
	Window time.Duration
	// Slots is the number of sub-windows a window plan counts in, 1 to
	// 64; 0 means 20. A request may be refused for up to one sub-window
	// longer than the window: Window/Slots (5% by default), rounded up
	// to whole µs, which adds at most Slots µs; memory per key grows with
	// Slots (docs/plans.md). It must be 0 for a token bucket.
	Slots int
	// Suppress, when not 0, puts a window plan in suppressed mode:
	// Capacity becomes a soft limit, and Capacity × Suppress,
	// rounded down, a hard one. Below the soft limit a request is
	// admitted; past the hard limit it is refused; in between it is
	// admitted with probability Capacity ÷ the load offered in the window,
	// admitted or not, so that in steady overload about Capacity pass per
	// window. It must be at least 1 (1.5 to 2 are usual), and 0 for a
	// token bucket. Suppressed plans write on every request, refusals
	// included, so the denial cache never answers for them.
	Suppress float64
	// Shadow puts the plan in dry run: it is decided, and its bucket
	// drained, exactly as if it were enforced, but it never denies. A
	// request it lacks the tokens for leaves its bucket as enforcement
	// would, so that its bucket always holds what the enforced plan would
	// hold; it is reported as PlanResult.WouldDeny, Result.ShadowDenied
	// and PlanStats.ShadowDenied. A Limiter's request for more tokens than
	// its Capacity is no error, as it is for an enforced plan
	// (ErrInvalidCost): it would deny it whatever its bucket holds, and
	// the request is decided on the other plans alone, with nothing taken
	// from it (see PlanResult). Only the first 52 plans of a chain may
	// be shadowed; a shadowed plan further along is ErrInvalidPlan. The
	// default, false, enforces the plan.
	Shadow bool
	// Version, when not 0, fences a change of this token bucket plan:
	// the first decision by a plan of a higher version than the bucket's
	// applies Inherit to its tokens, once, and stores the version with
	// the bucket, so that instances of old and new versions
	// running side by side never apply it twice. The default, 0, stores
	// nothing more and keeps the tokens, clamped. It must be 0 for a
	// window plan.
	Version uint32
	// Inherit is what a higher Version does to the bucket's tokens. The
	// default, the zero Inheritance, keeps them, clamped to the new
	// Capacity; any other needs a Version.
	Inherit Inheritance
	// Lease, when not 0, lets a Limiter on a RedisStore lease up to this
	// many tokens of a key at once and spend them locally, for a
	// decision that names this plan alone: one script call per
	// lease instead of one per decision. The unused rest goes back when
	// the lease ends (WithLeaseTTL) and at Limiter.Close; other
	// instances meanwhile see up to Lease tokens per instance as taken.
	// A lease serves only the plan it was taken for: after SetPlans, a
	// resolver's new plan or a new Version, the next decision gives it
	// back and the store decides under the new plan; Limiter.Reset drops
	// it. A plan shadowed by WithShadow takes no lease, so that it
	// reports what enforcement would. 1 to Capacity; 0 for a window plan
	// or one with Shadow set. The default, 0, decides every request in
	// Redis.
	Lease int64
	// Concurrency makes the plan a concurrency limit: at most Capacity
	// permits of a key are held at once, 1 to 10,000, whoever holds
	// them. Permits are taken with Limiter.Acquire and given back with
	// Permit.Release; a permit whose holder stops renewing it expires
	// after its lease (WithPermitLease). Rate, Window, Slots, Suppress,
	// Version, Inherit and Lease must be 0, and Shadow false. The
	// default, false, makes a token bucket or a window.
	Concurrency bool
}

// Per returns the rate, in tokens per second, of n tokens every d. For
// example Per(1000, time.Hour) is 1000 tokens an hour.
func Per(n float64, d time.Duration) float64 {
	return n / d.Seconds()
}

// validate checks every rule of Plan.
func (p Plan) validate() error {
	if err := p.validateName(); err != nil {
		return err
	}
	if err := p.validateNumbers(); err != nil {
		return fmt.Errorf("%w (plan %q)", err, p.Name)
	}
	return nil
}

// validateName checks that the name is 1 to 64 bytes of [A-Za-z0-9_.-], so
// that it names no key but its plan's. Stores call it on every request.
func (p Plan) validateName() error {
	if len(p.Name) < 1 || len(p.Name) > 64 {
		return fmt.Errorf("%w: name must be 1 to 64 bytes, got %d", ErrInvalidPlan, len(p.Name))
	}
	for i := 0; i < len(p.Name); i++ {
		c := p.Name[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '.' || c == '-') {
			return fmt.Errorf("%w: name %q: only [A-Za-z0-9_.-] allowed", ErrInvalidPlan, p.Name)
		}
	}
	return nil
}

// validateNumbers checks the fields the arithmetic depends on. Stores
// call it on every request, since they accept plans from callers other
// than Limiter.
func (p Plan) validateNumbers() error {
	if p.Capacity < 1 || p.Capacity > maxCapacity {
		return fmt.Errorf("%w: capacity must be 1 to %d, got %d", ErrInvalidPlan, maxCapacity, p.Capacity)
	}
	if p.Concurrency {
		return p.validateConcurrency()
	}
	if err := p.validateVersion(); err != nil {
		return err
	}
	if p.Lease != 0 && (p.Lease < 0 || p.Lease > p.Capacity || p.Window != 0 || p.Shadow) {
		return fmt.Errorf("%w: lease must be 0, or 1 to the capacity on an enforced token bucket, got %d", ErrInvalidPlan, p.Lease)
	}
	if p.Window != 0 {
		return p.validateWindow()
	}
	if p.Slots != 0 || p.Suppress != 0 {
		return fmt.Errorf("%w: slots and suppress are for window plans, and the plan has no window", ErrInvalidPlan)
	}
	if !(p.Rate > 0) || math.IsInf(p.Rate, 0) { // also rejects NaN
		return fmt.Errorf("%w: rate must be positive and finite for a token bucket, got %v (or set Window for a sliding window)", ErrInvalidPlan, p.Rate)
	}
	if float64(p.Capacity) > p.Rate*maxRefillPeriod.Seconds() {
		return fmt.Errorf("%w: capacity/rate is %.3g s, longer than 100 years", ErrInvalidPlan, float64(p.Capacity)/p.Rate)
	}
	return nil
}

// validateWindow checks the fields of a window plan.
func (p Plan) validateWindow() error {
	switch {
	case p.Rate != 0:
		return fmt.Errorf("%w: both rate and window are set: a rate makes a token bucket, a window a sliding window", ErrInvalidPlan)
	case p.Window < minWindow || p.Window > maxRefillPeriod:
		return fmt.Errorf("%w: window must be 1ms to 100 years, got %v", ErrInvalidPlan, p.Window)
	case p.Slots < 0 || p.Slots > maxSlots:
		return fmt.Errorf("%w: slots must be 0 (for %d) to %d, got %d", ErrInvalidPlan, defaultSlots, maxSlots, p.Slots)
	case p.Suppress != 0 && !(p.Suppress >= 1) || math.IsInf(p.Suppress, 0): // also rejects NaN
		return fmt.Errorf("%w: suppress must be 0 or at least 1, got %v", ErrInvalidPlan, p.Suppress)
	case float64(p.Capacity)*p.Suppress > maxCapacity:
		return fmt.Errorf("%w: the hard limit capacity × suppress exceeds %d", ErrInvalidPlan, maxCapacity)
	}
	return nil
}

// maxPermits is the largest Capacity of a concurrency plan: each permit
// is a member of a sorted set in Redis, which a renewal checks and
// rescores one by one, inside one script call.
const maxPermits = 10_000

// validateConcurrency checks the fields of a concurrency plan.
func (p Plan) validateConcurrency() error {
	switch {
	case p.Capacity > maxPermits:
		return fmt.Errorf("%w: a concurrency plan's capacity must be 1 to %d, got %d", ErrInvalidPlan, maxPermits, p.Capacity)
	case p.Rate != 0 || p.Window != 0 || p.Slots != 0 || p.Suppress != 0:
		return fmt.Errorf("%w: a concurrency plan has no rate, window, slots or suppress", ErrInvalidPlan)
	case p.Version != 0 || p.Inherit != 0 || p.Lease != 0 || p.Shadow:
		return fmt.Errorf("%w: a concurrency plan has no version, inherit, lease or shadow", ErrInvalidPlan)
	}
	return nil
}

// isWindow reports whether p is a sliding window rather than a bucket.
func (p Plan) isWindow() bool { return p.Window != 0 }

// slots returns k, the number of sub-windows of a window plan.
func (p Plan) slots() int64 {
	if p.Slots == 0 {
		return defaultSlots
	}
	return int64(p.Slots)
}

// width returns the length of one sub-window of a window plan, in µs: the
// window rounded up to whole µs, divided by k, rounded up, so that k
// sub-windows span at least the window.
func (p Plan) width() int64 {
	w := (p.Window + time.Microsecond - 1) / time.Microsecond
	k := p.slots()
	return (int64(w) + k - 1) / k
}

// hardLimit returns the hard limit of a suppressed plan, in tokens: the
// most it admits in any window.
func (p Plan) hardLimit() int64 {
	return int64(math.Floor(float64(p.Capacity) * p.Suppress))
}
