package tgprom_test

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	tgprom "github.com/tollgate-go/tollgate/metrics/prometheus"
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

// newObserved returns an Observer on a fresh registry and a Limiter on
// store that reports to it.
func newObserved(t *testing.T, store tollgate.Store, opts ...tollgate.Option) (*tgprom.Observer, *prometheus.Registry, *tollgate.Limiter) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	obs, err := tgprom.New(reg)
	require.NoError(t, err)
	lim, err := tollgate.New(store, plans, append([]tollgate.Option{tollgate.WithObserver(obs), tollgate.WithLogger(nil)}, opts...)...)
	require.NoError(t, err)
	return obs, reg, lim
}

// value returns the value of the one series of metric name in g whose
// labels include the name-value pairs in labels, as a scrape would see it.
func value(t *testing.T, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	var found []float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, l := range m.GetLabel() {
				got[l.GetName()] = l.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if got[labels[i]] != labels[i+1] {
					continue series
				}
			}
			found = append(found, m.GetCounter().GetValue()+m.GetGauge().GetValue())
		}
	}
	require.Len(t, found, 1, "series of %s with labels %v", name, labels)
	return found[0]
}

func decisions(t *testing.T, g prometheus.Gatherer, plan, decision, source string) float64 {
	t.Helper()
	return value(t, g, "tollgate_decisions_total", "plan", plan, "decision", decision, "source", source)
}

func TestDecisionsByPlanOutcomeAndSource(t *testing.T) {
	ctx := context.Background()
	obs, reg, lim := newObserved(t, tollgate.NewMemoryStore())
	for i := 0; i < 3; i++ { // gold holds 2: allowed, allowed, denied
		_, err := lim.Allow(ctx, "alice", "gold")
		require.NoError(t, err)
	}
	_, err := lim.Allow(ctx, "bob", "gold", "daily") // binding plan: gold (fewer left)
	require.NoError(t, err)
	_, err = lim.Peek(ctx, "alice", "daily") // takes nothing: not counted
	require.NoError(t, err)
	_, err = lim.Allow(ctx, "", "gold") // an error is not a decision
	require.Error(t, err)

	assert.Equal(t, 3.0, decisions(t, reg, "gold", "allowed", "store"))
	assert.Equal(t, 1.0, decisions(t, reg, "gold", "denied", "store"))
	// Every combination of a plan exists from its first decision, so that
	// the first denial or fallback shows in increase().
	assert.Equal(t, 6, testutil.CollectAndCount(obs, "tollgate_decisions_total"), "one plan seen, 2 outcomes x 3 sources")
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tollgate_decisions_total Decisions that took tokens, by binding plan, decision (allowed, denied) and source (store, fallback, fail-open).
# TYPE tollgate_decisions_total counter
tollgate_decisions_total{decision="allowed",plan="gold",source="fail-open"} 0
tollgate_decisions_total{decision="allowed",plan="gold",source="fallback"} 0
tollgate_decisions_total{decision="allowed",plan="gold",source="store"} 3
tollgate_decisions_total{decision="denied",plan="gold",source="fail-open"} 0
tollgate_decisions_total{decision="denied",plan="gold",source="fallback"} 0
tollgate_decisions_total{decision="denied",plan="gold",source="store"} 1
`), "tollgate_decisions_total"))
	assert.Equal(t, 1, testutil.CollectAndCount(obs, "tollgate_store_duration_seconds"))
	assert.Equal(t, 5.0, histogramCount(t, reg), "every store call is timed, the Peek's too")
}

func histogramCount(t *testing.T, g prometheus.Gatherer) float64 {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "tollgate_store_duration_seconds" {
			return float64(mf.GetMetric()[0].GetHistogram().GetSampleCount())
		}
	}
	t.Fatal("no tollgate_store_duration_seconds")
	return 0
}

// TestOutageAndRecovery fails the store, lets the fallback decide, and
// brings the store back: every metric of an outage must move and settle.
func TestOutageAndRecovery(t *testing.T) {
	ctx := context.Background()
	f := newFlakyStore()
	_, reg, lim := newObserved(t, f, tollgate.WithBreaker(tollgate.BreakerSettings{Failures: 2, Cooldown: 20 * time.Millisecond}))
	_, err := lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tollgate_fallback_active 1 while the store is failing and the Limiter decides by its failure policy, else 0.
# TYPE tollgate_fallback_active gauge
tollgate_fallback_active 0
# HELP tollgate_breaker_state State of the circuit breaker in front of the store: 0 closed, 1 open, 2 half-open.
# TYPE tollgate_breaker_state gauge
tollgate_breaker_state 0
# HELP tollgate_store_errors_total Calls to the Limiter's store that failed; calls its caller ended are not counted.
# TYPE tollgate_store_errors_total counter
tollgate_store_errors_total 0
`), "tollgate_fallback_active", "tollgate_breaker_state", "tollgate_store_errors_total"), "before the outage")

	f.fail(errors.New("connection refused"))
	for i := 0; i < 4; i++ { // 2 failures open the breaker; 2 more skip the store
		r, err := lim.Allow(ctx, "alice", "gold")
		require.NoError(t, err)
		require.Equal(t, tollgate.SourceFallback, r.Source)
	}
	assert.Equal(t, 2.0, value(t, reg, "tollgate_store_errors_total"), "calls the open breaker skipped are not errors")
	assert.Equal(t, 1.0, value(t, reg, "tollgate_fallback_active"))
	assert.Equal(t, float64(tollgate.BreakerOpen), value(t, reg, "tollgate_breaker_state"))
	// The fallback's buckets start full: 2 allowed, then denied.
	assert.Equal(t, 2.0, decisions(t, reg, "gold", "allowed", "fallback"))
	assert.Equal(t, 2.0, decisions(t, reg, "gold", "denied", "fallback"))

	f.fail(nil)
	time.Sleep(30 * time.Millisecond) // past the cooldown: the next call probes
	r, err := lim.Allow(ctx, "bob", "gold")
	require.NoError(t, err)
	require.Equal(t, tollgate.SourceStore, r.Source)
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tollgate_fallback_active 1 while the store is failing and the Limiter decides by its failure policy, else 0.
# TYPE tollgate_fallback_active gauge
tollgate_fallback_active 0
# HELP tollgate_breaker_state State of the circuit breaker in front of the store: 0 closed, 1 open, 2 half-open.
# TYPE tollgate_breaker_state gauge
tollgate_breaker_state 0
# HELP tollgate_breaker_transitions_total Transitions of the circuit breaker, by the state it entered (closed, open, half-open).
# TYPE tollgate_breaker_transitions_total counter
tollgate_breaker_transitions_total{to="closed"} 1
tollgate_breaker_transitions_total{to="half-open"} 1
tollgate_breaker_transitions_total{to="open"} 1
# HELP tollgate_store_errors_total Calls to the Limiter's store that failed; calls its caller ended are not counted.
# TYPE tollgate_store_errors_total counter
tollgate_store_errors_total 2
`), "tollgate_fallback_active", "tollgate_breaker_state", "tollgate_breaker_transitions_total", "tollgate_store_errors_total"), "after recovery")
	assert.Equal(t, 4.0, histogramCount(t, reg), "1 before, 2 failed, 1 probe")
}

func TestFailOpenDecisions(t *testing.T) {
	f := newFlakyStore()
	f.fail(errors.New("down"))
	_, reg, lim := newObserved(t, f, tollgate.WithFailurePolicy(tollgate.FailOpen))
	for i := 0; i < 5; i++ {
		_, err := lim.Allow(context.Background(), "alice", "gold")
		require.NoError(t, err)
	}
	assert.Equal(t, 5.0, decisions(t, reg, "gold", "allowed", "fail-open"))
	assert.Equal(t, 0.0, decisions(t, reg, "gold", "allowed", "store"))
}

// TestFailClosedCountsNoDecision: under FailClosed an outage returns
// errors, which are not decisions, but the outage metrics still move.
func TestFailClosedCountsNoDecision(t *testing.T) {
	f := newFlakyStore()
	f.fail(errors.New("down"))
	obs, reg, lim := newObserved(t, f, tollgate.WithFailurePolicy(tollgate.FailClosed))
	_, err := lim.Allow(context.Background(), "alice", "gold")
	require.ErrorIs(t, err, tollgate.ErrStoreUnavailable)
	assert.Equal(t, 0, testutil.CollectAndCount(obs, "tollgate_decisions_total"))
	assert.Equal(t, 1.0, value(t, reg, "tollgate_fallback_active"))
	assert.Equal(t, 1.0, value(t, reg, "tollgate_store_errors_total"))
}

// TestCancelledCallIsNotAStoreError: a caller that gives up says nothing
// about the store, as the Limiter's breaker agrees.
func TestCancelledCallIsNotAStoreError(t *testing.T) {
	f := newFlakyStore()
	_, reg, lim := newObserved(t, f)
	f.fail(context.Canceled)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err := lim.Allow(ctx, "alice", "gold")
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, 0.0, value(t, reg, "tollgate_store_errors_total"))
	assert.Equal(t, 1.0, histogramCount(t, reg), "the call is still timed")
}

// TestRedisOutageAndScriptLoads runs a RedisStore on miniredis: the
// first call loads the script (NOSCRIPT), SCRIPT FLUSH makes it load again,
// and closing the server is a real outage on the wire.
func TestRedisOutageAndScriptLoads(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	t.Cleanup(func() { _ = client.Close() })
	reg := prometheus.NewPedanticRegistry()
	obs, err := tgprom.New(reg)
	require.NoError(t, err)
	store := tollgate.NewRedisStore(client, tollgate.WithRedisObserver(obs))
	lim, err := tollgate.New(store, plans, tollgate.WithObserver(obs), tollgate.WithLogger(nil),
		tollgate.WithBreaker(tollgate.BreakerSettings{Failures: 1, Cooldown: 10 * time.Millisecond}))
	require.NoError(t, err)

	_, err = lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, 1.0, value(t, reg, "tollgate_script_loads_total"), "the first call loads the script")
	require.NoError(t, client.ScriptFlush(ctx).Err())
	_, err = lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, 2.0, value(t, reg, "tollgate_script_loads_total"))

	mr.Close()
	r, err := lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, tollgate.SourceFallback, r.Source)
	assert.Equal(t, 1.0, value(t, reg, "tollgate_fallback_active"))
	assert.Equal(t, 1.0, value(t, reg, "tollgate_store_errors_total"))
	assert.Equal(t, 1.0, decisions(t, reg, "gold", "allowed", "fallback"))

	require.NoError(t, mr.Restart())
	require.Eventually(t, func() bool {
		r, err := lim.Allow(ctx, "bob", "gold")
		return err == nil && r.Source == tollgate.SourceStore
	}, 2*time.Second, 5*time.Millisecond)
	assert.Equal(t, 0.0, value(t, reg, "tollgate_fallback_active"))
	assert.Equal(t, float64(tollgate.BreakerClosed), value(t, reg, "tollgate_breaker_state"))
}

// TestSeveralLimitersShareARegistry: const labels tell Observers apart;
// the same labels twice are refused without registering anything.
func TestSeveralLimitersShareARegistry(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	api, err := tgprom.New(reg, tgprom.WithConstLabels(prometheus.Labels{"limiter": "api"}))
	require.NoError(t, err)
	login, err := tgprom.New(reg, tgprom.WithConstLabels(prometheus.Labels{"limiter": "login"}))
	require.NoError(t, err)
	_, err = tgprom.New(reg, tgprom.WithConstLabels(prometheus.Labels{"limiter": "api"}))
	var are prometheus.AlreadyRegisteredError
	require.ErrorAs(t, err, &are)

	api.ObserveFallback(true)
	login.ObserveBreaker(tollgate.BreakerClosed, tollgate.BreakerOpen)
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tollgate_fallback_active 1 while the store is failing and the Limiter decides by its failure policy, else 0.
# TYPE tollgate_fallback_active gauge
tollgate_fallback_active{limiter="api"} 1
tollgate_fallback_active{limiter="login"} 0
# HELP tollgate_breaker_state State of the circuit breaker in front of the store: 0 closed, 1 open, 2 half-open.
# TYPE tollgate_breaker_state gauge
tollgate_breaker_state{limiter="api"} 0
tollgate_breaker_state{limiter="login"} 1
`), "tollgate_fallback_active", "tollgate_breaker_state"))
	assert.Equal(t, 2, testutil.CollectAndCount(reg, "tollgate_store_errors_total"), "one series per Limiter")
}

func TestBadConstLabelRegistersNothing(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	_, err := tgprom.New(reg, tgprom.WithConstLabels(prometheus.Labels{"plan": "x"}))
	require.ErrorContains(t, err, "duplicate label names")
	mfs, err := reg.Gather()
	require.NoError(t, err)
	assert.Empty(t, mfs)
}

func TestNilRegistererMeansDefault(t *testing.T) {
	obs, err := tgprom.New(nil, tgprom.WithConstLabels(prometheus.Labels{"limiter": t.Name()}))
	require.NoError(t, err)
	t.Cleanup(func() { prometheus.DefaultRegisterer.Unregister(obs) })
	n, err := testutil.GatherAndCount(prometheus.DefaultGatherer, "tollgate_store_errors_total")
	require.NoError(t, err)
	assert.Equal(t, 1, n)
}

func TestDurationBuckets(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	obs, err := tgprom.New(reg, tgprom.WithDurationBuckets([]float64{0.001, 0.1}))
	require.NoError(t, err)
	obs.ObserveStore(300*time.Microsecond, nil)
	obs.ObserveStore(50*time.Millisecond, nil)
	obs.ObserveStore(2*time.Second, errors.New("i/o timeout"))
	assert.NoError(t, testutil.GatherAndCompare(reg, strings.NewReader(`
# HELP tollgate_store_duration_seconds Duration of the Limiter's calls to its store, failed ones included, in seconds.
# TYPE tollgate_store_duration_seconds histogram
tollgate_store_duration_seconds_bucket{le="0.001"} 1
tollgate_store_duration_seconds_bucket{le="0.1"} 2
tollgate_store_duration_seconds_bucket{le="+Inf"} 3
tollgate_store_duration_seconds_sum 2.0503
tollgate_store_duration_seconds_count 3
`), "tollgate_store_duration_seconds"))
	assert.Len(t, tgprom.DefaultDurationBuckets, 14)
	assert.Equal(t, 0.00005, tgprom.DefaultDurationBuckets[0])
	assert.Equal(t, 1.0, tgprom.DefaultDurationBuckets[len(tgprom.DefaultDurationBuckets)-1])
}

// TestMetricNamesFollowConventions runs Prometheus's own linter over
// every metric.
func TestMetricNamesFollowConventions(t *testing.T) {
	obs, _, lim := newObserved(t, tollgate.NewMemoryStore())
	_, err := lim.Allow(context.Background(), "alice")
	require.NoError(t, err)
	obs.ObserveScriptLoad()
	problems, err := testutil.CollectAndLint(obs)
	require.NoError(t, err)
	assert.Empty(t, problems)
	assert.Equal(t, 7, countNames(t, obs), "seven metrics")
}

func countNames(t *testing.T, c prometheus.Collector) int {
	t.Helper()
	reg := prometheus.NewRegistry()
	require.NoError(t, reg.Register(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	return len(mfs)
}

// TestConcurrentNewPlans adds plans from many goroutines at once; run
// with -race.
func TestConcurrentNewPlans(t *testing.T) {
	reg := prometheus.NewPedanticRegistry()
	obs, err := tgprom.New(reg)
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
	total := 0.0
	for _, p := range []string{"a", "b", "c"} {
		for _, d := range []string{"allowed", "denied"} {
			total += decisions(t, reg, p, d, "store")
		}
	}
	assert.Equal(t, 800.0, total)
	assert.Equal(t, 18, testutil.CollectAndCount(obs, "tollgate_decisions_total"))
}

func TestBadDurationBucketsAreAnError(t *testing.T) {
	for _, b := range [][]float64{{1, 0.5}, {1, 1}, {math.NaN()}} {
		_, err := tgprom.New(prometheus.NewRegistry(), tgprom.WithDurationBuckets(b))
		assert.Error(t, err, "buckets %v", b)
	}
	_, err := tgprom.New(prometheus.NewRegistry(), tgprom.WithDurationBuckets([]float64{0.001, 0.01}))
	assert.NoError(t, err)
}
