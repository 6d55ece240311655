package tgprom_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
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
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redisscript"
	"github.com/tollgate-go/tollgate/internal/storetest"
	tgprom "github.com/tollgate-go/tollgate/metrics/prometheus"
)

var plans = []tollgate.Plan{
	{Name: "gold", Capacity: 2, Rate: 1},
	{Name: "daily", Capacity: 100, Rate: tollgate.Per(100, 24*time.Hour)},
}

// permitPlans are a concurrency plan of 2 permits and a bucket, which
// holds no permits.
var permitPlans = []tollgate.Plan{
	{Name: "inflight", Capacity: 2, Concurrency: true},
	{Name: "gold", Capacity: 2, Rate: 1},
}

// newCollected returns a Limiter on store, and a pedantic registry that
// holds its Collector. A pedantic registry checks on every Gather that
// each metric collected matches a Desc that Describe sent.
func newCollected(t *testing.T, store tollgate.Store, opts ...tollgate.Option) (*prometheus.Registry, *tollgate.Limiter) {
	t.Helper()
	return newCollectedPlans(t, store, plans, opts...)
}

// newCollectedPlans is newCollected for a Limiter on ps, closed when the
// test ends.
func newCollectedPlans(t *testing.T, store tollgate.Store, ps []tollgate.Plan, opts ...tollgate.Option) (*prometheus.Registry, *tollgate.Limiter) {
	t.Helper()
	lim, err := tollgate.New(store, ps, append([]tollgate.Option{tollgate.WithLogger(nil)}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = lim.Close() })
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(tgprom.New(lim)))
	return reg, lim
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

// heads are the HELP and TYPE lines of the metrics that tests compare as
// exposition text, pinned here once: dashboards and alerts show them.
var heads = map[string]string{
	"tollgate_decisions_total": `# HELP tollgate_decisions_total Decisions that took tokens, by binding plan, decision (allowed, denied) and source (store, fallback, fail-open, cache, lease).
# TYPE tollgate_decisions_total counter`,
	"tollgate_fallback_active": `# HELP tollgate_fallback_active 1 during an outage of the store (tollgate.Stats.Outage: from the breaker's trip until a success after two cooldowns without a failure), else 0.
# TYPE tollgate_fallback_active gauge`,
	"tollgate_breaker_state": `# HELP tollgate_breaker_state State of the circuit breaker in front of the store: 0 closed, 1 open, 2 half-open.
# TYPE tollgate_breaker_state gauge`,
	"tollgate_breaker_transitions_total": `# HELP tollgate_breaker_transitions_total Transitions of the circuit breaker, by the state it entered (closed, open, half-open); open counts trips, not the re-opening after a failed probe.
# TYPE tollgate_breaker_transitions_total counter`,
	"tollgate_store_errors_total": `# HELP tollgate_store_errors_total Calls to the Limiter's store that failed, by class; calls its caller ended are not counted.
# TYPE tollgate_store_errors_total counter`,
	"tollgate_permits_total": `# HELP tollgate_permits_total Acquire calls of concurrency plans and their permits, by event: granted, refused (Acquire calls); released, lost (Permits given back while held, or found with their lease ended); unreleased (releases the store failed); reclaimed (permits of any instance whose lease had ended, removed by this Limiter's calls to the store); adopted (Permits the fallback granted, moved into the store once it answered again).
# TYPE tollgate_permits_total counter`,
	"tollgate_permits_held": `# HELP tollgate_permits_held Permits of a concurrency plan that this Limiter holds now, on every key, by plan; 0 for other plans.
# TYPE tollgate_permits_held gauge`,
}

// assertSeries checks that the series of each metric in want are exactly
// want's, as testutil.GatherAndCompare does. want holds sample lines only,
// each metric's together; the metric's HELP and TYPE lines come from heads.
func assertSeries(t *testing.T, g prometheus.Gatherer, want string, msgAndArgs ...any) {
	t.Helper()
	var text strings.Builder
	var names []string
	for _, line := range strings.Split(strings.TrimSpace(want), "\n") {
		name, _, _ := strings.Cut(line, "{")
		name, _, _ = strings.Cut(name, " ")
		if !slices.Contains(names, name) {
			head, ok := heads[name]
			require.True(t, ok, "no HELP and TYPE lines for %s", name)
			text.WriteString(head + "\n")
			names = append(names, name)
		}
		text.WriteString(line + "\n")
	}
	assert.NoError(t, testutil.GatherAndCompare(g, strings.NewReader(text.String()), names...), msgAndArgs...)
}

func decisions(t *testing.T, g prometheus.Gatherer, plan, decision, source string) float64 {
	t.Helper()
	return value(t, g, "tollgate_decisions_total", "plan", plan, "decision", decision, "source", source)
}

func storeErrors(t *testing.T, g prometheus.Gatherer, class string) float64 {
	t.Helper()
	return value(t, g, "tollgate_store_errors_total", "class", class)
}

// histogram returns the one series of tollgate_store_duration_seconds:
// its count, its sum, and its cumulative bucket counts by upper bound.
func histogram(t *testing.T, g prometheus.Gatherer) (count uint64, sum float64, buckets map[float64]uint64) {
	t.Helper()
	mfs, err := g.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "tollgate_store_duration_seconds" {
			require.Len(t, mf.GetMetric(), 1)
			h := mf.GetMetric()[0].GetHistogram()
			buckets = map[float64]uint64{}
			for _, b := range h.GetBucket() {
				buckets[b.GetUpperBound()] = b.GetCumulativeCount()
			}
			return h.GetSampleCount(), h.GetSampleSum(), buckets
		}
	}
	t.Fatal("no tollgate_store_duration_seconds")
	return 0, 0, nil
}

func TestDecisionsBySource(t *testing.T) {
	ctx := context.Background()
	reg, lim := newCollected(t, storetest.NewFlaky())
	for i := 0; i < 3; i++ { // gold holds 2: allowed, allowed, denied
		r, err := lim.Allow(ctx, "alice", "gold")
		require.NoError(t, err)
		require.Equal(t, tollgate.SourceStore, r.Source)
	}
	r, err := lim.Allow(ctx, "alice", "gold") // the denial is remembered
	require.NoError(t, err)
	require.Equal(t, tollgate.SourceCache, r.Source)
	_, err = lim.Allow(ctx, "bob", "gold", "daily") // binding plan: gold (fewer left)
	require.NoError(t, err)
	_, err = lim.Peek(ctx, "alice", "daily") // takes nothing: not counted
	require.NoError(t, err)
	_, err = lim.Allow(ctx, "", "gold") // an error is not a decision
	require.Error(t, err)

	// Every plan has all its series from the first scrape, so that the
	// first denial or fallback shows in increase().
	assertSeries(t, reg, `
tollgate_decisions_total{decision="allowed",plan="daily",source="cache"} 0
tollgate_decisions_total{decision="allowed",plan="daily",source="fail-open"} 0
tollgate_decisions_total{decision="allowed",plan="daily",source="fallback"} 0
tollgate_decisions_total{decision="allowed",plan="daily",source="lease"} 0
tollgate_decisions_total{decision="allowed",plan="daily",source="store"} 0
tollgate_decisions_total{decision="allowed",plan="gold",source="cache"} 0
tollgate_decisions_total{decision="allowed",plan="gold",source="fail-open"} 0
tollgate_decisions_total{decision="allowed",plan="gold",source="fallback"} 0
tollgate_decisions_total{decision="allowed",plan="gold",source="lease"} 0
tollgate_decisions_total{decision="allowed",plan="gold",source="store"} 3
tollgate_decisions_total{decision="denied",plan="daily",source="cache"} 0
tollgate_decisions_total{decision="denied",plan="daily",source="fail-open"} 0
tollgate_decisions_total{decision="denied",plan="daily",source="fallback"} 0
tollgate_decisions_total{decision="denied",plan="daily",source="lease"} 0
tollgate_decisions_total{decision="denied",plan="daily",source="store"} 0
tollgate_decisions_total{decision="denied",plan="gold",source="cache"} 1
tollgate_decisions_total{decision="denied",plan="gold",source="fail-open"} 0
tollgate_decisions_total{decision="denied",plan="gold",source="fallback"} 0
tollgate_decisions_total{decision="denied",plan="gold",source="lease"} 0
tollgate_decisions_total{decision="denied",plan="gold",source="store"} 1
`)
	count, _, _ := histogram(t, reg)
	assert.Equal(t, uint64(5), count, "alice's 3 and bob's call and the Peek; the cache answered without the store")
}

// TestMemoryStore: a MemoryStore's decisions are counted, but it cannot
// fail and its calls are not timed.
func TestMemoryStore(t *testing.T) {
	reg, lim := newCollected(t, tollgate.NewMemoryStore())
	for i := 0; i < 3; i++ {
		_, err := lim.Allow(context.Background(), "alice", "gold")
		require.NoError(t, err)
	}
	assert.Equal(t, 2.0, decisions(t, reg, "gold", "allowed", "store"))
	assert.Equal(t, 1.0, decisions(t, reg, "gold", "denied", "store"))
	count, sum, _ := histogram(t, reg)
	assert.Equal(t, uint64(0), count)
	assert.Equal(t, 0.0, sum)
	assert.Equal(t, float64(breaker.Closed), value(t, reg, "tollgate_breaker_state"))
}

func TestReservations(t *testing.T) {
	reg, lim := newCollected(t, tollgate.NewMemoryStore())
	ctx := context.Background()
	for _, used := range []int64{0, 3} { // 1 refunded, then 2 charged
		r, err := lim.Reserve(ctx, "alice", 1, "daily")
		require.NoError(t, err)
		_, err = r.Settle(ctx, used)
		require.NoError(t, err)
	}
	assert.Equal(t, 2.0, value(t, reg, "tollgate_reservations_total", "event", "held"))
	assert.Equal(t, 2.0, value(t, reg, "tollgate_reservations_total", "event", "settled"))
	assert.Equal(t, 0.0, value(t, reg, "tollgate_reservations_total", "event", "expired"))
	assert.Equal(t, 1.0, value(t, reg, "tollgate_reservation_tokens_total", "kind", "refunded"))
	assert.Equal(t, 2.0, value(t, reg, "tollgate_reservation_tokens_total", "kind", "charged"))
	assert.Equal(t, 0.0, value(t, reg, "tollgate_reservation_tokens_total", "kind", "uncharged"))
}

// TestPermits acquires permits of a concurrency plan, is refused and
// releases: every event and every plan has its series from the first
// scrape, and each moves with its own count.
func TestPermits(t *testing.T) {
	reg, lim := newCollectedPlans(t, tollgate.NewMemoryStore(), permitPlans)
	ctx := context.Background()
	assertSeries(t, reg, `
tollgate_permits_total{event="adopted"} 0
tollgate_permits_total{event="granted"} 0
tollgate_permits_total{event="lost"} 0
tollgate_permits_total{event="reclaimed"} 0
tollgate_permits_total{event="refused"} 0
tollgate_permits_total{event="released"} 0
tollgate_permits_total{event="unreleased"} 0
tollgate_permits_held{plan="gold"} 0
tollgate_permits_held{plan="inflight"} 0
`, "before the first Acquire")

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
	assertSeries(t, reg, `
tollgate_permits_total{event="adopted"} 0
tollgate_permits_total{event="granted"} 3
tollgate_permits_total{event="lost"} 0
tollgate_permits_total{event="reclaimed"} 0
tollgate_permits_total{event="refused"} 1
tollgate_permits_total{event="released"} 2
tollgate_permits_total{event="unreleased"} 0
tollgate_permits_held{plan="gold"} 0
tollgate_permits_held{plan="inflight"} 2
`, "while c holds both permits")
	require.NoError(t, c.Release(ctx))
	assert.Equal(t, 0.0, value(t, reg, "tollgate_permits_held", "plan", "inflight"))
	assert.Equal(t, 3.0, value(t, reg, "tollgate_permits_total", "event", "released"))
}

// TestPermitsLost moves Redis's clock past a lease: the next renewal
// finds the Permit lost, and its 2 permits reclaimed.
func TestPermitsLost(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	reg, lim := newCollectedPlans(t, tollgate.NewRedisStore(client), permitPlans,
		tollgate.WithPermitLease(30*time.Millisecond))
	p, err := lim.Acquire(ctx, "alice", 2, "inflight")
	require.NoError(t, err)
	require.True(t, p.OK())
	assert.Equal(t, 2.0, value(t, reg, "tollgate_permits_held", "plan", "inflight"))

	mr.SetTime(time.Now().Add(time.Hour)) // TIME in scripts; the key's TTL stands still
	require.Eventually(t, func() bool { return lim.Stats().Permits.Lost > 0 }, 5*time.Second, 5*time.Millisecond)
	require.ErrorIs(t, p.Release(ctx), tollgate.ErrPermitLost)
	assertSeries(t, reg, `
tollgate_permits_total{event="adopted"} 0
tollgate_permits_total{event="granted"} 1
tollgate_permits_total{event="lost"} 1
tollgate_permits_total{event="reclaimed"} 2
tollgate_permits_total{event="refused"} 0
tollgate_permits_total{event="released"} 0
tollgate_permits_total{event="unreleased"} 0
tollgate_permits_held{plan="gold"} 0
tollgate_permits_held{plan="inflight"} 0
`)
}

// TestStoreDurationHistogram: the histogram is the Limiter's, made
// cumulative, with StoreTime as its sum.
func TestStoreDurationHistogram(t *testing.T) {
	f := storetest.NewFlaky()
	reg, lim := newCollected(t, f)
	ctx := context.Background()
	for _, key := range []string{"a", "b", "c"} {
		_, err := lim.Allow(ctx, key, "daily")
		require.NoError(t, err)
	}
	f.Slow(30 * time.Millisecond)
	_, err := lim.Allow(ctx, "d", "daily")
	require.NoError(t, err)

	count, sum, buckets := histogram(t, reg)
	s := lim.Stats() // nothing happened since the scrape
	assert.Equal(t, uint64(4), count)
	assert.Equal(t, s.StoreTime.Seconds(), sum)
	assert.GreaterOrEqual(t, sum, 0.030)
	require.Len(t, buckets, len(s.LatencyBounds))
	var cum uint64
	for i, b := range s.LatencyBounds {
		cum += s.StoreLatency[i]
		assert.Equal(t, cum, buckets[b.Seconds()], "bucket le=%v", b)
	}
	assert.LessOrEqual(t, buckets[0.025], uint64(3), "the slow call took over 25ms")
	assert.Equal(t, 0.00005, s.LatencyBounds[0].Seconds(), "the bounds the package doc promises")
	assert.Equal(t, 1.0, s.LatencyBounds[len(s.LatencyBounds)-1].Seconds())
}

// TestOutageAndRecovery fails the store, lets the fallback decide, and
// brings the store back: every metric of an outage must move and settle.
func TestOutageAndRecovery(t *testing.T) {
	ctx := context.Background()
	f := storetest.NewFlaky()
	// A cooldown long enough that the calls after the trip do not probe on
	// a loaded machine.
	const cooldown = 200 * time.Millisecond
	reg, lim := newCollected(t, f, tollgate.WithBreaker(breaker.Settings{Failures: 2, Cooldown: cooldown}))
	_, err := lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assertSeries(t, reg, `
tollgate_fallback_active 0
tollgate_breaker_state 0
tollgate_breaker_transitions_total{to="closed"} 0
tollgate_breaker_transitions_total{to="half-open"} 0
tollgate_breaker_transitions_total{to="open"} 0
tollgate_store_errors_total{class="bad-reply"} 0
tollgate_store_errors_total{class="canceled"} 0
tollgate_store_errors_total{class="network"} 0
tollgate_store_errors_total{class="other"} 0
tollgate_store_errors_total{class="timeout"} 0
`, "before the outage")

	f.Fail(errors.New("connection refused"))
	for i := 0; i < 4; i++ { // 2 failures open the breaker; 2 more skip the store
		r, err := lim.Allow(ctx, "alice", "gold")
		require.NoError(t, err)
		require.Equal(t, tollgate.SourceFallback, r.Source)
	}
	assert.Equal(t, 2.0, storeErrors(t, reg, "other"), "calls the open breaker skipped are not errors")
	assert.Equal(t, 1.0, value(t, reg, "tollgate_fallback_active"))
	assert.Equal(t, float64(breaker.Open), value(t, reg, "tollgate_breaker_state"))
	assert.Equal(t, 1.0, value(t, reg, "tollgate_breaker_transitions_total", "to", "open"))
	// The fallback's buckets start full: 2 allowed, then denied.
	assert.Equal(t, 2.0, decisions(t, reg, "gold", "allowed", "fallback"))
	assert.Equal(t, 2.0, decisions(t, reg, "gold", "denied", "fallback"))

	f.Fail(nil)
	time.Sleep(cooldown + 10*time.Millisecond) // the next call probes
	r, err := lim.Allow(ctx, "bob", "gold")
	require.NoError(t, err)
	require.Equal(t, tollgate.SourceStore, r.Source)
	assert.Equal(t, float64(breaker.Closed), value(t, reg, "tollgate_breaker_state"))
	// The outage ends at a success two cooldowns after the last failure,
	// which a slow machine may have reached already.
	assert.Equal(t, boolValue(lim.Stats().Outage), value(t, reg, "tollgate_fallback_active"))
	n := 0
	require.Eventually(t, func() bool { // a new key each time, so that the store answers
		n++
		_, err := lim.Allow(ctx, fmt.Sprintf("user-%d", n), "gold")
		return err == nil && !lim.Stats().Outage
	}, 5*cooldown, 10*time.Millisecond)
	assertSeries(t, reg, `
tollgate_fallback_active 0
tollgate_breaker_state 0
tollgate_breaker_transitions_total{to="closed"} 1
tollgate_breaker_transitions_total{to="half-open"} 1
tollgate_breaker_transitions_total{to="open"} 1
`, "after recovery")
	assert.Equal(t, 2.0, storeErrors(t, reg, "other"))
	count, _, _ := histogram(t, reg)
	assert.Equal(t, lim.Stats().StoreCalls, count)
	assert.GreaterOrEqual(t, count, uint64(5), "1 before, 2 failed, the probe, 1 after")
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}

// TestStoreErrorsByClass fails the store in each way the Limiter tells
// apart.
func TestStoreErrorsByClass(t *testing.T) {
	f := storetest.NewFlaky()
	// The breaker stays closed, so that every call reaches the store.
	reg, lim := newCollected(t, f, tollgate.WithBreaker(breaker.Settings{Failures: 1000}))
	for _, err := range []error{
		storetest.TimeoutError{},
		&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")},
		&net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")},
		fmt.Errorf("parse: %w", redisscript.ErrBadReply),
		errors.New("something else"),
	} {
		f.Fail(err)
		r, err := lim.Allow(context.Background(), "alice", "gold")
		require.NoError(t, err)
		require.Equal(t, tollgate.SourceFallback, r.Source)
	}
	for class, want := range map[string]float64{"timeout": 1, "network": 2, "bad-reply": 1, "other": 1, "canceled": 0} {
		assert.Equal(t, want, storeErrors(t, reg, class), "class %s", class)
	}
	assert.Equal(t, 5, testutil.CollectAndCount(reg, "tollgate_store_errors_total"))
}

func TestFailOpenDecisions(t *testing.T) {
	f := storetest.NewFlaky()
	f.Fail(errors.New("down"))
	reg, lim := newCollected(t, f, tollgate.WithFailurePolicy(breaker.FailOpen))
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
	f := storetest.NewFlaky()
	f.Fail(errors.New("down"))
	reg, lim := newCollected(t, f, tollgate.WithFailurePolicy(breaker.FailClosed),
		tollgate.WithBreaker(breaker.Settings{Failures: 1}))
	_, err := lim.Allow(context.Background(), "alice", "gold")
	require.ErrorIs(t, err, tollgate.ErrStoreUnavailable)
	mfs, err := reg.Gather()
	require.NoError(t, err)
	for _, mf := range mfs {
		if mf.GetName() == "tollgate_decisions_total" {
			for _, m := range mf.GetMetric() {
				assert.Zero(t, m.GetCounter().GetValue(), "%v", m.GetLabel())
			}
		}
	}
	assert.Equal(t, 1.0, value(t, reg, "tollgate_fallback_active"))
	assert.Equal(t, 1.0, storeErrors(t, reg, "other"))
}

// TestCancelledCallIsNotAStoreError: a caller that gives up while the
// store works says nothing about the store, as the Limiter's breaker
// agrees; a store that cancels its own call has failed.
func TestCancelledCallIsNotAStoreError(t *testing.T) {
	f := storetest.NewFlaky()
	reg, lim := newCollected(t, f)
	ctx, cancel := context.WithCancel(context.Background())
	f.OnTake(cancel)
	_, err := lim.Allow(ctx, "alice", "gold")
	require.ErrorIs(t, err, context.Canceled)
	assert.Equal(t, 0.0, storeErrors(t, reg, "canceled"))
	assert.Equal(t, 0.0, value(t, reg, "tollgate_fallback_active"))
	count, _, _ := histogram(t, reg)
	assert.Equal(t, uint64(1), count, "the call is still timed")

	f.OnTake(nil)
	f.Fail(context.Canceled) // the store's own context, not the caller's
	r, err := lim.Allow(context.Background(), "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, tollgate.SourceFallback, r.Source)
	assert.Equal(t, 1.0, storeErrors(t, reg, "canceled"))
}

// TestRedisOutageAndScriptLoads runs a RedisStore on miniredis: the
// first call loads the script (NOSCRIPT), SCRIPT FLUSH makes it load
// again, an error Redis answers is counted by its class, and closing the
// server is a real outage on the wire.
func TestRedisOutageAndScriptLoads(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	t.Cleanup(func() { _ = client.Close() })
	reg, lim := newCollected(t, tollgate.NewRedisStore(client),
		tollgate.WithBreaker(breaker.Settings{Failures: 1, Cooldown: 10 * time.Millisecond}))

	_, err := lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, 1.0, value(t, reg, "tollgate_script_loads_total"), "the first call loads the script")
	require.NoError(t, client.ScriptFlush(ctx).Err())
	_, err = lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, 2.0, value(t, reg, "tollgate_script_loads_total"))

	mr.SetError("READONLY You can't write against a read only replica.")
	r, err := lim.Allow(ctx, "carol", "gold")
	require.NoError(t, err)
	assert.Equal(t, tollgate.SourceFallback, r.Source)
	assert.Equal(t, 1.0, storeErrors(t, reg, "READONLY"), "Redis's class, without the rest of its text")
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
	assert.Equal(t, 1.0, value(t, reg, "tollgate_fallback_active"))

	require.NoError(t, mr.Restart())
	require.Eventually(t, func() bool { // back on Redis, and two cooldowns without a failure
		r, err := lim.Allow(ctx, "bob", "gold")
		return err == nil && r.Source == tollgate.SourceStore && !lim.Stats().Outage
	}, 2*time.Second, 5*time.Millisecond)
	assert.Equal(t, 0.0, value(t, reg, "tollgate_fallback_active"))
	assert.Equal(t, float64(breaker.Closed), value(t, reg, "tollgate_breaker_state"))
}

// TestSeveralLimitersShareARegistry: const labels tell Collectors apart;
// the same labels twice are refused.
func TestSeveralLimitersShareARegistry(t *testing.T) {
	ctx := context.Background()
	apiStore, loginStore := storetest.NewFlaky(), storetest.NewFlaky()
	api, err := tollgate.New(apiStore, plans, tollgate.WithLogger(nil))
	require.NoError(t, err)
	login, err := tollgate.New(loginStore, plans, tollgate.WithLogger(nil),
		tollgate.WithBreaker(breaker.Settings{Failures: 1, Cooldown: time.Hour}))
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(tgprom.New(api, tgprom.WithConstLabels(prometheus.Labels{"limiter": "api"}))))
	require.NoError(t, reg.Register(tgprom.New(login, tgprom.WithConstLabels(prometheus.Labels{"limiter": "login"}))))
	err = reg.Register(tgprom.New(api, tgprom.WithConstLabels(prometheus.Labels{"limiter": "api"})))
	var are prometheus.AlreadyRegisteredError
	require.ErrorAs(t, err, &are)

	_, err = api.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	loginStore.Fail(errors.New("down"))
	_, err = login.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assertSeries(t, reg, `
tollgate_fallback_active{limiter="api"} 0
tollgate_fallback_active{limiter="login"} 1
tollgate_breaker_state{limiter="api"} 0
tollgate_breaker_state{limiter="login"} 1
`)
	assert.Equal(t, 1.0, value(t, reg, "tollgate_decisions_total", "limiter", "api", "plan", "gold", "decision", "allowed", "source", "store"))
	assert.Equal(t, 1.0, value(t, reg, "tollgate_decisions_total", "limiter", "login", "plan", "gold", "decision", "allowed", "source", "fallback"))
	assert.Equal(t, 0.0, value(t, reg, "tollgate_decisions_total", "limiter", "login", "plan", "gold", "decision", "allowed", "source", "store"))
}

func TestBadConstLabelRegistersNothing(t *testing.T) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), plans)
	require.NoError(t, err)
	for _, name := range []string{"plan", "class", "to", "event"} {
		reg := prometheus.NewPedanticRegistry()
		err := reg.Register(tgprom.New(lim, tgprom.WithConstLabels(prometheus.Labels{name: "x"})))
		require.ErrorContains(t, err, "duplicate label names", "const label %s", name)
		mfs, err := reg.Gather()
		require.NoError(t, err)
		assert.Empty(t, mfs)
	}
}

// TestUnregister: Describe is the same on every call, so a registry can
// find the Collector again to remove it.
func TestUnregister(t *testing.T) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), plans)
	require.NoError(t, err)
	reg := prometheus.NewPedanticRegistry()
	c := tgprom.New(lim)
	require.NoError(t, reg.Register(c))
	assert.True(t, reg.Unregister(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	assert.Empty(t, mfs)
	require.NoError(t, reg.Register(c), "registered again")
}

func TestNilLimiterPanics(t *testing.T) {
	assert.PanicsWithValue(t, "tgprom: New with a nil Limiter", func() { tgprom.New(nil) })
}

// TestMetricNamesFollowConventions runs Prometheus's own linter over
// every metric.
func TestMetricNamesFollowConventions(t *testing.T) {
	lim, err := tollgate.New(storetest.NewFlaky(), plans)
	require.NoError(t, err)
	_, err = lim.Allow(context.Background(), "alice")
	require.NoError(t, err)
	c := tgprom.New(lim)
	problems, err := testutil.CollectAndLint(c)
	require.NoError(t, err)
	assert.Empty(t, problems)

	reg := prometheus.NewPedanticRegistry()
	require.NoError(t, reg.Register(c))
	mfs, err := reg.Gather()
	require.NoError(t, err)
	var names []string
	for _, mf := range mfs {
		names = append(names, mf.GetName())
	}
	assert.Equal(t, []string{
		"tollgate_breaker_state", "tollgate_breaker_transitions_total", "tollgate_decisions_total",
		"tollgate_fallback_active", "tollgate_fleet_size", "tollgate_permits_held", "tollgate_permits_total",
		"tollgate_reservation_tokens_total",
		"tollgate_reservations_total", "tollgate_script_loads_total", "tollgate_shadow_denials_total",
		"tollgate_store_duration_seconds", "tollgate_store_errors_total",
	}, names, "the names dashboards use")
}

// TestConcurrentScrapes scrapes while many goroutines decide; run with
// -race.
func TestConcurrentScrapes(t *testing.T) {
	reg, lim := newCollected(t, storetest.NewFlaky())
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Go(func() {
			for i := 0; i < 100; i++ {
				_, _ = lim.Allow(context.Background(), fmt.Sprintf("user-%d", i%10), []string{"gold", "daily"}[i%2])
			}
		})
	}
	wg.Go(func() {
		for i := 0; i < 20; i++ {
			_, err := reg.Gather()
			assert.NoError(t, err)
		}
	})
	wg.Wait()
	total := 0.0
	for _, p := range []string{"gold", "daily"} {
		for _, d := range []string{"allowed", "denied"} {
			for _, s := range []string{"store", "cache"} {
				total += decisions(t, reg, p, d, s)
			}
		}
	}
	assert.Equal(t, 400.0, total)
}

// BenchmarkCollect measures one scrape of a Limiter with four plans:
// Stats alone (the Limiter's share), the Collector's Collect (what this
// package adds), and a registry's Gather (what a /metrics request pays
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
	c := tgprom.New(lim, tgprom.WithConstLabels(prometheus.Labels{"limiter": "api"}))

	b.Run("stats", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			_ = lim.Stats()
		}
	})
	b.Run("collect", func(b *testing.B) {
		ch := make(chan prometheus.Metric, 128) // more than a scrape sends
		b.ReportAllocs()
		for b.Loop() {
			c.Collect(ch)
			for len(ch) > 0 {
				<-ch
			}
		}
	})
	b.Run("gather", func(b *testing.B) {
		reg := prometheus.NewRegistry()
		reg.MustRegister(c)
		b.ReportAllocs()
		for b.Loop() {
			if _, err := reg.Gather(); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// A shadowed plan's would-be denials are counted under its name.
func TestShadowDenialsByPlan(t *testing.T) {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "now", Capacity: 10, Rate: 1},
		{Name: "next", Capacity: 1, Rate: 0.001, Shadow: true},
	})
	require.NoError(t, err)
	for range 3 {
		_, err := lim.Allow(context.Background(), "alice", "now", "next")
		require.NoError(t, err)
	}
	c := tgprom.New(lim)
	assert.NoError(t, testutil.CollectAndCompare(c, strings.NewReader(`
# HELP tollgate_shadow_denials_total Decisions that a shadowed plan would have denied had it been enforced, by that plan.
# TYPE tollgate_shadow_denials_total counter
tollgate_shadow_denials_total{plan="next"} 2
tollgate_shadow_denials_total{plan="now"} 0
`), "tollgate_shadow_denials_total"))
}
