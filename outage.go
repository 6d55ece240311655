package tollgate

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
)

// outage tracks a store outage for the log and Stats: it begins when the
// breaker trips, and ends at a success once no store call has failed for a
// quiet period. In between, a partial outage may close and trip the breaker
// many times; those trips and the failed calls are counted, not logged.
type outage struct {
	start       atomic.Int64  // UnixNano when it began; 0 when there is none
	lastFailure atomic.Int64  // when a store call last failed, on the Limiter's clock
	failures    atomic.Uint64 // failed store calls since it began
	trips       atomic.Uint64 // trips of the breaker since it began

	// order is held from an outage's beginning or end to queueing its
	// line, so that an end is logged before the next beginning. The lines
	// are logged outside it, by one caller at a time (draining): a log
	// handler may call back into the Limiter, and its call may begin or
	// end an outage.
	order    sync.Mutex
	lines    []outageLine
	draining bool
}

// outageLine is a line of the log that an outage's beginning or end
// queued.
type outageLine struct {
	level slog.Level
	msg   string
	args  []any
}

// queue queues a line for flush to log; o.order must be held.
func (o *outage) queue(level slog.Level, msg string, args ...any) {
	o.lines = append(o.lines, outageLine{level, msg, args})
}

// flush logs the lines queued, in order, to log, outside o.order, unless
// another caller is logging them already: that one logs these too, after
// its own. A line queued by a handler that calls back is logged after
// the line it handles.
func (o *outage) flush(log *slog.Logger) {
	o.order.Lock()
	if o.draining {
		o.order.Unlock()
		return
	}
	o.draining = true
	logging := false
	defer func() { // a handler that panics, unlocked: the next flush logs the rest
		if logging {
			o.order.Lock()
			o.draining = false
			o.order.Unlock()
		}
	}()
	for len(o.lines) > 0 {
		ln := o.lines[0]
		o.lines = o.lines[1:]
		o.order.Unlock()
		logging = true
		log.Log(context.Background(), ln.level, ln.msg, ln.args...)
		logging = false
		o.order.Lock()
	}
	o.lines = nil
	o.draining = false
	o.order.Unlock()
}

// failed counts a failed store call at now, on the Limiter's clock.
func (o *outage) failed(now int64) {
	o.lastFailure.Store(now)
	if o.start.Load() != 0 {
		o.failures.Add(1)
	}
}

// begin counts a trip at wall time now, and reports whether it began an
// outage.
func (o *outage) begin(now int64) bool {
	if o.start.Load() != 0 || !o.start.CompareAndSwap(0, now) {
		o.trips.Add(1)
		return false
	}
	o.failures.Store(1) // the call that tripped
	o.trips.Store(1)
	return true
}

// end ends the outage if no call has failed in the quiet nanoseconds
// before clock (the Limiter's clock), and returns when it began (wall
// time) and what it counted. Exactly one caller ends an outage.
func (o *outage) end(clock, quiet int64) (start int64, failures, trips uint64, ok bool) {
	if !o.quiet(clock, quiet) {
		return 0, 0, 0, false
	}
	start = o.start.Swap(0)
	if start == 0 {
		return 0, 0, 0, false
	}
	return start, o.failures.Load(), o.trips.Load(), true
}

// active reports whether an outage is going on.
func (o *outage) active() bool { return o.start.Load() != 0 }

// quiet reports whether no store call has failed in the quiet nanoseconds
// before clock (the Limiter's clock).
func (o *outage) quiet(clock, quiet int64) bool {
	return clock-o.lastFailure.Load() >= quiet
}
