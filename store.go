package tollgate

import (
	"context"
	"fmt"
	"time"

	"github.com/tollgate-go/tollgate/internal/isnil"
)

// Store keeps token buckets and decides on them. RedisStore and MemoryStore
// implement it; a Limiter adds plan names, validation and failure handling
// on top. Implementations must be safe for concurrent use.
type Store interface {
	// Take takes cost tokens from the bucket of every plan for key, or from
	// none of them if any plan lacks the tokens, in one atomic step. A cost
	// of 0 reads the buckets without taking anything. Being limited is
	// reported in the Result, not as an error.
	Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error)

	// Reset makes the buckets of the plans for key full again.
	Reset(ctx context.Context, key string, plans []Plan) error
}

// The interfaces below are the capabilities a store may have beyond Store.
// A Limiter discovers each with one type assertion on an interface, at New
// or where a feature needs it, never by asking for a concrete store: a
// store that lacks one gets errors.ErrUnsupported from the feature that
// needs it.

// decider decides an op the Limiter has checked: a read for n tokens, a
// take, or a hold (Reserve, leases), with the Result by value, so that a
// decision allocates nothing for it.
type decider interface {
	decide(ctx context.Context, o op) (Result, error)
	// self returns the store itself. A store of another package that
	// embeds one of ours gets its methods, but may take differently in its
	// own Take: it is a plain Store, whose own methods decide.
	self() Store
}

// settler settles the holds it granted (Reservation.Settle).
type settler interface {
	settle(ctx context.Context, s settleOp) (Settlement, settleStatus, error)
}

// holdResetter is a store whose Reset also voids the refunds of the holds
// of the key taken before it, by every instance that shares the store, for
// at least keep: the longest such a hold may still be settled.
type holdResetter interface {
	resetHolds(ctx context.Context, key string, plans []Plan, keep time.Duration) error
}

// localStore is a store of this process, which cannot fail: a Limiter asks
// it without a breaker, failure policy or denial cache, and needs no lease
// in front of it.
type localStore interface {
	inProcess()
}

// wiredStore is a store that may have been built with a wiring mistake,
// which New reports.
type wiredStore interface {
	wiringError() error
}

// checkedStore is a store whose Limiter.Check runs a check of its own: a
// decision on plans.
type checkedStore interface {
	check(ctx context.Context, plans []Plan) error
}

// mastersStore is a store spread over masters that fail alone (a Redis
// Cluster): a Limiter keeps one breaker per master.
type mastersStore interface {
	// spread reports whether the store is spread over masters.
	spread() bool
	// masterOf names the master that holds key's bucket of plan.
	masterOf(ctx context.Context, key, plan string) (string, error)
}

// fleetStore is a store that every instance of a fleet shares, and that
// can count them (WithFleet).
type fleetStore interface {
	// heartbeat records instance id as alive for ttl and returns how many
	// instances are.
	heartbeat(ctx context.Context, id string, ttl time.Duration) (int64, error)
}

// scriptStore is a store that counts how often it had to send its scripts'
// source again (Stats.ScriptLoads).
type scriptStore interface {
	ScriptLoads() int64
}

var (
	_ Store        = (*MemoryStore)(nil)
	_ Store        = (*RedisStore)(nil)
	_ decider      = (*MemoryStore)(nil)
	_ decider      = (*RedisStore)(nil)
	_ settler      = (*MemoryStore)(nil)
	_ settler      = (*RedisStore)(nil)
	_ localStore   = (*MemoryStore)(nil)
	_ wiredStore   = (*RedisStore)(nil)
	_ wiredStore   = (*MemoryStore)(nil)
	_ checkedStore = (*RedisStore)(nil)
	_ holdResetter = (*MemoryStore)(nil)
	_ holdResetter = (*RedisStore)(nil)
	_ mastersStore = (*RedisStore)(nil)
	_ fleetStore   = (*RedisStore)(nil)
	_ scriptStore  = (*RedisStore)(nil)
	_ permitStore  = (*MemoryStore)(nil)
	_ permitStore  = (*RedisStore)(nil)
)

// plainStore is a decider for a Store of another package, which takes
// tokens and reads for one token, and can do nothing else.
type plainStore struct{ Store }

func (s plainStore) self() Store { return s.Store }

func (s plainStore) decide(ctx context.Context, o op) (Result, error) {
	switch {
	case o.mode == modeTake:
		return s.Take(ctx, o.key, o.n, o.plans)
	case o.mode == modeRead && o.n == 1:
		return s.Take(ctx, o.key, 0, o.plans)
	}
	return Result{}, errUnsupported(o.mode)
}

// deciderOf returns s as a decider.
func deciderOf(s Store) decider {
	if d, ok := s.(decider); ok && d.self() == s {
		return d
	}
	return plainStore{s}
}

// canRead reports whether s reads for more than one token.
func canRead(s Store) bool {
	_, plain := deciderOf(s).(plainStore)
	return !plain
}

// canHold reports whether s holds reservations and settles them.
func canHold(s Store) bool {
	_, ok := s.(settler)
	return ok && canRead(s)
}

// canPermit reports whether s holds permits of concurrency plans.
func canPermit(s Store) bool {
	_, ok := s.(permitStore)
	return ok && canRead(s)
}

// resetHolds resets the buckets of key for plans in s, as Reset does, and
// voids the refunds of the key's holds taken before, for at least keep,
// where s can (holdResetter).
func resetHolds(ctx context.Context, s Store, key string, plans []Plan, keep time.Duration) error {
	if r, ok := s.(holdResetter); ok && canRead(s) {
		return r.resetHolds(ctx, key, plans, keep)
	}
	return s.Reset(ctx, key, plans)
}

// isLocal reports whether s is a store of this process, which cannot fail.
func isLocal(s Store) bool {
	_, ok := s.(localStore)
	return ok && canRead(s)
}

// wiringError returns the mistake a store was built with, which it would
// otherwise report on every call, or that it is a typed nil. A nil s is
// none: no mistake.
func wiringError(s Store) error {
	if s != nil && isnil.Value(s) {
		return fmt.Errorf("%w: nil store", ErrInvalidOption)
	}
	if w, ok := s.(wiredStore); ok {
		return w.wiringError()
	}
	return nil
}

// checkKey rejects keys no store accepts. The key itself never appears in
// the error: it may be personal data. It is small enough to inline; the
// errors are built out of line.
func checkKey(key string) error {
	if key == "" || len(key) > MaxKeyLen {
		return keyError(len(key))
	}
	return nil
}

// checkReset validates a Store's Reset: the key, and the names of the
// plans, which name the keys it deletes.
func checkReset(key string, plans []Plan) error {
	if err := checkKey(key); err != nil {
		return err
	}
	for _, p := range plans {
		if err := p.validateName(); err != nil {
			return err
		}
	}
	return nil
}

func keyError(n int) error {
	if n == 0 {
		return fmt.Errorf("%w: empty", ErrInvalidKey)
	}
	return fmt.Errorf("%w: %d bytes, more than %d", ErrInvalidKey, n, MaxKeyLen)
}

// checkCost rejects a request for fewer than 1 token, or for more than the
// capacity of any plan but those that bit i of skip names for plan i.
func checkCost(n int64, plans []Plan, skip uint64) error {
	if n < 1 {
		return fmt.Errorf("%w: %d is below 1", ErrInvalidCost, n)
	}
	for i := range plans {
		if n > plans[i].Capacity && skip>>i&1 == 0 {
			return fmt.Errorf("%w: %d exceeds the capacity %d of plan %q", ErrInvalidCost, n, plans[i].Capacity, plans[i].Name)
		}
	}
	return nil
}

// checkTake validates a Store request: a store takes plans from any caller,
// so it checks everything its keys and arithmetic rely on. A cost of 0
// reads.
func checkTake(key string, cost int64, plans []Plan) error {
	if err := checkKey(key); err != nil {
		return err
	}
	if len(plans) == 0 {
		return fmt.Errorf("%w: no plan given", ErrUnknownPlan)
	}
	for _, p := range plans {
		if err := p.validate(); err != nil {
			return err
		}
	}
	if err := checkChain(plans); err != nil {
		return err
	}
	if permitsIn(plans) {
		return fmt.Errorf("%w: %w", ErrInvalidPlan, errNoPermitPlan)
	}
	if cost == 0 {
		cost = 1
	}
	return checkCost(cost, plans, 0)
}
