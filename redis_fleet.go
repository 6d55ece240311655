package tollgate

import (
	"context"
	"fmt"
	"time"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// fleetScript is the heartbeat script (scripts/fleet.lua), shared by every
// RedisStore.
var fleetScript = redisscript.New(luaFleet)

// heartbeat implements fleetStore: it records instance id as alive for
// ttl in the fleet's sorted set, and returns how many instances are, each
// counted until its own ttl has passed (and ttl, for the members of
// releases that recorded none).
func (s *RedisStore) heartbeat(ctx context.Context, id string, ttl time.Duration) (int64, error) {
	if s.err != nil {
		return 0, s.err
	}
	reply, err := fleetScript.Run(ctx, s.client, []string{s.fleetKey()}, id, ttl.Microseconds())
	if err != nil {
		return 0, err
	}
	n, ok := reply.(int64)
	if !ok || n < 1 {
		return 0, fmt.Errorf("%w: fleet size", redisscript.ErrBadReply)
	}
	return n, nil
}

// fleetKey is the Redis key of the fleet's sorted set. '#' is in no plan
// name, so no bucket key is this one.
func (s *RedisStore) fleetKey() string {
	return s.prefix + ":{fleet}:#instances"
}
