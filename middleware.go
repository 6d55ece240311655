package tollgate

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"
)

// Middleware returns net/http middleware that rate limits requests: each
// takes a token from the buckets of plans for the key that key returns,
// from all of them or from none, as AllowN does. No plans means the
// Limiter's default plan.
//
//	mux.Handle("/api/", tollgate.Middleware(lim, tollgate.ByHeader("X-API-Key"), []string{"gold", "daily"})(apiHandler))
//
// An allowed request goes on to the handler; a denied one gets 429 Too
// Many Requests and Retry-After. Both get the rate limit header fields
// (see HeaderMode), set before the handler runs. A request without a key
// gets 400 Bad Request. A request the Limiter cannot decide gets 503
// Service Unavailable: under FailClosed that includes a store outage, which
// the Fallback and FailOpen policies decide without the store. The options
// change these answers.
//
// It panics if l or key is nil, if a plan is named twice, if an option is
// invalid, or if l describes its plans, as *Limiter does, and one of plans
// is not among them. The middleware is safe for concurrent use.
func Middleware(l RateLimiter, key KeyFunc, plans []string, opts ...MiddlewareOption) func(http.Handler) http.Handler {
	if l == nil || key == nil {
		panic("tollgate: Middleware: nil RateLimiter or KeyFunc")
	}
	m := &middleware{
		lim:      l,
		key:      key,
		plans:    slices.Clone(plans),
		denied:   tooManyRequests,
		keyError: noKey,
		onError:  undecided,
	}
	m.planner, _ = l.(planner)
	for i, name := range m.plans {
		if slices.Contains(m.plans[:i], name) {
			panic(fmt.Sprintf("tollgate: Middleware: plan %q named twice", name))
		}
		if m.planner != nil {
			if _, ok := m.planner.Plan(name); !ok {
				panic(fmt.Sprintf("tollgate: Middleware: unknown plan %q", name))
			}
		}
	}
	for _, o := range opts {
		o(m)
	}
	if m.headers < HeadersBoth || m.headers > HeadersNone {
		panic(fmt.Sprintf("tollgate: Middleware: unknown HeaderMode %d", m.headers))
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			m.serve(w, r, next)
		})
	}
}

// MiddlewareOption configures Middleware.
type MiddlewareOption func(*middleware)

// WithCost sets the tokens a request takes to cost(r), which must be at
// least 1 and at most the Capacity of each plan. A cost outside that range
// is a bug in cost, answered 500 (see WithErrorHandler): reject requests
// too large to ever pass, with 413 for example, before the middleware.
// The default, or a nil cost, takes 1 token per request.
func WithCost(cost func(r *http.Request) int64) MiddlewareOption {
	return func(m *middleware) { m.cost = cost }
}

// WithSkip exempts the requests for which skip returns true, such as
// health checks or CORS preflight requests: they go on to the handler without a key, without taking
// a token and without rate limit header fields. The default, or a nil
// skip, exempts none.
func WithSkip(skip func(r *http.Request) bool) MiddlewareOption {
	return func(m *middleware) { m.skip = skip }
}

// WithHeaders selects the rate limit header fields written on allowed and
// denied requests. The default is HeadersBoth.
func WithHeaders(mode HeaderMode) MiddlewareOption {
	return func(m *middleware) { m.headers = mode }
}

// WithDeniedHandler sets what answers a denied request, res being the
// decision. The rate limit header fields and Retry-After are set when it
// runs. The default, or a nil denied, answers 429 Too Many Requests with
// a short text/plain body.
func WithDeniedHandler(denied func(w http.ResponseWriter, r *http.Request, res Result)) MiddlewareOption {
	return func(m *middleware) {
		if denied != nil {
			m.denied = denied
		}
	}
}

// WithKeyErrorHandler sets what answers a request that has no usable key:
// err is the KeyFunc's error, or ErrInvalidKey for a key that is empty or
// longer than MaxKeyLen. The default, or a nil h, answers 400 Bad Request
// with a short text/plain body that never holds the key.
func WithKeyErrorHandler(h func(w http.ResponseWriter, r *http.Request, err error)) MiddlewareOption {
	return func(m *middleware) {
		if h != nil {
			m.keyError = h
		}
	}
}

// WithErrorHandler sets what answers a request the Limiter could not
// decide, err being AllowN's error. The default, or a nil h, answers with
// a short text/plain body: 503 Service Unavailable when the store is
// unavailable (ErrStoreUnavailable, which a Limiter returns under
// FailClosed only) or the request's context ended, and 500 Internal Server
// Error otherwise, for errors that are bugs, such as ErrInvalidCost from a
// WithCost function.
func WithErrorHandler(h func(w http.ResponseWriter, r *http.Request, err error)) MiddlewareOption {
	return func(m *middleware) {
		if h != nil {
			m.onError = h
		}
	}
}

type middleware struct {
	lim     RateLimiter
	planner planner // lim, if it describes its plans; else nil
	key     KeyFunc
	plans   []string

	cost     func(*http.Request) int64
	skip     func(*http.Request) bool
	headers  HeaderMode
	denied   func(http.ResponseWriter, *http.Request, Result)
	keyError func(http.ResponseWriter, *http.Request, error)
	onError  func(http.ResponseWriter, *http.Request, error)
}

func (m *middleware) serve(w http.ResponseWriter, r *http.Request, next http.Handler) {
	if m.skip != nil && m.skip(r) {
		next.ServeHTTP(w, r)
		return
	}
	key, err := m.key(r)
	if err != nil {
		m.keyError(w, r, err)
		return
	}
	cost := int64(1)
	if m.cost != nil {
		cost = m.cost(r)
	}
	res, err := m.lim.AllowN(r.Context(), key, cost, m.plans...)
	switch {
	case errors.Is(err, ErrInvalidKey):
		m.keyError(w, r, err)
		return
	case err != nil:
		m.onError(w, r, err)
		return
	}
	setFields(w.Header(), &res, m.headers, m.planner)
	if !res.Allowed {
		m.denied(w, r, res)
		return
	}
	next.ServeHTTP(w, r)
}

func tooManyRequests(w http.ResponseWriter, _ *http.Request, _ Result) {
	http.Error(w, "too many requests", http.StatusTooManyRequests)
}

func noKey(w http.ResponseWriter, _ *http.Request, _ error) {
	http.Error(w, "bad request: no rate limit key", http.StatusBadRequest)
}

func undecided(w http.ResponseWriter, _ *http.Request, err error) {
	if errors.Is(err, ErrStoreUnavailable) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		http.Error(w, "service unavailable", http.StatusServiceUnavailable)
		return
	}
	http.Error(w, "internal server error", http.StatusInternalServerError)
}
