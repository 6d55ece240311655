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

var (
	_ Store = (*MemoryStore)(nil)
	_ Store = (*RedisStore)(nil)
)

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

// checkCost rejects a cost below minCost or above any plan's capacity. A
// read for n tokens (PeekN), of cost -n, is held to the capacities as n.
func checkCost(cost, minCost int64, plans []Plan) error {
	if cost < minCost {
		return fmt.Errorf("%w: %d is below %d", ErrInvalidCost, cost, minCost)
	}
	n := max(cost, -cost)
	for i := range plans {
		if n > plans[i].Capacity {
			return fmt.Errorf("%w: %d exceeds the capacity %d of plan %q", ErrInvalidCost, n, plans[i].Capacity, plans[i].Name)
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
	if err := checkShadow(plans); err != nil {
		return err
	}
	return checkCost(cost, 0, plans)
}
