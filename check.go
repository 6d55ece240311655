package tollgate

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Check makes one real decision through the store, on a key reserved for
// it, so that a wiring or permission mistake shows when the service starts
// rather than as a silent fallback for ever. Call it once at startup, after
// New, with a deadline.
//
// For a RedisStore the decision runs the script on a token bucket and, if
// the Limiter's plans (New, SetPlans) hold a sliding window or a
// concurrency plan, on one of each too, whose state expires within
// milliseconds; with WithFleet it also records one heartbeat. Its error
// wraps ErrStoreUnavailable and names the cause: authentication, an ACL
// that forbids a command the script or the heartbeat needs, a Cluster
// that is down, a script rejected (EVALSHA or EVAL disabled or renamed),
// a read-only replica, a server out of memory, a Redis older than 5.0, or
// no connection. A MemoryStore always passes; any other Store is asked to
// read a bucket. A fallback store (WithFallback) is checked the same way,
// and its error says "the fallback store".
func (l *Limiter) Check(ctx context.Context) error {
	plans := checkPlans(l.table.Load().plans)
	err := checkStore(ctx, l.store, plans)
	if err == nil && l.fallback != nil {
		if err = checkStore(ctx, l.fallback, plans); err != nil {
			err = fmt.Errorf("the fallback store: %w", err)
		}
	}
	if err == nil && l.fleet != nil {
		err = l.fleet.check(ctx)
	}
	if err == nil || ctx.Err() != nil {
		return err
	}
	return fmt.Errorf("%w: %s: %w", ErrStoreUnavailable, checkCause(err), err)
}

// checkStore is Check's decision on one store: plans on a store that can
// check them, nothing on a store in this process, and a read of a bucket
// on any other.
func checkStore(ctx context.Context, s Store, plans []Plan) error {
	if c, ok := s.(checkedStore); ok {
		return c.check(ctx, plans)
	}
	if _, ok := s.(localStore); ok {
		return nil
	}
	_, err := s.Take(ctx, reservedKey, 0, []Plan{checkPlan})
	return err
}

// reservedKey is the key whose bucket Check reads in a store of another
// package. A RedisStore decides Check's plans under Redis keys no
// caller's key maps to (see Key).
const reservedKey = "tollgate-check"

// checkPlan, checkWindow and checkPermits are the plans of each kind that
// Check decides on: checkPlan always, the others for a Limiter whose plans
// hold one of their kind. Each admits far more than the Checks of a fleet
// that starts at once, so that no Check is denied, which would write
// nothing and so try no command that writes; what each writes is gone
// within milliseconds.
var (
	checkPlan    = Plan{Name: "check", Capacity: 1_000_000, Rate: 1_000_000}
	checkWindow  = Plan{Name: "check-w", Capacity: 1_000_000, Window: minWindow}
	checkPermits = Plan{Name: "check-c", Capacity: maxPermits, Concurrency: true}
)

// checkPlans returns the plans Check decides on for a Limiter of plans: a
// bucket, and a window and a concurrency plan if plans hold one, so that
// the commands each kind's decisions need are tried.
func checkPlans(plans []Plan) []Plan {
	out := []Plan{checkPlan}
	if windowIn(plans) {
		out = append(out, checkWindow)
	}
	if permitsIn(plans) {
		out = append(out, checkPermits)
	}
	return out
}

// checkLease is how long the permit that Check's decision on a
// concurrency plan may take lives: the key expires with it.
const checkLease = time.Millisecond

// check runs the script on plans, for the store's reserved key, and checks
// the server's version if the script fails.
func (s *RedisStore) check(ctx context.Context, plans []Plan) error {
	if s.err != nil {
		return s.err
	}
	c := newScriptCall()
	c.Keys = c.keys[:0]
	for i := range plans {
		// "=" opens a base64 key, and the empty key is no caller's: the
		// encoding of the empty key, "=", is reserved.
		c.Keys = append(c.Keys, s.prefix+":{=}:"+plans[i].Name)
	}
	if permitsIn(plans) {
		o := op{n: 1, plans: plans, mode: modeAcquire, grant: &permit{id: newPermitID(), lease: checkLease}}
		c.Args = s.appendPermitArgs(c.args[:0], &o)
	} else {
		c.Args = s.appendArgs(c.args[:0], 1, plans)
	}
	_, err := s.run(ctx, c, 1, plans)
	if err == nil {
		return nil
	}
	if v, ok := s.version(ctx); ok && v < 5 {
		return fmt.Errorf("%w: Redis %d is older than 5.0, which scripts that read TIME need", err, v)
	}
	return err
}

// version returns the major version of the Redis server, if INFO tells.
func (s *RedisStore) version(ctx context.Context) (int, bool) {
	info, err := s.client.Info(ctx, "server").Result()
	if err != nil {
		return 0, false
	}
	for line := range strings.Lines(info) {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), "redis_version:"); ok {
			major, _, _ := strings.Cut(v, ".")
			n, err := strconv.Atoi(major)
			return n, err == nil
		}
	}
	return 0, false
}

// checkCause names, for an operator, what a failed Check says. It reads
// the class Stats counts the failure under.
func checkCause(err error) string {
	if errors.Is(err, ErrInvalidOption) {
		return "the store is misconfigured"
	}
	switch errorClass(err) {
	case "NOAUTH", "WRONGPASS":
		return "Redis refused the credentials: check the client's Username and Password"
	case "NOPERM":
		return "the ACL user may not run a command the script needs (EVALSHA, EVAL, TIME, GET and SET for buckets and holds, HGETALL, HSET, HINCRBY, HDEL, PEXPIRE and DEL for windows, ZREMRANGEBYSCORE, ZCARD, ZADD, ZRANGE, ZSCORE, ZREM, PEXPIRE and DEL for concurrency plans and the fleet) on the key prefix"
	case "CLUSTERDOWN", "MASTERDOWN":
		return "the Redis Cluster or its master is down"
	case "READONLY":
		return "the client is connected to a read-only replica"
	case "OOM":
		return "Redis is out of memory under a noeviction policy"
	case "LOADING", "BUSY":
		return "Redis is busy loading or running a script"
	case "ERR":
		return "Redis rejected the script (EVALSHA or EVAL disabled or renamed, scripting off, or a server too old)"
	case "bad-reply":
		return "the script's reply had the wrong shape (a proxy or a server that is not Redis?)"
	case "network", "timeout":
		return "cannot reach Redis"
	case "canceled", "other":
		return "the store failed"
	}
	return "Redis answered with an error"
}
