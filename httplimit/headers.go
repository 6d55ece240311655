package httplimit

import (
	"math"
	"net/http"
	"strconv"
	"time"

	"github.com/tollgate-go/tollgate"
)

// HeaderMode selects the rate limit header fields that Middleware writes
// for a decision.
//
// RateLimit-Policy and RateLimit follow the IETF draft "RateLimit header
// fields for HTTP", draft-ietf-httpapi-ratelimit-headers-11 (23 May 2026):
// each is a Structured Field List (RFC 9651) with one Item per chained
// plan, in the order asked, named by the plan as a String. After the
// first request of a key to the plans gold (Capacity 20, Rate 2) and daily
// (Capacity 10000, tollgate.Per(10000, 24*time.Hour)):
//
//	RateLimit-Policy: "gold";q=20;w=10, "daily";q=10000;w=86400
//	RateLimit: "gold";r=19;t=1, "daily";r=9999;t=9
//
// A token bucket maps onto the draft's quota policy as follows:
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
// w and t need the plan's Rate, which only a RateLimiter with a
// Plan(name string) (tollgate.Plan, bool) method tells, as
// *tollgate.Limiter does; without it they are left out. The optional
// parameter pk (partition key) is left out because keys may be personal
// data, and qu because the default unit, requests, is right unless
// WithCost charges more.
//
// The legacy fields describe the binding plan (the top-level fields of
// tollgate.Result):
//
//	X-RateLimit-Limit: 20       its Capacity
//	X-RateLimit-Remaining: 19   its whole tokens left
//	X-RateLimit-Reset: 1        seconds until its bucket is full, rounded up
//
// A denial also gets Retry-After, in every mode: the seconds until the same
// request would pass, rounded up and at least 1 (1.2s is 2, 0.3s is 1).
type HeaderMode int

const (
	// HeadersBoth writes the IETF fields and the legacy fields. It is the
	// default: clients in use today read X-RateLimit-*, and the IETF
	// fields are where they are going.
	HeadersBoth HeaderMode = iota
	// HeadersIETF writes RateLimit-Policy and RateLimit.
	HeadersIETF
	// HeadersLegacy writes X-RateLimit-Limit, X-RateLimit-Remaining and
	// X-RateLimit-Reset.
	HeadersLegacy
	// HeadersNone writes no rate limit fields. Denials still get
	// Retry-After.
	HeadersNone
)

// field is a header field that setFields writes.
type field uint8

const (
	fieldPolicy field = iota
	fieldRateLimit
	fieldLimit
	fieldRemaining
	fieldReset
	fieldRetryAfter
	numFields
)

// fieldNames are the names of the fields in canonical form, so that they
// index an http.Header.
var fieldNames = [numFields]string{
	fieldPolicy:     "Ratelimit-Policy",
	fieldRateLimit:  "Ratelimit",
	fieldLimit:      "X-Ratelimit-Limit",
	fieldRemaining:  "X-Ratelimit-Remaining",
	fieldReset:      "X-Ratelimit-Reset",
	fieldRetryAfter: "Retry-After",
}

// planner describes plans by name. *tollgate.Limiter implements it.
type planner interface {
	Plan(name string) (tollgate.Plan, bool)
}

// setFields sets the fields of mode for res on h, and Retry-After if res
// is a denial. p may be nil.
func setFields(h http.Header, res *tollgate.Result, mode HeaderMode, p planner) {
	var buf [256]byte
	f := fields{buf: buf[:0]}
	if mode == HeadersBoth || mode == HeadersIETF {
		prs := res.PlanResults()
		for i, pr := range prs {
			f.buf = appendItem(f.buf, i, pr.Plan)
			f.buf = appendParam(f.buf, ";q=", pr.Limit)
			if plan, ok := describe(p, pr.Plan); ok {
				f.buf = appendParam(f.buf, ";w=", atLeastOne(accrual(plan.Capacity, plan.Rate)))
			}
		}
		f.end(fieldPolicy)
		for i, pr := range prs {
			f.buf = appendItem(f.buf, i, pr.Plan)
			f.buf = appendParam(f.buf, ";r=", pr.Remaining)
			if plan, ok := describe(p, pr.Plan); ok {
				f.buf = appendParam(f.buf, ";t=", atLeastOne(nextToken(pr, plan.Rate)))
			}
		}
		f.end(fieldRateLimit)
	}
	if mode == HeadersBoth || mode == HeadersLegacy {
		f.buf = strconv.AppendInt(f.buf, res.Limit, 10)
		f.end(fieldLimit)
		f.buf = strconv.AppendInt(f.buf, res.Remaining, 10)
		f.end(fieldRemaining)
		f.buf = strconv.AppendInt(f.buf, ceilSeconds(res.ResetAfter), 10)
		f.end(fieldReset)
	}
	if !res.Allowed {
		f.buf = strconv.AppendInt(f.buf, atLeastOne(res.RetryAfter), 10)
		f.end(fieldRetryAfter)
	}
	f.setOn(h)
}

// fields collects the values of a response's header fields in one buffer,
// so that setting all of them costs two allocations, a string and a
// []string, rather than two for each field. It holds no string, which
// would let the buffer escape to the heap along with the field names.
type fields struct {
	buf  []byte
	ids  [numFields]field
	ends [numFields]int // ends[i] is where the value of field ids[i] ends in buf
	n    int
}

// end ends the value of field id: what was appended since the last end.
func (f *fields) end(id field) {
	f.ids[f.n], f.ends[f.n] = id, len(f.buf)
	f.n++
}

// setOn sets the fields on h, replacing the values they had.
func (f *fields) setOn(h http.Header) {
	if f.n == 0 {
		return
	}
	s := string(f.buf)
	values := make([]string, f.n)
	start := 0
	for i := range f.n {
		values[i] = s[start:f.ends[i]]
		// Capacity 1, so that a later Header.Add copies the slice rather
		// than overwrite the next field's value.
		h[fieldNames[f.ids[i]]] = values[i : i+1 : i+1]
		start = f.ends[i]
	}
}

// describe returns the plan named name, if p knows it.
func describe(p planner, name string) (tollgate.Plan, bool) {
	if p == nil {
		return tollgate.Plan{}, false
	}
	return p.Plan(name)
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
func nextToken(pr tollgate.PlanResult, rate float64) time.Duration {
	if pr.Remaining >= pr.Limit {
		return accrual(1, rate)
	}
	// The bucket fills in ResetAfter: the part of a token that the next
	// token still lacks, then Limit-Remaining-1 whole tokens.
	return pr.ResetAfter - accrual(pr.Limit-pr.Remaining-1, rate)
}

// ceilSeconds returns d, at least 0, in seconds rounded up.
func ceilSeconds(d time.Duration) int64 {
	return int64((max(d, 0) + time.Second - 1) / time.Second)
}

// atLeastOne returns ceilSeconds(d), but at least 1: a zero window or
// Retry-After would tell the client to come back at once.
func atLeastOne(d time.Duration) int64 {
	return max(ceilSeconds(d), 1)
}
