package redistest

import (
	"context"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// This file holds what tests of a Redis they did not start need too: a
// client set up as docs/redis.md advises, Redis's clock, and key prefixes that keep
// tests apart on a shared server.

// FailFast returns the go-redis options docs/redis.md recommends for a client of
// addr: a dead Redis costs a decision at most about 100 ms, and the
// limiter's breaker does the rest. Cluster and failover options copy its
// timeouts.
func FailFast(addr string) *redis.Options {
	return &redis.Options{
		Addr:                  addr,
		DialTimeout:           100 * time.Millisecond,
		ReadTimeout:           100 * time.Millisecond,
		WriteTimeout:          100 * time.Millisecond,
		PoolTimeout:           100 * time.Millisecond,
		DialerRetries:         1,  // go-redis dials 5 times, 100 ms apart, by default
		MaxRetries:            -1, // no retries: the failure policy is the retry
		ContextTimeoutEnabled: true,
	}
}

// NewClient returns redis.NewClient(opt), closed when t ends.
func NewClient(t testing.TB, opt *redis.Options) *redis.Client {
	t.Helper()
	c := redis.NewClient(opt)
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// Time returns what TIME answers on c, in microseconds since the Unix
// epoch: the clock tollgate's script decides by. It calls t.Fatal if c
// cannot answer.
func Time(t testing.TB, c redis.Cmdable) int64 {
	t.Helper()
	tm, err := c.Time(context.Background()).Result()
	if err != nil {
		t.Fatalf("redistest: TIME: %v", err)
	}
	return tm.UnixMicro()
}

// KeyPrefix returns a key prefix that no other test uses, so that tests
// sharing a Redis (see Addr) never see each other's keys and need not
// flush it.
func KeyPrefix() string {
	return fmt.Sprintf("tollgate-test-%d-%x", time.Now().UnixNano(), rand.Uint32())
}
