package tollgate

import (
	"context"
	"fmt"
	"time"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// resetMarkName is the name, in Key's scheme, of a key's reset mark: the
// Redis TIME of its latest Reset, in µs. A plan's name is never "~", nor
// is a hold's, which is "~" and its id.
const resetMarkName = "~"

// minResetKeep is the least time a reset mark lives: the default hold
// TTL, which is more than a lease's hold lives (4 × the longest lease TTL),
// so that a Reset by an instance with a shorter hold TTL, or by a
// RedisStore used on its own (the CLI), still voids the refunds of other
// instances' holds of the default TTL.
const minResetKeep = defaultHoldTTL

// Reset implements Store: it deletes the buckets and windows, which then
// read as full, but never a concurrency plan's permits (the CLI names plans
// without their kind), and marks the key as reset now, in the same script
// call, so that a reservation of the key taken before it, by any instance
// that shares the store, is refunded nothing when it settles: the buckets
// Reset filled hold its tokens already. The mark lives 15 minutes, the
// default hold TTL; a Limiter's Reset keeps it for its own hold TTL if that
// is longer.
func (s *RedisStore) Reset(ctx context.Context, key string, plans []Plan) error {
	return s.resetHolds(ctx, key, plans, minResetKeep)
}

// resetHolds implements holdResetter: Reset, with a mark that lives at
// least keep, and never less than minResetKeep.
func (s *RedisStore) resetHolds(ctx context.Context, key string, plans []Plan, keep time.Duration) error {
	if s.err != nil {
		return s.err
	}
	if err := checkReset(key, plans); err != nil {
		return err
	}
	if len(plans) == 0 {
		return nil
	}
	keep = max(keep, minResetKeep)
	reply, err := s.resetScript.Run(ctx, s.client, s.keys(key, plans, resetMarkName), keep.Milliseconds())
	if err != nil {
		return err
	}
	if _, ok := reply.(int64); !ok {
		return fmt.Errorf("%w: a reset's mark is %T", redisscript.ErrBadReply, reply)
	}
	return nil
}
