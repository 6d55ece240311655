package tgprom

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/tollgate-go/tollgate/breaker"
)

// BreakerCollector is the prometheus.Collector of one breaker.Shared
// instance's SharedStats. It is safe for concurrent use; each scrape reads
// the stats once. Its metrics (no label ever holds a key):
//
//	tollgate_circuit_calls_total{state,result}      counter; result granted or rejected
//	tollgate_circuit_outcomes_total{state,outcome}  counter; outcome success, failure or slow
//	tollgate_circuit_stale_total                    counter
//	tollgate_circuit_transitions_total{to}          counter, made by this instance
//	tollgate_circuit_trips_total                    counter, made by this instance
//	tollgate_circuit_open                           gauge: breakers this instance holds open
//	tollgate_circuit_round_trips_total              counter
//	tollgate_circuit_store_errors_total             counter
//	tollgate_circuit_degraded_total                 counter: decided by the failure policy
//	tollgate_circuit_store_outage                   gauge, 0 or 1
//
// state is closed, open or half-open: the state a call was granted or
// refused in. Every instance counts only the transitions its own calls
// made, so a sum over the fleet counts each transition once.
type BreakerCollector struct {
	b                                                *breaker.Shared
	calls, outcomes, stale, transitions, trips, open *prometheus.Desc
	roundTrips, storeErrors, degraded, outage        *prometheus.Desc
}

var _ prometheus.Collector = (*BreakerCollector)(nil)

// NewBreaker returns the Collector of b's metrics, to register with a
// prometheus.Registerer. It panics if b is nil. WithConstLabels tells
// several breakers apart in one registry.
func NewBreaker(b *breaker.Shared, opts ...Option) *BreakerCollector {
	if b == nil {
		panic("tgprom: NewBreaker with a nil breaker")
	}
	var c config
	for _, o := range opts {
		o(&c)
	}
	cl := c.constLabels
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc("tollgate_circuit_"+name, help, labels, cl)
	}
	return &BreakerCollector{
		b:           b,
		calls:       d("calls_total", "Calls the shared breaker granted or rejected, by the state they were decided in.", "state", "result"),
		outcomes:    d("outcomes_total", "Outcomes reported for granted calls (success, failure, slow), by the state they were granted in.", "state", "outcome"),
		stale:       d("stale_total", "Outcomes ignored because the breaker changed state, or the probe lease expired, since the call was granted."),
		transitions: d("transitions_total", "Transitions this instance's calls made, by the state entered; open includes failed probes.", "to"),
		trips:       d("trips_total", "Transitions from closed to open this instance's calls made."),
		open:        d("open", "Breakers this instance currently holds open without asking Redis."),
		roundTrips:  d("round_trips_total", "Script calls sent to Redis."),
		storeErrors: d("store_errors_total", "Script calls that failed through Redis, not through the caller's context."),
		degraded:    d("degraded_total", "Acquire calls the failure policy decided because Redis failed."),
		outage:      d("store_outage", "1 from the trip of the breaker in front of Redis until Redis answers again, else 0."),
	}
}

// Describe implements prometheus.Collector.
func (c *BreakerCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{c.calls, c.outcomes, c.stale, c.transitions, c.trips, c.open,
		c.roundTrips, c.storeErrors, c.degraded, c.outage} {
		ch <- d
	}
}

// Collect implements prometheus.Collector: it reads the breaker's stats
// once and sends them as const metrics.
func (c *BreakerCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.b.Stats()
	for _, st := range []breaker.State{breaker.Closed, breaker.Open, breaker.HalfOpen} {
		state := st.String()
		counter(ch, c.calls, s.Granted[st], state, "granted")
		counter(ch, c.calls, s.Rejected[st], state, "rejected")
		counter(ch, c.outcomes, s.Successes[st], state, "success")
		counter(ch, c.outcomes, s.Failures[st], state, "failure")
		counter(ch, c.outcomes, s.Slow[st], state, "slow")
		counter(ch, c.transitions, s.Entered[st], state)
	}
	counter(ch, c.stale, s.Stale)
	counter(ch, c.trips, s.Trips)
	gauge(ch, c.open, float64(s.Open))
	counter(ch, c.roundTrips, s.RoundTrips)
	counter(ch, c.storeErrors, s.StoreErrors)
	counter(ch, c.degraded, s.Degraded)
	gauge(ch, c.outage, boolValue(s.Outage))
}
