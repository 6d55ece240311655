package breaker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// callerError marks an error of the caller's own doing (its context), which
// must reach the caller as it is and never count against Redis. answer is
// the error Redis answered meanwhile, if it did: that one counted against
// Redis.
type callerError struct{ err, answer error }

func (e callerError) Error() string { return e.err.Error() }

// Unwrap returns the error Redis answered, if it did, or nil.
func (e callerError) Unwrap() error { return e.answer }

// run runs the script for key with in, behind the store breaker, and
// updates the key's memo from the reply. It returns the reply and the memo
// (created if m was nil and the call succeeded). A call cut short by its
// caller comes back as a callerError; any other error is Redis's. Each is
// counted as failed says. A context that has ended before the call is
// the caller's error and asks nothing, of Redis or of the store breaker.
func (b *Shared) run(ctx context.Context, key string, m *memo, in input, start int64) (reply, *memo, error) {
	if err := ctx.Err(); err != nil {
		return reply{}, m, callerError{err: err}
	}
	gen, ok, probe := b.health.Admit()
	if !ok {
		return reply{}, m, errStoreBreakerOpen
	}
	rkey := ""
	if m != nil {
		rkey = m.rkey
	} else {
		rkey = b.Key(key)
	}
	r, err := b.eval(ctx, rkey, in, probe, gen)
	if err != nil {
		return reply{}, m, b.failed(ctx, err, probe, gen, start)
	}
	if now := b.now(); now-b.heard.Load() > int64(time.Millisecond) {
		b.heard.Store(now) // to the ms: a write per call would make cores wait
	}
	b.health.SuccessIn(gen)
	if b.health.State() == Closed {
		if began := b.outage.Swap(0); began != 0 {
			b.log.Info("tollgate/breaker: Redis recovered", "outage", time.Duration(time.Now().UnixNano()-began))
		}
	}
	if b.nlocal.Load() > 0 {
		b.dropLocal(key) // Redis's state wins again
	}
	if m == nil {
		m = b.newMemo(key, rkey)
	}
	b.learn(key, m, r, in, start)
	return r, m, nil
}

var errStoreBreakerOpen = errors.New("store breaker open")

// failed judges a call to Redis of the store breaker's generation gen,
// begun at start (the instance's clock), that failed with err, and returns
// the error run returns. A call cut short by its caller's context is the
// caller's: it comes back as a callerError, and the store breaker hears
// nothing, so that impatient callers cannot open it on a healthy Redis.
// Unless Redis has been asked for a cooldown without an answer (silent):
// then it is hung or too slow for every caller, and the store breaker
// hears a failure too. Any other failure is Redis's; an error Redis
// answered to a caller whose context ended meanwhile is Redis's failure
// and the caller's error, which the caller gets.
func (b *Shared) failed(ctx context.Context, err error, probe bool, gen uint64, start int64) error {
	cerr, answered := redisscript.CutShort(ctx, err)
	cut := cerr != nil && !answered
	if cut && !b.silent(probe, start) {
		if probe {
			b.health.AbandonIn(gen)
		}
		return callerError{err: cerr}
	}
	b.stats.storeErrors.Add(1)
	if b.health.FailureIn(gen) && b.outage.CompareAndSwap(0, time.Now().UnixNano()) {
		b.log.Warn("tollgate/breaker: Redis failing; deciding by failure policy until it recovers",
			"policy", b.policy.String(), "error", err)
	}
	switch {
	case cut:
		return callerError{err: cerr}
	case cerr != nil:
		return callerError{err: cerr, answer: err}
	}
	return err
}

// silent reports whether Redis has been asked for a store breaker's
// cooldown without an answer, as far as a call begun at start can tell:
// since the last call that succeeded, or the Shared breaker was made, or,
// for a probe, since the probe began, for the store breaker kept every
// call from Redis until then.
func (b *Shared) silent(probe bool, start int64) bool {
	since := b.heard.Load()
	if probe {
		since = max(since, start)
	}
	return b.now()-since >= int64(b.health.Settings().Cooldown)
}

// eval runs the script on rkey with in and reads its reply. A probe of the
// store breaker (of generation gen) that does not return, because the
// client panics or its goroutine exits, is abandoned, or the breaker would
// stay half-open for ever: the next call probes.
func (b *Shared) eval(ctx context.Context, rkey string, in input, probe bool, gen uint64) (r reply, err error) {
	returned := false
	if probe {
		defer func() {
			if !returned {
				b.health.AbandonIn(gen)
			}
		}()
	}
	args := make([]any, 0, 17)
	args = append(args, in.op, in.token, in.gen, in.b.calls, in.b.failures, in.b.slow, in.b.run, boolInt(in.b.succeeded))
	args = append(args, b.p.args()...)
	b.stats.roundTrips.Add(1)
	raw, err := script.Run(ctx, b.c, []string{rkey}, args...)
	returned = true
	if err != nil {
		return reply{}, err
	}
	var buf [replyLen]int64
	vals, err := redisscript.Ints(buf[:0], raw, replyLen)
	if err != nil {
		return reply{}, err
	}
	r = reply{vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], vals[6], vals[7], vals[8], vals[9], vals[10], vals[11]}
	if r.state > stateHalfOpen {
		return reply{}, fmt.Errorf("%w: state %d", redisscript.ErrBadReply, r.state)
	}
	return r, nil
}
