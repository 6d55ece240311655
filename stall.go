package tollgate

import (
	"errors"
	"time"

	"github.com/redis/go-redis/v9"
)

// callBudgeter is a store that can tell how long one of its calls takes,
// at most, while this process runs and the store answers nothing. The
// Limiter judges a timeout that came far later than that as this
// process's stall, not as the store's failure.
type callBudgeter interface {
	// callBudget returns the longest a call to the store takes while this
	// process runs and the store does not answer; 0 when unknown.
	callBudget() time.Duration
}

// errStalled is the class, in Stats.StoreErrors ("stalled"), of a store
// call that timed out because this process was stalled.
var errStalled = errors.New("process stalled")

// stalled reports whether a store call that began at start and failed
// with err at now (the Limiter's clock) timed out because this process
// was stopped or starved of CPU, not because the store failed to answer:
// the call timed out, and took longer than the store's call budget, which
// no call on a running process outlasts. The timers of calls in flight
// when a process is stopped all fire when it runs again, late by the
// stop, however soon the store answered.
//
// A store that no call has heard from for a cooldown before this call
// began is hung, or too slow, however late this call learnt of it: the
// call is the store's failure then. A stall cannot make that so, for it
// began after the call.
func (l *Limiter) stalled(err error, start, now int64) bool {
	budget := int64(l.health.budget)
	if budget <= 0 || now-start <= budget || !isTimeout(err) {
		return false
	}
	return start-l.lastSuccess.Load() < int64(l.health.settings.Cooldown)
}

// isTimeout reports whether err is a timeout: a network wait's, a
// context deadline's, or a wait for a client's connection.
func isTimeout(err error) bool {
	return errorClass(err) == "timeout" || errors.Is(err, redis.ErrPoolTimeout)
}

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
