package httplimit

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/storetest"
)

// rateLimitFields returns the rate limit fields of w, an absent one as "".
func rateLimitFields(w *httptest.ResponseRecorder) map[string]string {
	got := map[string]string{}
	for _, name := range []string{"RateLimit-Policy", "RateLimit", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "Retry-After"} {
		got[name] = w.Header().Get(name)
	}
	return got
}

func TestFields(t *testing.T) {
	tests := []struct {
		name    string
		plans   []string
		before  int           // requests at the start, before the one checked
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
		inBubble(t, tt.name, func(t *testing.T) {
			h := Middleware(newLimiter(t), ByHeader("X-Api-Key"), WithPlans(tt.plans...))(ok)
			for range tt.before {
				require.Equal(t, 200, get(h, "/").Code)
			}
			time.Sleep(tt.advance)
			w := get(h, "/")
			assert.Equal(t, tt.status, w.Code)
			assert.Equal(t, tt.want, rateLimitFields(w))
		})
	}
}

func TestFieldsUnderFailOpen(t *testing.T) {
	lim, err := tollgate.New(storetest.Down(errRefused), testPlans, tollgate.WithFailurePolicy(breaker.FailOpen))
	require.NoError(t, err)
	w := get(Middleware(lim, ByHeader("X-Api-Key"), WithPlans("gold", "daily"))(ok), "/")

	assert.Equal(t, 200, w.Code)
	assert.Equal(t, map[string]string{
		"RateLimit-Policy":  `"gold";q=20;w=10, "daily";q=10000;w=86400`,
		"RateLimit":         `"gold";r=20;t=1, "daily";r=10000;t=9`,
		"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "20", "X-RateLimit-Reset": "0", "Retry-After": "",
	}, rateLimitFields(w))
}

func TestRetryAfterRounding(t *testing.T) {
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
			lim := &stubLimiter{res: tollgate.Result{Plan: "gold", Limit: 20, RetryAfter: tt.retryAfter, ResetAfter: 10 * time.Second}}
			w := get(Middleware(lim, ByHeader("X-Api-Key"))(ok), "/")
			assert.Equal(t, 429, w.Code)
			assert.Equal(t, tt.want, w.Header().Get("Retry-After"))
		})
	}
}

func TestFieldsWithoutPlanDescriptions(t *testing.T) {
	// A RateLimiter that does not describe its plans: no w, no t. Names
	// are escaped as sf-strings, whatever the RateLimiter returns.
	lim := &stubLimiter{res: tollgate.Result{Allowed: true,
		Plan: "we\"ird\\\n", Limit: 20, Remaining: 7, ResetAfter: 1500 * time.Millisecond}}
	w := get(Middleware(lim, ByHeader("X-Api-Key"), WithPlans("anything"))(ok), "/")

	assert.Equal(t, 200, w.Code)
	assert.Equal(t, map[string]string{
		"RateLimit-Policy":  `"we\"ird\\";q=20`,
		"RateLimit":         `"we\"ird\\";r=7`,
		"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "7", "X-RateLimit-Reset": "2", "Retry-After": "",
	}, rateLimitFields(w))
}

func TestHeaderModes(t *testing.T) {
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
				lim := &stubLimiter{res: tollgate.Result{Allowed: allowed, Plan: "gold", Limit: 20, RetryAfter: time.Second}}
				w := get(Middleware(lim, ByHeader("X-Api-Key"), WithHeaders(tt.mode))(ok), "/")
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

func TestFieldsSurviveHandlerAdds(t *testing.T) {
	// The fields share one backing array; a handler's Add must not
	// overwrite a neighbour.
	synctest.Test(t, func(t *testing.T) {
		h := Middleware(newLimiter(t), ByHeader("X-Api-Key"), WithPlans("gold"))(
			http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
				w.Header().Add("RateLimit-Policy", `"other";q=1`)
				w.Header().Add("X-RateLimit-Limit", "1")
			}))
		w := get(h, "/")

		assert.Equal(t, []string{`"gold";q=20;w=10`, `"other";q=1`}, w.Header().Values("RateLimit-Policy"))
		assert.Equal(t, []string{`"gold";r=19;t=1`}, w.Header().Values("RateLimit"))
		assert.Equal(t, []string{"20", "1"}, w.Header().Values("X-RateLimit-Limit"))
		assert.Equal(t, []string{"19"}, w.Header().Values("X-RateLimit-Remaining"))
	})
}

func TestFieldsOfTheREADME(t *testing.T) {
	// README's section Headers shows these fields for its plans; keep
	// the two in step.
	synctest.Test(t, func(t *testing.T) {
		lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
			{Name: "gold", Capacity: 20, Rate: 10},
			{Name: "daily", Capacity: 10_000, Rate: tollgate.Per(10_000, 24*time.Hour)},
		})
		require.NoError(t, err)
		h := Middleware(lim, ByHeader("X-API-Key"), WithPlans("gold", "daily"))(ok)
		for range 20 {
			require.Equal(t, 200, get(h, "/").Code)
		}
		w := get(h, "/")
		assert.Equal(t, 429, w.Code)
		assert.Equal(t, map[string]string{
			"RateLimit-Policy":  `"gold";q=20;w=2, "daily";q=10000;w=86400`,
			"RateLimit":         `"gold";r=0;t=1, "daily";r=9980;t=9`,
			"X-RateLimit-Limit": "20", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "2", "Retry-After": "1",
		}, rateLimitFields(w))
	})
}

// WithShadowHeaders shows the shadowed plans as if enforced; without it,
// a Limiter whose plans are all shadowed writes no rate limit field.
func TestShadowHeaders(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "next", Capacity: 1, Rate: 0.5}}, tollgate.WithShadow())
	require.NoError(t, err)
	serve := func(opts ...Option) http.Header {
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		req.Header.Set("K", "k")
		rec := httptest.NewRecorder()
		Middleware(l, ByHeader("K"), opts...)(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})).ServeHTTP(rec, req)
		require.Equal(t, http.StatusOK, rec.Code, "never 429 because of shadow")
		return rec.Header()
	}
	h := serve()
	assert.Empty(t, h.Get("RateLimit-Policy"))
	assert.Empty(t, h.Get("X-RateLimit-Limit"))
	h = serve(WithShadowHeaders())
	assert.Equal(t, `"next";q=1;w=2`, h.Get("RateLimit-Policy"))
	assert.Equal(t, `"next";r=0;t=2`, h.Get("RateLimit"), "the second request: the bucket a denial would leave")
	assert.Equal(t, "1", h.Get("X-RateLimit-Limit"))
	assert.Empty(t, h.Get("Retry-After"))
}

// A cost above a shadowed plan's capacity is no error: the request is
// served, and the plan, shown as if enforced, has too few tokens for it.
func TestShadowedPlanBelowTheCostServes(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "next", Capacity: 10, Rate: 1}}, tollgate.WithShadow())
	require.NoError(t, err)
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	req.Header.Set("K", "k")
	rec := httptest.NewRecorder()
	cost := WithCost(func(*http.Request) int64 { return 20 })
	Middleware(l, ByHeader("K"), cost, WithShadowHeaders())(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})).ServeHTTP(rec, req)
	assert.Equal(t, http.StatusOK, rec.Code)
	assert.Equal(t, `"next";r=10;t=1`, rec.Header().Get("RateLimit"))
	assert.Empty(t, rec.Header().Get("Retry-After"))
}

// An exempt key gets no rate limit fields: it has no limits.
func TestExemptKeyHasNoFields(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), testPlans, tollgate.WithPlanResolver(func(context.Context, string, tollgate.Plan) (tollgate.Plan, error) {
		return tollgate.Plan{}, tollgate.ErrExempt
	}))
	require.NoError(t, err)
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	req.Header.Set("K", "k")
	rec := httptest.NewRecorder()
	Middleware(l, ByHeader("K"))(http.HandlerFunc(func(http.ResponseWriter, *http.Request) {})).ServeHTTP(rec, req)
	assert.Equal(t, http.StatusOK, rec.Code)
	assert.Empty(t, rec.Header().Get("RateLimit-Policy"))
}

// TestFieldsOfAConcurrencyPlan holds the example of HeaderMode's
// documentation: the 11th request in flight of 10 is told the capacity
// and that none is free, and no reset or Retry-After.
func TestFieldsOfAConcurrencyPlan(t *testing.T) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "inflight", Capacity: 10, Concurrency: true},
		{Name: "minute", Capacity: 100, Rate: tollgate.Per(100, time.Minute)},
	})
	require.NoError(t, err)
	defer lim.Close()
	h := Middleware(lim, ByHeader("X-Api-Key"), WithPlans("inflight", "minute"))(ok)
	for range 10 { // held as by requests in flight
		p, err := lim.Acquire(context.Background(), "header:X-Api-Key:k", 1, "inflight", "minute")
		require.NoError(t, err)
		require.True(t, p.OK())
	}
	w := get(h, "/")
	assert.Equal(t, 429, w.Code)
	assert.Equal(t, map[string]string{
		"RateLimit-Policy":  `"inflight";q=10, "minute";q=100;w=60`,
		"RateLimit":         `"inflight";r=0, "minute";r=90;t=1`,
		"X-RateLimit-Limit": "10", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "", "Retry-After": "",
	}, rateLimitFields(w))
}

// TestFieldsOfStackedMiddlewares: a Middleware in front of another (per
// client in front of PerRoute, as http.md advises) keeps its fields: the
// IETF lists name the plans of both, and the legacy fields describe the
// plan closest to denying across both, the one that denied if one did.
func TestFieldsOfStackedMiddlewares(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		l := newLimiter(t)
		stack := func(outer, inner string) http.Handler {
			return Middleware(l, ByHeader("X-Api-Key"), WithPlans(outer))(
				Middleware(l, ByHeader("X-Api-Key"), WithPlans(inner))(ok))
		}
		h := stack("slow", "gold")
		assert.Equal(t, map[string]string{
			"RateLimit-Policy":  `"slow";q=2;w=180, "gold";q=20;w=10`,
			"RateLimit":         `"slow";r=1;t=90, "gold";r=19;t=1`,
			"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "1", "X-RateLimit-Reset": "90", "Retry-After": "",
		}, rateLimitFields(get(h, "/")), "the outer plan is closer to denying")

		h = stack("daily", "slow")
		get(h, "/") // slow's second token
		w := get(h, "/")
		assert.Equal(t, http.StatusTooManyRequests, w.Code)
		assert.Equal(t, map[string]string{
			"RateLimit-Policy":  `"daily";q=10000;w=86400, "slow";q=2;w=180`,
			"RateLimit":         `"daily";r=9998;t=9, "slow";r=0;t=90`,
			"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "180", "Retry-After": "90",
		}, rateLimitFields(w), "the inner plan denied")
	})
}
