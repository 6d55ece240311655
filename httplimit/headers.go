package httplimit

import (
	"net/http"
	"strconv"
	"strings"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/ratefields"
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
// Behind another Middleware, which set the fields before, the IETF lists
// hold its plans and then these, and the legacy fields describe the plan
// closest to denying across both, or the one that denied.
//
// A denial also gets Retry-After, in every mode: the seconds until the same
// request would pass, rounded up and at least 1 (1.2s is 2, 0.3s is 1).
//
// A concurrency plan (tollgate.Plan.Concurrency) is described by q, its
// capacity, and r, its free permits after the decision, so that q-r
// requests are in flight; the legacy Limit and Remaining say the same
// when it binds. Its permits come back when their requests end, on no
// schedule: it has no w or t, and when it binds, no X-RateLimit-Reset,
// and a denial no Retry-After. With two plans of 10 permits and 100
// requests a minute, the 11th request in flight gets:
//
//	RateLimit-Policy: "inflight";q=10, "minute";q=100;w=60
//	RateLimit: "inflight";r=0, "minute";r=90;t=1
//	X-RateLimit-Limit: 10
//	X-RateLimit-Remaining: 0
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
type planner = ratefields.Planner

// WithShadowHeaders has the rate limit fields describe shadowed plans
// (tollgate.Plan.Shadow, tollgate.WithShadow) too, as if they were
// enforced, so that clients see a limit before it is enforced. Shadowed
// plans never cause a 429 or Retry-After. The default leaves them out: the
// IETF fields list the enforced plans only, and when every plan is
// shadowed no rate limit field is written.
func WithShadowHeaders() Option {
	return func(m *middleware) { m.shadowHeaders = true }
}

// setFields sets the fields of mode for res on h, and Retry-After if res
// is a denial; shadowed plans only if shadow is set. p may be nil. A
// binding concurrency plan has no reset or Retry-After to tell. The
// values come from package ratefields, which the gRPC interceptors share.
func setFields(h http.Header, res *tollgate.Result, mode HeaderMode, p planner, shadow bool) {
	var buf [256]byte
	f := fields{buf: buf[:0]}
	if !shadow && allShadowed(res) {
		mode = HeadersNone
	}
	scheduled := !ratefields.Concurrent(res, p)
	if mode == HeadersBoth || mode == HeadersIETF {
		f.buf = ratefields.AppendPolicy(f.buf, res, p, shadow)
		f.end(fieldPolicy)
		f.buf = ratefields.AppendRateLimit(f.buf, res, p, shadow)
		f.end(fieldRateLimit)
	}
	if (mode == HeadersBoth || mode == HeadersLegacy) && !boundBefore(h, res) {
		delete(h, fieldNames[fieldReset]) // a binding concurrency plan has none
		f.buf = ratefields.AppendLimit(f.buf, res)
		f.end(fieldLimit)
		f.buf = ratefields.AppendRemaining(f.buf, res)
		f.end(fieldRemaining)
		if scheduled {
			f.buf = ratefields.AppendReset(f.buf, res)
			f.end(fieldReset)
		}
	}
	if !res.Allowed && scheduled {
		f.buf = ratefields.AppendRetryAfter(f.buf, res)
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

// setOn sets the fields on h, replacing the values they had, but for
// the IETF lists, RateLimit-Policy and RateLimit: a Middleware in front
// set those for its plans, and the plans of this one join its list.
func (f *fields) setOn(h http.Header) {
	if f.n == 0 {
		return
	}
	s := string(f.buf)
	values := make([]string, f.n)
	start := 0
	for i := range f.n {
		values[i] = s[start:f.ends[i]]
		name := fieldNames[f.ids[i]]
		// Capacity 1, so that a later Header.Add copies the slice rather
		// than overwrite the next field's value.
		v := values[i : i+1 : i+1]
		if listed := f.ids[i] == fieldPolicy || f.ids[i] == fieldRateLimit; listed && len(h[name]) > 0 {
			v = []string{strings.Join(h[name], ", ") + ", " + values[i]}
		}
		h[name] = v
		start = f.ends[i]
	}
}

// boundBefore reports whether h holds the legacy fields of a plan that
// binds over the binding plan of res, allowed: set by a Middleware in
// front, whose decision allowed too, for a plan with no more whole tokens
// left (the first on a tie, as within one Result).
func boundBefore(h http.Header, res *tollgate.Result) bool {
	before := h[fieldNames[fieldRemaining]]
	if !res.Allowed || len(before) == 0 {
		return false
	}
	n, err := strconv.ParseInt(before[0], 10, 64)
	return err == nil && n <= res.Remaining
}

// allShadowed reports whether every plan of res is shadowed: then the
// binding plan, which the legacy fields describe, is a shadowed one.
func allShadowed(res *tollgate.Result) bool {
	for _, pr := range res.PlanResults() {
		if !pr.Shadow {
			return false
		}
	}
	return true
}
