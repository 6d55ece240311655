// Package tgotel records what tollgate Limiters do as OpenTelemetry
// metrics. It is a module of its own, so services that do not use
// OpenTelemetry never see it in their go.sum.
//
//	import tgotel "github.com/tollgate-go/tollgate/metrics/otel"
//
//	obs, err := tgotel.New(otel.GetMeterProvider())
//	...
//	store := tollgate.NewRedisStore(client, tollgate.WithRedisObserver(obs))
//	lim, err := tollgate.New(store, plans, tollgate.WithObserver(obs))
//
// Instruments (no attribute ever holds a caller's key):
//
//	tollgate.decisions{plan,decision,source}  Int64Counter, {decision}
//	tollgate.store.duration                   Float64Histogram, s
//	tollgate.store.errors                     Int64Counter, {error}
//	tollgate.fallback.active                  Int64Gauge, 0 or 1
//	tollgate.breaker.state                    Int64Gauge, 0 closed, 1 open, 2 half-open
//	tollgate.breaker.transitions{to}          Int64Counter, {transition}
//	tollgate.script.loads                     Int64Counter, {load}
//
// Through the OpenTelemetry Prometheus exporter these become the series of
// the Prometheus adapter (tollgate_decisions_total{plan,decision,source},
// tollgate_store_duration_seconds, ...), so dashboards and alerts work
// with either.
//
// Use one Observer per Limiter. Several Limiters on one MeterProvider need
// distinct attributes, for example WithAttributes(attribute.String(
// "limiter", "login")): the gauges describe one Limiter each.
package tgotel

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/tollgate-go/tollgate"
)

// ScopeName is the instrumentation scope of the Observer's meter.
const ScopeName = "github.com/tollgate-go/tollgate/metrics/otel"

// DefaultDurationBuckets are the default bucket boundaries of
// tollgate.store.duration, in seconds: 50µs to 1s, for Redis calls that
// take a fraction of a millisecond when healthy and up to the client's
// timeout when not. A View in the MeterProvider overrides them.
var DefaultDurationBuckets = []float64{
	0.00005, 0.0001, 0.00025, 0.0005,
	0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
	0.1, 0.25, 0.5, 1,
}

// Option configures an Observer.
type Option func(*config)

type config struct {
	attrs   []attribute.KeyValue
	buckets []float64
}

// WithAttributes adds attributes to every measurement, for example
// attribute.String("limiter", "api") to tell the Observers of several
// Limiters apart. The default is none.
func WithAttributes(kv ...attribute.KeyValue) Option {
	return func(c *config) { c.attrs = kv }
}

// WithDurationBuckets sets the bucket boundaries, in seconds, advised for
// tollgate.store.duration. The default is DefaultDurationBuckets.
func WithDurationBuckets(b []float64) Option {
	return func(c *config) { c.buckets = b }
}

// Observer is a tollgate.Observer that records OpenTelemetry metrics. Give
// the same Observer to the Limiter (tollgate.WithObserver) and to its
// RedisStore (tollgate.WithRedisObserver). It is safe for concurrent use.
type Observer struct {
	decisions   metric.Int64Counter
	duration    metric.Float64Histogram
	storeErrors metric.Int64Counter
	fallback    metric.Int64Gauge
	breaker     metric.Int64Gauge
	transitions metric.Int64Counter
	scriptLoads metric.Int64Counter

	// Measurement options are built once: the attribute sets of every
	// measurement are known in advance or cached, so recording one
	// allocates nothing in this package.
	attrs         []attribute.KeyValue
	addBase       []metric.AddOption
	recordBase    []metric.RecordOption
	transitionsTo [3][]metric.AddOption // by tollgate.BreakerState

	// byPlan maps a plan name to its decision options. It is copied on
	// write, so a decision reads it without a lock; plans are few and
	// fixed when a Limiter is made.
	byPlan atomic.Pointer[map[string]*planOpts]
	mu     sync.Mutex // serialises writers of byPlan
}

// numSources is the number of tollgate.Source values this package knows.
const numSources = 3

// planOpts holds a plan's decision options by [allowed][source].
type planOpts [2][numSources][]metric.AddOption

var _ tollgate.Observer = (*Observer)(nil)

// New returns an Observer whose instruments come from a meter of mp; nil
// means otel.GetMeterProvider(). It fails if an instrument cannot be
// created.
func New(mp metric.MeterProvider, opts ...Option) (*Observer, error) {
	c := config{buckets: DefaultDurationBuckets}
	for _, o := range opts {
		o(&c)
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	m := mp.Meter(ScopeName)
	o := &Observer{attrs: c.attrs}
	var err, e error
	o.decisions, e = m.Int64Counter("tollgate.decisions", metric.WithUnit("{decision}"),
		metric.WithDescription("Decisions that took tokens, by binding plan, decision (allowed, denied) and source (store, fallback, fail-open)."))
	err = errors.Join(err, e)
	o.duration, e = m.Float64Histogram("tollgate.store.duration", metric.WithUnit("s"),
		metric.WithDescription("Duration of the Limiter's calls to its store, failed ones included."),
		metric.WithExplicitBucketBoundaries(c.buckets...))
	err = errors.Join(err, e)
	o.storeErrors, e = m.Int64Counter("tollgate.store.errors", metric.WithUnit("{error}"),
		metric.WithDescription("Calls to the Limiter's store that failed; calls its caller ended are not counted."))
	err = errors.Join(err, e)
	o.fallback, e = m.Int64Gauge("tollgate.fallback.active",
		metric.WithDescription("1 while the store is failing and the Limiter decides by its failure policy, else 0."))
	err = errors.Join(err, e)
	o.breaker, e = m.Int64Gauge("tollgate.breaker.state",
		metric.WithDescription("State of the circuit breaker in front of the store: 0 closed, 1 open, 2 half-open."))
	err = errors.Join(err, e)
	o.transitions, e = m.Int64Counter("tollgate.breaker.transitions", metric.WithUnit("{transition}"),
		metric.WithDescription("Transitions of the circuit breaker, by the state it entered (closed, open, half-open)."))
	err = errors.Join(err, e)
	o.scriptLoads, e = m.Int64Counter("tollgate.script.loads", metric.WithUnit("{load}"),
		metric.WithDescription("Reloads of the Lua script after Redis answered NOSCRIPT."))
	err = errors.Join(err, e)
	if err != nil {
		return nil, err
	}

	base := attribute.NewSet(c.attrs...)
	o.addBase = []metric.AddOption{metric.WithAttributeSet(base)}
	o.recordBase = []metric.RecordOption{metric.WithAttributeSet(base)}
	ctx := context.Background()
	for _, s := range []tollgate.BreakerState{tollgate.BreakerClosed, tollgate.BreakerOpen, tollgate.BreakerHalfOpen} {
		o.transitionsTo[s] = o.addOpts(attribute.String("to", s.String()))
		o.transitions.Add(ctx, 0, o.transitionsTo[s]...) // every series exists from the start
	}
	o.fallback.Record(ctx, 0, o.recordBase...)
	o.breaker.Record(ctx, int64(tollgate.BreakerClosed), o.recordBase...)
	o.byPlan.Store(&map[string]*planOpts{})
	return o, nil
}

// addOpts returns the AddOptions of a measurement with kv and the
// Observer's own attributes.
func (o *Observer) addOpts(kv ...attribute.KeyValue) []metric.AddOption {
	all := append(append([]attribute.KeyValue(nil), o.attrs...), kv...)
	return []metric.AddOption{metric.WithAttributeSet(attribute.NewSet(all...))}
}

// ObserveDecision implements tollgate.Observer: it counts a decision in
// tollgate.decisions. Peeks (cost 0) take nothing and are not counted;
// each attempt of Limiter.Wait is.
func (o *Observer) ObserveDecision(d tollgate.Decision) {
	if d.Cost == 0 {
		return
	}
	ctx := context.Background()
	if d.Source >= numSources { // a Source newer than this package
		o.decisions.Add(ctx, 1, o.addOpts(attribute.String("plan", d.Plan),
			attribute.String("decision", decisionLabel(d.Allowed)), attribute.String("source", d.Source.String()))...)
		return
	}
	po := (*o.byPlan.Load())[d.Plan]
	if po == nil {
		po = o.addPlan(d.Plan)
	}
	a := 0
	if d.Allowed {
		a = 1
	}
	o.decisions.Add(ctx, 1, po[a][d.Source]...)
}

// addPlan builds the options of a plan seen for the first time, and starts
// every combination at 0 so that the first denial shows in a rate.
func (o *Observer) addPlan(plan string) *planOpts {
	o.mu.Lock()
	defer o.mu.Unlock()
	old := *o.byPlan.Load()
	if po := old[plan]; po != nil {
		return po
	}
	po := new(planOpts)
	for a := range po {
		for s := range po[a] {
			po[a][s] = o.addOpts(attribute.String("plan", plan),
				attribute.String("decision", decisionLabel(a == 1)), attribute.String("source", tollgate.Source(s).String()))
			o.decisions.Add(context.Background(), 0, po[a][s]...)
		}
	}
	m := make(map[string]*planOpts, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[plan] = po
	o.byPlan.Store(&m)
	return po
}

func decisionLabel(allowed bool) string {
	if allowed {
		return "allowed"
	}
	return "denied"
}

// ObserveStore implements tollgate.Observer: it records the call in
// tollgate.store.duration, in seconds, and, if it failed, counts it in
// tollgate.store.errors. The Limiter passes no
// error for calls that ended for the caller's own reasons (bad input, a
// cancelled context or one past its deadline): only the store's failures
// are counted.
func (o *Observer) ObserveStore(elapsed time.Duration, err error) {
	ctx := context.Background()
	o.duration.Record(ctx, elapsed.Seconds(), o.recordBase...)
	if err != nil {
		o.storeErrors.Add(ctx, 1, o.addBase...)
	}
}

// ObserveFallback implements tollgate.Observer: it sets
// tollgate.fallback.active to 1 when an outage starts and to 0 when it
// ends.
func (o *Observer) ObserveFallback(active bool) {
	var v int64
	if active {
		v = 1
	}
	o.fallback.Record(context.Background(), v, o.recordBase...)
}

// ObserveBreaker implements tollgate.Observer: it sets
// tollgate.breaker.state to the new state and counts the transition in
// tollgate.breaker.transitions.
func (o *Observer) ObserveBreaker(_, to tollgate.BreakerState) {
	ctx := context.Background()
	o.breaker.Record(ctx, int64(to), o.recordBase...)
	if int(to) >= 0 && int(to) < len(o.transitionsTo) {
		o.transitions.Add(ctx, 1, o.transitionsTo[to]...)
	} else {
		o.transitions.Add(ctx, 1, o.addOpts(attribute.String("to", to.String()))...)
	}
}

// ObserveScriptLoad implements tollgate.Observer: it counts a reload in
// tollgate.script.loads.
func (o *Observer) ObserveScriptLoad() {
	o.scriptLoads.Add(context.Background(), 1, o.addBase...)
}
