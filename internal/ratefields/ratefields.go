// Package ratefields computes the values of the rate limit fields that
// tollgate's adapters send with a decision: the IETF RateLimit-Policy and
// RateLimit fields, the legacy X-RateLimit-* fields and Retry-After. The
// net/http middleware (httplimit) writes them as header fields and the
// gRPC interceptors (grpclimit) as response metadata; both take them from
// here, so the two never disagree and a new kind of plan is described in
// one place.
//
// RateLimit-Policy and RateLimit follow the IETF draft "RateLimit header
// fields for HTTP", draft-ietf-httpapi-ratelimit-headers-11 (23 May 2026):
// each is a Structured Field List (RFC 9651) with one Item per chained
// plan, in the order asked, named by the plan as a String. A token bucket
// maps onto the draft's quota policy as follows:
//
//   - q, the quota, is Capacity: the largest burst.
//   - w, the window, is Capacity/Rate seconds rounded up: the time an empty
//     bucket takes to fill, so that q/w is about the sustained rate.
//   - r, the available quota, is the whole tokens left.
//   - t, the effective window, is the seconds until the next token accrues,
//     rounded up: until then the client can spend no more than r. The
//     time until the bucket is full would be wrong: it tells a client that
//     spent its tokens to hold back longer than it must, and a denied
//     client to hold back longer than Retry-After, which the draft forbids
//     (section 6).
//
// w and t need the plan's Rate or Window, which a Result of a
// tollgate.Limiter tells, as applied, or else a Planner; without either
// they are left out.
//
// A concurrency plan (tollgate.Plan.Concurrency) is a quota of permits
// held at once: q is its capacity and r its free permits after the
// decision, so that q-r are in flight. Permits come back when their
// holders release them, on no schedule: w and t are left out, and so are
// the reset and Retry-After of a decision it binds (see Concurrent). The optional parameter pk (partition key) is left out
// because keys may be personal data, and qu because the default unit,
// requests, is right unless a cost function charges more.
//
// The functions append to a caller's buffer and allocate nothing.
package ratefields

import (
	"iter"
	"math"
	"strconv"
	"time"

	"github.com/tollgate-go/tollgate"
)

// Planner describes plans by name. *tollgate.Limiter implements it.
type Planner interface {
	Plan(name string) (tollgate.Plan, bool)
}

// AppendPolicy appends the value of the RateLimit-Policy field for res,
// such as `"gold";q=20;w=10, "daily";q=10000;w=86400`, with shadowed
// plans (tollgate.Plan.Shadow) only if shadow is set. p may be nil.
func AppendPolicy(b []byte, res *tollgate.Result, p Planner, shadow bool) []byte {
	for n, pr := range shown(res, shadow) {
		b = appendItem(b, n, pr.Plan)
		b = appendParam(b, ";q=", pr.Limit)
		if plan, ok := describe(p, pr); ok {
			b = appendParam(b, ";w=", AtLeastOne(window(plan)))
		}
	}
	return b
}

// AppendRateLimit appends the value of the RateLimit field for res, such
// as `"gold";r=19;t=1, "daily";r=9999;t=9`, with shadowed plans only if
// shadow is set. p may be nil.
func AppendRateLimit(b []byte, res *tollgate.Result, p Planner, shadow bool) []byte {
	for n, pr := range shown(res, shadow) {
		b = appendItem(b, n, pr.Plan)
		b = appendParam(b, ";r=", pr.Remaining)
		if plan, ok := describe(p, pr); ok {
			b = appendParam(b, ";t=", AtLeastOne(nextToken(pr, plan)))
		}
	}
	return b
}

// AppendLimit appends the value of X-RateLimit-Limit: the binding plan's
// Capacity.
func AppendLimit(b []byte, res *tollgate.Result) []byte {
	return strconv.AppendInt(b, res.Limit, 10)
}

// AppendRemaining appends the value of X-RateLimit-Remaining: the binding
// plan's whole tokens left.
func AppendRemaining(b []byte, res *tollgate.Result) []byte {
	return strconv.AppendInt(b, res.Remaining, 10)
}

// Concurrent reports whether the binding plan of res is a concurrency
// plan, as p describes it: a Result whose binding plan tells a Rate or
// Window is not. Its permits come back on no schedule, so a decision it
// binds has no reset time, and a refusal no Retry-After. p may be nil:
// then it reports false.
func Concurrent(res *tollgate.Result, p Planner) bool {
	if p == nil || res.Rate > 0 || res.Window > 0 {
		return false
	}
	plan, ok := p.Plan(res.Plan)
	return ok && plan.Concurrency
}

// AppendReset appends the value of X-RateLimit-Reset: the seconds until
// the binding plan's bucket is full, rounded up.
func AppendReset(b []byte, res *tollgate.Result) []byte {
	return strconv.AppendInt(b, CeilSeconds(res.ResetAfter), 10)
}

// AppendRetryAfter appends the value of Retry-After for a denial: the
// seconds until the same request would pass, rounded up and at least 1
// (1.2s is 2, 0.3s is 1).
func AppendRetryAfter(b []byte, res *tollgate.Result) []byte {
	return strconv.AppendInt(b, AtLeastOne(res.RetryAfter), 10)
}

// shown yields the plans of res the fields list, numbered from 0: the
// shadowed ones only if shadow is set.
func shown(res *tollgate.Result, shadow bool) iter.Seq2[int, tollgate.PlanResult] {
	return func(yield func(int, tollgate.PlanResult) bool) {
		n := 0
		for _, pr := range res.PlanResults() {
			if pr.Shadow && !shadow {
				continue
			}
			if !yield(n, pr) {
				return
			}
			n++
		}
	}
}

// describe returns the plan of pr as it was applied: from pr itself when
// it tells its Rate or Window, as a tollgate.Limiter's results do, which
// may differ from the table's plan of that name (a resolver's tier);
// otherwise from p, if p knows it and it is not a concurrency plan, which
// has no window.
func describe(p Planner, pr tollgate.PlanResult) (tollgate.Plan, bool) {
	switch {
	case pr.Rate > 0 || pr.Window > 0:
		return tollgate.Plan{Name: pr.Plan, Capacity: pr.Limit, Rate: pr.Rate, Window: pr.Window}, true
	case p == nil:
		return tollgate.Plan{}, false
	}
	plan, ok := p.Plan(pr.Plan)
	return plan, ok && !plan.Concurrency // a permit accrues at no rate
}

// appendItem appends the i-th List member's separator and its bare item,
// the plan name as a String (RFC 9651, section 4.1.6). Names of a
// Limiter's plans need no escaping; other RateLimiters may return any
// name, so '"' and '\' are escaped and bytes a String cannot hold dropped.
func appendItem(b []byte, i int, name string) []byte {
	if i > 0 {
		b = append(b, ", "...)
	}
	b = append(b, '"')
	for j := 0; j < len(name); j++ {
		switch c := name[j]; {
		case c == '"' || c == '\\':
			b = append(b, '\\', c)
		case c >= 0x20 && c <= 0x7e:
			b = append(b, c)
		}
	}
	return append(b, '"')
}

func appendParam(b []byte, param string, v int64) []byte {
	return strconv.AppendInt(append(b, param...), v, 10)
}

// accrual returns the time n tokens take to accrue at rate, to the
// microsecond, the precision of tollgate.Result, so that 10000 tokens at
// Per(10000, 24*time.Hour) take 86400s, not a hair more.
func accrual(n int64, rate float64) time.Duration {
	return time.Duration(math.Round(float64(n)/rate*1e6)) * time.Microsecond
}

// nextToken returns the time until pr's bucket holds one more whole token,
// if the client spends none: the draft's effective window. A full bucket
// gains nothing until the client spends, and then its next token takes
// one token's accrual time.
//
// A sliding window gives nothing back one token at a time: its counts
// leave a sub-window at a time. A refused request learns when it would
// pass (RetryAfter, so that t never exceeds Retry-After); otherwise it
// learns when all have left (ResetAfter), or, when it counts nothing, the
// Window.
func nextToken(pr tollgate.PlanResult, plan tollgate.Plan) time.Duration {
	switch {
	case plan.Window > 0 && pr.RetryAfter > 0:
		return pr.RetryAfter
	case plan.Window > 0 && pr.ResetAfter > 0:
		return pr.ResetAfter
	case plan.Window > 0:
		return plan.Window
	case pr.Remaining >= pr.Limit:
		return accrual(1, plan.Rate)
	}
	// The bucket fills in ResetAfter: the part of a token that the next
	// token still lacks, then Limit-Remaining-1 whole tokens.
	return pr.ResetAfter - accrual(pr.Limit-pr.Remaining-1, plan.Rate)
}

// window returns the draft's window of a plan: a window plan's Window,
// or the time a token bucket takes to refill from empty.
func window(plan tollgate.Plan) time.Duration {
	if plan.Window > 0 {
		return plan.Window
	}
	return accrual(plan.Capacity, plan.Rate)
}

// CeilSeconds returns d, at least 0, in seconds rounded up.
func CeilSeconds(d time.Duration) int64 {
	return int64((max(d, 0) + time.Second - 1) / time.Second)
}

// AtLeastOne returns CeilSeconds(d), but at least 1: a zero window or
// Retry-After would tell the client to come back at once.
func AtLeastOne(d time.Duration) int64 {
	return max(CeilSeconds(d), 1)
}
