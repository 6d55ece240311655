package tollgate

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var mwPlans = []Plan{
	{Name: "gold", Capacity: 20, Rate: 2},
	{Name: "daily", Capacity: 10_000, Rate: Per(10_000, 24*time.Hour)},
	{Name: "slow", Capacity: 2, Rate: Per(1, 90*time.Second)},
}

// newMWLimiter returns a Limiter on a MemoryStore whose clock is *now.
func newMWLimiter(t *testing.T, now *int64, opts ...Option) *Limiter {
	t.Helper()
	l, err := New(newClockedMemoryStore(now), mwPlans, append([]Option{WithLogger(nil)}, opts...)...)
	require.NoError(t, err)
	return l
}

// ok is the handler behind the middleware in tests. It allocates nothing.
var ok = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
	_, _ = w.Write(okBody)
})

var okBody = []byte("ok")

// get serves one GET of target from key "k" through h.
func get(h http.Handler, target string) *httptest.ResponseRecorder {
	r := httptest.NewRequest("GET", target, nil)
	r.Header.Set("X-Api-Key", "k")
	w := httptest.NewRecorder()
	h.ServeHTTP(w, r)
	return w
}

// rateLimitFields returns the rate limit fields of w, an absent one as "".
func rateLimitFields(w *httptest.ResponseRecorder) map[string]string {
	got := map[string]string{}
	for _, name := range []string{"RateLimit-Policy", "RateLimit", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "Retry-After"} {
		got[name] = w.Header().Get(name)
	}
	return got
}

func TestMiddlewareFields(t *testing.T) {
	tests := []struct {
		name    string
		plans   []string
		before  int           // requests at t0, before the one checked
		advance time.Duration // clock step before the checked request
		status  int
		want    map[string]string
	}{
		{"first request", []string{"gold"}, 0, 0, 200, map[string]string{
			"RateLimit-Policy":  `"gold";q=20;w=10`,
			"RateLimit":         `"gold";r=19;t=1`,
			"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "19", "X-RateLimit-Reset": "1", "Retry-After": "",
		}},
		{"default plan", nil, 0, 0, 200, map[string]string{
			"RateLimit-Policy":  `"gold";q=20;w=10`,
			"RateLimit":         `"gold";r=19;t=1`,
			"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "19", "X-RateLimit-Reset": "1", "Retry-After": "",
		}},
		{"chained plans, gold binds", []string{"gold", "daily"}, 0, 0, 200, map[string]string{
			"RateLimit-Policy":  `"gold";q=20;w=10, "daily";q=10000;w=86400`,
			"RateLimit":         `"gold";r=19;t=1, "daily";r=9999;t=9`,
			"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "19", "X-RateLimit-Reset": "1", "Retry-After": "",
		}},
		{"t is the next token, reset is full", []string{"gold"}, 4, 0, 200, map[string]string{
			"RateLimit-Policy":  `"gold";q=20;w=10`,
			"RateLimit":         `"gold";r=15;t=1`,
			"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "15", "X-RateLimit-Reset": "3", "Retry-After": "",
		}},
		{"slow plan", []string{"slow"}, 0, 0, 200, map[string]string{
			"RateLimit-Policy":  `"slow";q=2;w=180`,
			"RateLimit":         `"slow";r=1;t=90`,
			"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "1", "X-RateLimit-Reset": "90", "Retry-After": "",
		}},
		{"slow plan, part of a token accrued", []string{"slow"}, 1, 30 * time.Second, 200, map[string]string{
			"RateLimit-Policy":  `"slow";q=2;w=180`,
			"RateLimit":         `"slow";r=0;t=60`,
			"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "150", "Retry-After": "",
		}},
		{"denied", []string{"gold"}, 20, 0, 429, map[string]string{
			"RateLimit-Policy":  `"gold";q=20;w=10`,
			"RateLimit":         `"gold";r=0;t=1`,
			"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "10", "Retry-After": "1",
		}},
		{"denied by the slow plan, Retry-After rounded up", []string{"gold", "slow"}, 2, 50 * time.Second, 429, map[string]string{
			"RateLimit-Policy":  `"gold";q=20;w=10, "slow";q=2;w=180`,
			"RateLimit":         `"gold";r=20;t=1, "slow";r=0;t=40`,
			"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "130", "Retry-After": "40",
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			now := t0
			h := Middleware(newMWLimiter(t, &now), ByHeader("X-Api-Key"), tt.plans)(ok)
			for range tt.before {
				require.Equal(t, 200, get(h, "/").Code)
			}
			now += tt.advance.Microseconds()
			w := get(h, "/")
			assert.Equal(t, tt.status, w.Code)
			assert.Equal(t, tt.want, rateLimitFields(w))
		})
	}
}

func TestMiddlewareFieldsUnderFailOpen(t *testing.T) {
	lim, err := New(downStore{}, mwPlans, WithFailurePolicy(FailOpen), WithLogger(nil))
	require.NoError(t, err)
	w := get(Middleware(lim, ByHeader("X-Api-Key"), []string{"gold", "daily"})(ok), "/")

	assert.Equal(t, 200, w.Code)
	assert.Equal(t, map[string]string{
		"RateLimit-Policy":  `"gold";q=20;w=10, "daily";q=10000;w=86400`,
		"RateLimit":         `"gold";r=20;t=1, "daily";r=10000;t=9`,
		"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "20", "X-RateLimit-Reset": "0", "Retry-After": "",
	}, rateLimitFields(w))
}

// stubLimiter is a RateLimiter that returns res and err, and records the
// last call. It does not describe its plans.
type stubLimiter struct {
	res   Result
	err   error
	calls int
	key   string
	cost  int64
}

func (s *stubLimiter) Allow(ctx context.Context, key string, plans ...string) (Result, error) {
	return s.AllowN(ctx, key, 1, plans...)
}

func (s *stubLimiter) AllowN(_ context.Context, key string, cost int64, _ ...string) (Result, error) {
	s.calls++
	s.key, s.cost = key, cost
	return s.res, s.err
}

func TestMiddlewareRetryAfterRounding(t *testing.T) {
	tests := []struct {
		retryAfter time.Duration
		want       string
	}{
		{1200 * time.Millisecond, "2"},
		{300 * time.Millisecond, "1"},
		{time.Second, "1"},
		{time.Microsecond, "1"},
		{0, "1"},
		{59*time.Second + time.Microsecond, "60"},
	}
	for _, tt := range tests {
		t.Run(tt.retryAfter.String(), func(t *testing.T) {
			lim := &stubLimiter{res: Result{Plan: "gold", Limit: 20, RetryAfter: tt.retryAfter, ResetAfter: 10 * time.Second}}
			w := get(Middleware(lim, ByHeader("X-Api-Key"), nil)(ok), "/")
			assert.Equal(t, 429, w.Code)
			assert.Equal(t, tt.want, w.Header().Get("Retry-After"))
		})
	}
}

func TestMiddlewareWithoutPlanDescriptions(t *testing.T) {
	// A RateLimiter that does not describe its plans: no w, no t. Names
	// are escaped as sf-strings, whatever the RateLimiter returns.
	lim := &stubLimiter{res: Result{Allowed: true, Plans: []PlanResult{
		{Plan: "gold", Limit: 20, Remaining: 7, ResetAfter: 1500 * time.Millisecond},
		{Plan: "we\"ird\\\n", Limit: 5, Remaining: 4},
	}, Plan: "gold", Limit: 20, Remaining: 7, ResetAfter: 1500 * time.Millisecond}}
	w := get(Middleware(lim, ByHeader("X-Api-Key"), []string{"anything"})(ok), "/")

	assert.Equal(t, 200, w.Code)
	assert.Equal(t, map[string]string{
		"RateLimit-Policy":  `"gold";q=20, "we\"ird\\";q=5`,
		"RateLimit":         `"gold";r=7, "we\"ird\\";r=4`,
		"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "7", "X-RateLimit-Reset": "2", "Retry-After": "",
	}, rateLimitFields(w))
}

func TestMiddlewareHeaderModes(t *testing.T) {
	ietf := []string{"RateLimit-Policy", "RateLimit"}
	legacy := []string{"X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset"}
	tests := []struct {
		name string
		mode HeaderMode
		want []string
	}{
		{"both", HeadersBoth, append(append([]string{}, ietf...), legacy...)},
		{"ietf", HeadersIETF, ietf},
		{"legacy", HeadersLegacy, legacy},
		{"none", HeadersNone, nil},
	}
	for _, tt := range tests {
		for _, allowed := range []bool{true, false} {
			t.Run(fmt.Sprintf("%s/allowed=%v", tt.name, allowed), func(t *testing.T) {
				lim := &stubLimiter{res: Result{Allowed: allowed, Plan: "gold", Limit: 20, RetryAfter: time.Second}}
				w := get(Middleware(lim, ByHeader("X-Api-Key"), nil, WithHeaders(tt.mode))(ok), "/")
				var got []string
				for name := range rateLimitFields(w) {
					if w.Header().Get(name) != "" && name != "Retry-After" {
						got = append(got, name)
					}
				}
				assert.ElementsMatch(t, tt.want, got)
				assert.Equal(t, !allowed, w.Header().Get("Retry-After") != "", "Retry-After on denial only, in every mode")
			})
		}
	}
}

func TestMiddlewareFieldsSurviveHandlerAdds(t *testing.T) {
	// The fields share one backing array; a handler's Add must not
	// overwrite a neighbour.
	now := t0
	h := Middleware(newMWLimiter(t, &now), ByHeader("X-Api-Key"), []string{"gold"})(
		http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.Header().Add("RateLimit-Policy", `"other";q=1`)
			w.Header().Add("X-RateLimit-Limit", "1")
		}))
	w := get(h, "/")

	assert.Equal(t, []string{`"gold";q=20;w=10`, `"other";q=1`}, w.Header().Values("RateLimit-Policy"))
	assert.Equal(t, []string{`"gold";r=19;t=1`}, w.Header().Values("RateLimit"))
	assert.Equal(t, []string{"20", "1"}, w.Header().Values("X-RateLimit-Limit"))
	assert.Equal(t, []string{"19"}, w.Header().Values("X-RateLimit-Remaining"))
}

func TestMiddlewareDeniesAndIsolatesKeys(t *testing.T) {
	now := t0
	h := Middleware(newMWLimiter(t, &now), ByIP(), []string{"slow"})(ok)
	serve := func(remote string) int {
		r := httptest.NewRequest("GET", "/", nil)
		r.RemoteAddr = remote
		w := httptest.NewRecorder()
		h.ServeHTTP(w, r)
		return w.Code
	}
	steps := []struct {
		remote string
		want   int
	}{
		{"203.0.113.7:1000", 200},
		{"203.0.113.7:1001", 200},
		{"203.0.113.7:1002", 429}, // same address, another port: same key
		{"203.0.113.8:1000", 200}, // another address: its own buckets
		{"[2001:db8:1:2::1]:1", 200},
		{"[2001:db8:1:2::2]:1", 200},
		{"[2001:db8:1:2::3]:1", 429}, // same /64
		{"[2001:db8:1:3::1]:1", 200},
		{"[::ffff:203.0.113.8]:1", 200}, // mapped: the same key as 203.0.113.8
		{"203.0.113.8:1", 429},
	}
	for i, s := range steps {
		assert.Equal(t, s.want, serve(s.remote), "step %d: %s", i, s.remote)
	}
}

func TestMiddlewareDeniedBody(t *testing.T) {
	lim := &stubLimiter{res: Result{Plan: "gold", Limit: 20, RetryAfter: time.Second}}
	handlerRan := false
	next := http.HandlerFunc(func(http.ResponseWriter, *http.Request) { handlerRan = true })

	w := get(Middleware(lim, ByHeader("X-Api-Key"), nil)(next), "/")
	assert.Equal(t, 429, w.Code)
	assert.Equal(t, "too many requests\n", w.Body.String())
	assert.False(t, handlerRan)

	custom := func(w http.ResponseWriter, r *http.Request, res Result) {
		assert.Equal(t, "1", w.Header().Get("Retry-After"), "fields are set before the denied handler")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		_, _ = fmt.Fprintf(w, `{"violated":%q}`, res.Plan)
	}
	w = get(Middleware(lim, ByHeader("X-Api-Key"), nil, WithDeniedHandler(custom))(next), "/")
	assert.Equal(t, 429, w.Code)
	assert.Equal(t, `{"violated":"gold"}`, w.Body.String())
	assert.False(t, handlerRan)
}

func TestMiddlewareKeyErrors(t *testing.T) {
	secret := "sk-" + strings.Repeat("s", MaxKeyLen)
	tests := []struct {
		name   string
		apiKey string
		err    error
	}{
		{"missing", "", ErrNoKey},
		{"longer than MaxKeyLen", secret, ErrInvalidKey},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			now := t0
			lim := newMWLimiter(t, &now)
			serve := func(h http.Handler) *httptest.ResponseRecorder {
				r := httptest.NewRequest("GET", "/", nil)
				if tt.apiKey != "" {
					r.Header.Set("X-Api-Key", tt.apiKey)
				}
				w := httptest.NewRecorder()
				h.ServeHTTP(w, r)
				return w
			}

			w := serve(Middleware(lim, ByHeader("X-Api-Key"), nil)(ok))
			assert.Equal(t, 400, w.Code)
			assert.Equal(t, "bad request: no rate limit key\n", w.Body.String())
			assert.Empty(t, w.Header().Get("RateLimit"))

			var gotErr error
			custom := WithKeyErrorHandler(func(w http.ResponseWriter, _ *http.Request, err error) {
				gotErr = err
				http.Error(w, "who are you?", http.StatusUnauthorized)
			})
			w = serve(Middleware(lim, ByHeader("X-Api-Key"), nil, custom)(ok))
			assert.Equal(t, 401, w.Code)
			assert.Equal(t, "who are you?\n", w.Body.String())
			require.ErrorIs(t, gotErr, tt.err)
			assert.NotContains(t, gotErr.Error(), "sk-", "errors never hold the key")
		})
	}
}

func TestMiddlewareSkip(t *testing.T) {
	now := t0
	calls := 0
	next := http.HandlerFunc(func(http.ResponseWriter, *http.Request) { calls++ })
	isHealth := func(r *http.Request) bool { return r.URL.Path == "/healthz" }
	h := Middleware(newMWLimiter(t, &now), ByHeader("X-Api-Key"), []string{"slow"}, WithSkip(isHealth))(next)

	for range 5 {
		w := get(h, "/healthz")
		assert.Equal(t, 200, w.Code)
		assert.Empty(t, w.Header().Get("RateLimit"), "a skipped request gets no fields")
	}
	// Skipped requests need no key either.
	w := httptest.NewRecorder()
	h.ServeHTTP(w, httptest.NewRequest("GET", "/healthz", nil))
	assert.Equal(t, 200, w.Code)

	w = get(h, "/api")
	assert.Equal(t, `"slow";r=1;t=90`, w.Header().Get("RateLimit"), "skipped requests took no token")
	assert.Equal(t, 7, calls)
}

func TestMiddlewareCost(t *testing.T) {
	tests := []struct {
		name      string
		cost      int64
		status    int
		rateLimit string
		errIs     error
	}{
		{"cost 5", 5, 200, `"gold";r=15;t=1`, nil},
		{"whole capacity", 20, 200, `"gold";r=0;t=1`, nil},
		{"zero is a bug", 0, 500, "", ErrInvalidCost},
		{"above capacity is a bug", 21, 500, "", ErrInvalidCost},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			now := t0
			var gotErr error
			record := func(w http.ResponseWriter, r *http.Request, err error) {
				gotErr = err
				undecided(w, r, err)
			}
			h := Middleware(newMWLimiter(t, &now), ByHeader("X-Api-Key"), []string{"gold"},
				WithCost(func(*http.Request) int64 { return tt.cost }), WithErrorHandler(record))(ok)
			w := get(h, "/")
			assert.Equal(t, tt.status, w.Code)
			assert.Equal(t, tt.rateLimit, w.Header().Get("RateLimit"))
			if tt.errIs != nil {
				assert.ErrorIs(t, gotErr, tt.errIs)
				assert.Equal(t, "internal server error\n", w.Body.String())
			}
		})
	}
}

// downStore is a Store that always fails.
type downStore struct{}

func (downStore) Take(context.Context, string, int64, []Plan) (Result, error) {
	return Result{}, errors.New("connection refused")
}

func (downStore) Reset(context.Context, string, []Plan) error {
	return errors.New("connection refused")
}

func TestMiddlewareStoreDown(t *testing.T) {
	tests := []struct {
		name   string
		policy FailurePolicy
		opts   []MiddlewareOption
		status int
		body   string
	}{
		{"fail closed", FailClosed, nil, 503, "service unavailable\n"},
		{"fail closed, custom handler", FailClosed, []MiddlewareOption{WithErrorHandler(func(w http.ResponseWriter, _ *http.Request, err error) {
			if errors.Is(err, ErrStoreUnavailable) {
				http.Error(w, "try later", http.StatusBadGateway)
			}
		})}, 502, "try later\n"},
		{"fallback decides locally", Fallback, nil, 200, "ok"},
		{"fail open", FailOpen, nil, 200, "ok"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lim, err := New(downStore{}, mwPlans, WithFailurePolicy(tt.policy), WithLogger(nil))
			require.NoError(t, err)
			w := get(Middleware(lim, ByHeader("X-Api-Key"), nil, tt.opts...)(ok), "/")
			assert.Equal(t, tt.status, w.Code)
			assert.Equal(t, tt.body, w.Body.String())
			assert.Equal(t, tt.status == 200, w.Header().Get("RateLimit") != "", "fields only on a decision")
		})
	}
}

func TestMiddlewareCancelledRequestIsUnavailable(t *testing.T) {
	lim := &stubLimiter{err: context.Canceled}
	w := get(Middleware(lim, ByHeader("X-Api-Key"), nil)(ok), "/")
	assert.Equal(t, 503, w.Code)
}

func TestMiddlewarePassesKeyCostAndRequest(t *testing.T) {
	lim := &stubLimiter{res: Result{Allowed: true, Plan: "gold", Limit: 20, Remaining: 19}}
	var seen *http.Request
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { seen = r })
	h := Middleware(lim, ByHeader("X-Api-Key"), nil, WithCost(func(*http.Request) int64 { return 3 }))(next)

	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-Api-Key", "k")
	h.ServeHTTP(httptest.NewRecorder(), r)

	assert.Equal(t, 1, lim.calls)
	assert.Equal(t, "header:X-Api-Key:k", lim.key)
	assert.Equal(t, int64(3), lim.cost)
	assert.Same(t, r, seen)
}

func TestMiddlewareWithServeMux(t *testing.T) {
	now := t0
	lim := newMWLimiter(t, &now)
	perRoute := Middleware(lim, PerRoute(ByHeader("X-Api-Key")), []string{"slow"})
	item := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte("item " + r.PathValue("id")))
	})
	mux := http.NewServeMux()
	mux.Handle("GET /items/{id}", perRoute(item))
	mux.Handle("GET /users/{id}", perRoute(ok))
	mux.Handle("GET /shared/{id}", Middleware(lim, ByHeader("X-Api-Key"), []string{"slow"})(ok))

	steps := []struct {
		target string
		want   int
		body   string
	}{
		{"/items/1", 200, "item 1"},
		{"/items/2", 200, "item 2"}, // one pattern, one bucket
		{"/items/3", 429, "too many requests\n"},
		{"/users/1", 200, "ok"}, // another pattern: its own bucket
		{"/users/2", 200, "ok"},
		{"/users/2", 429, "too many requests\n"},
		{"/shared/1", 200, "ok"}, // not per route: the key alone
		{"/shared/2", 200, "ok"},
		{"/shared/3", 429, "too many requests\n"},
		{"/nowhere", 404, "404 page not found\n"},
	}
	for i, s := range steps {
		w := get(mux, s.target)
		assert.Equal(t, s.want, w.Code, "step %d: %s", i, s.target)
		assert.Equal(t, s.body, w.Body.String(), "step %d: %s", i, s.target)
	}
}

func TestMiddlewarePanicsOnMisuse(t *testing.T) {
	now := t0
	lim := newMWLimiter(t, &now)
	key := ByHeader("X-Api-Key")
	for name, f := range map[string]func(){
		"nil limiter":  func() { Middleware(nil, key, nil) },
		"nil key":      func() { Middleware(lim, nil, nil) },
		"unknown plan": func() { Middleware(lim, key, []string{"gold", "platinum"}) },
		"plan twice":   func() { Middleware(lim, key, []string{"gold", "gold"}) },
		"header mode":  func() { Middleware(lim, key, nil, WithHeaders(HeaderMode(7))) },
	} {
		assert.Panics(t, f, name)
	}
	assert.NotPanics(t, func() { Middleware(&stubLimiter{}, key, []string{"any"}) }, "plans unknown to a RateLimiter that does not describe them")
}

// headerWriter is a ResponseWriter that keeps one header map, cleared
// between requests, so that allocation counts show the middleware alone.
type headerWriter struct{ h http.Header }

func (w *headerWriter) Header() http.Header         { return w.h }
func (w *headerWriter) Write(b []byte) (int, error) { return len(b), nil }
func (w *headerWriter) WriteHeader(int)             {}

func TestMiddlewareAllocations(t *testing.T) {
	// ByHeader builds its key (1); the fields cost a string and a
	// []string (2); the decision itself allocates nothing.
	now := t0
	lim, err := New(newClockedMemoryStore(&now), []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1e6}}, WithLogger(nil))
	require.NoError(t, err)
	h := Middleware(lim, ByHeader("X-Api-Key"), []string{"p"})(ok)
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-Api-Key", "k")
	w := &headerWriter{h: http.Header{}}

	allocs := testing.AllocsPerRun(1000, func() {
		clear(w.h)
		h.ServeHTTP(w, r)
	})
	assert.Equal(t, 3.0, allocs)
}

// BenchmarkMiddleware compares a bare handler with the same handler behind
// the middleware, on a MemoryStore, by header and by IP.
func BenchmarkMiddleware(b *testing.B) {
	lim, err := New(NewMemoryStore(), []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1e9}}, WithLogger(nil))
	require.NoError(b, err)
	r := httptest.NewRequest("GET", "/", nil)
	r.RemoteAddr = "203.0.113.7:1234"
	r.Header.Set("X-Api-Key", "k")
	for _, bc := range []struct {
		name string
		h    http.Handler
	}{
		{"bare", ok},
		{"by-header", Middleware(lim, ByHeader("X-Api-Key"), []string{"p"})(ok)},
		{"by-ip", Middleware(lim, ByIP(), []string{"p"})(ok)},
	} {
		b.Run(bc.name, func(b *testing.B) {
			w := &headerWriter{h: http.Header{}}
			b.ReportAllocs()
			for b.Loop() {
				clear(w.h)
				bc.h.ServeHTTP(w, r)
			}
		})
	}
}
