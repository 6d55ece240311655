// Package httplimit rate limits net/http requests with a
// tollgate.RateLimiter. Middleware takes a token for each request from the
// buckets of the request's key, which a KeyFunc finds (the client's IP
// address, an API key header, the authenticated principal), and tells the
// client its limits in the RateLimit header fields:
//
//	limit := httplimit.Middleware(lim, httplimit.ByIP(), httplimit.WithPlans("gold", "daily"))
//	mux.Handle("/api/", limit(apiHandler))
//
// A plan resolver (tollgate.WithPlanResolver) is given the key the client sent, such as the
// API key within "header:X-Api-Key:key-gold" (see KeyFunc).
//
// Everything in this package is safe for concurrent use.
package httplimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"slices"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/callerkey"
	"github.com/tollgate-go/tollgate/internal/isnil"
)

// Middleware returns net/http middleware that rate limits requests: each
// takes a token from the buckets of the plans (see WithPlans) for the key
// that key returns, from all of them or from none, as AllowN does.
//
//	mux.Handle("/api/", httplimit.Middleware(lim, httplimit.ByHeader("X-API-Key"), httplimit.WithPlans("gold", "daily"))(apiHandler))
//
// An allowed request goes on to the handler; a denied one gets 429 Too
// Many Requests and Retry-After. Both get the rate limit header fields
// (see HeaderMode), set before the handler runs. A concurrency plan among
// the plans holds its permits while the handler runs (see Acquirer). A request without a key
// gets 400 Bad Request. A request the RateLimiter cannot decide gets 503
// Service Unavailable: under tollgate.FailClosed that includes a store
// outage, which the tollgate.Fallback and tollgate.FailOpen policies
// decide without the store. The options change these answers.
//
// It panics if l (also a typed nil, such as a *tollgate.Limiter never
// set) or key is nil, if a plan is named twice, if an option is
// invalid, or if l describes its plans, as *tollgate.Limiter does, and
// one of the plans is not among them, or one is a concurrency plan and l
// is not an Acquirer or WithSettle is given (a reservation holds no
// permits), or one is a sliding window and WithSettle is given (Reserve
// refuses windows), or, without WithPlans, l's default plan is a
// concurrency plan: these are wiring mistakes, caught when the program starts. Serving never panics. The middleware is
// safe for concurrent use.
func Middleware(l tollgate.RateLimiter, key KeyFunc, opts ...Option) func(http.Handler) http.Handler {
	if isnil.Value(l) || key == nil {
		panic("httplimit: Middleware: nil RateLimiter or KeyFunc")
	}
	m := &middleware{
		lim:      l,
		key:      key,
		denied:   tooManyRequests,
		keyError: noKey,
		onError:  undecided,

		releaseError: logReleaseError,
	}
	m.planner, _ = l.(planner)
	for _, o := range opts {
		o(m)
	}
	for i, name := range m.plans {
		if slices.Contains(m.plans[:i], name) {
			panic(fmt.Sprintf("httplimit: Middleware: plan %q named twice", name))
		}
		if m.planner != nil {
			plan, ok := m.planner.Plan(name)
			if !ok {
				panic(fmt.Sprintf("httplimit: Middleware: unknown plan %q", name))
			}
			m.permits = m.permits || plan.Concurrency
		}
	}
	m.checkDefault()
	m.checkSettle()
	if _, ok := l.(Reserver); m.final != nil && !ok {
		panic("httplimit: Middleware: WithSettle needs a RateLimiter that is a Reserver")
	}
	if _, ok := l.(Acquirer); m.permits && (!ok || m.final != nil) {
		panic("httplimit: Middleware: a concurrency plan needs a RateLimiter that is an Acquirer, and no WithSettle")
	}
	if m.headers < HeadersBoth || m.headers > HeadersNone {
		panic(fmt.Sprintf("httplimit: Middleware: unknown HeaderMode %d", m.headers))
	}
	return func(next http.Handler) http.Handler {
		return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			m.serve(w, r, next)
		})
	}
}

// Option configures Middleware.
type Option func(*middleware)

// WithPlans names the plans each request takes its tokens from: from all
// of them, or, if one lacks the tokens, from none. A concurrency plan
// among them (tollgate.Plan.Concurrency) gives the request a permit to
// hold while its handler runs (see Acquirer). A later WithPlans
// replaces an earlier one. The default, or no names, is the RateLimiter's
// default plan (for a *tollgate.Limiter, the first plan given to New),
// which must not be a concurrency plan (Middleware panics): name that one.
func WithPlans(names ...string) Option {
	names = slices.Clone(names)
	return func(m *middleware) { m.plans = names }
}

// WithCost sets the tokens a request takes to cost(r), and the permits it
// holds of a concurrency plan, which must be at least 1 and at most the
// Capacity of each plan. A cost outside that range
// is a bug in cost, answered 500 (see WithErrorHandler): reject requests
// too large to ever pass, with 413 for example, before the middleware.
// The default, or a nil cost, takes 1 token per request.
func WithCost(cost func(r *http.Request) int64) Option {
	return func(m *middleware) { m.cost = cost }
}

// WithSkip exempts the requests for which skip returns true, such as
// health checks or CORS preflight requests: they go on to the handler
// without a key, without taking a token and without rate limit header
// fields. The default, or a nil skip, exempts none.
func WithSkip(skip func(r *http.Request) bool) Option {
	return func(m *middleware) { m.skip = skip }
}

// WithHeaders selects the rate limit header fields written on allowed and
// denied requests. The default is HeadersBoth.
func WithHeaders(mode HeaderMode) Option {
	return func(m *middleware) { m.headers = mode }
}

// WithDeniedHandler sets what answers a denied request, res being the
// decision. The rate limit header fields and Retry-After, if it has one
// (see HeaderMode), are set when it runs. The default, or a nil denied, answers 429 Too Many Requests with
// a short text/plain body.
func WithDeniedHandler(denied func(w http.ResponseWriter, r *http.Request, res tollgate.Result)) Option {
	return func(m *middleware) {
		if denied != nil {
			m.denied = denied
		}
	}
}

// WithKeyErrorHandler sets what answers a request that has no usable key:
// err is the KeyFunc's error (ErrNoKey for the KeyFuncs of this package),
// or tollgate.ErrInvalidKey for a key that is empty or longer than
// tollgate.MaxKeyLen bytes. The default, or a nil h, answers 400 Bad
// Request with a short text/plain body that never holds the key.
func WithKeyErrorHandler(h func(w http.ResponseWriter, r *http.Request, err error)) Option {
	return func(m *middleware) {
		if h != nil {
			m.keyError = h
		}
	}
}

// WithErrorHandler sets what answers a request the RateLimiter could not
// decide, err being AllowN's error. The default, or a nil h, answers with
// a short text/plain body: 503 Service Unavailable when the store is
// unavailable (tollgate.ErrStoreUnavailable, which a Limiter returns under
// FailClosed only) or the request's context ended, and 500 Internal Server
// Error otherwise, for errors that are bugs, such as
// tollgate.ErrInvalidCost from a WithCost function.
func WithErrorHandler(h func(w http.ResponseWriter, r *http.Request, err error)) Option {
	return func(m *middleware) {
		if h != nil {
			m.onError = h
		}
	}
}

type middleware struct {
	lim     tollgate.RateLimiter
	planner planner // lim, if it describes its plans; else nil
	key     KeyFunc
	plans   []string

	cost     func(*http.Request) int64
	skip     func(*http.Request) bool
	headers  HeaderMode
	denied   func(http.ResponseWriter, *http.Request, tollgate.Result)
	keyError func(http.ResponseWriter, *http.Request, error)
	onError  func(http.ResponseWriter, *http.Request, error)
	final    func(*http.Request, Response) int64 // WithSettle's; nil: AllowN
	permits  bool                                // a plan is a concurrency plan: Acquire

	releaseError func(*http.Request, error)

	shadowHeaders bool // WithShadowHeaders
	inContext     bool // WithResultInContext
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
	ctx := callerkey.Context(r.Context(), key) // a plan resolver sees the API key, not the bucket's key
	d, err := m.decide(ctx, key, cost)
	switch {
	case errors.Is(err, tollgate.ErrInvalidKey):
		m.keyError(w, r, err)
		return
	case err != nil:
		m.onError(w, r, err)
		return
	}
	res := &d.res
	if res.Source != tollgate.SourceExempt { // an exempt key has no limits to tell
		setFields(w.Header(), res, m.headers, m.planner, m.shadowHeaders)
	}
	if m.inContext {
		r = r.WithContext(context.WithValue(r.Context(), resultKey{}, *res))
	}
	switch {
	case !res.Allowed:
		m.denied(w, r, *res)
	case d.held != nil:
		m.serveHeld(ctx, w, r, d.held, next)
	case d.permit != nil:
		m.servePermit(w, r, d.permit, next)
	default:
		next.ServeHTTP(w, r)
	}
}

// decision is a request's Result, and what the request holds while its
// handler runs: a reservation to settle (WithSettle), or a permit to
// release (a concurrency plan), or neither.
type decision struct {
	res    tollgate.Result
	held   *tollgate.Reservation
	permit *tollgate.Permit
}

// decide takes the request's cost: reserves it, acquires it, or, for
// neither, takes it with AllowN.
func (m *middleware) decide(ctx context.Context, key string, cost int64) (d decision, err error) {
	switch {
	case m.final != nil:
		if d.held, err = m.lim.(Reserver).Reserve(ctx, key, cost, m.plans...); err == nil {
			d.res = d.held.Result()
		}
	case m.permits:
		if d.permit, err = m.lim.(Acquirer).Acquire(ctx, key, cost, m.plans...); err == nil {
			d.res = d.permit.Result()
		}
	default:
		d.res, err = m.lim.AllowN(ctx, key, cost, m.plans...)
	}
	return d, err
}

func tooManyRequests(w http.ResponseWriter, _ *http.Request, _ tollgate.Result) {
	http.Error(w, "too many requests", http.StatusTooManyRequests)
}

func noKey(w http.ResponseWriter, _ *http.Request, _ error) {
	http.Error(w, "bad request: no rate limit key", http.StatusBadRequest)
}

func undecided(w http.ResponseWriter, _ *http.Request, err error) {
	if errors.Is(err, tollgate.ErrStoreUnavailable) || errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		http.Error(w, "service unavailable", http.StatusServiceUnavailable)
		return
	}
	http.Error(w, "internal server error", http.StatusInternalServerError)
}
