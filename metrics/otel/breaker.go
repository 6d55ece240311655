package tgotel

import (
	"context"
	"errors"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/tollgate-go/tollgate/breaker"
)

// breakerInstruments are one shared breaker's instruments, with the
// options of every data point built in advance.
type breakerInstruments struct {
	b *breaker.Shared

	calls, outcomes, stale, transitions, trips metric.Int64ObservableCounter
	roundTrips, storeErrors, degraded          metric.Int64ObservableCounter
	open, outage                               metric.Int64ObservableGauge

	base []metric.ObserveOption
	// by state (closed, open, half-open): calls granted and rejected,
	// outcomes success, failure and slow, and transitions into it.
	granted, rejected, success, failure, slow, to [3][]metric.ObserveOption
}

// RegisterBreaker creates the instruments of a shared circuit breaker's
// metrics (breaker.Shared, across every key this instance asked about) on
// a meter of mp, nil meaning otel.GetMeterProvider(), and registers the
// callback that observes them. They are those of tgprom's NewBreaker:
//
//	tollgate.circuit.calls{state,result}     Int64ObservableCounter, {call}; result granted or rejected
//	tollgate.circuit.outcomes{state,outcome} Int64ObservableCounter, {outcome}; success, failure or slow
//	tollgate.circuit.stale                   Int64ObservableCounter, {outcome}
//	tollgate.circuit.transitions{to}         Int64ObservableCounter, {transition}
//	tollgate.circuit.trips                   Int64ObservableCounter, {trip}
//	tollgate.circuit.open                    Int64ObservableGauge, {breaker}
//	tollgate.circuit.round_trips             Int64ObservableCounter, {call}
//	tollgate.circuit.store.errors            Int64ObservableCounter, {error}
//	tollgate.circuit.degraded                Int64ObservableCounter, {call}
//	tollgate.circuit.store.outage            Int64ObservableGauge, 0 or 1
//
// No attribute holds a key. It panics if b is nil, and fails if the
// provider refuses an instrument or the callback. WithAttributes adds
// attributes to every data point.
func RegisterBreaker(b *breaker.Shared, mp metric.MeterProvider, opts ...Option) (metric.Registration, error) {
	if b == nil {
		panic("tgotel: RegisterBreaker with a nil breaker")
	}
	m, c := meter(mp, opts)
	in := &breakerInstruments{b: b}
	var err error
	counter := func(name, unit, desc string) metric.Int64ObservableCounter {
		i, e := m.Int64ObservableCounter(name, metric.WithUnit(unit), metric.WithDescription(desc))
		err = errors.Join(err, e)
		return i
	}
	gauge := func(name, unit, desc string) metric.Int64ObservableGauge {
		i, e := m.Int64ObservableGauge(name, metric.WithUnit(unit), metric.WithDescription(desc))
		err = errors.Join(err, e)
		return i
	}
	in.calls = counter("tollgate.circuit.calls", "{call}", "Calls the shared breaker granted or rejected, by the state they were decided in.")
	in.outcomes = counter("tollgate.circuit.outcomes", "{outcome}", "Outcomes reported for granted calls (success, failure, slow), by the state they were granted in.")
	in.stale = counter("tollgate.circuit.stale", "{outcome}", "Outcomes ignored because the breaker changed state, or the probe lease expired, since the call was granted.")
	in.transitions = counter("tollgate.circuit.transitions", "{transition}", "Transitions this instance's calls made, by the state entered; open includes failed probes.")
	in.trips = counter("tollgate.circuit.trips", "{trip}", "Transitions from closed to open this instance's calls made.")
	in.open = gauge("tollgate.circuit.open", "{breaker}", "Breakers this instance currently holds open without asking Redis.")
	in.roundTrips = counter("tollgate.circuit.round_trips", "{call}", "Script calls sent to Redis.")
	in.storeErrors = counter("tollgate.circuit.store.errors", "{error}", "Script calls that failed through Redis, not through the caller's context.")
	in.degraded = counter("tollgate.circuit.degraded", "{call}", "Acquire calls the failure policy decided because Redis failed.")
	in.outage = gauge("tollgate.circuit.store.outage", "", "1 from the trip of the breaker in front of Redis until Redis answers again, else 0.")
	if err != nil {
		return nil, err
	}
	in.base = point(c.attrs)
	for _, st := range []breaker.State{breaker.Closed, breaker.Open, breaker.HalfOpen} {
		state := attribute.String("state", st.String())
		in.granted[st] = point(c.attrs, state, attribute.String("result", "granted"))
		in.rejected[st] = point(c.attrs, state, attribute.String("result", "rejected"))
		in.success[st] = point(c.attrs, state, attribute.String("outcome", "success"))
		in.failure[st] = point(c.attrs, state, attribute.String("outcome", "failure"))
		in.slow[st] = point(c.attrs, state, attribute.String("outcome", "slow"))
		in.to[st] = point(c.attrs, attribute.String("to", st.String()))
	}
	return m.RegisterCallback(in.observe, in.calls, in.outcomes, in.stale, in.transitions, in.trips,
		in.open, in.roundTrips, in.storeErrors, in.degraded, in.outage)
}

// observe is the callback: it reads the breaker's stats once.
func (in *breakerInstruments) observe(_ context.Context, o metric.Observer) error {
	s := in.b.Stats()
	for _, st := range []breaker.State{breaker.Closed, breaker.Open, breaker.HalfOpen} {
		o.ObserveInt64(in.calls, clamp(s.Granted[st]), in.granted[st]...)
		o.ObserveInt64(in.calls, clamp(s.Rejected[st]), in.rejected[st]...)
		o.ObserveInt64(in.outcomes, clamp(s.Successes[st]), in.success[st]...)
		o.ObserveInt64(in.outcomes, clamp(s.Failures[st]), in.failure[st]...)
		o.ObserveInt64(in.outcomes, clamp(s.Slow[st]), in.slow[st]...)
		o.ObserveInt64(in.transitions, clamp(s.Entered[st]), in.to[st]...)
	}
	o.ObserveInt64(in.stale, clamp(s.Stale), in.base...)
	o.ObserveInt64(in.trips, clamp(s.Trips), in.base...)
	o.ObserveInt64(in.open, int64(s.Open), in.base...)
	o.ObserveInt64(in.roundTrips, clamp(s.RoundTrips), in.base...)
	o.ObserveInt64(in.storeErrors, clamp(s.StoreErrors), in.base...)
	o.ObserveInt64(in.degraded, clamp(s.Degraded), in.base...)
	var outage int64
	if s.Outage {
		outage = 1
	}
	o.ObserveInt64(in.outage, outage, in.base...)
	return nil
}
