package tgotel_test

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"

	"github.com/tollgate-go/tollgate"
	tgotel "github.com/tollgate-go/tollgate/metrics/otel"
)

var plans = []tollgate.Plan{
	{Name: "gold", Capacity: 2, Rate: 1},
	{Name: "daily", Capacity: 100, Rate: tollgate.Per(100, 24*time.Hour)},
}

// flakyStore wraps a MemoryStore and fails while err is set.
type flakyStore struct {
	mu    sync.Mutex
	err   error
	inner *tollgate.MemoryStore
}

func newFlakyStore() *flakyStore { return &flakyStore{inner: tollgate.NewMemoryStore()} }

func (f *flakyStore) fail(err error) {
	f.mu.Lock()
	f.err = err
	f.mu.Unlock()
}

func (f *flakyStore) Take(ctx context.Context, key string, cost int64, plans []tollgate.Plan) (tollgate.Result, error) {
	f.mu.Lock()
	err := f.err
	f.mu.Unlock()
	if err != nil {
		return tollgate.Result{}, err
	}
	return f.inner.Take(ctx, key, cost, plans)
}

func (f *flakyStore) Reset(ctx context.Context, key string, plans []tollgate.Plan) error {
	return f.inner.Reset(ctx, key, plans)
}

// reader collects what an Observer recorded, as an exporter would.
type reader struct {
	t *testing.T
	*sdkmetric.ManualReader
}

func (r reader) collect() []metricdata.Metrics {
	r.t.Helper()
	var rm metricdata.ResourceMetrics
	require.NoError(r.t, r.Collect(context.Background(), &rm))
	require.Len(r.t, rm.ScopeMetrics, 1)
	assert.Equal(r.t, tgotel.ScopeName, rm.ScopeMetrics[0].Scope.Name)
	return rm.ScopeMetrics[0].Metrics
}

func (r reader) metric(name string) metricdata.Metrics {
	r.t.Helper()
	for _, m := range r.collect() {
		if m.Name == name {
			return m
		}
	}
	r.t.Fatalf("no metric %s", name)
	return metricdata.Metrics{}
}

// value returns the value of the one data point of the counter or gauge
// name whose attributes include kv.
func (r reader) value(name string, kv ...attribute.KeyValue) int64 {
	r.t.Helper()
	var found []int64
	match := func(set attribute.Set) bool {
		for _, want := range kv {
			got, ok := set.Value(want.Key)
			if !ok || got != want.Value {
				return false
			}
		}
		return true
	}
	switch d := r.metric(name).Data.(type) {
	case metricdata.Sum[int64]:
		for _, p := range d.DataPoints {
			if match(p.Attributes) {
				found = append(found, p.Value)
			}
		}
	case metricdata.Gauge[int64]:
		for _, p := range d.DataPoints {
			if match(p.Attributes) {
				found = append(found, p.Value)
			}
		}
	default:
		r.t.Fatalf("%s is a %T", name, d)
	}
	require.Len(r.t, found, 1, "data points of %s with %v", name, kv)
	return found[0]
}

func (r reader) histogram(name string) metricdata.HistogramDataPoint[float64] {
	r.t.Helper()
	h, ok := r.metric(name).Data.(metricdata.Histogram[float64])
	require.True(r.t, ok, "%s is a float64 histogram", name)
	require.Len(r.t, h.DataPoints, 1)
	return h.DataPoints[0]
}

func (r reader) decisions(plan, decision, source string) int64 {
	r.t.Helper()
	return r.value("tollgate.decisions", attribute.String("plan", plan),
		attribute.String("decision", decision), attribute.String("source", source))
}

func newReader(t *testing.T) (reader, *sdkmetric.MeterProvider) {
	mr := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(mr))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return reader{t, mr}, mp
}

func newObserved(t *testing.T, store tollgate.Store, opts ...tollgate.Option) (reader, *tollgate.Limiter) {
	t.Helper()
	r, mp := newReader(t)
	obs, err := tgotel.New(mp)
	require.NoError(t, err)
	lim, err := tollgate.New(store, plans, append([]tollgate.Option{tollgate.WithObserver(obs), tollgate.WithLogger(nil)}, opts...)...)
	require.NoError(t, err)
	return r, lim
}

func TestDecisionsByPlanOutcomeAndSource(t *testing.T) {
	ctx := context.Background()
	r, lim := newObserved(t, tollgate.NewMemoryStore())
	for i := 0; i < 3; i++ { // gold holds 2: allowed, allowed, denied
		_, err := lim.Allow(ctx, "alice", "gold")
		require.NoError(t, err)
	}
	_, err := lim.Allow(ctx, "bob", "gold", "daily") // binding plan: gold
	require.NoError(t, err)
	_, err = lim.Peek(ctx, "alice", "daily") // takes nothing: not counted
	require.NoError(t, err)

	assert.Equal(t, int64(3), r.decisions("gold", "allowed", "store"))
	assert.Equal(t, int64(1), r.decisions("gold", "denied", "store"))
	assert.Equal(t, int64(0), r.decisions("gold", "denied", "fallback"), "every combination exists from a plan's first decision")
	d := r.metric("tollgate.decisions")
	assert.Len(t, d.Data.(metricdata.Sum[int64]).DataPoints, 6, "one plan seen, 2 outcomes x 3 sources")
	assert.Equal(t, "{decision}", d.Unit)
	assert.True(t, d.Data.(metricdata.Sum[int64]).IsMonotonic)
	assert.Equal(t, uint64(5), r.histogram("tollgate.store.duration").Count, "every store call is timed, the Peek's too")
}

// TestOutageAndRecovery fails the store, lets the fallback decide, and
// brings the store back: every instrument of an outage must move and
// settle.
func TestOutageAndRecovery(t *testing.T) {
	ctx := context.Background()
	f := newFlakyStore()
	r, lim := newObserved(t, f, tollgate.WithBreaker(tollgate.BreakerSettings{Failures: 2, Cooldown: 20 * time.Millisecond}))
	_, err := lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, int64(0), r.value("tollgate.fallback.active"))
	assert.Equal(t, int64(0), r.value("tollgate.breaker.state"))

	f.fail(errors.New("connection refused"))
	for i := 0; i < 4; i++ { // 2 failures open the breaker; 2 more skip the store
		res, err := lim.Allow(ctx, "alice", "gold")
		require.NoError(t, err)
		require.Equal(t, tollgate.SourceFallback, res.Source)
	}
	assert.Equal(t, int64(2), r.value("tollgate.store.errors"), "calls the open breaker skipped are not errors")
	assert.Equal(t, int64(1), r.value("tollgate.fallback.active"))
	assert.Equal(t, int64(1), r.value("tollgate.fallback.active"), "a gauge keeps its value across collections")
	assert.Equal(t, int64(tollgate.BreakerOpen), r.value("tollgate.breaker.state"))
	assert.Equal(t, int64(2), r.decisions("gold", "allowed", "fallback"))
	assert.Equal(t, int64(2), r.decisions("gold", "denied", "fallback"))

	f.fail(nil)
	time.Sleep(30 * time.Millisecond) // past the cooldown: the next call probes
	res, err := lim.Allow(ctx, "bob", "gold")
	require.NoError(t, err)
	require.Equal(t, tollgate.SourceStore, res.Source)
	assert.Equal(t, int64(0), r.value("tollgate.fallback.active"))
	assert.Equal(t, int64(tollgate.BreakerClosed), r.value("tollgate.breaker.state"))
	for to, want := range map[string]int64{"open": 1, "half-open": 1, "closed": 1} {
		assert.Equal(t, want, r.value("tollgate.breaker.transitions", attribute.String("to", to)), "to %s", to)
	}
	assert.Equal(t, int64(2), r.value("tollgate.store.errors"))
	assert.Equal(t, uint64(4), r.histogram("tollgate.store.duration").Count, "1 before, 2 failed, 1 probe")
}

func TestFailOpenDecisions(t *testing.T) {
	f := newFlakyStore()
	f.fail(errors.New("down"))
	r, lim := newObserved(t, f, tollgate.WithFailurePolicy(tollgate.FailOpen))
	for i := 0; i < 5; i++ {
		_, err := lim.Allow(context.Background(), "alice", "gold")
		require.NoError(t, err)
	}
	assert.Equal(t, int64(5), r.decisions("gold", "allowed", "fail-open"))
	assert.Equal(t, int64(0), r.decisions("gold", "allowed", "store"))
}

// TestCancelledCallIsNotAStoreError: a caller that gives up says nothing
// about the store, as the Limiter's breaker agrees.
func TestCancelledCallIsNotAStoreError(t *testing.T) {
	f := newFlakyStore()
	r, lim := newObserved(t, f)
	f.fail(context.Canceled)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := lim.Allow(ctx, "alice", "gold")
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, uint64(1), r.histogram("tollgate.store.duration").Count, "the call is still timed")
	for _, m := range r.collect() {
		assert.NotEqual(t, "tollgate.store.errors", m.Name, "no error recorded")
	}
}

// TestRedisOutageAndScriptLoads runs a RedisStore on miniredis: the first
// call loads the script (NOSCRIPT), and closing the server is a real
// outage on the wire.
func TestRedisOutageAndScriptLoads(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	t.Cleanup(func() { _ = client.Close() })
	r, mp := newReader(t)
	obs, err := tgotel.New(mp)
	require.NoError(t, err)
	lim, err := tollgate.New(tollgate.NewRedisStore(client, tollgate.WithRedisObserver(obs)), plans,
		tollgate.WithObserver(obs), tollgate.WithLogger(nil),
		tollgate.WithBreaker(tollgate.BreakerSettings{Failures: 1, Cooldown: 10 * time.Millisecond}))
	require.NoError(t, err)

	_, err = lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, int64(1), r.value("tollgate.script.loads"), "the first call loads the script")

	mr.Close()
	res, err := lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, tollgate.SourceFallback, res.Source)
	assert.Equal(t, int64(1), r.value("tollgate.fallback.active"))
	assert.Equal(t, int64(1), r.value("tollgate.store.errors"))

	require.NoError(t, mr.Restart())
	require.Eventually(t, func() bool {
		res, err := lim.Allow(ctx, "bob", "gold")
		return err == nil && res.Source == tollgate.SourceStore
	}, 2*time.Second, 5*time.Millisecond)
	assert.Equal(t, int64(0), r.value("tollgate.fallback.active"))
	assert.Equal(t, int64(tollgate.BreakerClosed), r.value("tollgate.breaker.state"))
}

// TestSeveralLimitersShareAProvider: attributes tell Observers apart.
func TestSeveralLimitersShareAProvider(t *testing.T) {
	r, mp := newReader(t)
	api, err := tgotel.New(mp, tgotel.WithAttributes(attribute.String("limiter", "api")))
	require.NoError(t, err)
	login, err := tgotel.New(mp, tgotel.WithAttributes(attribute.String("limiter", "login")))
	require.NoError(t, err)
	api.ObserveFallback(true)
	login.ObserveBreaker(tollgate.BreakerClosed, tollgate.BreakerOpen)
	login.ObserveDecision(tollgate.Decision{Plan: "gold", Allowed: true, Cost: 1})

	api1, login1 := attribute.String("limiter", "api"), attribute.String("limiter", "login")
	assert.Equal(t, int64(1), r.value("tollgate.fallback.active", api1))
	assert.Equal(t, int64(0), r.value("tollgate.fallback.active", login1))
	assert.Equal(t, int64(0), r.value("tollgate.breaker.state", api1))
	assert.Equal(t, int64(1), r.value("tollgate.breaker.state", login1))
	assert.Equal(t, int64(1), r.value("tollgate.decisions", login1, attribute.String("decision", "allowed"), attribute.String("source", "store")))
}

// TestInstruments pins every instrument's name, unit and kind, which
// decide the names an exporter gives them.
func TestInstruments(t *testing.T) {
	r, mp := newReader(t)
	obs, err := tgotel.New(mp)
	require.NoError(t, err)
	obs.ObserveDecision(tollgate.Decision{Plan: "gold", Allowed: true, Cost: 1})
	obs.ObserveStore(time.Millisecond, errors.New("i/o timeout"))
	obs.ObserveScriptLoad()
	got := map[string]string{}
	for _, m := range r.collect() {
		kind := ""
		switch d := m.Data.(type) {
		case metricdata.Sum[int64]:
			kind = "gauge"
			if d.IsMonotonic {
				kind = "counter"
			}
		case metricdata.Gauge[int64]:
			kind = "gauge"
		case metricdata.Histogram[float64]:
			kind = "histogram"
		}
		got[m.Name] = kind + " " + m.Unit
	}
	assert.Equal(t, map[string]string{
		"tollgate.decisions":           "counter {decision}",
		"tollgate.store.duration":      "histogram s",
		"tollgate.store.errors":        "counter {error}",
		"tollgate.fallback.active":     "gauge ",
		"tollgate.breaker.state":       "gauge ",
		"tollgate.breaker.transitions": "counter {transition}",
		"tollgate.script.loads":        "counter {load}",
	}, got)
}

func TestDurationBuckets(t *testing.T) {
	r, mp := newReader(t)
	obs, err := tgotel.New(mp, tgotel.WithDurationBuckets([]float64{0.001, 0.1}))
	require.NoError(t, err)
	obs.ObserveStore(300*time.Microsecond, nil)
	obs.ObserveStore(50*time.Millisecond, nil)
	obs.ObserveStore(2*time.Second, nil)
	h := r.histogram("tollgate.store.duration")
	assert.Equal(t, []float64{0.001, 0.1}, h.Bounds)
	assert.Equal(t, []uint64{1, 1, 1}, h.BucketCounts)
	assert.InDelta(t, 2.0503, h.Sum, 1e-9)

	r2, mp2 := newReader(t)
	obs2, err := tgotel.New(mp2)
	require.NoError(t, err)
	obs2.ObserveStore(time.Millisecond, nil)
	assert.Equal(t, tgotel.DefaultDurationBuckets, r2.histogram("tollgate.store.duration").Bounds)
}

func TestNilProviderMeansGlobal(t *testing.T) {
	r, mp := newReader(t)
	prev := otel.GetMeterProvider()
	otel.SetMeterProvider(mp)
	t.Cleanup(func() { otel.SetMeterProvider(prev) })
	obs, err := tgotel.New(nil)
	require.NoError(t, err)
	obs.ObserveScriptLoad()
	assert.Equal(t, int64(1), r.value("tollgate.script.loads"))
}

// TestConcurrentNewPlans adds plans from many goroutines at once; run with
// -race.
func TestConcurrentNewPlans(t *testing.T) {
	r, mp := newReader(t)
	obs, err := tgotel.New(mp)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for g := 0; g < 8; g++ {
		wg.Go(func() {
			for i := 0; i < 100; i++ {
				obs.ObserveDecision(tollgate.Decision{Plan: []string{"a", "b", "c"}[i%3], Allowed: i%2 == 0, Cost: 1})
			}
		})
	}
	wg.Wait()
	var total int64
	for _, p := range []string{"a", "b", "c"} {
		for _, d := range []string{"allowed", "denied"} {
			total += r.decisions(p, d, "store")
		}
	}
	assert.Equal(t, int64(800), total)
}
