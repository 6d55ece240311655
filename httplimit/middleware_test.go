package httplimit

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/storetest"
)

var testPlans = []tollgate.Plan{
	{Name: "gold", Capacity: 20, Rate: 2},
	{Name: "daily", Capacity: 10_000, Rate: tollgate.Per(10_000, 24*time.Hour)},
	{Name: "slow", Capacity: 2, Rate: tollgate.Per(1, 90*time.Second)},
}

// newLimiter returns a Limiter on a MemoryStore. Made inside a synctest
// bubble, the store reads the bubble's clock, which stands still until
// time.Sleep moves it.
func newLimiter(t *testing.T) *tollgate.Limiter {
	t.Helper()
	l, err := tollgate.New(tollgate.NewMemoryStore(), testPlans)
	require.NoError(t, err)
	return l
}

// inBubble runs f as the subtest name, in a synctest bubble: a Limiter
// made there sees a clock that only time.Sleep moves.
func inBubble(t *testing.T, name string, f func(t *testing.T)) {
	t.Helper()
	t.Run(name, func(t *testing.T) { synctest.Test(t, f) })
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

// stubLimiter is a RateLimiter that returns res and err, and records the
// last call. It does not describe its plans.
type stubLimiter struct {
	res   tollgate.Result
	err   error
	calls int
	key   string
	cost  int64
	plans []string
}

func (s *stubLimiter) Allow(ctx context.Context, key string, plans ...string) (tollgate.Result, error) {
	return s.AllowN(ctx, key, 1, plans...)
}

func (s *stubLimiter) AllowN(_ context.Context, key string, cost int64, plans ...string) (tollgate.Result, error) {
	s.calls++
	s.key, s.cost, s.plans = key, cost, plans
	return s.res, s.err
}

// errRefused is what a store out of reach answers.
var errRefused = errors.New("connection refused")

func TestMiddlewareDeniedBody(t *testing.T) {
	lim := &stubLimiter{res: tollgate.Result{Plan: "gold", Limit: 20, RetryAfter: time.Second}}
	handlerRan := false
	next := http.HandlerFunc(func(http.ResponseWriter, *http.Request) { handlerRan = true })

	w := get(Middleware(lim, ByHeader("X-Api-Key"))(next), "/")
	assert.Equal(t, 429, w.Code)
	assert.Equal(t, "too many requests\n", w.Body.String())
	assert.False(t, handlerRan)

	custom := func(w http.ResponseWriter, r *http.Request, res tollgate.Result) {
		assert.Equal(t, "1", w.Header().Get("Retry-After"), "fields are set before the denied handler")
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusTooManyRequests)
		_, _ = fmt.Fprintf(w, `{"violated":%q}`, res.Plan)
	}
	w = get(Middleware(lim, ByHeader("X-Api-Key"), WithDeniedHandler(custom))(next), "/")
	assert.Equal(t, 429, w.Code)
	assert.Equal(t, `{"violated":"gold"}`, w.Body.String())
	assert.False(t, handlerRan)
}

func TestMiddlewareKeyErrors(t *testing.T) {
	secret := "sk-" + strings.Repeat("s", tollgate.MaxKeyLen)
	tests := []struct {
		name   string
		apiKey string
		err    error
	}{
		{"missing", "", ErrNoKey},
		{"longer than MaxKeyLen", secret, tollgate.ErrInvalidKey},
	}
	for _, tt := range tests {
		inBubble(t, tt.name, func(t *testing.T) {
			lim := newLimiter(t)
			serve := func(h http.Handler) *httptest.ResponseRecorder {
				r := httptest.NewRequest("GET", "/", nil)
				if tt.apiKey != "" {
					r.Header.Set("X-Api-Key", tt.apiKey)
				}
				w := httptest.NewRecorder()
				h.ServeHTTP(w, r)
				return w
			}

			w := serve(Middleware(lim, ByHeader("X-Api-Key"))(ok))
			assert.Equal(t, 400, w.Code)
			assert.Equal(t, "bad request: no rate limit key\n", w.Body.String())
			assert.Empty(t, w.Header().Get("RateLimit"))

			var gotErr error
			custom := WithKeyErrorHandler(func(w http.ResponseWriter, _ *http.Request, err error) {
				gotErr = err
				http.Error(w, "who are you?", http.StatusUnauthorized)
			})
			w = serve(Middleware(lim, ByHeader("X-Api-Key"), custom)(ok))
			assert.Equal(t, 401, w.Code)
			assert.Equal(t, "who are you?\n", w.Body.String())
			require.ErrorIs(t, gotErr, tt.err)
			assert.NotContains(t, gotErr.Error(), "sk-", "%s: errors never hold the key")
		})
	}
}

func TestMiddlewareSkip(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		calls := 0
		next := http.HandlerFunc(func(http.ResponseWriter, *http.Request) { calls++ })
		isHealth := func(r *http.Request) bool { return r.URL.Path == "/healthz" }
		h := Middleware(newLimiter(t), ByHeader("X-Api-Key"), WithPlans("slow"), WithSkip(isHealth))(next)

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
	})
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
		{"zero is a bug", 0, 500, "", tollgate.ErrInvalidCost},
		{"above capacity is a bug", 21, 500, "", tollgate.ErrInvalidCost},
	}
	for _, tt := range tests {
		inBubble(t, tt.name, func(t *testing.T) {
			var gotErr error
			record := func(w http.ResponseWriter, r *http.Request, err error) {
				gotErr = err
				undecided(w, r, err)
			}
			h := Middleware(newLimiter(t), ByHeader("X-Api-Key"), WithPlans("gold"),
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

func TestMiddlewareStoreDown(t *testing.T) {
	// A function builds each limiter, as the type of a failure policy is
	// not among the root names this package relies on.
	fallback := func() (*tollgate.Limiter, error) { return tollgate.New(storetest.Down(errRefused), testPlans) }
	failOpen := func() (*tollgate.Limiter, error) {
		return tollgate.New(storetest.Down(errRefused), testPlans, tollgate.WithFailurePolicy(breaker.FailOpen))
	}
	failClosed := func() (*tollgate.Limiter, error) {
		return tollgate.New(storetest.Down(errRefused), testPlans, tollgate.WithFailurePolicy(breaker.FailClosed))
	}
	tests := []struct {
		name   string
		lim    func() (*tollgate.Limiter, error)
		opts   []Option
		status int
		body   string
	}{
		{"fail closed", failClosed, nil, 503, "service unavailable\n"},
		{"fail closed, custom handler", failClosed, []Option{WithErrorHandler(func(w http.ResponseWriter, _ *http.Request, err error) {
			if errors.Is(err, tollgate.ErrStoreUnavailable) {
				http.Error(w, "try later", http.StatusBadGateway)
			}
		})}, 502, "try later\n"},
		{"fallback decides locally", fallback, nil, 200, "ok"},
		{"fail open", failOpen, nil, 200, "ok"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lim, err := tt.lim()
			require.NoError(t, err)
			w := get(Middleware(lim, ByHeader("X-Api-Key"), tt.opts...)(ok), "/")
			assert.Equal(t, tt.status, w.Code)
			assert.Equal(t, tt.body, w.Body.String())
			assert.Equal(t, tt.status == 200, w.Header().Get("RateLimit") != "", "fields only on a decision")
		})
	}
}

func TestMiddlewareCancelledRequestIsUnavailable(t *testing.T) {
	lim := &stubLimiter{err: context.Canceled}
	w := get(Middleware(lim, ByHeader("X-Api-Key"))(ok), "/")
	assert.Equal(t, 503, w.Code)
}

func TestMiddlewarePassesKeyCostPlansAndRequest(t *testing.T) {
	lim := &stubLimiter{res: tollgate.Result{Allowed: true, Plan: "gold", Limit: 20, Remaining: 19}}
	var seen *http.Request
	next := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { seen = r })
	plans := []string{"gold", "daily"}
	h := Middleware(lim, ByHeader("X-Api-Key"), WithPlans(plans...), WithCost(func(*http.Request) int64 { return 3 }))(next)
	plans[0] = "changed" // WithPlans keeps its own copy

	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-Api-Key", "k")
	h.ServeHTTP(httptest.NewRecorder(), r)

	assert.Equal(t, 1, lim.calls)
	assert.Equal(t, "header:X-Api-Key:k", lim.key)
	assert.Equal(t, int64(3), lim.cost)
	assert.Equal(t, []string{"gold", "daily"}, lim.plans)
	assert.Same(t, r, seen)
}

func TestMiddlewareWithPlans(t *testing.T) {
	tests := []struct {
		name string
		opts []Option
		want []string
	}{
		{"default plan", nil, nil},
		{"no names: default plan", []Option{WithPlans()}, nil},
		{"one", []Option{WithPlans("gold")}, []string{"gold"}},
		{"chained, in order", []Option{WithPlans("daily", "gold")}, []string{"daily", "gold"}},
		{"the last WithPlans wins", []Option{WithPlans("gold"), WithPlans("slow")}, []string{"slow"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lim := &stubLimiter{res: tollgate.Result{Allowed: true}}
			get(Middleware(lim, ByHeader("X-Api-Key"), tt.opts...)(ok), "/")
			assert.Equal(t, tt.want, lim.plans)
		})
	}
}

func TestMiddlewareWithServeMux(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		lim := newLimiter(t)
		perRoute := Middleware(lim, PerRoute(ByHeader("X-Api-Key")), WithPlans("slow"))
		item := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			_, _ = w.Write([]byte("item " + r.PathValue("id")))
		})
		mux := http.NewServeMux()
		mux.Handle("GET /items/{id}", perRoute(item))
		mux.Handle("GET /users/{id}", perRoute(ok))
		mux.Handle("GET /shared/{id}", Middleware(lim, ByHeader("X-Api-Key"), WithPlans("slow"))(ok))

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
	})
}

func TestMiddlewarePanicsOnMisuse(t *testing.T) {
	lim := newLimiter(t)
	key := ByHeader("X-Api-Key")
	for _, tt := range []struct {
		name, msg string
		f         func()
	}{
		{"nil limiter", "httplimit: Middleware: nil RateLimiter or KeyFunc", func() { Middleware(nil, key) }},
		{"nil key", "httplimit: Middleware: nil RateLimiter or KeyFunc", func() { Middleware(lim, nil) }},
		{"typed nil limiter", "httplimit: Middleware: nil RateLimiter or KeyFunc", func() { Middleware((*tollgate.Limiter)(nil), key) }},
		{"unknown plan", `httplimit: Middleware: unknown plan "platinum"`, func() { Middleware(lim, key, WithPlans("gold", "platinum")) }},
		{"plan twice", `httplimit: Middleware: plan "gold" named twice`, func() { Middleware(lim, key, WithPlans("gold", "gold")) }},
		{"header mode", "httplimit: Middleware: unknown HeaderMode 7", func() { Middleware(lim, key, WithHeaders(HeaderMode(7))) }},
	} {
		assert.PanicsWithValue(t, tt.msg, tt.f, tt.name)
	}
	assert.NotPanics(t, func() { Middleware(&stubLimiter{}, key, WithPlans("any")) }, "plans unknown to a RateLimiter that does not describe them")
}

// headerWriter is a ResponseWriter that keeps one header map, cleared
// between requests, so that allocation counts show the middleware alone.
type headerWriter struct{ h http.Header }

func (w *headerWriter) Header() http.Header         { return w.h }
func (w *headerWriter) Write(b []byte) (int, error) { return len(b), nil }
func (w *headerWriter) WriteHeader(int)             {}

func TestMiddlewareAllocations(t *testing.T) {
	// ByHeader builds its key (1); the context that names the API key
	// for a plan resolver (1); the fields cost a string and a []string
	// (2); the decision itself allocates nothing.
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "p", Capacity: 1 << 30, Rate: 1e6}})
	require.NoError(t, err)
	h := Middleware(lim, ByHeader("X-Api-Key"), WithPlans("p"))(ok)
	r := httptest.NewRequest("GET", "/", nil)
	r.Header.Set("X-Api-Key", "k")
	w := &headerWriter{h: http.Header{}}

	allocs := testing.AllocsPerRun(1000, func() {
		clear(w.h)
		h.ServeHTTP(w, r)
	})
	assert.Equal(t, 4.0, allocs)
}

// BenchmarkMiddleware compares a bare handler with the same handler behind
// the middleware, on a MemoryStore, by header and by IP.
func BenchmarkMiddleware(b *testing.B) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "p", Capacity: 1 << 30, Rate: 1e9}})
	require.NoError(b, err)
	r := httptest.NewRequest("GET", "/", nil)
	r.RemoteAddr = "203.0.113.7:1234"
	r.Header.Set("X-Api-Key", "k")
	for _, bc := range []struct {
		name string
		h    http.Handler
	}{
		{"bare", ok},
		{"by-header", Middleware(lim, ByHeader("X-Api-Key"), WithPlans("p"))(ok)},
		{"by-ip", Middleware(lim, ByIP(), WithPlans("p"))(ok)},
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

// resolverKeys notes the keys a plan resolver was given.
type resolverKeys struct {
	mu   sync.Mutex
	keys []string
}

func (k *resolverKeys) add(key string) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if !slices.Contains(k.keys, key) {
		k.keys = append(k.keys, key)
	}
}

func (k *resolverKeys) list() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	return slices.Sorted(slices.Values(k.keys))
}

// readmeTiers is README's tier example ("Tiers: a plan per key"), with
// tiers.Of a map, on a RedisStore on miniredis, whose clock stands still:
// no bucket refills. It returns the keys the resolver is given.
func readmeTiers(t *testing.T) (*tollgate.Limiter, *resolverKeys) {
	t.Helper()
	mr := miniredis.RunT(t)
	mr.SetTime(time.Now())
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	seen := &resolverKeys{}
	tiers := map[string]string{"key-gold": "gold", "key-internal": "internal"}
	lim, err := tollgate.New(tollgate.NewRedisStore(c), []tollgate.Plan{{Name: "api", Capacity: 20, Rate: 10}},
		tollgate.WithPlanResolver(func(ctx context.Context, key string, p tollgate.Plan) (tollgate.Plan, error) {
			seen.add(key)
			switch tiers[key] {
			case "gold":
				return tollgate.Plan{Name: p.Name, Capacity: 200, Rate: 100}, nil
			case "internal":
				return tollgate.Plan{}, tollgate.ErrExempt
			}
			return p, nil
		}))
	require.NoError(t, err)
	return lim, seen
}

// Behind ByHeader, README's tier example sees the API key, so the gold
// tier applies: 50 requests pass, where the default plan admits 20. The
// bucket stays the header key's.
func TestMiddlewareAppliesREADMEsTiers(t *testing.T) {
	for _, settle := range []bool{false, true} {
		t.Run(fmt.Sprintf("settle %t", settle), func(t *testing.T) {
			lim, seen := readmeTiers(t)
			opts := []Option{WithPlans("api")}
			if settle {
				opts = append(opts, WithSettle(func(*http.Request, Response) int64 { return 1 }))
			}
			srv := httptest.NewServer(Middleware(lim, ByHeader("X-Api-Key"), opts...)(ok))
			defer srv.Close()
			admitted := map[string]int{}
			for _, key := range []string{"key-gold", "key-free"} {
				for range 50 {
					req, err := http.NewRequest("GET", srv.URL, nil)
					require.NoError(t, err)
					req.Header.Set("X-Api-Key", key)
					resp, err := srv.Client().Do(req)
					require.NoError(t, err)
					_ = resp.Body.Close()
					if resp.StatusCode == http.StatusOK {
						admitted[key]++
					}
				}
			}
			assert.Equal(t, map[string]int{"key-gold": 50, "key-free": 20}, admitted, "the gold tier, and the default plan")
			assert.Equal(t, []string{"key-free", "key-gold"}, seen.list(), "the resolver is given the API keys")

			ctx := context.Background()
			r, err := lim.Peek(tollgate.ResolveAs(ctx, "header:X-Api-Key:key-gold", "key-gold"), "header:X-Api-Key:key-gold")
			require.NoError(t, err)
			assert.Equal(t, int64(150), r.Remaining, "the bucket is the header key's")
			r, err = lim.Peek(ctx, "key-gold")
			require.NoError(t, err)
			assert.Equal(t, int64(200), r.Remaining, "the bare API key has no bucket of its own")
		})
	}
}

// Every KeyFunc of this package gives a plan resolver the value it found,
// without its kind or route; a KeyFunc of one's own, its key.
func TestMiddlewareGivesTheResolverTheCallersKey(t *testing.T) {
	type principalKey struct{}
	principal := func(ctx context.Context) (string, bool) {
		id, ok := ctx.Value(principalKey{}).(string)
		return id, ok
	}
	for _, tt := range []struct {
		name string
		key  KeyFunc
		want string
	}{
		{"header", ByHeader("X-Api-Key"), "key-gold"},
		{"ip", ByIP(), "203.0.113.7"},
		{"principal", ByPrincipal(principal), "user-42"},
		{"route", PerRoute(ByHeader("X-Api-Key")), "key-gold"},
		{"own", func(*http.Request) (string, error) { return "tenant-7", nil }, "tenant-7"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			lim, seen := readmeTiers(t)
			r := httptest.NewRequest("GET", "/items/1", nil)
			r.RemoteAddr = "203.0.113.7:1234"
			r.Header.Set("X-Api-Key", "key-gold")
			r = r.WithContext(context.WithValue(r.Context(), principalKey{}, "user-42"))
			w := httptest.NewRecorder()
			Middleware(lim, tt.key, WithPlans("api"))(ok).ServeHTTP(w, r)
			require.Equal(t, http.StatusOK, w.Code)
			assert.Equal(t, []string{tt.want}, seen.list())
		})
	}
}
