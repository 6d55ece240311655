package tollgate

import (
	"context"
	"errors"
	"sync"
	"time"
)

// giveBacks counts a Limiter's give-backs under way, for Close to wait
// for. Unlike a sync.WaitGroup, it may count a new one while a wait is
// under way. The zero value counts none; a nil *giveBacks counts nothing.
type giveBacks struct {
	mu   sync.Mutex
	n    int
	idle chan struct{} // closed when n drops to 0; nil while nobody waits
}

// add counts a give-back that starts.
func (g *giveBacks) add() {
	if g == nil {
		return
	}
	g.mu.Lock()
	g.n++
	g.mu.Unlock()
}

// done counts a give-back that ended.
func (g *giveBacks) done() {
	if g == nil {
		return
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.n--; g.n == 0 && g.idle != nil {
		close(g.idle)
		g.idle = nil
	}
}

// wait returns once no give-back is under way.
func (g *giveBacks) wait() {
	g.mu.Lock()
	if g.n == 0 {
		g.mu.Unlock()
		return
	}
	if g.idle == nil {
		g.idle = make(chan struct{})
	}
	idle := g.idle
	g.mu.Unlock()
	<-idle
}

// retryGiveBack calls try until it returns nil or ctx ends, pausing
// holdBackPause after the first try, twice that after the next, up to a
// second.
func retryGiveBack(ctx context.Context, try func() error) {
	for pause := holdBackPause; try() != nil; pause = min(2*pause, time.Second) {
		t := time.NewTimer(pause)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return
		}
	}
}

// giveBack settles r, a hold the Limiter took for itself (a lease, or a
// Reserve whose caller left), with used tokens used, which gives the rest
// back: on a goroutine that Close waits for, on a context of its own with
// ctx's values, tried until the store that granted r settles it or
// holdBackTimeout passes (retryGiveBack). No failure policy
// answers one that refunds: a refund it dropped would leave the hold's
// tokens taken in Redis while it may be healthy (a stall of this process,
// a breaker tripped by one), and the hold's id makes a second try refund
// nothing twice. One of all its tokens used refunds nothing, whoever
// settles it.
func (l *Limiter) giveBack(ctx context.Context, r *Reservation, used int64) {
	l.backs.add()
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), holdBackTimeout)
	go func() {
		defer l.backs.done()
		defer cancel()
		retryGiveBack(ctx, func() error {
			_, err := r.settle(ctx, used, used < r.n)
			switch {
			case errors.Is(err, ErrNotHeld): // settled by an earlier try, whose reply was lost
				l.stats.reservations.settled.Add(1)
				return nil
			case errors.Is(err, ErrHoldExpired):
				return nil
			}
			return err
		})
	}()
}
