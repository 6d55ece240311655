package httplimit

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
)

// A shadowed plan never answers 429 nor sets Retry-After; the handler
// learns from the context what it would have denied.
func TestShadowNeverDeniesAndHandlersSeeTheResult(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "now", Capacity: 100, Rate: 1},
		{Name: "next", Capacity: 2, Rate: 0.001, Shadow: true},
	})
	require.NoError(t, err)
	var seen []bool
	h := Middleware(l, ByHeader("K"), WithPlans("now", "next"), WithResultInContext())(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		res, ok := ResultFrom(r.Context())
		require.True(t, ok)
		seen = append(seen, res.ShadowDenied)
	}))
	for range 4 {
		req := httptest.NewRequest(http.MethodGet, "/", nil)
		req.Header.Set("K", "k")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		assert.Equal(t, http.StatusOK, rec.Code)
		assert.Empty(t, rec.Header().Get("Retry-After"))
		assert.NotContains(t, rec.Header().Get("RateLimit-Policy"), "next", "shadowed plans are left out by default")
	}
	assert.Equal(t, []bool{false, false, true, true}, seen)
}

func TestResultFromWithoutTheOption(t *testing.T) {
	_, ok := ResultFrom(context.Background())
	assert.False(t, ok)
}
