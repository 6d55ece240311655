package tollgate

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
)

// Check makes one real decision through the store, on a key reserved for
// it, so that a wiring or permission mistake shows when the service starts
// rather than as a silent fallback for ever. Call it once at startup, after
// New, with a deadline.
//
// For a RedisStore the decision runs the script and writes a bucket that
// expires within milliseconds. Its error wraps ErrStoreUnavailable and
// names the cause: authentication, an ACL that forbids a command the
// script needs, a Cluster that is down, a script rejected (EVALSHA or EVAL
// disabled or renamed), a read-only replica, a server out of memory, a
// Redis older than 5.0, or no connection. A MemoryStore always passes; any
// other Store is asked to read a bucket.
func (l *Limiter) Check(ctx context.Context) error {
	var err error
	if c, ok := l.store.(checkedStore); ok {
		err = c.check(ctx)
	} else if l.mem == nil {
		_, err = l.store.Take(ctx, reservedKey, 0, []Plan{checkPlan})
	}
	if err == nil || ctx.Err() != nil {
		return err
	}
	return fmt.Errorf("%w: %s: %w", ErrStoreUnavailable, checkCause(err), err)
}

// reservedKey and checkPlan are what Check decides on. A RedisStore writes
// its bucket under a Redis key no caller's key maps to (see Key).
const reservedKey = "tollgate-check"

var checkPlan = Plan{Name: "check", Capacity: 1, Rate: 1000}

// check runs the script on the store's reserved key, and checks the
// server's version if the script fails.
func (s *RedisStore) check(ctx context.Context) error {
	if s.err != nil {
		return s.err
	}
	// "=" opens a base64 key, and the empty key is no caller's: the
	// encoding of the empty key, "=", is reserved.
	plans := []Plan{checkPlan}
	c := newScriptCall()
	c.Keys = append(c.keys[:0], s.prefix+":{=}:"+checkPlan.Name)
	c.Args = s.appendArgs(c.args[:0], 1, plans)
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
		return "the ACL user may not run a command the script needs (EVALSHA, EVAL, TIME, GET and SET for buckets and holds, HGETALL, HSET, HINCRBY, HDEL, PEXPIRE and DEL for windows) on the key prefix"
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
