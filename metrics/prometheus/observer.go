// Package tgprom exports what tollgate Limiters do as Prometheus metrics.
// It is a module of its own, so services that do not use Prometheus never
// see client_golang in their go.sum.
//
//	import tgprom "github.com/tollgate-go/tollgate/metrics/prometheus"
//
//	obs, err := tgprom.New(prometheus.DefaultRegisterer)
//	...
//	store := tollgate.NewRedisStore(client, tollgate.WithRedisObserver(obs))
//	lim, err := tollgate.New(store, plans, tollgate.WithObserver(obs))
//
// Metrics (no label ever holds a caller's key):
//
//	tollgate_decisions_total{plan,decision,source}  counter
//	tollgate_store_duration_seconds                 histogram
//	tollgate_store_errors_total                     counter
//	tollgate_fallback_active                        gauge, 0 or 1
//	tollgate_breaker_state                          gauge, 0 closed, 1 open, 2 half-open
//	tollgate_breaker_transitions_total{to}          counter
//	tollgate_script_loads_total                     counter
//
// Use one Observer per Limiter. Several Limiters in one registry need
// distinct const labels, for example WithConstLabels(prometheus.Labels{
// "limiter": "login"}): the gauges describe one Limiter each.
package tgprom

import (
	"fmt"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tollgate-go/tollgate"
)

// DefaultDurationBuckets are the default buckets of
// tollgate_store_duration_seconds, in seconds: 50µs to 1s, for Redis calls
// that take a fraction of a millisecond when healthy and up to the client's
// timeout when not.
var DefaultDurationBuckets = []float64{
	0.00005, 0.0001, 0.00025, 0.0005,
	0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
	0.1, 0.25, 0.5, 1,
}

// Option configures an Observer.
type Option func(*config)

type config struct {
	constLabels prometheus.Labels
	buckets     []float64
}

// WithConstLabels adds labels with fixed values to every metric, for
// example prometheus.Labels{"limiter": "api"} to tell the Observers of
// several Limiters apart in one registry. The default is none.
func WithConstLabels(l prometheus.Labels) Option {
	return func(c *config) { c.constLabels = l }
}

// WithDurationBuckets sets the upper bounds, in seconds, of the buckets of
// tollgate_store_duration_seconds. The default is DefaultDurationBuckets.
func WithDurationBuckets(b []float64) Option {
	return func(c *config) { c.buckets = b }
}

// Observer is a tollgate.Observer that keeps Prometheus metrics, and the
// prometheus.Collector of those metrics. Give the same Observer to the
// Limiter (tollgate.WithObserver) and to its RedisStore
// (tollgate.WithRedisObserver). It is safe for concurrent use, and a
// decision costs a few atomic additions and no allocation.
type Observer struct {
	decisions   *prometheus.CounterVec
	duration    prometheus.Histogram
	storeErrors prometheus.Counter
	fallback    prometheus.Gauge
	breaker     prometheus.Gauge
	transitions *prometheus.CounterVec
	scriptLoads prometheus.Counter

	// byPlan maps a plan name to its decision counters. It is copied on
	// write, so a decision reads it without a lock; plans are few and
	// fixed when a Limiter is made.
	byPlan atomic.Pointer[map[string]*planCounters]
	mu     sync.Mutex // serialises writers of byPlan

	transitionsTo [3]prometheus.Counter // by tollgate.BreakerState
}

// numSources is the number of tollgate.Source values this package knows.
const numSources = 3

// planCounters holds a plan's decision counters by [allowed][source].
type planCounters [2][numSources]prometheus.Counter

var (
	_ tollgate.Observer    = (*Observer)(nil)
	_ prometheus.Collector = (*Observer)(nil)
)

// New returns an Observer whose metrics are registered with reg; nil means
// prometheus.DefaultRegisterer. It fails, registering nothing, if reg
// already holds metrics of the same names and const labels (a
// prometheus.AlreadyRegisteredError), or if a const label is invalid, such
// as one named plan, decision, source or to, or if the duration buckets do
// not increase strictly.
func New(reg prometheus.Registerer, opts ...Option) (*Observer, error) {
	c := config{buckets: DefaultDurationBuckets}
	for _, o := range opts {
		o(&c)
	}
	if reg == nil {
		reg = prometheus.DefaultRegisterer
	}
	// prometheus.NewHistogram panics on these; New returns an error.
	for i, b := range c.buckets {
		if math.IsNaN(b) || i > 0 && b <= c.buckets[i-1] {
			return nil, fmt.Errorf("tgprom: duration buckets must increase strictly, got %v", c.buckets)
		}
	}
	cl := c.constLabels
	o := &Observer{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "tollgate_decisions_total",
			Help:        "Decisions that took tokens, by binding plan, decision (allowed, denied) and source (store, fallback, fail-open).",
			ConstLabels: cl,
		}, []string{"plan", "decision", "source"}),
		duration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:        "tollgate_store_duration_seconds",
			Help:        "Duration of the Limiter's calls to its store, failed ones included, in seconds.",
			ConstLabels: cl,
			Buckets:     c.buckets,
		}),
		storeErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        "tollgate_store_errors_total",
			Help:        "Calls to the Limiter's store that failed; calls its caller ended are not counted.",
			ConstLabels: cl,
		}),
		fallback: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "tollgate_fallback_active",
			Help:        "1 while the store is failing and the Limiter decides by its failure policy, else 0.",
			ConstLabels: cl,
		}),
		breaker: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "tollgate_breaker_state",
			Help:        "State of the circuit breaker in front of the store: 0 closed, 1 open, 2 half-open.",
			ConstLabels: cl,
		}),
		transitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "tollgate_breaker_transitions_total",
			Help:        "Transitions of the circuit breaker, by the state it entered (closed, open, half-open).",
			ConstLabels: cl,
		}, []string{"to"}),
		scriptLoads: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        "tollgate_script_loads_total",
			Help:        "Reloads of the Lua script after Redis answered NOSCRIPT.",
			ConstLabels: cl,
		}),
	}
	for _, s := range []tollgate.BreakerState{tollgate.BreakerClosed, tollgate.BreakerOpen, tollgate.BreakerHalfOpen} {
		o.transitionsTo[s] = o.transitions.WithLabelValues(s.String())
	}
	o.byPlan.Store(&map[string]*planCounters{})
	if err := reg.Register(o); err != nil {
		return nil, err
	}
	return o, nil
}

// Describe implements prometheus.Collector.
func (o *Observer) Describe(ch chan<- *prometheus.Desc) {
	for _, c := range o.collectors() {
		c.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (o *Observer) Collect(ch chan<- prometheus.Metric) {
	for _, c := range o.collectors() {
		c.Collect(ch)
	}
}

func (o *Observer) collectors() []prometheus.Collector {
	return []prometheus.Collector{o.decisions, o.duration, o.storeErrors, o.fallback, o.breaker, o.transitions, o.scriptLoads}
}

// ObserveDecision implements tollgate.Observer: it counts a decision in
// tollgate_decisions_total. Peeks (cost 0) take nothing and are not
// counted; each attempt of Limiter.Wait is.
func (o *Observer) ObserveDecision(d tollgate.Decision) {
	if d.Cost == 0 {
		return
	}
	if d.Source >= numSources { // a Source newer than this package
		o.decisions.WithLabelValues(d.Plan, decisionLabel(d.Allowed), d.Source.String()).Inc()
		return
	}
	pc := (*o.byPlan.Load())[d.Plan]
	if pc == nil {
		pc = o.addPlan(d.Plan)
	}
	a := 0
	if d.Allowed {
		a = 1
	}
	pc[a][d.Source].Inc()
}

// addPlan creates the counters of a plan seen for the first time, every
// combination at 0, so that the first denial shows in increase().
func (o *Observer) addPlan(plan string) *planCounters {
	o.mu.Lock()
	defer o.mu.Unlock()
	old := *o.byPlan.Load()
	if pc := old[plan]; pc != nil {
		return pc
	}
	pc := new(planCounters)
	for a := range pc {
		for s := range pc[a] {
			pc[a][s] = o.decisions.WithLabelValues(plan, decisionLabel(a == 1), tollgate.Source(s).String())
		}
	}
	m := make(map[string]*planCounters, len(old)+1)
	for k, v := range old {
		m[k] = v
	}
	m[plan] = pc
	o.byPlan.Store(&m)
	return pc
}

func decisionLabel(allowed bool) string {
	if allowed {
		return "allowed"
	}
	return "denied"
}

// ObserveStore implements tollgate.Observer: it records the call in
// tollgate_store_duration_seconds and, if it failed, counts it in
// tollgate_store_errors_total. The Limiter passes no
// error for calls that ended for the caller's own reasons (bad input, a
// cancelled context or one past its deadline): only the store's failures
// are counted.
func (o *Observer) ObserveStore(elapsed time.Duration, err error) {
	o.duration.Observe(elapsed.Seconds())
	if err != nil {
		o.storeErrors.Inc()
	}
}

// ObserveFallback implements tollgate.Observer: it sets
// tollgate_fallback_active to 1 when an outage starts and to 0 when it
// ends.
func (o *Observer) ObserveFallback(active bool) {
	if active {
		o.fallback.Set(1)
	} else {
		o.fallback.Set(0)
	}
}

// ObserveBreaker implements tollgate.Observer: it sets
// tollgate_breaker_state to the new state and counts the transition in
// tollgate_breaker_transitions_total.
func (o *Observer) ObserveBreaker(_, to tollgate.BreakerState) {
	o.breaker.Set(float64(to))
	if int(to) >= 0 && int(to) < len(o.transitionsTo) {
		o.transitionsTo[to].Inc()
	} else {
		o.transitions.WithLabelValues(to.String()).Inc()
	}
}

// ObserveScriptLoad implements tollgate.Observer: it counts a reload in
// tollgate_script_loads_total.
func (o *Observer) ObserveScriptLoad() {
	o.scriptLoads.Inc()
}
