package tollgate

import (
	"context"
	"errors"
	"net"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// holdBackTimeout bounds the give-back of a hold whose call failed, all
// its tries together.
const holdBackTimeout = 5 * time.Second

// holdBackPause is the pause before a give-back's second try; it doubles
// after each try, up to a second.
const holdBackPause = 50 * time.Millisecond

// mayHaveRun reports whether a script call that failed with err may have
// run in Redis all the same, or may run yet: its reply was lost (a
// timeout, a connection that broke, a context that ended while it was
// sent or awaited), or unreadable. An error Redis answered ends the call,
// whose script then set no hold; a connection that could not be made, and
// a client closed or out of connections, sent nothing.
func mayHaveRun(err error) bool {
	var rerr *redisscript.Error
	var nerr *net.OpError
	switch {
	case errors.As(err, &rerr),
		errors.Is(err, redis.ErrPoolTimeout), errors.Is(err, redis.ErrClosed),
		errors.As(err, &nerr) && nerr.Op == "dial":
		return false
	}
	return true
}

// giveBackLater gives back the hold of o, whose script call failed but
// may have run, by the hold's id: a settlement of none used, on a
// goroutine that the hold's Limiter's Close waits for, on a context of its
// own with ctx's values, tried until it succeeds or holdBackTimeout
// passes, each try further apart (retryGiveBack). Whichever
// of the hold's call and the give-back reaches Redis first, the tokens
// come back once: a live hold is refunded (capped at a full bucket) and
// leaves a tombstone, a hold not there yet leaves one too, and the hold's
// call takes nothing for a hold whose key exists. Shadowed plans are not
// refunded, since a shadowed plan that would have denied took nothing:
// this never mints, and may leave a shadowed plan's bucket short of the
// tokens.
func (s *RedisStore) giveBackLater(ctx context.Context, o settleOp) {
	h := *o.hold // the caller's is the Reservation's, which it keeps
	h.skip = shadowMask(o.plans)
	o.hold, o.used = &h, 0
	h.backs.add()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), holdBackTimeout)
	go func() {
		defer cancel()
		defer h.backs.done()
		retryGiveBack(ctx, func() error {
			_, _, err := s.settle(ctx, o)
			return err
		})
	}()
}
