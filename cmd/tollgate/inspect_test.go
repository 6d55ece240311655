package main

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/bucketvalue"
)

func TestInspect(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	mr.SetTime(t0)
	lim := newLimiter(t, mr)
	_, err := lim.AllowN(ctx, "alice", 3, "gold") // 1 of 4 left; full again in 1.5 s (+2 ms, the script's margin)
	require.NoError(t, err)
	require.NoError(t, mr.Set("tollgate:{alice}:2:silver", "not a bucket"))
	mr.HSet("tollgate:{alice}:2:old", "t", "12", "ts", "1", "v", "1")
	_, err = mr.Lpush("tollgate:{alice}:2:list", "x")
	require.NoError(t, err)
	require.NoError(t, mr.Set("tollgate:{alice}:2:versioned", bucketvalue.Encode(bucketvalue.Bucket{
		Tokens: 2_500_000, Stamp: t0.UnixMicro() + 1_000_000, Version: 3, Capacity: 4})))
	mr.SetTime(t0.Add(250 * time.Millisecond))
	before := mr.Dump()

	code, stdout, stderr := cli(t, ctx, mr.Addr(), "inspect", "alice", "gold", "daily", "silver", "old", "list", "versioned")
	require.Equal(t, exitOK, code, stderr)
	assert.Equal(t, `Redis TIME 2026-11-22T10:00:00.373456Z (the buckets' clock)

"tollgate:{alice}:2:gold"
  tokens    1.000000 (1000000 micro-tokens, as of the stamp)
  refilled  2026-11-22T10:00:00.123456Z (stamp 1795341600123456 µs), 250ms ago
  expires   in 1.502s (PTTL 1502 ms)
  schema    2, a string of 10 bytes

"tollgate:{alice}:2:daily"
  absent: reads as full

"tollgate:{alice}:2:silver"
  value     "not a bucket": a string of 12 bytes but not a bucket: foreign data; reads as full, and the next decision that takes tokens replaces it
  expires   never (PTTL -1)

"tollgate:{alice}:2:old"
  schema    v = "1": a hash but not a window: foreign data; reads as full or empty, and the next decision that takes tokens replaces it
  expires   never (PTTL -1)

"tollgate:{alice}:2:list"
  type      list, neither a bucket (string) nor a window (hash): foreign data; reads as full or empty, and the next decision that takes tokens replaces it
  expires   never (PTTL -1)

"tollgate:{alice}:2:versioned"
  tokens    2.500000 (2500000 micro-tokens, as of the stamp)
  refilled  2026-11-22T10:00:01.123456Z (stamp 1795341601123456 µs), 750ms ahead of Redis TIME: the bucket refills nothing until then
  version   3, written with a capacity of 4 tokens
  expires   never (PTTL -1)
  schema    2, a string of 28 bytes
`, stdout)
	assert.Empty(t, stderr)
	assert.Equal(t, before, mr.Dump(), "inspect writes nothing")
}

// TestInspectPermits prints a concurrency plan's permits: those alive,
// and each holder's, by a prefix of its id only.
func TestInspectPermits(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	mr.SetTime(t0)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	lim, err := tollgate.New(tollgate.NewRedisStore(client), []tollgate.Plan{{Name: "inflight", Capacity: 5, Concurrency: true}},
		tollgate.WithFailurePolicy(breaker.FailClosed), tollgate.WithLogger(nil), tollgate.WithPermitLease(time.Minute))
	require.NoError(t, err)
	t.Cleanup(func() { _ = lim.Close() })
	for _, n := range []int64{2, 1} {
		p, err := lim.Acquire(ctx, "alice", n, "inflight")
		require.NoError(t, err)
		require.True(t, p.OK())
	}
	mr.SetTime(t0.Add(10 * time.Second))
	code, stdout, stderr := cli(t, ctx, mr.Addr(), "inspect", "alice", "inflight")
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, "permits   3 held, alive at Redis TIME; 3 members in all")
	assert.Regexp(t, `holder    [0-9a-f]{8}…: 2, lease ends in 50s`, stdout)
	assert.Regexp(t, `holder    [0-9a-f]{8}…: 1, lease ends in 50s`, stdout)

	// reset leaves the permits to their holders, and says so.
	code, stdout, stderr = cli(t, ctx, mr.Addr(), "reset", "alice", "inflight")
	require.Equal(t, exitOK, code, stderr)
	assert.Contains(t, stdout, `kept     "tollgate:{alice}:2:inflight" (a concurrency plan's permits, their holders' until released)`)
	assert.Contains(t, stdout, "deleted 0 of 1 buckets")
	_, stdout, _ = cli(t, ctx, mr.Addr(), "inspect", "alice", "inflight")
	assert.Contains(t, stdout, "permits   3 held")

	mr.SetTime(t0.Add(61 * time.Second))
	_, stdout, _ = cli(t, ctx, mr.Addr(), "inspect", "alice", "inflight")
	assert.Contains(t, stdout, "permits   0 held")
	assert.Contains(t, stdout, "lease ended 1s ago: the next decision reclaims them")
}

// TestInspectWindow prints a window's sub-windows as the script wrote
// them.
func TestInspectWindow(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	mr.SetTime(t0)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	lim, err := tollgate.New(tollgate.NewRedisStore(client), []tollgate.Plan{
		{Name: "api", Capacity: 10, Window: time.Second, Slots: 4},
	})
	require.NoError(t, err)
	_, err = lim.AllowN(ctx, "alice", 3, "api")
	require.NoError(t, err)
	mr.SetTime(t0.Add(300 * time.Millisecond))
	_, err = lim.AllowN(ctx, "alice", 2, "api")
	require.NoError(t, err)
	mr.HSet("tollgate:{alice}:2:odd", "v", "w12")
	// A suppressed window whose refusals left offered counts alone.
	sub := strconv.FormatInt(t0.UnixMicro()/250_000, 10)
	mr.HSet("tollgate:{alice}:2:sup", "v", "s250000/4", "o"+sub, "4")

	code, stdout, stderr := cli(t, ctx, mr.Addr(), "inspect", "alice", "api", "odd", "sup")
	require.Equal(t, exitOK, code, stderr)
	first := t0.UnixMicro() / 250_000
	assert.Equal(t, fmt.Sprintf(`Redis TIME 2026-11-22T10:00:00.423456Z (the buckets' clock)

"tollgate:{alice}:2:api"
  sliding window of 4 sub-windows of 250ms (v = w250000/4); sub-windows from %d on count now
  admitted  5 counted now
  %d: 2 admitted (from 2026-11-22T10:00:00.250000Z)
  %d: 3 admitted (from 2026-11-22T10:00:00.000000Z)
  expires   in 1.078s (PTTL 1078 ms)

"tollgate:{alice}:2:odd"
  schema    v = "w12": foreign data; reads as empty, and the next decision that takes tokens replaces it
  expires   never (PTTL -1)

"tollgate:{alice}:2:sup"
  suppressed sliding window of 4 sub-windows of 250ms (v = s250000/4); sub-windows from %d on count now
  admitted  0 counted now
  %d: 0 admitted, offered 4 (from 2026-11-22T10:00:00.000000Z)
  expires   never (PTTL -1)
`, first+1-4, first+1, first, first+1-4, first), stdout)
}

// TestInspectFindsEveryKey: the CLI computes keys as the library does,
// prefix and encoded keys included.
func TestInspectFindsEveryKey(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	lim := newLimiter(t, mr, tollgate.WithKeyPrefix("app"))
	for _, key := range []string{"user:42", "a}b", "=x", "ключ"} {
		_, err := lim.Allow(ctx, key, "gold")
		require.NoError(t, err)
		code, stdout, stderr := cli(t, ctx, mr.Addr(), "inspect", "-prefix", "app", key, "gold")
		require.Equal(t, exitOK, code, stderr)
		assert.Contains(t, stdout, "tokens    3.", "key %q", key)
		assert.NotContains(t, stdout, "absent", "key %q", key)
	}
	_, stdout, _ := cli(t, ctx, mr.Addr(), "inspect", "-prefix", "app", "a}b", "gold")
	assert.Contains(t, stdout, `"app:{=YX1i}:2:gold"`, "a key with a brace is base64url-encoded")
	_, stdout, _ = cli(t, ctx, mr.Addr(), "inspect", "user:42", "gold")
	assert.Contains(t, stdout, "absent", "another prefix holds other buckets")
}

func TestReset(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	lim := newLimiter(t, mr)
	for _, key := range []string{"alice", "bob"} {
		_, err := lim.AllowN(ctx, key, 4, "gold")
		require.NoError(t, err)
	}
	_, err := lim.Allow(ctx, "alice", "daily")
	require.NoError(t, err)

	code, stdout, stderr := cli(t, ctx, mr.Addr(), "reset", "alice", "gold", "daily", "silver")
	require.Equal(t, exitOK, code, stderr)
	assert.Equal(t, `deleted  "tollgate:{alice}:2:gold"
deleted  "tollgate:{alice}:2:daily"
absent   "tollgate:{alice}:2:silver" (already full)
deleted 2 of 3 buckets of key "alice": they read as full in Redis now
running instances that denied the key keep denying it from their denial cache until the RetryAfter they gave
`, stdout)
	assert.Equal(t, []string{"tollgate:{alice}:2:~", "tollgate:{bob}:2:gold"}, mr.Keys(),
		"only the named buckets go, and alice's reset mark comes")
	r, err := lim.Allow(ctx, "alice", "gold")
	require.NoError(t, err)
	assert.Equal(t, int64(3), r.Remaining, "a reset bucket is full")
}
