package tollgate

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"sync"
	"time"
)

// defaultPermitLease is how long a permit lives without a renewal unless
// WithPermitLease says otherwise.
const defaultPermitLease = 5 * time.Second

// The shortest and longest WithPermitLease: a renewal every third of the
// lease must fit a round trip, and a dead holder's permits must come back
// in hours, not days.
const (
	minPermitLease = 30 * time.Millisecond
	maxPermitLease = time.Hour
)

// Permit is the outcome of Acquire: when granted, n permits of each
// concurrency plan of a key, held until Release, and the tokens of the
// other plans, taken. It is safe for concurrent use; it is released at
// most once.
//
// While it is held, its Limiter renews its lease in the store every
// third of WithPermitLease, in one call per key for all the permits it
// holds there. A permit whose holder dies, or cannot reach the store,
// stops being renewed: its lease ends, and its permits go to others.
type Permit struct {
	l      *Limiter
	key    string
	n      int64
	plans  []Plan // the concurrency plans, as decided
	result Result
	grant  permit

	mu         sync.Mutex
	released   bool  // by Release, or the store found it lost
	lost       bool  // the store found its lease ended
	releasedAt int64 // when Release's store call ran, in µs of the store's clock; 0 before, or if it failed
}

// permit is what Acquire asks of the store that decides it: to hold its
// permits under a new holder id, for a lease. The store that grants it
// fills in which store it is.
type permit struct {
	id        string        // 128 random bits in hex: unguessable, so no one else releases them
	lease     time.Duration // how long the permits live without a renewal
	store     Store         // the store that granted them; nil when none did (FailOpen, exempt)
	decidedAt int64         // when a RedisStore decided, granted or not: the Redis TIME its call read, in µs; else 0

	backs *giveBacks // the Limiter's, which a release of a lost reply joins
}

// newPermitID returns a new holder id.
func newPermitID() string {
	var b [16]byte
	_, _ = rand.Read(b[:]) // never fails (crypto/rand)
	return hex.EncodeToString(b[:])
}

// permitOp is what a store is asked to do with permits on the
// concurrency plans of key: renew each holder's for lease, or, for a
// lease of 0, release them; or, to adopt, add each holder's for lease,
// held elsewhere, whether it holds them or not and whatever its count.
type permitOp struct {
	key     string
	plans   []Plan
	lease   time.Duration
	holders []permitHolder
	adopt   bool
}

// permitHolder is one holder's part of a permitOp: its id, the permits
// it holds of each plan, and the plans it holds them of, bit i for
// permitOp.plans[i].
type permitHolder struct {
	id   string
	n    int64
	mask uint64
}

// permitStore is a store that holds permits of concurrency plans
// (Limiter.Acquire): it releases and renews them, and replies what it
// found.
type permitStore interface {
	permits(ctx context.Context, o permitOp) (permitReply, error)
}

// permitReply is a permitStore's reply to a permitOp.
type permitReply struct {
	now       int64  // when the store decided, in µs of its clock
	live      []bool // per holder: it still held all its permits, alive
	reclaimed int64  // permits whose lease had ended, which it removed first
}

// Acquire takes n permits of each concurrency plan (Plan.Concurrency)
// among the named plans for key, and n tokens of every other, all or
// none, in one atomic step, and returns the Permit that holds them. A
// Permit that is not OK took nothing; one that is must be released
// (Permit.Release) once the work it guards is done.
//
// A refusal by a full concurrency plan has a Result whose RetryAfter is 0:
// a permit comes back when its holder releases it, on no schedule. Naming
// no concurrency plan is ErrInvalidPlan, as is naming one in Allow, Peek or
// Reserve. n must be 1 to the smallest capacity of the enforced plans
// (ErrInvalidCost). A key that a plan resolver exempts (ErrExempt) from
// every concurrency plan named takes the tokens of the plans left, and its
// Permit holds no permit. On a store, or a fallback store, that cannot hold
// permits (one of another package), New and SetPlans refuse concurrency
// plans with errors.ErrUnsupported, and Acquire returns it.
//
// While the store fails, the failure policy decides: Fallback grants
// permits in the fallback store, from this instance's share of each plan
// (WithFleet) less the permits of the store it still holds, and moves
// them into the store once it answers again, so that it counts them;
// FailOpen grants a Permit that holds nothing; FailClosed returns
// ErrStoreUnavailable. A call whose reply was lost is released by its
// holder id in the background; if it reaches the store after that, its
// permits live until their lease ends.
func (l *Limiter) Acquire(ctx context.Context, key string, n int64, plans ...string) (*Permit, error) {
	if !l.permitsHeld {
		return nil, errUnsupported(modeAcquire)
	}
	p := &Permit{l: l, key: key, n: n, grant: permit{id: newPermitID(), lease: l.permitLease, backs: &l.backs}}
	q := &request{op: op{key: key, n: n, mode: modeAcquire, grant: &p.grant}}
	if err := l.named(ctx, &p.result, q, plans); err != nil {
		return nil, err
	}
	l.stats.permits.acquired(&p.result)
	if p.result.Allowed && p.grant.store != nil {
		p.plans = concurrencyOf(q.plans)
		l.book.add(p)
	}
	return p, nil
}

// concurrencyOf returns the concurrency plans of plans.
func concurrencyOf(plans []Plan) []Plan {
	var out []Plan
	for _, p := range plans {
		if p.Concurrency {
			out = append(out, p)
		}
	}
	return out
}

// OK reports whether the permits were granted; false for a nil Permit,
// which Acquire returns with an error.
func (p *Permit) OK() bool { return p != nil && p.result.Allowed }

// Result returns the decision Acquire made. For a concurrency plan,
// Limit is its capacity and Remaining its permits that no holder held
// after the decision. A nil Permit's is the zero Result.
func (p *Permit) Result() Result {
	if p == nil {
		return Result{}
	}
	return p.result
}

// Release gives the permits back, in one call to the store that granted
// them, on a context of its own (a caller whose context ended still
// releases), bounded by ctx's deadline or 2 seconds, whichever is later.
//
// Errors: ErrNotHeld for a Permit that was not granted (a nil one too, so
// that a deferred Release before the error check is safe), or released
// before; ErrPermitLost when its lease ended before it was renewed or
// released, so that its permits may have gone to others; and the store's
// failure, wrapped in ErrStoreUnavailable: the permits are then no longer
// renewed, and come back when their lease ends. A Permit granted by
// FailOpen, or to an exempt key, holds nothing, and its Release returns
// nil.
func (p *Permit) Release(ctx context.Context) error {
	if !p.OK() {
		return ErrNotHeld
	}
	store, err := p.take()
	if err != nil || store == nil {
		return err
	}
	p.l.book.remove(p)
	ctx, cancel := detach(ctx, detachTimeout)
	defer cancel()
	reply, err := store.(permitStore).permits(ctx, opOf([]*Permit{p}, 0))
	p.l.stats.permits.reclaimed.Add(uint64(reply.reclaimed))
	p.mu.Lock()
	p.releasedAt = reply.now
	p.mu.Unlock()
	switch {
	case err != nil:
		p.l.stats.permits.unreleased.Add(1)
		return fmt.Errorf("%w: %w", ErrStoreUnavailable, err)
	case !reply.live[0]:
		p.l.stats.permits.lost.Add(1)
		return ErrPermitLost
	}
	p.l.stats.permits.released.Add(1)
	return nil
}

// take marks p released, once, and returns the store that granted it
// (nil for none), or why there is nothing to release: ErrNotHeld after a
// release, ErrPermitLost once the store found its lease ended. The store
// call is made after, without p's lock: a Close waits for no release.
func (p *Permit) take() (Store, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	switch {
	case p.released:
		return nil, ErrNotHeld
	case p.lost:
		p.released = true
		return nil, ErrPermitLost
	}
	p.released = true
	return p.grant.store, nil
}

// markLost records that the store found p's lease ended, and reports
// whether p was still held: a Permit released meanwhile was not lost.
func (p *Permit) markLost() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.released || p.lost {
		return false
	}
	p.lost = true
	return true
}

// errNoPermitPlan is the error of an Acquire that names no concurrency
// plan, and of a decision other than Acquire that names one.
var errNoPermitPlan = errors.New("only Acquire takes concurrency plans, and Acquire needs one")

// errShadowedPermits is the error of WithShadow on a concurrency plan: a
// shadowed plan never denies, and a permit it granted beyond the capacity
// would have to be released like any other.
var errShadowedPermits = fmt.Errorf("%w: WithShadow cannot shadow a concurrency plan", ErrInvalidPlan)

// errKindOfPermits is the error of a plan that would become, or stop
// being, a concurrency plan under the same name (SetPlans, a resolver,
// AllowPlans): its callers Acquire or Allow by its kind, and would fail
// on every call.
func errKindOfPermits(name string) error {
	return fmt.Errorf("%w: plan %q cannot become or stop being a concurrency plan; give it a new name", ErrInvalidPlan, name)
}

// errKindOfDefault is SetPlans's error for a first plan whose kind is not
// the old first plan's: the callers that name no plan Acquire or Allow by
// its kind, and would fail on every call.
var errKindOfDefault = fmt.Errorf("%w: the first plan cannot become or stop being a concurrency plan", ErrInvalidPlan)
