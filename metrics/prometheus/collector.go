// Package tgprom exports what a tollgate Limiter has done as Prometheus
// metrics. It is a module of its own, so services that do not use
// Prometheus never see client_golang in their go.sum.
//
//	import tgprom "github.com/tollgate-go/tollgate/metrics/prometheus"
//
//	lim, err := tollgate.New(store, plans)
//	...
//	prometheus.MustRegister(tgprom.New(lim))
//
// A Collector reads the Limiter's Stats on every scrape, as
// client_golang's own collectors do: the Limiter keeps its counters, and a
// decision costs nothing in this package.
//
// Metrics (no label ever holds a caller's key):
//
//	tollgate_decisions_total{plan,decision,source}  counter
//	tollgate_store_duration_seconds                 histogram
//	tollgate_store_errors_total{class}              counter
//	tollgate_fallback_active                        gauge, 0 or 1
//	tollgate_breaker_state                          gauge, 0 closed, 1 open, 2 half-open
//	tollgate_breaker_transitions_total{to}          counter
//	tollgate_script_loads_total                     counter
//	tollgate_reservations_total{event}              counter
//	tollgate_reservation_tokens_total{kind}         counter
//	tollgate_shadow_denials_total{plan}             counter
//	tollgate_fleet_size                             gauge
//	tollgate_permits_total{event}                   counter
//	tollgate_permits_held{plan}                     gauge
//
// decision is allowed or denied; source is store, fallback, fail-open or
// cache (a denial the Limiter remembered); to is closed, open or
// half-open; class is the class of a store failure, as in
// tollgate.Stats.StoreErrors; a reservation's event is held, settled or
// expired, and kind refunded, charged or uncharged, as in
// tollgate.Stats.Reservations.
// Every plan has all its decision series from
// the first scrape, at 0, so that increase() sees the first denial or
// fallback; so do the common error classes (timeout, network, canceled,
// bad-reply, other), while a Redis class such as READONLY appears when it
// first happens. tollgate_shadow_denials_total counts the decisions a
// shadowed plan would have denied (tollgate.PlanStats.ShadowDenied), every
// plan from the first scrape; tollgate_fleet_size is the most instances
// alive that the last three heartbeats counted (tollgate.WithFleet,
// Stats.FleetSize), 0 without one.
//
// tollgate_permits_total counts the Acquire calls of concurrency plans
// and their Permits by event, as in tollgate.Stats.Permits: granted and
// refused Acquire calls, Permits released while held, Permits lost (their
// lease had ended), releases the store failed (unreleased), reclaimed
// permits, those of any instance whose lease had ended when this
// Limiter's Acquire, renewal or release found them, and adopted Permits,
// which the fallback granted and which moved into the store once it
// answered again. Every event has its series from the first scrape.
// tollgate_permits_held is the permits of a plan that the Limiter holds
// now, on every key (tollgate.PlanStats.PermitsHeld). As with
// tollgate_shadow_denials_total, every plan has a series from the first
// scrape, at 0 for one that is not a concurrency plan.
//
// The buckets of tollgate_store_duration_seconds are the Limiter's,
// Stats.LatencyBounds (50µs to 1s), and cannot be changed: the Limiter
// counts each call into a bucket as it happens. WithDurationBuckets, which
// set them when this package received each call, is gone for that reason.
//
// NewBreaker exports a breaker.Shared instance's stats the same way, as
// tollgate_circuit_* metrics (see BreakerCollector).
//
// Several Limiters in one registry need one Collector each, with distinct
// const labels, for example WithConstLabels(prometheus.Labels{"limiter":
// "login"}); the registry refuses a second Collector with the same ones.
package tgprom

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tollgate-go/tollgate"
)

// Option configures a Collector.
type Option func(*config)

type config struct {
	constLabels prometheus.Labels
}

// WithConstLabels adds labels with fixed values to every metric, for
// example prometheus.Labels{"limiter": "api"} to tell the Collectors of
// several Limiters apart in one registry. A label named like one of the
// metrics' own (plan, decision, source, class, to, event, kind) makes registering the
// Collector fail. The default is none.
func WithConstLabels(l prometheus.Labels) Option {
	return func(c *config) { c.constLabels = l }
}

// Collector is the prometheus.Collector of one Limiter's Stats. It is safe
// for concurrent use; each scrape reads the Stats once.
type Collector struct {
	lim *tollgate.Limiter

	decisions   *prometheus.Desc
	duration    *prometheus.Desc
	storeErrors *prometheus.Desc
	fallback    *prometheus.Desc
	breaker     *prometheus.Desc
	transitions *prometheus.Desc
	scriptLoads *prometheus.Desc
	holds       *prometheus.Desc
	holdTokens  *prometheus.Desc
	shadow      *prometheus.Desc
	fleetSize   *prometheus.Desc
	permits     *prometheus.Desc
	held        *prometheus.Desc
}

var _ prometheus.Collector = (*Collector)(nil)

// commonErrorClasses are the classes of tollgate.Stats.StoreErrors that
// are not Redis's own: they have a series from the first scrape.
var commonErrorClasses = []string{"timeout", "network", "canceled", "bad-reply", "other"}

// New returns the Collector of lim's metrics, to register with a
// prometheus.Registerer. It panics if lim is nil, a wiring mistake that
// would otherwise show only on the first scrape.
func New(lim *tollgate.Limiter, opts ...Option) *Collector {
	if lim == nil {
		panic("tgprom: New with a nil Limiter")
	}
	var c config
	for _, o := range opts {
		o(&c)
	}
	cl := c.constLabels
	return &Collector{
		lim: lim,
		decisions: prometheus.NewDesc("tollgate_decisions_total",
			"Decisions that took tokens, by binding plan, decision (allowed, denied) and source (store, fallback, fail-open, cache, lease).",
			[]string{"plan", "decision", "source"}, cl),
		duration: prometheus.NewDesc("tollgate_store_duration_seconds",
			"Duration of the Limiter's calls to its store, failed ones included, in seconds.",
			nil, cl),
		storeErrors: prometheus.NewDesc("tollgate_store_errors_total",
			"Calls to the Limiter's store that failed, by class; calls its caller ended are not counted.",
			[]string{"class"}, cl),
		fallback: prometheus.NewDesc("tollgate_fallback_active",
			"1 during an outage of the store (tollgate.Stats.Outage: from the breaker's trip until a success after two cooldowns without a failure), else 0.",
			nil, cl),
		breaker: prometheus.NewDesc("tollgate_breaker_state",
			"State of the circuit breaker in front of the store: 0 closed, 1 open, 2 half-open.",
			nil, cl),
		transitions: prometheus.NewDesc("tollgate_breaker_transitions_total",
			"Transitions of the circuit breaker, by the state it entered (closed, open, half-open); open counts trips, not the re-opening after a failed probe.",
			[]string{"to"}, cl),
		scriptLoads: prometheus.NewDesc("tollgate_script_loads_total",
			"Reloads of the Lua script after Redis answered NOSCRIPT.",
			nil, cl),
		holds: prometheus.NewDesc("tollgate_reservations_total",
			"Reservations, by event: held (granted), settled (expired ones included), expired (settled after the hold was gone).",
			[]string{"event"}, cl),
		holdTokens: prometheus.NewDesc("tollgate_reservation_tokens_total",
			"Tokens settled, by kind: refunded, charged (used beyond a reservation), uncharged (not taken because a bucket's debt would pass one capacity).",
			[]string{"kind"}, cl),
		shadow: prometheus.NewDesc("tollgate_shadow_denials_total",
			"Decisions that a shadowed plan would have denied had it been enforced, by that plan.",
			[]string{"plan"}, cl),
		fleetSize: prometheus.NewDesc("tollgate_fleet_size",
			"The most instances alive that the last three heartbeats counted (WithFleet); 0 without one.",
			nil, cl),
		permits: prometheus.NewDesc("tollgate_permits_total",
			"Acquire calls of concurrency plans and their permits, by event: granted, refused (Acquire calls); released, lost (Permits given back while held, or found with their lease ended); unreleased (releases the store failed); reclaimed (permits of any instance whose lease had ended, removed by this Limiter's calls to the store); adopted (Permits the fallback granted, moved into the store once it answered again).",
			[]string{"event"}, cl),
		held: prometheus.NewDesc("tollgate_permits_held",
			"Permits of a concurrency plan that this Limiter holds now, on every key, by plan; 0 for other plans.",
			[]string{"plan"}, cl),
	}
}

// Describe implements prometheus.Collector.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.decisions, c.duration, c.storeErrors, c.fallback, c.breaker, c.transitions, c.scriptLoads, c.holds, c.holdTokens, c.shadow, c.fleetSize, c.permits, c.held} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: it reads the Limiter's Stats
// once and sends them as const metrics.
func (c *Collector) Collect(ch chan<- prometheus.Metric) {
	s := c.lim.Stats()
	for _, p := range s.Plans {
		for src := range p.Allowed {
			source := tollgate.Source(src).String()
			counter(ch, c.decisions, p.Allowed[src], p.Plan, "allowed", source)
			counter(ch, c.decisions, p.Denied[src], p.Plan, "denied", source)
		}
		counter(ch, c.shadow, p.ShadowDenied, p.Plan)
		gauge(ch, c.held, float64(p.PermitsHeld), p.Plan)
	}

	// Prometheus's buckets are cumulative, the Limiter's are not.
	buckets := make(map[float64]uint64, len(s.LatencyBounds))
	var n uint64
	for i, v := range s.StoreLatency {
		n += v
		if i < len(s.LatencyBounds) {
			buckets[s.LatencyBounds[i].Seconds()] = n
		}
	}
	h, err := prometheus.NewConstHistogram(c.duration, n, s.StoreTime.Seconds(), buckets)
	send(ch, c.duration, h, err)

	for _, class := range commonErrorClasses {
		if _, ok := s.StoreErrors[class]; !ok {
			counter(ch, c.storeErrors, 0, class)
		}
	}
	for class, v := range s.StoreErrors {
		counter(ch, c.storeErrors, v, class)
	}

	gauge(ch, c.fallback, boolValue(s.Outage))
	gauge(ch, c.breaker, float64(s.Breaker))
	counter(ch, c.transitions, s.BreakerClosed, "closed")
	counter(ch, c.transitions, s.BreakerOpened, "open")
	counter(ch, c.transitions, s.BreakerHalfOpened, "half-open")
	counter(ch, c.scriptLoads, uint64(max(s.ScriptLoads, 0)))
	rs := s.Reservations
	counter(ch, c.holds, rs.Held, "held")
	counter(ch, c.holds, rs.Settled, "settled")
	counter(ch, c.holds, rs.Expired, "expired")
	counter(ch, c.holdTokens, rs.Refunded, "refunded")
	counter(ch, c.holdTokens, rs.Charged, "charged")
	counter(ch, c.holdTokens, rs.Uncharged, "uncharged")
	gauge(ch, c.fleetSize, float64(s.FleetSize))
	ps := s.Permits
	counter(ch, c.permits, ps.Granted, "granted")
	counter(ch, c.permits, ps.Refused, "refused")
	counter(ch, c.permits, ps.Released, "released")
	counter(ch, c.permits, ps.Lost, "lost")
	counter(ch, c.permits, ps.Unreleased, "unreleased")
	counter(ch, c.permits, ps.Reclaimed, "reclaimed")
	counter(ch, c.permits, ps.Adopted, "adopted")
}

func counter(ch chan<- prometheus.Metric, d *prometheus.Desc, v uint64, labels ...string) {
	m, err := prometheus.NewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	send(ch, d, m, err)
}

func gauge(ch chan<- prometheus.Metric, d *prometheus.Desc, v float64, labels ...string) {
	m, err := prometheus.NewConstMetric(d, prometheus.GaugeValue, v, labels...)
	send(ch, d, m, err)
}

// send sends m, or the error that kept it from being made. The error can
// only come from an invalid const label, which Register refuses: a
// Collector scraped without a registry gets an invalid metric rather than
// a panic in the scrape, as MustNewConstMetric would give.
func send(ch chan<- prometheus.Metric, d *prometheus.Desc, m prometheus.Metric, err error) {
	if err != nil {
		m = prometheus.NewInvalidMetric(d, err)
	}
	ch <- m
}

func boolValue(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
