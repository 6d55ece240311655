package tollgate

import (
	"context"
	"sync/atomic"
	"time"
)

// detachTimeout bounds a store call made on a context of its own (detach)
// beyond its caller's deadline: a Reserve's once its caller has given up
// waiting for it (the hold is then given back), a Settle's and a
// Release's, so that a caller whose context ended (a client that hung up)
// still settles or gives its permits back.
const detachTimeout = 2 * time.Second

// handoff settles who owns the outcome of a store call made on a context
// of its own for a caller that may give up waiting: the caller, if the
// call claims it first, or else the call, which must then keep or give
// back what it took.
type handoff struct {
	state atomic.Int32 // 0 open, 1 claimed for the caller, 2 abandoned by it
	done  chan struct{}
}

// claim reports whether the caller still waits, and keeps it waiting for
// the outcome.
func (h *handoff) claim() bool {
	return h.state.CompareAndSwap(0, 1) || h.state.Load() == 1
}

// abandon reports whether the caller gave up before the call claimed it.
func (h *handoff) abandon() bool {
	return h.state.CompareAndSwap(0, 2)
}

// detach returns a context with ctx's values but not its cancellation,
// for a store call whose outcome must not be lost when its caller gives
// up: it ends d from now, or at ctx's deadline if that is later.
// The detached context keeps ctx, so that a failure of the call while its
// caller still waits is judged by the caller's context (callerOf): the
// detached context's own bound ending is then not the caller's doing.
func detach(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	end := time.Now().Add(d)
	if dl, ok := ctx.Deadline(); ok && dl.After(end) {
		end = dl
	}
	dctx, cancel := context.WithDeadline(context.WithoutCancel(ctx), end)
	return context.WithValue(dctx, callerKey{}, ctx), cancel
}

// callerKey is the key under which a detached context keeps its caller's.
type callerKey struct{}

// callerOf returns the context of the caller a store call under ctx is
// made for: the one a detached ctx keeps, or ctx itself.
func callerOf(ctx context.Context) context.Context {
	if c, ok := ctx.Value(callerKey{}).(context.Context); ok {
		return c
	}
	return ctx
}

// reserve decides r, a reservation of the named plans, and counts it if
// granted: on a store that can fail, on a context of its own.
func (l *Limiter) reserve(ctx context.Context, r *Reservation, plans []string) error {
	if l.mem == nil {
		return l.reserveDetached(ctx, r, plans)
	}
	if err := l.named(ctx, &r.result, r.request(), plans); err != nil {
		return err
	}
	l.held(r)
	return nil
}

// reserveDetached decides r, a reservation of the named plans on a store
// that can fail, on a context of its own, on a goroutine that Close waits
// for: a caller whose ctx ends first gets its error at once, and a hold
// granted without it is given back, so that no hold whose reply was
// dropped keeps its tokens.
func (l *Limiter) reserveDetached(ctx context.Context, r *Reservation, plans []string) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	w := &handoff{done: make(chan struct{})}
	var err error // the decision's, the caller's once w.done is closed
	rctx, cancel := detach(ctx, detachTimeout)
	l.backs.add() // Close waits for a hold that may be given back
	go func() {
		defer l.backs.done()
		defer cancel()
		derr := l.named(rctx, &r.result, r.request(), plans)
		if derr == nil {
			l.held(r)
		}
		if w.claim() {
			err = derr
			close(w.done)
			return
		}
		if derr == nil && r.result.Allowed {
			l.giveBack(rctx, r, 0)
		}
	}()
	select {
	case <-w.done:
	case <-ctx.Done():
		if w.abandon() {
			return ctx.Err()
		}
		<-w.done // claimed: the reservation is the caller's
	}
	return err
}
