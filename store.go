package tollgate

import (
	"context"
	"fmt"
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

// checkedTaker is implemented by the stores of this package: take is Take
// without the checks, for requests a Limiter has already checked.
type checkedTaker interface {
	take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error)
}

// storeTaker lets a Limiter call any Store through checkedTaker.
type storeTaker struct{ Store }

func (s storeTaker) take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	return s.Take(ctx, key, cost, plans)
}

// takerOf returns s itself for the stores of this package, which skip
// their checks, and s wrapped otherwise.
func takerOf(s Store) checkedTaker {
	if c, ok := s.(checkedTaker); ok {
		return c
	}
	return storeTaker{s}
}

// takeInto has t take, with the Result in *r. A MemoryStore builds it in
// place, without the interface: a pointer passed through an interface
// escapes to the heap, and copying the Result up the call chain cost a
// fifth of a memory decision.
func takeInto(ctx context.Context, r *Result, t checkedTaker, key string, cost int64, plans []Plan) (err error) {
	if m, ok := t.(*MemoryStore); ok {
		m.takeInto(r, key, cost, plans)
		return nil
	}
	*r, err = t.take(ctx, key, cost, plans)
	return err
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

func keyError(n int) error {
	if n == 0 {
		return fmt.Errorf("%w: empty", ErrInvalidKey)
	}
	return fmt.Errorf("%w: %d bytes, more than %d", ErrInvalidKey, n, MaxKeyLen)
}

// checkCost rejects a cost below minCost or above any plan's capacity.
func checkCost(cost, minCost int64, plans []Plan) error {
	if cost < minCost {
		return fmt.Errorf("%w: %d is below %d", ErrInvalidCost, cost, minCost)
	}
	for _, p := range plans {
		if cost > p.Capacity {
			return fmt.Errorf("%w: %d exceeds the capacity %d of plan %q", ErrInvalidCost, cost, p.Capacity, p.Name)
		}
	}
	return nil
}

// checkTake validates a Store request: a store takes plans from any caller,
// so it checks everything its arithmetic relies on.
func checkTake(key string, cost int64, plans []Plan) error {
	if err := checkKey(key); err != nil {
		return err
	}
	if len(plans) == 0 {
		return fmt.Errorf("%w: no plan given", ErrUnknownPlan)
	}
	for _, p := range plans {
		if err := p.validateNumbers(); err != nil {
			return err
		}
	}
	return checkCost(cost, 0, plans)
}
