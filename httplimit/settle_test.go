package httplimit

import (
	"context"
	"io"
	"math"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
)

// TestWithSettleChargesTheResponse reserves 10 kB a request and settles
// with the kilobytes actually sent, rounded up.
func TestWithSettleChargesTheResponse(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "kb", Capacity: 30, Rate: 0.001}})
	require.NoError(t, err)
	body := map[string]int{"/small": 1500, "/large": 25_000, "/none": 0}
	h := Middleware(l, ByHeader("X-Key"), WithCost(func(*http.Request) int64 { return 10 }),
		WithSettle(func(_ *http.Request, resp Response) int64 { return (resp.Bytes + 1023) / 1024 }),
	)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = w.Write([]byte(strings.Repeat("x", body[r.URL.Path])))
	}))
	send := func(path string) *httptest.ResponseRecorder {
		req := httptest.NewRequest(http.MethodGet, path, nil)
		req.Header.Set("X-Key", "k")
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	remaining := func() int64 {
		p, err := l.Peek(context.Background(), "header:X-Key:k")
		require.NoError(t, err)
		return p.Remaining
	}
	require.Equal(t, http.StatusOK, send("/small").Code)
	assert.Equal(t, int64(28), remaining(), "2 kB charged of the 10 reserved")
	require.Equal(t, http.StatusOK, send("/none").Code)
	assert.Equal(t, int64(28), remaining(), "nothing sent, nothing charged")
	require.Equal(t, http.StatusOK, send("/large").Code)
	assert.Equal(t, int64(3), remaining(), "25 kB: 15 beyond the reservation")
	rec := send("/small")
	assert.Equal(t, http.StatusTooManyRequests, rec.Code, "10 kB no longer fit")
	assert.Equal(t, uint64(3), l.Stats().Reservations.Settled)
}

// TestWithSettleSeesTheStatus settles failed responses at nothing.
func TestWithSettleSeesTheStatus(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "p", Capacity: 6, Rate: 0.001}})
	require.NoError(t, err)
	var statuses []int
	h := Middleware(l, ByHeader("X-Key"), WithCost(func(*http.Request) int64 { return 5 }),
		WithSettle(func(_ *http.Request, resp Response) int64 {
			statuses = append(statuses, resp.Status)
			if resp.Status >= 500 {
				return 0
			}
			return 1
		}),
	)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/fail" {
			w.WriteHeader(http.StatusBadGateway)
		}
	}))
	for _, path := range []string{"/fail", "/ok", "/fail"} {
		req := httptest.NewRequest(http.MethodGet, path, nil)
		req.Header.Set("X-Key", "k")
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	assert.Equal(t, []int{http.StatusBadGateway, http.StatusOK, http.StatusBadGateway}, statuses)
	p, err := l.Peek(context.Background(), "header:X-Key:k")
	require.NoError(t, err)
	assert.Equal(t, int64(5), p.Remaining, "only the good response was charged")
}

// TestWithSettleSeesTheFinalStatus: an informational 103 Early Hints
// before the response is not its status.
func TestWithSettleSeesTheFinalStatus(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "p", Capacity: 6, Rate: 0.001}})
	require.NoError(t, err)
	var statuses []int
	h := Middleware(l, ByHeader("X-Key"), WithSettle(func(_ *http.Request, resp Response) int64 {
		statuses = append(statuses, resp.Status)
		return 1
	}))(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Link", "</style.css>; rel=preload; as=style")
		w.WriteHeader(http.StatusEarlyHints)
		if r.URL.Path == "/fail" {
			w.WriteHeader(http.StatusBadGateway)
			return
		}
		_, _ = w.Write([]byte("ok"))
	}))
	for _, path := range []string{"/fail", "/ok"} {
		req := httptest.NewRequest(http.MethodGet, path, nil)
		req.Header.Set("X-Key", "k")
		h.ServeHTTP(httptest.NewRecorder(), req)
	}
	assert.Equal(t, []int{http.StatusBadGateway, http.StatusOK}, statuses)
}

func TestWithSettleNeedsAReserver(t *testing.T) {
	var notReserver tollgate.RateLimiter = struct{ tollgate.RateLimiter }{newLimiter(t)}
	assert.Panics(t, func() {
		Middleware(notReserver, ByIP(), WithSettle(func(*http.Request, Response) int64 { return 1 }))
	})
}

// TestWithSettlePassesFlushAndHijack: a handler behind WithSettle still
// finds the http.Flusher and http.Hijacker of the writer beneath, as
// streaming (server-sent events) and websocket handlers assert them, and
// its request is settled.
func TestWithSettlePassesFlushAndHijack(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "p", Capacity: 10, Rate: 0.001}})
	require.NoError(t, err)
	settled := make(chan Response, 2) // the hijacked request settles on the server's goroutine
	h := Middleware(l, ByHeader("X-Key"), WithCost(func(*http.Request) int64 { return 5 }),
		WithSettle(func(_ *http.Request, resp Response) int64 {
			settled <- resp
			return 1
		}),
	)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/hijack" {
			hj, ok := w.(http.Hijacker)
			if !assert.True(t, ok, "the writer is no http.Hijacker") {
				return
			}
			conn, buf, err := hj.Hijack()
			if !assert.NoError(t, err) {
				return
			}
			defer conn.Close()
			_, _ = buf.WriteString("HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nhi")
			_ = buf.Flush()
			return
		}
		_, _ = w.Write([]byte("event"))
		f, ok := w.(http.Flusher)
		if assert.True(t, ok, "the writer is no http.Flusher") {
			f.Flush()
		}
	}))

	req := httptest.NewRequest(http.MethodGet, "/events", nil)
	req.Header.Set("X-Key", "k")
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	assert.True(t, rec.Flushed, "the handler's Flush reached the recorder")
	assert.Equal(t, Response{Status: http.StatusOK, Bytes: 5}, <-settled)

	srv := httptest.NewServer(h)
	defer srv.Close()
	req, err = http.NewRequest(http.MethodGet, srv.URL+"/hijack", nil)
	require.NoError(t, err)
	req.Header.Set("X-Key", "k")
	resp, err := srv.Client().Do(req)
	require.NoError(t, err)
	body, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, "hi", string(body))
	assert.Equal(t, Response{Status: http.StatusOK}, <-settled, "a hijacked request settles too")
}

// TestWithSettleSettlesAHandlerThatPanics: a handler that panics, as
// httputil.ReverseProxy does with http.ErrAbortHandler when its backend
// fails mid-body, is still settled with what it wrote, and the panic goes
// on up to the server: its reservation does not stay charged in full.
func TestWithSettleSettlesAHandlerThatPanics(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "p", Capacity: 20, Rate: 0.001}})
	require.NoError(t, err)
	var seen []Response
	h := Middleware(l, ByHeader("X-Key"), WithCost(func(*http.Request) int64 { return 10 }),
		WithSettle(func(_ *http.Request, resp Response) int64 {
			seen = append(seen, resp)
			return 1
		}),
	)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/part" {
			_, _ = w.Write([]byte("part"))
		}
		panic(http.ErrAbortHandler)
	}))
	for _, path := range []string{"/part", "/none"} {
		req := httptest.NewRequest(http.MethodGet, path, nil)
		req.Header.Set("X-Key", "k")
		assert.PanicsWithValue(t, http.ErrAbortHandler, func() { h.ServeHTTP(httptest.NewRecorder(), req) },
			"the panic goes on up")
	}
	assert.Equal(t, []Response{{Status: http.StatusOK, Bytes: 4}, {Status: http.StatusInternalServerError}}, seen,
		"a handler that panicked before a status is settled as a 500")
	p, err := l.Peek(context.Background(), "header:X-Key:k")
	require.NoError(t, err)
	assert.Equal(t, int64(18), p.Remaining, "1 charged of each 10 reserved")
	assert.Equal(t, uint64(2), l.Stats().Reservations.Settled)
}

// TestWithSettleChargesACostBeyondTheLargest: a settling function that
// answers more than Settle takes (a byte count of a huge response, an
// overflow) charges the most it can, debt up to a capacity, rather than
// failing the settlement and leaving the request charged its reservation.
func TestWithSettleChargesACostBeyondTheLargest(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "p", Capacity: 10, Rate: 0.001}})
	require.NoError(t, err)
	h := Middleware(l, ByHeader("X-Key"), WithCost(func(*http.Request) int64 { return 2 }),
		WithSettle(func(*http.Request, Response) int64 { return math.MaxInt64 }),
	)(ok)
	req := httptest.NewRequest(http.MethodGet, "/", nil)
	req.Header.Set("X-Key", "k")
	h.ServeHTTP(httptest.NewRecorder(), req)
	p, err := l.Peek(context.Background(), "header:X-Key:k")
	require.NoError(t, err)
	assert.Equal(t, int64(0), p.Remaining, "the excess charged as debt")
	assert.Equal(t, uint64(1), l.Stats().Reservations.Settled)
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	assert.Equal(t, http.StatusTooManyRequests, rec.Code, "a bucket in debt refuses")
}

// TestWithSettlePanicsOnAWindowPlan: Reserve refuses a chain with a
// sliding window (tollgate.ErrInvalidPlan), so WithSettle with one is a
// wiring mistake, caught when the middleware is wired, not answered 500
// on every request.
func TestWithSettlePanicsOnAWindowPlan(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "win", Capacity: 10, Window: time.Minute},
		{Name: "p", Capacity: 10, Rate: 1},
	})
	require.NoError(t, err)
	_, err = l.Reserve(context.Background(), "k", 1, "p", "win")
	require.ErrorIs(t, err, tollgate.ErrInvalidPlan, "what every request would get")
	settle := WithSettle(func(*http.Request, Response) int64 { return 1 })
	msg := `httplimit: Middleware: WithSettle: plan "win" is a sliding window, which takes no reservation`
	assert.PanicsWithValue(t, msg, func() { Middleware(l, ByHeader("X-Key"), WithPlans("p", "win"), settle) })
	assert.PanicsWithValue(t, msg, func() { Middleware(l, ByHeader("X-Key"), settle) }, "the default plan")
	assert.NotPanics(t, func() { Middleware(l, ByHeader("X-Key"), WithPlans("p"), settle) })
	assert.NotPanics(t, func() { Middleware(l, ByHeader("X-Key"), WithPlans("p", "win")) }, "AllowN takes windows")
}
