package breaker

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// callerError marks an error of the caller's own doing (its context), which
// must reach the caller as it is and never count against Redis.
type callerError struct{ err error }

func (e callerError) Error() string { return e.err.Error() }

// deadlineSlack is how close to its deadline a caller may be for a Redis
// call that timed out to count as cut short by the caller.
const deadlineSlack = time.Millisecond

// run runs the script for key with in, behind the store breaker, and
// updates the key's memo from the reply. It returns the reply and the memo
// (created if m was nil and the call succeeded). A failure of the caller's
// doing comes back as a callerError; any other error is Redis's, already
// counted.
func (b *Shared) run(ctx context.Context, key string, m *memo, in input, start int64) (reply, *memo, error) {
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
		var rerr *redisscript.Error
		answered := errors.As(err, &rerr) || errors.Is(err, redisscript.ErrBadReply)
		cerr := ctx.Err()
		if cerr == nil && !answered {
			if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= deadlineSlack {
				cerr = context.DeadlineExceeded
			}
		}
		if cerr != nil && !answered {
			if probe {
				b.health.AbandonIn(gen)
			}
			return reply{}, m, callerError{cerr}
		}
		b.stats.storeErrors.Add(1)
		if b.health.FailureIn(gen) && b.outage.CompareAndSwap(0, time.Now().UnixNano()) {
			b.log.Warn("tollgate/breaker: Redis failing; deciding by failure policy until it recovers",
				"policy", b.policy.String(), "error", err)
		}
		return reply{}, m, err
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
