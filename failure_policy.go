package tollgate

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// This file holds the step of a decision that asks a store that can fail:
// behind its breaker, judging each failure (the caller's, the store's, or
// this process's stall), and deciding by the failure policy while the
// store fails.

// errBreakerOpen is the cause of ErrStoreUnavailable while the breaker
// keeps calls from the store.
var errBreakerOpen = errors.New("circuit breaker open")

// ask has the store, one that can fail, decide o into *r behind its
// breaker, timed from start (the Limiter's clock). While it fails, the
// failure policy decides instead.
func (l *Limiter) ask(ctx context.Context, r *Result, o *op, start int64) error {
	n := l.health.forKey(ctx, o.key, o.plans)
	gen, ok, probe := n.b.Admit()
	if !ok {
		return l.degrade(ctx, r, o, errBreakerOpen)
	}
	asked := *o
	if o.mode == modeAcquire && l.fallback != nil {
		// The permits the fallback granted while the store failed count
		// until a renewal moves them into the store.
		asked.plans = l.lessHeld(o.plans, o.key, l.fallback)
	}
	callerErr, storeErr := l.call(ctx, r, pass{n, gen, probe, start}, func() (err error) {
		*r, err = l.decider.decide(ctx, asked)
		return err
	})
	switch {
	case callerErr != nil:
		*r = Result{}
		return callerErr
	case storeErr != nil:
		return l.degrade(ctx, r, o, storeErr)
	}
	return nil
}

// pass is a store call the breaker let through: the breaker's node, the
// generation the call began in (its outcome counts only in that one),
// whether the call is its probe, and when the decision asked, on the
// Limiter's clock.
type pass struct {
	n     *node
	gen   uint64
	probe bool
	start int64
}

// call makes fn, a call to the store that puts its outcome in *r, times
// it, and judges a failure: the breaker hears it, unless the caller's own
// doing ended the call. It returns the error the caller gets instead of
// an answer, or the store's failure, for the failure policy to answer.
func (l *Limiter) call(ctx context.Context, r *Result, p pass, fn func() error) (callerErr, storeErr error) {
	b, probe, start := p.n.b, p.probe, p.start
	// A probe must end in SuccessIn, FailureIn or AbandonIn, or the breaker stays
	// half-open for ever: also when the store panics or its goroutine
	// exits (runtime.Goexit, which recover does not see). Every way out
	// after the store returns ends it.
	returned := false
	if probe {
		defer func() {
			if !returned {
				b.AbandonIn(p.gen)
			}
		}()
	}
	err := fn()
	returned = true
	now := l.now()
	elapsed := time.Duration(now - start)
	if err == nil {
		l.stats.storeCall(r, elapsed, nil)
		if now-p.n.heard.Load() > int64(time.Millisecond) {
			p.n.heard.Store(now) // to the ms: a write per call would make cores wait
		}
		b.SuccessIn(p.gen)
		if l.outage.active() {
			l.recovered(now)
		}
		return nil, nil
	}
	since := l.askedSince(p)
	callerErr, storeFailed := l.blame(ctx, err, now, since)
	if storeFailed && l.stalled(err, start, now, since) {
		// Not the store's failure, and not the caller's doing: the failure
		// policy answers this call, and the breaker hears nothing.
		l.stats.storeCall(r, elapsed, errStalled)
		if probe {
			b.AbandonIn(p.gen)
		}
		if callerErr != nil {
			return callerErr, nil
		}
		return nil, err
	}
	if !storeFailed {
		l.stats.storeCall(r, elapsed, nil)
		if probe {
			b.AbandonIn(p.gen)
		}
		return callerErr, nil
	}
	l.stats.storeCall(r, elapsed, err)
	l.outage.failed(now)
	if b.FailureIn(p.gen) {
		l.tripped(err)
	}
	if callerErr != nil {
		return callerErr, nil
	}
	return nil, err
}

// askedSince returns the instant (the Limiter's clock) since which the
// store, or p's master of it, has been asked without an answer, as far as
// call p can tell: the last call through p's breaker that succeeded (on a
// Cluster, another master's answers tell nothing of this one's) or, for a
// probe, the probe's start, for the breaker kept every call from the store
// until then and none could succeed.
func (l *Limiter) askedSince(p pass) int64 {
	since := p.n.heard.Load()
	if p.probe {
		since = max(since, p.start)
	}
	return since
}

// blame judges a store call that failed with err at now (the Limiter's
// clock), the store asked without an answer since since (see askedSince). It returns the error to give the caller instead of a decision,
// nil when the failure policy should decide, and whether the store failed.
//
//   - Bad input is the caller's alone.
//   - An error Redis answered (OOM, READONLY, a bad reply) is the store's,
//     however close the caller's deadline.
//   - A call that ended after the caller's context did, or that timed out
//     within redisscript.DeadlineSlack of the caller's deadline, was cut short by the
//     caller: the caller gets its context's error, and the store is not
//     blamed, so that impatient callers cannot open the breaker on a
//     healthy store. Unless the store has been asked for a cooldown
//     without a success: then it is hung or too slow for every caller,
//     and is blamed too.
func (l *Limiter) blame(ctx context.Context, err error, now, since int64) (callerErr error, storeFailed bool) {
	if isCallerError(err) {
		return err, false
	}
	callerErr, answered := cutShort(ctx, err)
	if callerErr == nil {
		return nil, true
	}
	starved := now-since >= int64(l.health.settings.Cooldown)
	return callerErr, answered || starved
}

// cutShort judges a store call under ctx that failed with err: it returns
// the error its caller gets if the caller's context cut it short (see
// blame), else nil, and whether the store answered err (an error Redis
// answered, or a bad reply), which no deadline produced.
func cutShort(ctx context.Context, err error) (callerErr error, answered bool) {
	if c := callerOf(ctx); c.Err() == nil {
		ctx = c // a detached call's own bound ending is not its waiting caller's doing
	}
	cerr, answered := redisscript.CutShort(ctx, err)
	switch {
	case cerr == nil:
		return nil, answered
	case errors.Is(err, cerr):
		return err, answered
	}
	return cerr, answered
}

// degrade decides o by the failure policy, without the store, into *r.
// The fallback store decides on this instance's share of each plan
// (WithFleet), which holds at least the tokens asked about. A fallback of
// another process whose call the caller's context cut short gives the
// caller its context's error, as the store would.
func (l *Limiter) degrade(ctx context.Context, r *Result, o *op, cause error) error {
	switch l.policy {
	case breaker.FailOpen:
		*r = failOpenResult(o.plans)
		return nil
	case breaker.FailClosed:
		*r = Result{}
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, cause)
	}
	share := *o
	share.plans = shareOf(o.plans, l.fleetSize(), o.n)
	if o.mode == modeAcquire {
		// Counted and decided while no permit moves into the store.
		l.book.fallback.Lock()
		defer l.book.fallback.Unlock()
		share.plans = l.lessHeld(share.plans, o.key, l.store)
		// Under an id of its own: a release of the store's call, whose
		// reply was lost, may still come, and must not free these.
		o.grant.id = newPermitID()
	}
	var err error
	if *r, err = l.fallbackDecider.decide(ctx, share); err != nil {
		*r = Result{}
		if callerErr, _ := cutShort(ctx, err); callerErr != nil {
			return callerErr // a fallback of another process cut short by its caller
		}
		return fmt.Errorf("%w: fallback store failed too: %w", ErrStoreUnavailable, err)
	}
	r.Source = SourceFallback
	return nil
}

// tripped logs the start of an outage when the breaker trips, once: a
// partial outage trips the breaker again after each probe that closed it,
// and those trips are counted for the line that ends the outage.
func (l *Limiter) tripped(err error) {
	l.outage.order.Lock()
	began := l.outage.begin(time.Now().UnixNano())
	if began {
		l.outage.queue(slog.LevelWarn, "tollgate: store failing; deciding by failure policy until it recovers",
			"policy", l.policy.String(), "error", err)
	}
	l.outage.order.Unlock()
	if began {
		l.outage.flush(l.log)
	}
}

// recovered logs the end of an outage, once: at a success when the breaker
// is closed and no call has failed for two cool-downs before now (the
// Limiter's clock).
func (l *Limiter) recovered(now int64) {
	quiet := 2 * int64(l.health.settings.Cooldown)
	if !l.health.closed() || !l.outage.quiet(now, quiet) {
		return
	}
	l.outage.order.Lock()
	start, failed, trips, ok := l.outage.end(now, quiet)
	if ok {
		l.outage.queue(slog.LevelInfo, "tollgate: store recovered", "outage", time.Duration(time.Now().UnixNano()-start),
			"failed_calls", failed, "trips", trips)
	}
	l.outage.order.Unlock()
	if ok {
		l.outage.flush(l.log)
	}
}
