package tollgate

import "time"

// Observer receives what a Limiter and a RedisStore do, for metrics. The
// adapters in the observability modules implement it for Prometheus and
// OpenTelemetry; its methods are called synchronously on the caller's
// goroutine, so they must be fast and safe for concurrent use. Embed
// NopObserver to implement only some methods. With no Observer set,
// observing costs nothing.
//
// ObserveFallback and ObserveBreaker are called under a lock that keeps
// their reports in the order of the changes they report, so a gauge that
// follows them ends on the true state; they must not call back into the
// Limiter. The other methods are called under no lock of tollgate's.
type Observer interface {
	// ObserveDecision reports one decision of Allow, AllowN, Peek or Wait
	// that returned no error.
	ObserveDecision(Decision)
	// ObserveStore reports one call to the Limiter's store: how long it
	// took, and the store's failure: nil when the store answered, and also
	// when the call ended for the caller's own reasons (bad input, its
	// context cancelled or past its deadline), which are not failures.
	// Calls the breaker skipped are not reported.
	ObserveStore(elapsed time.Duration, err error)
	// ObserveFallback reports that the store started failing (true) or
	// recovered (false): once per outage each, like the log lines.
	ObserveFallback(active bool)
	// ObserveBreaker reports a transition of the circuit breaker.
	ObserveBreaker(from, to BreakerState)
	// ObserveScriptLoad reports that a RedisStore reloaded its script after
	// Redis answered NOSCRIPT.
	ObserveScriptLoad()
}

// Decision describes one decision for an Observer. It never holds the
// key: keys may be personal data and have unbounded cardinality.
type Decision struct {
	// Plan is the binding plan's name (see Result).
	Plan string
	// Allowed reports whether the tokens were taken.
	Allowed bool
	// Source tells who decided.
	Source Source
	// Cost is the tokens asked for; 0 for Peek.
	Cost int64
}

// NopObserver is an Observer that does nothing, to embed in observers
// that implement only some methods.
type NopObserver struct{}

// ObserveDecision does nothing.
func (NopObserver) ObserveDecision(Decision) {}

// ObserveStore does nothing.
func (NopObserver) ObserveStore(time.Duration, error) {}

// ObserveFallback does nothing.
func (NopObserver) ObserveFallback(bool) {}

// ObserveBreaker does nothing.
func (NopObserver) ObserveBreaker(BreakerState, BreakerState) {}

// ObserveScriptLoad does nothing.
func (NopObserver) ObserveScriptLoad() {}
