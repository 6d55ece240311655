package redisscript

import (
	"context"
	"errors"
	"time"
)

// DeadlineSlack is how close to its deadline a caller may be for a call
// that timed out to count as cut short by the caller: a client may time
// out at the deadline a moment before the context's own timer marks it
// done.
const DeadlineSlack = time.Millisecond

// CutShort judges a call to Redis under ctx that failed with err. It
// returns ctx's error if ctx has ended, or context.DeadlineExceeded if
// err is no answer and ctx's deadline is within DeadlineSlack; nil
// otherwise. answered reports whether Redis answered err (an *Error, or
// ErrBadReply), which no deadline produced.
func CutShort(ctx context.Context, err error) (cerr error, answered bool) {
	var rerr *Error
	answered = errors.As(err, &rerr) || errors.Is(err, ErrBadReply)
	cerr = ctx.Err()
	if cerr == nil && !answered {
		if dl, ok := ctx.Deadline(); ok && time.Until(dl) <= DeadlineSlack {
			cerr = context.DeadlineExceeded
		}
	}
	return cerr, answered
}
