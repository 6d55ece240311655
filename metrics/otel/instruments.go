// Package tgotel exports what a tollgate Limiter has done as
// OpenTelemetry metrics. It is a module of its own, so services that do
// not use OpenTelemetry never see it in their go.sum.
//
//	import tgotel "github.com/tollgate-go/tollgate/metrics/otel"
//
//	lim, err := tollgate.New(store, plans)
//	...
//	reg, err := tgotel.Register(lim, otel.GetMeterProvider())
//	...
//	defer reg.Unregister()
//
// The instruments are asynchronous, with one callback that reads the
// Limiter's Stats once per collection: the Limiter keeps its counters, and
// a decision costs nothing in this package.
//
// Instruments (no attribute ever holds a caller's key):
//
//	tollgate.decisions{plan,decision,source}  Int64ObservableCounter, {decision}
//	tollgate.store.duration                   Float64ObservableCounter, s
//	tollgate.store.calls                      Int64ObservableCounter, {call}
//	tollgate.store.errors{class}              Int64ObservableCounter, {error}
//	tollgate.fallback.active                  Int64ObservableGauge, 0 or 1
//	tollgate.breaker.state                    Int64ObservableGauge, 0 closed, 1 open, 2 half-open
//	tollgate.breaker.transitions{to}          Int64ObservableCounter, {transition}
//	tollgate.script.loads                     Int64ObservableCounter, {load}
//	tollgate.reservations{event}              Int64ObservableCounter, {reservation}
//	tollgate.reservation.tokens{kind}         Int64ObservableCounter, {token}
//	tollgate.shadow.denials{plan}             Int64ObservableCounter, {decision}
//	tollgate.fleet.size                       Int64ObservableGauge, {instance}
//	tollgate.permits{event}                   Int64ObservableCounter, {permit}
//	tollgate.permits.held{plan}               Int64ObservableGauge, {permit}
//
// decision is allowed or denied; source is store, fallback, fail-open or
// cache (a denial the Limiter remembered); to is closed, open or
// half-open; class is the class of a store failure, as in
// tollgate.Stats.StoreErrors; a reservation's event is held, settled or
// expired, and kind refunded, charged or uncharged, as in
// tollgate.Stats.Reservations. Every plan has all its decision data points
// from the first collection, at 0, and so do the common error classes
// (timeout, network, canceled, bad-reply, other).
//
// tollgate.permits counts the Acquire calls of concurrency plans and their
// Permits by event, as in tollgate.Stats.Permits: granted and refused
// Acquire calls, Permits released while held, Permits lost (their lease
// had ended), releases the store failed (unreleased), reclaimed permits,
// those of any instance whose lease had ended when this Limiter's
// Acquire, renewal or release found them, and adopted Permits, which the
// fallback granted and which moved into the store once it answered again.
// tollgate.permits.held is the permits of a plan that the Limiter holds
// now, on every key (tollgate.PlanStats.PermitsHeld). Every event, and
// every plan, has its data point from the first collection; a plan that
// is not a concurrency plan holds 0, as for tollgate.shadow.denials.
//
// OpenTelemetry has no asynchronous histogram, so the duration of the
// store calls is their total, tollgate.store.duration, beside their
// number, tollgate.store.calls: the ratio of their rates is the mean
// duration. The distribution, which the Limiter keeps in fixed buckets
// (Stats.StoreLatency), reaches only Prometheus, through tgprom's
// tollgate_store_duration_seconds histogram. When this package received
// each call, it recorded a synchronous histogram, at the cost of work on
// every decision; WithDurationBuckets went with it.
//
// Through the OpenTelemetry Prometheus exporter the instruments become the
// series of the Prometheus adapter (tollgate_decisions_total{plan,
// decision,source}, tollgate_breaker_state, ...), so dashboards and alerts
// work with either, except for the store's duration:
// tollgate_store_duration_seconds_total and tollgate_store_calls_total
// here, a histogram there.
//
// RegisterBreaker does the same for a shared circuit breaker
// (breaker.Shared), as tollgate.circuit.* instruments.
//
// Several Limiters on one MeterProvider need one Register each, with
// distinct attributes, for example WithAttributes(attribute.String(
// "limiter", "login")): OpenTelemetry requires each callback's data points
// to be its own.
package tgotel

import (
	"context"
	"errors"
	"math"

	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/tollgate-go/tollgate"
)

// ScopeName is the instrumentation scope of the meter that holds the
// instruments.
const ScopeName = "github.com/tollgate-go/tollgate/metrics/otel"

// Option configures Register.
type Option func(*config)

type config struct {
	attrs []attribute.KeyValue
}

// WithAttributes adds attributes to every data point, for example
// attribute.String("limiter", "api") to tell several Limiters apart. The
// default is none.
func WithAttributes(kv ...attribute.KeyValue) Option {
	return func(c *config) { c.attrs = kv }
}

// commonErrorClasses are the classes of tollgate.Stats.StoreErrors that
// are not Redis's own: they have a data point from the first collection.
var commonErrorClasses = []string{"timeout", "network", "canceled", "bad-reply", "other"}

// instruments are one Limiter's instruments, with the options of every
// data point built in advance: a collection allocates nothing in this
// package but for a Redis error class it has not seen.
type instruments struct {
	lim *tollgate.Limiter

	decisions   metric.Int64ObservableCounter
	duration    metric.Float64ObservableCounter
	calls       metric.Int64ObservableCounter
	storeErrors metric.Int64ObservableCounter
	fallback    metric.Int64ObservableGauge
	breaker     metric.Int64ObservableGauge
	transitions metric.Int64ObservableCounter
	scriptLoads metric.Int64ObservableCounter
	holds       metric.Int64ObservableCounter
	holdTokens  metric.Int64ObservableCounter
	shadow      metric.Int64ObservableCounter
	fleetSize   metric.Int64ObservableGauge
	permits     metric.Int64ObservableCounter
	held        metric.Int64ObservableGauge

	attrs         []attribute.KeyValue
	base          []metric.ObserveOption
	plans         map[string]planPoints // by plan name, as Register saw them
	classes       map[string][]metric.ObserveOption
	transitionsTo [3][]metric.ObserveOption // closed, open, half-open
	holdEvents    [3][]metric.ObserveOption // held, settled, expired
	holdKinds     [3][]metric.ObserveOption // refunded, charged, uncharged
	permitEvents  [7][]metric.ObserveOption // granted, refused, released, lost, unreleased, reclaimed, adopted
}

// Register creates the instruments of lim's metrics on a meter of mp, nil
// meaning otel.GetMeterProvider(), and registers the callback that
// observes them. Unregister the Registration it returns to stop reporting
// lim, for example before dropping a Limiter that a long-lived provider
// would otherwise keep alive. It panics if lim is nil, a wiring mistake
// that would otherwise show only at the first collection, and fails if
// the provider refuses an instrument or the callback.
func Register(lim *tollgate.Limiter, mp metric.MeterProvider, opts ...Option) (metric.Registration, error) {
	if lim == nil {
		panic("tgotel: Register with a nil Limiter")
	}
	m, c := meter(mp, opts)
	in := &instruments{lim: lim, attrs: c.attrs}
	if err := in.create(m); err != nil {
		return nil, err
	}
	in.prepare()
	return m.RegisterCallback(in.observe, in.decisions, in.duration, in.calls, in.storeErrors,
		in.fallback, in.breaker, in.transitions, in.scriptLoads, in.holds, in.holdTokens, in.shadow, in.fleetSize,
		in.permits, in.held)
}

// create creates the instruments on m.
func (in *instruments) create(m metric.Meter) error {
	var err, e error
	in.decisions, e = m.Int64ObservableCounter("tollgate.decisions", metric.WithUnit("{decision}"),
		metric.WithDescription("Decisions that took tokens, by binding plan, decision (allowed, denied) and source (store, fallback, fail-open, cache, lease)."))
	err = errors.Join(err, e)
	in.duration, e = m.Float64ObservableCounter("tollgate.store.duration", metric.WithUnit("s"),
		metric.WithDescription("Total duration of the Limiter's calls to its store, failed ones included; divided by tollgate.store.calls, their mean."))
	err = errors.Join(err, e)
	in.calls, e = m.Int64ObservableCounter("tollgate.store.calls", metric.WithUnit("{call}"),
		metric.WithDescription("Calls of the Limiter to its store that its breaker let through, failed ones included."))
	err = errors.Join(err, e)
	in.storeErrors, e = m.Int64ObservableCounter("tollgate.store.errors", metric.WithUnit("{error}"),
		metric.WithDescription("Calls to the Limiter's store that failed, by class; calls its caller ended are not counted."))
	err = errors.Join(err, e)
	in.fallback, e = m.Int64ObservableGauge("tollgate.fallback.active",
		metric.WithDescription("1 during an outage of the store (tollgate.Stats.Outage: from the breaker's trip until a success after two cooldowns without a failure), else 0."))
	err = errors.Join(err, e)
	in.breaker, e = m.Int64ObservableGauge("tollgate.breaker.state",
		metric.WithDescription("State of the circuit breaker in front of the store: 0 closed, 1 open, 2 half-open."))
	err = errors.Join(err, e)
	in.transitions, e = m.Int64ObservableCounter("tollgate.breaker.transitions", metric.WithUnit("{transition}"),
		metric.WithDescription("Transitions of the circuit breaker, by the state it entered (closed, open, half-open); open counts trips, not the re-opening after a failed probe."))
	err = errors.Join(err, e)
	in.scriptLoads, e = m.Int64ObservableCounter("tollgate.script.loads", metric.WithUnit("{load}"),
		metric.WithDescription("Reloads of the Lua script after Redis answered NOSCRIPT."))
	err = errors.Join(err, e)
	in.holds, e = m.Int64ObservableCounter("tollgate.reservations", metric.WithUnit("{reservation}"),
		metric.WithDescription("Reservations, by event: held (granted), settled (expired ones included), expired (settled after the hold was gone)."))
	err = errors.Join(err, e)
	in.holdTokens, e = m.Int64ObservableCounter("tollgate.reservation.tokens", metric.WithUnit("{token}"),
		metric.WithDescription("Tokens settled, by kind: refunded, charged (used beyond a reservation), uncharged (not taken because a bucket's debt would pass one capacity)."))
	err = errors.Join(err, e)
	in.shadow, e = m.Int64ObservableCounter("tollgate.shadow.denials", metric.WithUnit("{decision}"),
		metric.WithDescription("Decisions that a shadowed plan would have denied had it been enforced, by that plan."))
	err = errors.Join(err, e)
	in.fleetSize, e = m.Int64ObservableGauge("tollgate.fleet.size", metric.WithUnit("{instance}"),
		metric.WithDescription("The most instances alive that the last three heartbeats counted (WithFleet); 0 without one."))
	err = errors.Join(err, e)
	in.permits, e = m.Int64ObservableCounter("tollgate.permits", metric.WithUnit("{permit}"),
		metric.WithDescription("Acquire calls of concurrency plans and their permits, by event: granted, refused (Acquire calls); released, lost (Permits given back while held, or found with their lease ended); unreleased (releases the store failed); reclaimed (permits of any instance whose lease had ended, removed by this Limiter's calls to the store); adopted (Permits the fallback granted, moved into the store once it answered again)."))
	err = errors.Join(err, e)
	in.held, e = m.Int64ObservableGauge("tollgate.permits.held", metric.WithUnit("{permit}"),
		metric.WithDescription("Permits of a concurrency plan that this Limiter holds now, on every key, by plan; 0 for other plans."))
	err = errors.Join(err, e)
	return err
}

// prepare builds the attribute sets of the data points, once: the base
// set, each plan's known so far, and each event's, kind's, class's and
// state's.
func (in *instruments) prepare() {
	in.base = []metric.ObserveOption{metric.WithAttributeSet(attribute.NewSet(in.attrs...))}
	in.plans = make(map[string]planPoints)
	for _, p := range in.lim.Stats().Plans { // SetPlans may add others later
		in.plans[p.Plan] = in.planOpts(p)
	}
	in.classes = make(map[string][]metric.ObserveOption, len(commonErrorClasses))
	for _, class := range commonErrorClasses {
		in.classes[class] = in.opts(attribute.String("class", class))
	}
	for i, to := range []string{"closed", "open", "half-open"} {
		in.transitionsTo[i] = in.opts(attribute.String("to", to))
	}
	for i, event := range []string{"held", "settled", "expired"} {
		in.holdEvents[i] = in.opts(attribute.String("event", event))
	}
	for i, kind := range []string{"refunded", "charged", "uncharged"} {
		in.holdKinds[i] = in.opts(attribute.String("kind", kind))
	}
	for i, event := range []string{"granted", "refused", "released", "lost", "unreleased", "reclaimed", "adopted"} {
		in.permitEvents[i] = in.opts(attribute.String("event", event))
	}
}

// meter returns the meter of mp, nil meaning otel.GetMeterProvider(), and
// the options applied.
func meter(mp metric.MeterProvider, opts []Option) (metric.Meter, config) {
	var c config
	for _, o := range opts {
		o(&c)
	}
	if mp == nil {
		mp = otel.GetMeterProvider()
	}
	return mp.Meter(ScopeName), c
}

// opts returns the ObserveOptions of a data point with kv and the
// attributes of WithAttributes.
func (in *instruments) opts(kv ...attribute.KeyValue) []metric.ObserveOption {
	return point(in.attrs, kv...)
}

// point returns the ObserveOptions of a data point with attrs and kv.
func point(attrs []attribute.KeyValue, kv ...attribute.KeyValue) []metric.ObserveOption {
	all := append(append([]attribute.KeyValue(nil), attrs...), kv...)
	return []metric.ObserveOption{metric.WithAttributeSet(attribute.NewSet(all...))}
}

// planPoints are the ObserveOptions of one plan's data points.
type planPoints struct {
	decisions [2][][]metric.ObserveOption // [denied, allowed][source]
	plan      []metric.ObserveOption      // of the data points with the plan alone
}

// planOpts returns the ObserveOptions of a plan's data points.
func (in *instruments) planOpts(p tollgate.PlanStats) planPoints {
	var pp planPoints
	for a, decision := range []string{"denied", "allowed"} {
		for src := range p.Allowed {
			pp.decisions[a] = append(pp.decisions[a], in.opts(attribute.String("plan", p.Plan),
				attribute.String("decision", decision), attribute.String("source", tollgate.Source(src).String())))
		}
	}
	pp.plan = in.opts(attribute.String("plan", p.Plan))
	return pp
}

// observe is the callback: it reads the Stats once and observes every
// instrument from them. The SDK may call it from several readers at once;
// it writes nothing shared.
func (in *instruments) observe(_ context.Context, o metric.Observer) error {
	s := in.lim.Stats()
	for _, p := range s.Plans {
		pp, ok := in.plans[p.Plan] // read only: safe from concurrent callbacks
		if !ok {                   // a plan that SetPlans or AllowPlans added
			pp = in.planOpts(p)
		}
		for src := range p.Allowed {
			o.ObserveInt64(in.decisions, clamp(p.Denied[src]), pp.decisions[0][src]...)
			o.ObserveInt64(in.decisions, clamp(p.Allowed[src]), pp.decisions[1][src]...)
		}
		o.ObserveInt64(in.shadow, clamp(p.ShadowDenied), pp.plan...)
		o.ObserveInt64(in.held, p.PermitsHeld, pp.plan...)
	}

	o.ObserveFloat64(in.duration, s.StoreTime.Seconds(), in.base...)
	o.ObserveInt64(in.calls, clamp(s.StoreCalls), in.base...)
	for _, class := range commonErrorClasses {
		if _, ok := s.StoreErrors[class]; !ok {
			o.ObserveInt64(in.storeErrors, 0, in.classes[class]...)
		}
	}
	for class, v := range s.StoreErrors {
		opts, ok := in.classes[class] // read only: safe from concurrent callbacks
		if !ok {
			opts = in.opts(attribute.String("class", class))
		}
		o.ObserveInt64(in.storeErrors, clamp(v), opts...)
	}

	var outage int64
	if s.Outage {
		outage = 1
	}
	o.ObserveInt64(in.fallback, outage, in.base...)
	o.ObserveInt64(in.breaker, int64(s.Breaker), in.base...)
	o.ObserveInt64(in.transitions, clamp(s.BreakerClosed), in.transitionsTo[0]...)
	o.ObserveInt64(in.transitions, clamp(s.BreakerOpened), in.transitionsTo[1]...)
	o.ObserveInt64(in.transitions, clamp(s.BreakerHalfOpened), in.transitionsTo[2]...)
	o.ObserveInt64(in.scriptLoads, max(s.ScriptLoads, 0), in.base...)
	rs := s.Reservations
	for i, v := range [3]uint64{rs.Held, rs.Settled, rs.Expired} {
		o.ObserveInt64(in.holds, clamp(v), in.holdEvents[i]...)
	}
	for i, v := range [3]uint64{rs.Refunded, rs.Charged, rs.Uncharged} {
		o.ObserveInt64(in.holdTokens, clamp(v), in.holdKinds[i]...)
	}
	o.ObserveInt64(in.fleetSize, s.FleetSize, in.base...)
	ps := s.Permits
	for i, v := range [7]uint64{ps.Granted, ps.Refused, ps.Released, ps.Lost, ps.Unreleased, ps.Reclaimed, ps.Adopted} {
		o.ObserveInt64(in.permits, clamp(v), in.permitEvents[i]...)
	}
	return nil
}

// clamp converts a counter to the int64 of OpenTelemetry's instruments.
func clamp(v uint64) int64 {
	return int64(min(v, math.MaxInt64))
}
