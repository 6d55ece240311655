package tollgate

import (
	"time"

	"github.com/redis/go-redis/v9"
)

// clientTimeouts are the waits of a Redis client's call, by its options.
type clientTimeouts struct {
	pool, dial, read, write time.Duration // each at most; dial with its retries
	backoff                 time.Duration // between attempts, at most
	attempts                int
}

// budget returns the longest a call takes when Redis answers nothing:
// each attempt waits for a connection, then fails at the first network
// wait that times out. 0 when a wait has no timeout.
func (t clientTimeouts) budget() time.Duration {
	if t.read <= 0 || t.pool <= 0 || t.dial <= 0 {
		return 0
	}
	n := time.Duration(max(t.attempts, 1))
	return n*(t.pool+max(t.dial, t.read, t.write)) + (n-1)*t.backoff
}

// callBudget returns the longest a script call takes while this process
// runs and Redis answers nothing, by the client's options: PoolTimeout,
// DialTimeout (with DialerRetries), ReadTimeout, WriteTimeout, MaxRetries
// and MaxRetryBackoff, and a Cluster's MaxRedirects. With batching, a
// decision may first wait for a call under way, as long as a call's
// network wait. It is 0, unknown, for a Ring, a client of another kind,
// or one without a read timeout.
func (s *RedisStore) callBudget() time.Duration {
	var t clientTimeouts
	switch c := s.client.(type) {
	case *redis.Client: // a Sentinel failover client too
		o := c.Options()
		t = clientTimeouts{pool: o.PoolTimeout, read: o.ReadTimeout, write: o.WriteTimeout,
			dial:    dialWait(o.DialTimeout, o.DialerRetries, o.DialerRetryTimeout),
			backoff: o.MaxRetryBackoff, attempts: max(o.MaxRetries, 0) + 1}
	case *redis.ClusterClient:
		o := c.Options()
		pool := o.PoolTimeout
		if pool == 0 && o.ReadTimeout > 0 {
			pool = o.ReadTimeout + time.Second // go-redis's default for the nodes' clients
		}
		t = clientTimeouts{pool: pool, read: o.ReadTimeout, write: o.WriteTimeout,
			dial:    dialWait(o.DialTimeout, o.DialerRetries, o.DialerRetryTimeout),
			backoff: o.MaxRetryBackoff, attempts: (o.MaxRedirects + 1) * (max(o.MaxRetries, 0) + 1)}
	default:
		return 0
	}
	if s.batch != nil {
		t.pool += max(t.read, t.write)
	}
	return t.budget()
}

// dialWait returns the longest a dial takes: tries dials of timeout each,
// pause apart.
func dialWait(timeout time.Duration, tries int, pause time.Duration) time.Duration {
	tries = max(tries, 1)
	return time.Duration(tries)*timeout + time.Duration(tries-1)*pause
}
