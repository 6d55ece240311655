package tgotel_test

import (
	"context"
	"errors"
	"fmt"
	"net"
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
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redisscript"
	"github.com/tollgate-go/tollgate/internal/storetest"
	tgotel "github.com/tollgate-go/tollgate/metrics/otel"
)

var plans = []tollgate.Plan{
	{Name: "gold", Capacity: 2, Rate: 1},
	{Name: "daily", Capacity: 100, Rate: tollgate.Per(100, 24*time.Hour)},
}

// reader collects what the instruments observe, as an exporter would.
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

func match(set attribute.Set, kv []attribute.KeyValue) bool {
	for _, want := range kv {
		got, ok := set.Value(want.Key)
		if !ok || got != want.Value {
			return false
		}
	}
	return true
}

// value returns the value of the one data point of the int64 counter or
// gauge name whose attributes include kv.
func (r reader) value(name string, kv ...attribute.KeyValue) int64 {
	r.t.Helper()
	var found []int64
	switch d := r.metric(name).Data.(type) {
	case metricdata.Sum[int64]:
		for _, p := range d.DataPoints {
			if match(p.Attributes, kv) {
				found = append(found, p.Value)
			}
		}
	case metricdata.Gauge[int64]:
		for _, p := range d.DataPoints {
			if match(p.Attributes, kv) {
				found = append(found, p.Value)
			}
		}
	default:
		r.t.Fatalf("%s is a %T", name, d)
	}
	require.Len(r.t, found, 1, "data points of %s with %v", name, kv)
	return found[0]
}

// points returns the number of data points of the int64 counter name.
func (r reader) points(name string) int {
	r.t.Helper()
	d, ok := r.metric(name).Data.(metricdata.Sum[int64])
	require.True(r.t, ok, "%s is an int64 sum", name)
	return len(d.DataPoints)
}

// seconds returns the value of the one data point of tollgate.store.duration.
func (r reader) seconds() float64 {
	r.t.Helper()
	d, ok := r.metric("tollgate.store.duration").Data.(metricdata.Sum[float64])
	require.True(r.t, ok, "tollgate.store.duration is a float64 sum")
	require.Len(r.t, d.DataPoints, 1)
	return d.DataPoints[0].Value
}

func (r reader) decisions(plan, decision, source string) int64 {
	r.t.Helper()
	return r.value("tollgate.decisions", attribute.String("plan", plan),
		attribute.String("decision", decision), attribute.String("source", source))
}

func (r reader) storeErrors(class string) int64 {
	r.t.Helper()
	return r.value("tollgate.store.errors", attribute.String("class", class))
}

func newReader(t *testing.T) (reader, *sdkmetric.MeterProvider) {
	mr := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(mr))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	return reader{t, mr}, mp
}

// permitPlans are a concurrency plan of 2 permits and a bucket, which
// holds no permits.
var permitPlans = []tollgate.Plan{
	{Name: "inflight", Capacity: 2, Concurrency: true},
	{Name: "gold", Capacity: 2, Rate: 1},
}

// newRegistered returns a Limiter on store, and a reader of its
// instruments.
func newRegistered(t *testing.T, store tollgate.Store, opts ...tollgate.Option) (reader, *tollgate.Limiter) {
	t.Helper()
	return newRegisteredPlans(t, store, plans, opts...)
}

// newRegisteredPlans is newRegistered for a Limiter on ps, closed when the
// test ends.
func newRegisteredPlans(t *testing.T, store tollgate.Store, ps []tollgate.Plan, opts ...tollgate.Option) (reader, *tollgate.Limiter) {
	t.Helper()
	lim, err := tollgate.New(store, ps, append([]tollgate.Option{tollgate.WithLogger(nil)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lim.Close() })
	r, mp := newReader(t)
	_, err = tgotel.Register(lim, mp)
	require.NoError(t, err)
	return r, lim
}

func TestDecisionsBySource(t *testing.T) {
	ctx := context.Background()
	r, lim := newRegistered(t, storetest.NewFlaky())
	for i := 0; i < 3; i++ { // gold holds 2: allowed, allowed, denied
		res, err := lim.Allow(ctx, "alice", "gold")
		require.NoError(t, err)
		require.Equal(t, tollgate.SourceStore, res.Source)
	}
	res, err := lim.Allow(ctx, "alice", "gold") // the denial is remembered
	require.NoError(t, err)
	require.Equal(t, tollgate.SourceCache, res.Source)
	_, err = lim.Allow(ctx, "bob", "gold", "daily") // binding plan: gold
	require.NoError(t, err)
	_, err = lim.Peek(ctx, "alice", "daily") // takes nothing: not counted
	require.NoError(t, err)

	assert.Equal(t, int64(3), r.decisions("gold", "allowed", "store"))
	assert.Equal(t, int64(1), r.decisions("gold", "denied", "store"))
	assert.Equal(t, int64(1), r.decisions("gold", "denied", "cache"))
	assert.Equal(t, int64(0), r.decisions("daily", "denied", "fallback"), "every data point exists from the first collection")
	d := r.metric("tollgate.decisions")
	sum := d.Data.(metricdata.Sum[int64])
	assert.Len(t, sum.DataPoints, 20, "2 plans x 2 decisions x 5 sources")
	assert.Equal(t, "{decision}", d.Unit)
	assert.True(t, sum.IsMonotonic)
	assert.Equal(t, metricdata.CumulativeTemporality, sum.Temporality)
	assert.Equal(t, int64(5), r.value("tollgate.store.calls"), "alice's 3, bob's and the Peek; the cache answered without the store")
}

// TestMemoryStore: a MemoryStore's decisions are counted, but it cannot
// fail and its calls are not timed.
func TestMemoryStore(t *testing.T) {
	r, lim := newRegistered(t, tollgate.NewMemoryStore())
	for i := 0; i < 3; i++ {
		_, err := lim.Allow(context.Background(), "alice", "gold")
		require.NoError(t, err)
	}
	assert.Equal(t, int64(2), r.decisions("gold", "allowed", "store"))
	assert.Equal(t, int64(1), r.decisions("gold", "denied", "store"))
	assert.Equal(t, int64(0), r.value("tollgate.store.calls"))
	assert.Equal(t, 0.0, r.seconds())
}

// TestStoreDuration: without a histogram, the total and the count of the
// store calls.
func TestStoreDuration(t *testing.T) {
	f := storetest.NewFlaky()
	r, lim := newRegistered(t, f)
	ctx := context.Background()
	_, err := lim.Allow(ctx, "a", "daily")
	require.NoError(t, err)
	f.Slow(30 * time.Millisecond)
	_, err = lim.Allow(ctx, "b", "daily")
	require.NoError(t, err)

	got := r.seconds()
	assert.Equal(t, lim.Stats().StoreTime.Seconds(), got, "nothing happened since the collection")
	assert.GreaterOrEqual(t, got, 0.030)
	assert.Equal(t, int64(2), r.value("tollgate.store.calls"))
	d := r.metric("tollgate.store.duration")
	assert.Equal(t, "s", d.Unit)
	assert.True(t, d.Data.(metricdata.Sum[float64]).IsMonotonic)
}

// TestOutageAndRecovery fails the store, lets the fallback decide, and
// brings the store back: every instrument of an outage must move and
// settle.
func TestOutageAndRecovery(t *testing.T) {
	ctx := context.Background()
	f := storetest.NewFlaky()
	// A cooldown long enough that the calls after the trip do not probe on
	// a loaded machine.
	const cooldown = 200 * time.Millisecond
	r, lim := newRegistered(t, f, tollgate.WithBreaker(breaker.Settings{Failures: 2, Cooldown: cooldown}))
	_, err := lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, int64(0), r.value("tollgate.fallback.active"))
	assert.Equal(t, int64(breaker.Closed), r.value("tollgate.breaker.state"))
	assert.Equal(t, int64(0), r.value("tollgate.breaker.transitions", attribute.String("to", "open")))
	assert.Equal(t, int64(0), r.storeErrors("other"))

	f.Fail(errors.New("connection refused"))
	for i := 0; i < 4; i++ { // 2 failures open the breaker; 2 more skip the store
		res, err := lim.Allow(ctx, "alice", "gold")
		require.NoError(t, err)
		require.Equal(t, tollgate.SourceFallback, res.Source)
	}
	assert.Equal(t, int64(2), r.storeErrors("other"), "calls the open breaker skipped are not errors")
	assert.Equal(t, int64(1), r.value("tollgate.fallback.active"))
	assert.Equal(t, int64(1), r.value("tollgate.fallback.active"), "a gauge keeps its value across collections")
	assert.Equal(t, int64(breaker.Open), r.value("tollgate.breaker.state"))
	assert.Equal(t, int64(2), r.decisions("gold", "allowed", "fallback"))
	assert.Equal(t, int64(2), r.decisions("gold", "denied", "fallback"))

	f.Fail(nil)
	time.Sleep(cooldown + 10*time.Millisecond) // the next call probes
	res, err := lim.Allow(ctx, "bob", "gold")
	require.NoError(t, err)
	require.Equal(t, tollgate.SourceStore, res.Source)
	assert.Equal(t, int64(breaker.Closed), r.value("tollgate.breaker.state"))
	// The outage ends at a success two cooldowns after the last failure,
	// which a slow machine may have reached already.
	var outage int64
	if lim.Stats().Outage {
		outage = 1
	}
	assert.Equal(t, outage, r.value("tollgate.fallback.active"))
	n := 0
	require.Eventually(t, func() bool { // a new key each time, so that the store answers
		n++
		_, err := lim.Allow(ctx, fmt.Sprintf("user-%d", n), "gold")
		return err == nil && !lim.Stats().Outage
	}, 5*cooldown, 10*time.Millisecond)
	assert.Equal(t, int64(0), r.value("tollgate.fallback.active"))
	for to, want := range map[string]int64{"open": 1, "half-open": 1, "closed": 1} {
		assert.Equal(t, want, r.value("tollgate.breaker.transitions", attribute.String("to", to)), "to %s", to)
	}
	assert.Equal(t, int64(2), r.storeErrors("other"))
	calls := r.value("tollgate.store.calls")
	assert.Equal(t, int64(lim.Stats().StoreCalls), calls)
	assert.GreaterOrEqual(t, calls, int64(5), "1 before, 2 failed, the probe, 1 after")
}

// TestStoreErrorsByClass fails the store in each way the Limiter tells
// apart.
func TestStoreErrorsByClass(t *testing.T) {
	f := storetest.NewFlaky()
	// The breaker stays closed, so that every call reaches the store.
	r, lim := newRegistered(t, f, tollgate.WithBreaker(breaker.Settings{Failures: 1000}))
	for _, err := range []error{
		storetest.TimeoutError{},
		&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")},
		&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")},
		fmt.Errorf("parse: %w", redisscript.ErrBadReply),
		errors.New("something else"),
	} {
		f.Fail(err)
		res, err := lim.Allow(context.Background(), "alice", "gold")
		require.NoError(t, err)
		require.Equal(t, tollgate.SourceFallback, res.Source)
	}
	for class, want := range map[string]int64{"timeout": 1, "network": 2, "bad-reply": 1, "other": 1, "canceled": 0} {
		assert.Equal(t, want, r.storeErrors(class), "class %s", class)
	}
	assert.Equal(t, 5, r.points("tollgate.store.errors"))
}

func TestFailOpenDecisions(t *testing.T) {
	f := storetest.NewFlaky()
	f.Fail(errors.New("down"))
	r, lim := newRegistered(t, f, tollgate.WithFailurePolicy(breaker.FailOpen))
	for i := 0; i < 5; i++ {
		_, err := lim.Allow(context.Background(), "alice", "gold")
		require.NoError(t, err)
	}
	assert.Equal(t, int64(5), r.decisions("gold", "allowed", "fail-open"))
	assert.Equal(t, int64(0), r.decisions("gold", "allowed", "store"))
}

// TestCancelledCallIsNotAStoreError: a caller that gives up while the
// store works says nothing about the store, as the Limiter's breaker
// agrees; a store that cancels its own call has failed.
func TestCancelledCallIsNotAStoreError(t *testing.T) {
	f := storetest.NewFlaky()
	r, lim := newRegistered(t, f)
	ctx, cancel := context.WithCancel(context.Background())
	f.OnTake(cancel)
	_, err := lim.Allow(ctx, "alice", "gold")
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, int64(0), r.storeErrors("canceled"))
	assert.Equal(t, int64(0), r.value("tollgate.fallback.active"))
	assert.Equal(t, int64(1), r.value("tollgate.store.calls"), "the call is still timed")

	f.OnTake(nil)
	f.Fail(context.Canceled) // the store's own context, not the caller's
	res, err := lim.Allow(context.Background(), "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, tollgate.SourceFallback, res.Source)
	assert.Equal(t, int64(1), r.storeErrors("canceled"))
}

// TestRedisOutageAndScriptLoads runs a RedisStore on miniredis: the first
// call loads the script (NOSCRIPT), an error Redis answers is counted by
// its class, and closing the server is a real outage on the wire.
func TestRedisOutageAndScriptLoads(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	t.Cleanup(func() { _ = client.Close() })
	r, lim := newRegistered(t, tollgate.NewRedisStore(client),
		tollgate.WithBreaker(breaker.Settings{Failures: 1, Cooldown: 10 * time.Millisecond}))

	_, err := lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, int64(1), r.value("tollgate.script.loads"), "the first call loads the script")

	mr.SetError("READONLY You can't write against a read only replica.")
	res, err := lim.Allow(ctx, "carol", "gold")
	require.NoError(t, err)
	assert.Equal(t, tollgate.SourceFallback, res.Source)
	assert.Equal(t, int64(1), r.storeErrors("READONLY"), "Redis's class, without the rest of its text")
	assert.Equal(t, int64(1), r.value("tollgate.fallback.active"))
	mr.SetError("")

	mr.Close()
	require.Eventually(t, func() bool { // past the cooldown, a probe fails on the wire
		if _, err := lim.Allow(ctx, "alice", "gold"); err != nil {
			return false
		}
		var n uint64
		for class, v := range lim.Stats().StoreErrors {
			if class != "READONLY" {
				n += v
			}
		}
		return n > 0
	}, 2*time.Second, 5*time.Millisecond)
	assert.Equal(t, int64(1), r.value("tollgate.fallback.active"))

	require.NoError(t, mr.Restart())
	require.Eventually(t, func() bool { // back on Redis, and two cooldowns without a failure
		res, err := lim.Allow(ctx, "bob", "gold")
		return err == nil && res.Source == tollgate.SourceStore && !lim.Stats().Outage
	}, 2*time.Second, 5*time.Millisecond)
	assert.Equal(t, int64(0), r.value("tollgate.fallback.active"))
	assert.Equal(t, int64(breaker.Closed), r.value("tollgate.breaker.state"))
}

// TestSeveralLimitersShareAProvider: attributes tell Limiters apart.
func TestSeveralLimitersShareAProvider(t *testing.T) {
	ctx := context.Background()
	r, mp := newReader(t)
	apiStore, loginStore := storetest.NewFlaky(), storetest.NewFlaky()
	api, err := tollgate.New(apiStore, plans, tollgate.WithLogger(nil))
	require.NoError(t, err)
	login, err := tollgate.New(loginStore, plans, tollgate.WithLogger(nil),
		tollgate.WithBreaker(breaker.Settings{Failures: 1, Cooldown: time.Hour}))
	require.NoError(t, err)
	_, err = tgotel.Register(api, mp, tgotel.WithAttributes(attribute.String("limiter", "api")))
	require.NoError(t, err)
	_, err = tgotel.Register(login, mp, tgotel.WithAttributes(attribute.String("limiter", "login")))
	require.NoError(t, err)

	_, err = api.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	loginStore.Fail(errors.New("down"))
	_, err = login.Allow(ctx, "alice", "gold")
	require.NoError(t, err)

	api1, login1 := attribute.String("limiter", "api"), attribute.String("limiter", "login")
	assert.Equal(t, int64(0), r.value("tollgate.fallback.active", api1))
	assert.Equal(t, int64(1), r.value("tollgate.fallback.active", login1))
	assert.Equal(t, int64(breaker.Closed), r.value("tollgate.breaker.state", api1))
	assert.Equal(t, int64(breaker.Open), r.value("tollgate.breaker.state", login1))
	allowed := []attribute.KeyValue{attribute.String("plan", "gold"), attribute.String("decision", "allowed")}
	assert.Equal(t, int64(1), r.value("tollgate.decisions", append(allowed, api1, attribute.String("source", "store"))...))
	assert.Equal(t, int64(1), r.value("tollgate.decisions", append(allowed, login1, attribute.String("source", "fallback"))...))
	assert.Equal(t, int64(0), r.value("tollgate.decisions", append(allowed, login1, attribute.String("source", "store"))...))
}

// TestUnregister: after Unregister the callback is not called, and the
// Limiter's data points are gone from the next collection.
func TestUnregister(t *testing.T) {
	r, mp := newReader(t)
	api, err := tollgate.New(tollgate.NewMemoryStore(), plans)
	require.NoError(t, err)
	login, err := tollgate.New(tollgate.NewMemoryStore(), plans)
	require.NoError(t, err)
	reg, err := tgotel.Register(api, mp, tgotel.WithAttributes(attribute.String("limiter", "api")))
	require.NoError(t, err)
	_, err = tgotel.Register(login, mp, tgotel.WithAttributes(attribute.String("limiter", "login")))
	require.NoError(t, err)
	assert.Equal(t, 20*2, r.points("tollgate.decisions"))

	require.NoError(t, reg.Unregister())
	require.NoError(t, reg.Unregister(), "idempotent")
	assert.Equal(t, 20, r.points("tollgate.decisions"), "the login Limiter's alone")
	assert.Equal(t, int64(0), r.value("tollgate.fallback.active", attribute.String("limiter", "login")))
}

func TestNilLimiterPanics(t *testing.T) {
	_, mp := newReader(t)
	assert.PanicsWithValue(t, "tgotel: Register with a nil Limiter", func() { _, _ = tgotel.Register(nil, mp) })
}

// TestInstruments pins every instrument's name, unit and kind, which
// decide the names an exporter gives them.
func TestInstruments(t *testing.T) {
	r, _ := newRegistered(t, storetest.NewFlaky())
	got := map[string]string{}
	for _, m := range r.collect() {
		kind := ""
		switch d := m.Data.(type) {
		case metricdata.Sum[int64]:
			kind = "int64 up-down counter"
			if d.IsMonotonic {
				kind = "int64 counter"
			}
		case metricdata.Sum[float64]:
			kind = "float64 up-down counter"
			if d.IsMonotonic {
				kind = "float64 counter"
			}
		case metricdata.Gauge[int64]:
			kind = "int64 gauge"
		default:
			kind = fmt.Sprintf("%T", d)
		}
		got[m.Name] = kind + " " + m.Unit
	}
	assert.Equal(t, map[string]string{
		"tollgate.decisions":           "int64 counter {decision}",
		"tollgate.store.duration":      "float64 counter s",
		"tollgate.store.calls":         "int64 counter {call}",
		"tollgate.store.errors":        "int64 counter {error}",
		"tollgate.fallback.active":     "int64 gauge ",
		"tollgate.breaker.state":       "int64 gauge ",
		"tollgate.breaker.transitions": "int64 counter {transition}",
		"tollgate.script.loads":        "int64 counter {load}",
		"tollgate.reservations":        "int64 counter {reservation}",
		"tollgate.reservation.tokens":  "int64 counter {token}",
		"tollgate.shadow.denials":      "int64 counter {decision}",
		"tollgate.fleet.size":          "int64 gauge {instance}",
		"tollgate.permits":             "int64 counter {permit}",
		"tollgate.permits.held":        "int64 gauge {permit}",
	}, got)
}

func TestReservations(t *testing.T) {
	r, lim := newRegistered(t, tollgate.NewMemoryStore())
	ctx := context.Background()
	for _, used := range []int64{0, 3} { // 1 refunded, then 2 charged
		res, err := lim.Reserve(ctx, "alice", 1, "daily")
		require.NoError(t, err)
		_, err = res.Settle(ctx, used)
		require.NoError(t, err)
	}
	assert.Equal(t, int64(2), r.value("tollgate.reservations", attribute.String("event", "held")))
	assert.Equal(t, int64(2), r.value("tollgate.reservations", attribute.String("event", "settled")))
	assert.Equal(t, int64(0), r.value("tollgate.reservations", attribute.String("event", "expired")))
	assert.Equal(t, int64(1), r.value("tollgate.reservation.tokens", attribute.String("kind", "refunded")))
	assert.Equal(t, int64(2), r.value("tollgate.reservation.tokens", attribute.String("kind", "charged")))
	assert.Equal(t, int64(0), r.value("tollgate.reservation.tokens", attribute.String("kind", "uncharged")))
}

// permits returns the data points of tollgate.permits by event, and of
// tollgate.permits.held by plan.
func (r reader) permits() (events, held map[string]int64) {
	r.t.Helper()
	events, held = map[string]int64{}, map[string]int64{}
	for _, m := range r.collect() {
		switch d := m.Data.(type) {
		case metricdata.Sum[int64]:
			if m.Name == "tollgate.permits" {
				for _, p := range d.DataPoints {
					event, _ := p.Attributes.Value("event")
					events[event.AsString()] = p.Value
				}
			}
		case metricdata.Gauge[int64]:
			if m.Name == "tollgate.permits.held" {
				for _, p := range d.DataPoints {
					plan, _ := p.Attributes.Value("plan")
					held[plan.AsString()] = p.Value
				}
			}
		}
	}
	return events, held
}

// TestPermits acquires permits of a concurrency plan, is refused and
// releases: every event and every plan has its data point from the first
// collection, and each moves with its own count.
func TestPermits(t *testing.T) {
	r, lim := newRegisteredPlans(t, tollgate.NewMemoryStore(), permitPlans)
	ctx := context.Background()
	events, held := r.permits()
	assert.Equal(t, map[string]int64{"granted": 0, "refused": 0, "released": 0, "lost": 0, "unreleased": 0, "reclaimed": 0, "adopted": 0}, events, "before the first Acquire")
	assert.Equal(t, map[string]int64{"inflight": 0, "gold": 0}, held, "before the first Acquire")

	acquire := func(n int64) *tollgate.Permit {
		t.Helper()
		p, err := lim.Acquire(ctx, "alice", n, "inflight")
		require.NoError(t, err)
		return p
	}
	a, b := acquire(1), acquire(1)
	require.True(t, a.OK() && b.OK())
	require.False(t, acquire(1).OK(), "2 permits, both held")
	require.NoError(t, a.Release(ctx))
	require.NoError(t, b.Release(ctx))
	c := acquire(2)
	require.True(t, c.OK())
	events, held = r.permits()
	assert.Equal(t, map[string]int64{"granted": 3, "refused": 1, "released": 2, "lost": 0, "unreleased": 0, "reclaimed": 0, "adopted": 0}, events, "while c holds both permits")
	assert.Equal(t, map[string]int64{"inflight": 2, "gold": 0}, held, "while c holds both permits")
	require.NoError(t, c.Release(ctx))
	assert.Equal(t, int64(0), r.value("tollgate.permits.held", attribute.String("plan", "inflight")))
	assert.Equal(t, int64(3), r.value("tollgate.permits", attribute.String("event", "released")))
}

// TestPermitsLost moves Redis's clock past a lease: the next renewal
// finds the Permit lost, and its 2 permits reclaimed.
func TestPermitsLost(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	r, lim := newRegisteredPlans(t, tollgate.NewRedisStore(client), permitPlans,
		tollgate.WithPermitLease(30*time.Millisecond))
	p, err := lim.Acquire(ctx, "alice", 2, "inflight")
	require.NoError(t, err)
	require.True(t, p.OK())
	assert.Equal(t, int64(2), r.value("tollgate.permits.held", attribute.String("plan", "inflight")))

	mr.SetTime(time.Now().Add(time.Hour)) // TIME in scripts; the key's TTL stands still
	require.Eventually(t, func() bool { return lim.Stats().Permits.Lost > 0 }, 5*time.Second, 5*time.Millisecond)
	require.ErrorIs(t, p.Release(ctx), tollgate.ErrPermitLost)
	events, held := r.permits()
	assert.Equal(t, map[string]int64{"granted": 1, "refused": 0, "released": 0, "lost": 1, "unreleased": 0, "reclaimed": 2, "adopted": 0}, events)
	assert.Equal(t, map[string]int64{"inflight": 0, "gold": 0}, held)
}

// Would-be denials are counted under the shadowed plan, also one that
// SetPlans added after Register, with its own plan attribute.
func TestShadowDenialsByPlan(t *testing.T) {
	r, lim := newRegistered(t, tollgate.NewMemoryStore())
	require.NoError(t, lim.SetPlans([]tollgate.Plan{{Name: "now", Capacity: 10, Rate: 1}, {Name: "next", Capacity: 1, Rate: 0.001, Shadow: true}}))
	for range 3 {
		_, err := lim.Allow(context.Background(), "alice", "now", "next")
		require.NoError(t, err)
	}
	assert.Equal(t, int64(2), r.value("tollgate.shadow.denials", attribute.String("plan", "next")))
	assert.Equal(t, int64(0), r.value("tollgate.shadow.denials", attribute.String("plan", "now")))
	assert.Equal(t, int64(3), r.decisions("now", "allowed", "store"))
}

func TestNilProviderMeansGlobal(t *testing.T) {
	r, mp := newReader(t)
	prev := otel.GetMeterProvider()
	otel.SetMeterProvider(mp)
	t.Cleanup(func() { otel.SetMeterProvider(prev) })
	lim, err := tollgate.New(tollgate.NewMemoryStore(), plans)
	require.NoError(t, err)
	_, err = tgotel.Register(lim, nil)
	require.NoError(t, err)
	_, err = lim.Allow(context.Background(), "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, int64(1), r.decisions("gold", "allowed", "store"))
}

// TestConcurrentCollections collects from two readers while many
// goroutines decide; run with -race.
func TestConcurrentCollections(t *testing.T) {
	r1, r2 := sdkmetric.NewManualReader(), sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(r1), sdkmetric.WithReader(r2))
	t.Cleanup(func() { _ = mp.Shutdown(context.Background()) })
	lim, err := tollgate.New(storetest.NewFlaky(), plans, tollgate.WithLogger(nil))
	require.NoError(t, err)
	_, err = tgotel.Register(lim, mp)
	require.NoError(t, err)

	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Go(func() {
			for i := 0; i < 100; i++ {
				_, _ = lim.Allow(context.Background(), fmt.Sprintf("user-%d", i%10), []string{"gold", "daily"}[i%2])
			}
		})
	}
	for _, rd := range []*sdkmetric.ManualReader{r1, r2} {
		wg.Go(func() {
			for i := 0; i < 20; i++ {
				var rm metricdata.ResourceMetrics
				assert.NoError(t, rd.Collect(context.Background(), &rm))
			}
		})
	}
	wg.Wait()
	r := reader{t, r1}
	var total int64
	for _, p := range []string{"gold", "daily"} {
		for _, d := range []string{"allowed", "denied"} {
			for _, s := range []string{"store", "cache"} {
				total += r.decisions(p, d, s)
			}
		}
	}
	assert.Equal(t, int64(400), total)
}

// BenchmarkCollect measures one collection of a Limiter with four plans:
// Stats alone (the Limiter's share), and a ManualReader's Collect, which
// runs the callback and the SDK's aggregation (what an exporter pays
// before encoding).
func BenchmarkCollect(b *testing.B) {
	ctx := context.Background()
	f := storetest.NewFlaky()
	lim, err := tollgate.New(f, []tollgate.Plan{
		{Name: "free", Capacity: 10, Rate: 1},
		{Name: "pro", Capacity: 100, Rate: 10},
		{Name: "burst", Capacity: 5, Rate: 5},
		{Name: "daily", Capacity: 1000, Rate: tollgate.Per(1000, 24*time.Hour)},
	}, tollgate.WithLogger(nil), tollgate.WithBreaker(breaker.Settings{Failures: 1000}))
	if err != nil {
		b.Fatal(err)
	}
	for i := 0; i < 200; i++ {
		_, _ = lim.Allow(ctx, fmt.Sprintf("user-%d", i%7), []string{"free", "pro", "burst", "daily"}[i%4])
	}
	f.Fail(storetest.TimeoutError{})
	_, _ = lim.Allow(ctx, "user-1", "free")
	f.Fail(nil)

	b.Run("stats", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = lim.Stats()
		}
	})
	b.Run("collect", func(b *testing.B) {
		rd := sdkmetric.NewManualReader()
		mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(rd))
		b.Cleanup(func() { _ = mp.Shutdown(ctx) })
		if _, err := tgotel.Register(lim, mp, tgotel.WithAttributes(attribute.String("limiter", "api"))); err != nil {
			b.Fatal(err)
		}
		var rm metricdata.ResourceMetrics
		b.ReportAllocs()
		for b.Loop() {
			if err := rd.Collect(ctx, &rm); err != nil {
				b.Fatal(err)
			}
		}
	})
}
