package httplimit

import (
	"bytes"
	"context"
	"io"
	"log"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
)

var permitPlans = []tollgate.Plan{
	{Name: "one", Capacity: 1, Concurrency: true},
	{Name: "inflight", Capacity: 2, Concurrency: true},
	{Name: "hourly", Capacity: 1, Rate: tollgate.Per(1, time.Hour)},
}

// permitLimiters returns a Limiter of permitPlans on a MemoryStore and
// one on a RedisStore on miniredis, whose server it also returns.
func permitLimiters(t *testing.T) (map[string]*tollgate.Limiter, *miniredis.Miniredis) {
	t.Helper()
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1}) // a closed server fails at once
	t.Cleanup(func() { _ = c.Close() })
	out := map[string]*tollgate.Limiter{}
	for name, store := range map[string]tollgate.Store{"memory": tollgate.NewMemoryStore(), "miniredis": tollgate.NewRedisStore(c)} {
		l, err := tollgate.New(store, permitPlans, tollgate.WithLogger(nil))
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.Close() })
		out[name] = l
	}
	return out, mr
}

// permitServer is a real server whose handler, behind the middleware,
// answers "/" at once, panics on "/panic", and holds "/block" until the
// test lets it go.
type permitServer struct {
	url     string
	entered chan struct{} // a request reached "/block"
	hungUp  chan struct{} // a request on "/block" saw its context end
	letGo   chan struct{} // a request on "/block" may answer
	done    chan any      // the middleware returned, with the panic that went up through it, or nil
}

func newPermitServer(t *testing.T, l *tollgate.Limiter, opts ...Option) *permitServer {
	t.Helper()
	s := &permitServer{entered: make(chan struct{}, 8), hungUp: make(chan struct{}, 8), letGo: make(chan struct{}), done: make(chan any, 8)}
	handler := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/panic":
			panic("boom")
		case "/block":
			s.entered <- struct{}{}
			select {
			case <-r.Context().Done():
				s.hungUp <- struct{}{}
				<-s.letGo
			case <-s.letGo:
			}
		}
		_, _ = w.Write(okBody)
	})
	limited := Middleware(l, ByHeader("X-Api-Key"), opts...)(handler)
	srv := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		defer func() {
			v := recover()
			s.done <- v
			if v != nil {
				panic(v) // on to the server, as without this wrapper
			}
		}()
		limited.ServeHTTP(w, r)
	}))
	srv.Config.ErrorLog = log.New(io.Discard, "", 0) // the panic's stack
	srv.Start()
	t.Cleanup(srv.Close)
	s.url = srv.URL
	return s
}

// send sends a GET of path with key "k" under ctx, and returns the
// response with its body read, or the error.
func (s *permitServer) send(ctx context.Context, path string) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.url+path, nil)
	if err != nil {
		return nil, err
	}
	req.Header.Set("X-Api-Key", "k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	_, err = io.Copy(io.Discard, resp.Body)
	return resp, err
}

// status sends a GET of path and returns its status code.
func (s *permitServer) status(t *testing.T, path string) int {
	t.Helper()
	resp, err := s.send(context.Background(), path)
	require.NoError(t, err)
	return resp.StatusCode
}

// wait receives from c, or fails the test after a generous while.
func wait[T any](t *testing.T, c <-chan T, what string) T {
	t.Helper()
	select {
	case v := <-c:
		return v
	case <-time.After(10 * time.Second):
		require.FailNow(t, "timed out waiting: "+what)
		panic("unreachable")
	}
}

// A handler that panics releases its permit: the panic goes up through
// the middleware as it came, and the next request gets the one permit.
func TestPermitReleasedWhenTheHandlerPanics(t *testing.T) {
	lims, _ := permitLimiters(t)
	for name, l := range lims {
		t.Run(name, func(t *testing.T) {
			s := newPermitServer(t, l, WithPlans("one"))
			_, err := s.send(context.Background(), "/panic")
			require.Error(t, err, "the server drops the connection of a handler that panicked")
			assert.Equal(t, "boom", wait(t, s.done, "the panicking request"), "the panic goes on up")
			assert.Equal(t, uint64(1), l.Stats().Permits.Released)
			assert.Equal(t, http.StatusOK, s.status(t, "/"), "the permit came back")
			assert.Nil(t, wait(t, s.done, "the next request"))
		})
	}
}

// A client that hangs up mid-handler does not end the handler: its
// permit is held until the handler returns, and released then, though
// the request's context has ended.
func TestPermitReleasedWhenTheClientHangsUp(t *testing.T) {
	lims, _ := permitLimiters(t)
	for name, l := range lims {
		t.Run(name, func(t *testing.T) {
			s := newPermitServer(t, l, WithPlans("one"))
			ctx, cancel := context.WithCancel(context.Background())
			failed := make(chan error, 1)
			go func() {
				_, err := s.send(ctx, "/block")
				failed <- err
			}()
			wait(t, s.entered, "the request to reach the handler")
			cancel()
			assert.ErrorIs(t, wait(t, failed, "the client to give up"), context.Canceled)
			wait(t, s.hungUp, "the handler to see the client hang up")
			assert.Equal(t, http.StatusTooManyRequests, s.status(t, "/"), "held while the handler runs")
			wait(t, s.done, "the refused request")

			s.letGo <- struct{}{}
			assert.Nil(t, wait(t, s.done, "the handler to return"))
			assert.Equal(t, uint64(1), l.Stats().Permits.Released)
			assert.Equal(t, http.StatusOK, s.status(t, "/"), "the permit came back")
		})
	}
}

// With 2 requests in flight of a capacity of 2, the third is refused
// without Retry-After, and the fields say none is free.
func TestPermitCapacityRefusesTheNext(t *testing.T) {
	lims, _ := permitLimiters(t)
	for name, l := range lims {
		t.Run(name, func(t *testing.T) {
			s := newPermitServer(t, l, WithPlans("inflight"))
			for range 2 {
				go func() { _, _ = s.send(context.Background(), "/block") }()
				wait(t, s.entered, "a request to reach the handler")
			}
			resp, err := s.send(context.Background(), "/")
			require.NoError(t, err)
			assert.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
			assert.Equal(t, map[string]string{
				"RateLimit-Policy": `"inflight";q=2`, "RateLimit": `"inflight";r=0`,
				"X-RateLimit-Limit": "2", "X-RateLimit-Remaining": "0", "X-RateLimit-Reset": "", "Retry-After": "",
			}, fieldsOf(resp.Header), "no schedule: no reset and no Retry-After")
			wait(t, s.done, "the refused request")

			for range 2 {
				s.letGo <- struct{}{}
				wait(t, s.done, "a held request")
			}
			resp, err = s.send(context.Background(), "/")
			require.NoError(t, err)
			assert.Equal(t, http.StatusOK, resp.StatusCode)
			assert.Equal(t, `"inflight";r=1`, resp.Header.Get("RateLimit"), "1 free of 2 while this one ran")
		})
	}
}

// A rate plan chained with a concurrency plan that refuses has a
// schedule: Retry-After is kept.
func TestPermitChainedRatePlanKeepsRetryAfter(t *testing.T) {
	lims, _ := permitLimiters(t)
	for name, l := range lims {
		t.Run(name, func(t *testing.T) {
			s := newPermitServer(t, l, WithPlans("inflight", "hourly"))
			require.Equal(t, http.StatusOK, s.status(t, "/"))
			resp, err := s.send(context.Background(), "/")
			require.NoError(t, err)
			assert.Equal(t, http.StatusTooManyRequests, resp.StatusCode)
			f := fieldsOf(resp.Header)
			assert.Equal(t, `"inflight";q=2, "hourly";q=1;w=3600`, f["RateLimit-Policy"])
			assert.Equal(t, "1", f["X-RateLimit-Limit"], "the hourly plan binds")
			assert.Equal(t, "3600", f["Retry-After"])
			assert.Equal(t, "3600", f["X-RateLimit-Reset"])
		})
	}
}

// fieldsOf returns the rate limit fields of h, "" for one that is absent.
func fieldsOf(h http.Header) map[string]string {
	out := map[string]string{}
	for _, name := range []string{"RateLimit-Policy", "RateLimit", "X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "Retry-After"} {
		out[name] = h.Get(name)
	}
	return out
}

// A release that fails does not change the response, which is sent; the
// handler hears of it, by default as a log line without the key.
func TestPermitReleaseErrors(t *testing.T) {
	var logged bytes.Buffer
	defer slog.SetDefault(slog.Default())
	slog.SetDefault(slog.New(slog.NewTextHandler(&logged, nil)))
	var heard []error
	for name, opts := range map[string][]Option{
		"default": {WithPlans("one")},
		"handler": {WithPlans("one"), WithReleaseErrorHandler(func(_ *http.Request, err error) { heard = append(heard, err) })},
	} {
		t.Run(name, func(t *testing.T) {
			lims, mr := permitLimiters(t)
			s := newPermitServer(t, lims["miniredis"], opts...)
			got := make(chan *http.Response, 1)
			go func() {
				resp, err := s.send(context.Background(), "/block")
				assert.NoError(t, err)
				got <- resp
			}()
			wait(t, s.entered, "the request to reach the handler")
			mr.Close()
			s.letGo <- struct{}{}
			assert.Equal(t, http.StatusOK, wait(t, got, "the response").StatusCode)
			wait(t, s.done, "the handler to return")
		})
	}
	require.Len(t, heard, 1)
	assert.ErrorIs(t, heard[0], tollgate.ErrStoreUnavailable)
	assert.NotContains(t, heard[0].Error(), "X-Api-Key")
	assert.Contains(t, logged.String(), "httplimit: releasing a permit failed")
	assert.NotContains(t, logged.String(), "X-Api-Key", "no key in the log")
	assert.Equal(t, 1, strings.Count(logged.String(), "releasing a permit failed"), "the handler replaces the log")
}

// planOnly describes plans but acquires no permits.
type planOnly struct{ stubLimiter }

func (planOnly) Plan(name string) (tollgate.Plan, bool) {
	return tollgate.Plan{Name: name, Capacity: 2, Concurrency: true}, true
}

func TestPermitWiringMistakesPanic(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), permitPlans)
	require.NoError(t, err)
	msg := "httplimit: Middleware: a concurrency plan needs a RateLimiter that is an Acquirer, and no WithSettle"
	assert.PanicsWithValue(t, msg, func() {
		Middleware(l, ByHeader("X-Api-Key"), WithPlans("hourly", "inflight"), WithSettle(func(*http.Request, Response) int64 { return 1 }))
	}, "a reservation holds no permit")
	assert.PanicsWithValue(t, msg, func() { Middleware(&planOnly{}, ByHeader("X-Api-Key"), WithPlans("inflight")) })
	assert.NotPanics(t, func() { Middleware(l, ByHeader("X-Api-Key"), WithPlans("hourly", "inflight")) })
}

// TestPermitDefaultPlanPanics: without WithPlans, a request takes from the
// Limiter's default plan with AllowN, which a concurrency plan refuses.
// Before, Middleware took it and answered every request 500.
func TestPermitDefaultPlanPanics(t *testing.T) {
	l, err := tollgate.New(tollgate.NewMemoryStore(), permitPlans) // "one" first
	require.NoError(t, err)
	_, err = l.Allow(context.Background(), "k")
	require.ErrorIs(t, err, tollgate.ErrInvalidPlan, "what every request would get")
	msg := `httplimit: Middleware: the default plan "one" is a concurrency plan: name it in WithPlans`
	assert.PanicsWithValue(t, msg, func() { Middleware(l, ByHeader("X-Api-Key")) })
	assert.PanicsWithValue(t, msg, func() { Middleware(l, ByHeader("X-Api-Key"), WithPlans()) })
	assert.NotPanics(t, func() { Middleware(l, ByHeader("X-Api-Key"), WithPlans("one")) })
	assert.NotPanics(t, func() { Middleware(&planOnly{}, ByHeader("X-Api-Key")) }, "a RateLimiter that tells no default")
}
