package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"regexp"
	"strconv"
	"strings"
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

func TestMain(m *testing.M) {
	redis.SetLogger(quietLogger{}) // as main does
	os.Exit(m.Run())
}

// cli runs the command line args with REDIS_URL pointing at addr, and
// returns its exit status and output.
func cli(t *testing.T, ctx context.Context, addr string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	getenv := func(k string) string {
		if k == "REDIS_URL" && addr != "" {
			return "redis://" + addr + "/0"
		}
		return ""
	}
	code = run(ctx, args, &out, &errOut, getenv)
	return code, out.String(), errOut.String()
}

// deadAddr returns the address of a Redis that has gone away.
func deadAddr(t *testing.T) string {
	mr := miniredis.NewMiniRedis()
	require.NoError(t, mr.Start())
	addr := mr.Addr()
	mr.Close()
	return addr
}

func TestUsageAndExitCodes(t *testing.T) {
	dead := deadAddr(t)
	tests := []struct {
		name       string
		args       []string
		code       int
		stdout     string
		stderr     string
		notInPrint string
	}{
		{name: "no args", args: nil, code: exitUsage, stderr: "Usage:\n  tollgate inspect"},
		{name: "help", args: []string{"help"}, code: exitOK, stdout: "Exit status: 0 ok, 1 runtime error, 2 usage error."},
		{name: "-h", args: []string{"-h"}, code: exitOK, stdout: "Usage:"},
		{name: "unknown command", args: []string{"frob"}, code: exitUsage, stderr: `tollgate: unknown command "frob"` + "\nRun 'tollgate help' for usage.\n"},
		{name: "inspect without args", args: []string{"inspect"}, code: exitUsage, stderr: "inspect needs KEY and at least one PLAN"},
		{name: "reset without plan", args: []string{"reset", "alice"}, code: exitUsage, stderr: "reset needs KEY and at least one PLAN"},
		{name: "subcommand -h", args: []string{"inspect", "-h"}, code: exitOK, stderr: "Usage: tollgate inspect [-redis URL] [-prefix P] KEY PLAN..."},
		{name: "unknown flag", args: []string{"inspect", "-nope", "alice", "gold"}, code: exitUsage, stderr: "flag provided but not defined: -nope"},
		{name: "brace in prefix", args: []string{"inspect", "-prefix", "a{b", "alice", "gold"}, code: exitUsage, stderr: "-prefix must be non-empty, without '{' or '}'"},
		{name: "empty key", args: []string{"reset", "", "gold"}, code: exitUsage, stderr: "KEY is empty"},
		{name: "long key", args: []string{"inspect", strings.Repeat("k", tollgate.MaxKeyLen+1), "gold"}, code: exitUsage, stderr: "KEY is 1025 bytes, longer than 1024", notInPrint: "kkkk"},
		{name: "bad plan name", args: []string{"inspect", "alice", "bad plan"}, code: exitUsage, stderr: `tollgate: invalid plan: name "bad plan"`},
		{name: "plan twice", args: []string{"reset", "alice", "gold", "gold"}, code: exitUsage, stderr: `plan name "gold" is given twice`},
		{name: "flag after KEY", args: []string{"reset", "alice", "-prefix", "staging", "gold"}, code: exitUsage, stderr: `flag-like argument "-prefix" after KEY: flags go before KEY`},
		{name: "bad URL hides password", args: []string{"inspect", "-redis", "redis://u:secret@[::1", "alice", "gold"}, code: exitUsage, stderr: "bad Redis URL: missing ']' in host", notInPrint: "secret"},
		// A password holding '/', '?' or '#' ends the authority early, and
		// net/url's error quotes what it took for the port: the password.
		{name: "bad URL hides a password with a slash", args: []string{"inspect", "-redis", "redis://u:pa55/word@localhost:6379/0", "alice", "gold"}, code: exitUsage, stderr: "bad Redis URL: the user name or password does not parse: percent-encode", notInPrint: "pa55"},
		{name: "bad URL hides a password with a hash", args: []string{"inspect", "-redis", "redis://u:pa55#word@localhost:6379/0", "alice", "gold"}, code: exitUsage, stderr: "bad Redis URL: the user name or password does not parse: percent-encode", notInPrint: "pa55"},
		{name: "bad scheme", args: []string{"inspect", "-redis", "http://localhost", "alice", "gold"}, code: exitUsage, stderr: "bad Redis URL"},
		{name: "Redis down", args: []string{"inspect", "-redis", "redis://u:secret@" + dead, "alice", "gold"}, code: exitError, stderr: "connection refused", notInPrint: "secret"},
		{name: "bench: bad plans", args: []string{"bench", "-plans", "x:1"}, code: exitUsage, stderr: `-plans: "x:1" is not NAME:CAPACITY:RATE or NAME:CAPACITY:WINDOW`},
		{name: "bench: zero capacity", args: []string{"bench", "-plans", "x:0:1"}, code: exitUsage, stderr: "-plans: invalid plan: capacity must be 1"},
		{name: "bench: neither rate nor window", args: []string{"bench", "-plans", "x:1:soon"}, code: exitUsage, stderr: `-plans: "soon" is neither a rate (tokens/s) nor a window (such as 1m)`},
		{name: "bench: window too short", args: []string{"bench", "-plans", "x:1:1us"}, code: exitUsage, stderr: "-plans: invalid plan: window must be 1ms to 100 years"},
		{name: "bench: zero duration", args: []string{"bench", "-duration", "0s"}, code: exitUsage, stderr: "-duration and -progress must be positive"},
		{name: "bench: argument", args: []string{"bench", "extra"}, code: exitUsage, stderr: `bench takes no arguments, got "extra"`},
		{name: "bench: Redis down", args: []string{"bench", "-redis", "redis://" + dead}, code: exitError, stderr: "tollgate: ping " + dead},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := cli(t, context.Background(), "", tt.args...)
			assert.Equal(t, tt.code, code, "stderr: %s", stderr)
			assert.Contains(t, stdout, tt.stdout)
			assert.Contains(t, stderr, tt.stderr)
			if tt.code != exitOK {
				assert.Empty(t, stdout, "errors go to stderr")
			}
			if tt.notInPrint != "" {
				assert.NotContains(t, stdout+stderr, tt.notInPrint)
			}
		})
	}
}

var t0 = time.Date(2026, 11, 22, 10, 0, 0, 123456000, time.UTC)

// newLimiter returns a Limiter on mr, as a service would use it.
func newLimiter(t *testing.T, mr *miniredis.Miniredis, opts ...tollgate.Option) *tollgate.Limiter {
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	lim, err := tollgate.New(tollgate.NewRedisStore(client, opts...), []tollgate.Plan{
		{Name: "gold", Capacity: 4, Rate: 2},
		{Name: "daily", Capacity: 100, Rate: tollgate.Per(100, 24*time.Hour)},
	}, tollgate.WithFailurePolicy(breaker.FailClosed), tollgate.WithLogger(nil))
	require.NoError(t, err)
	return lim
}

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

var (
	benchPrefix = regexp.MustCompile(`key prefix (tollgate-bench-[0-9a-f]{16})\n`)
	benchLine   = regexp.MustCompile(`(?m)^ +[0-9.]+m?s +[0-9]+ decisions/s +[0-9]+ errors$`)
	benchTotal  = regexp.MustCompile(`total +(\d+) decisions in [0-9.]+m?s: \d+ decisions/s\nallowed +(\d+) \(.*\)\ndenied +(\d+) \(.*\)\nerrors +0\nlatency +p50 \S+ +p99 \S+ +p99\.9 \S+ +max \S+`)
	benchClean  = regexp.MustCompile(`cleanup +deleted (\d+) buckets under prefix (tollgate-bench-[0-9a-f]{16})\n$`)
)

func TestBench(t *testing.T) {
	mr := miniredis.RunT(t)
	began := time.Now()
	code, stdout, stderr := cli(t, context.Background(), mr.Addr(), "bench",
		"-duration", "400ms", "-progress", "100ms", "-concurrency", "4", "-keys", "5", "-plans", "p:2:1,q:1000:1000")
	elapsed := time.Since(began)
	require.Equal(t, exitOK, code, stderr)
	assert.Empty(t, stderr)
	t.Log(stdout)

	assert.Contains(t, stdout, "bench: 400ms against "+mr.Addr()+", 4 workers, 5 keys, plans p:2:1,q:1000:1000, FailClosed")
	prefix := benchPrefix.FindStringSubmatch(stdout)
	require.NotNil(t, prefix, "the header names the key prefix")
	assert.GreaterOrEqual(t, len(benchLine.FindAllString(stdout, -1)), 2, "a progress line every 100ms")
	m := benchTotal.FindStringSubmatch(stdout)
	require.NotNil(t, m, "summary")
	total, _ := strconv.Atoi(m[1])
	allowed, _ := strconv.Atoi(m[2])
	denied, _ := strconv.Atoi(m[3])
	assert.Equal(t, total, allowed+denied)
	secs := elapsed.Seconds()
	assert.LessOrEqual(t, float64(allowed), 5*(2+1*secs), "the limit holds: 5 keys of 2 tokens, refilling 1/s")
	assert.Greater(t, total, 30, "even a slow run decides more than the limit allows")
	assert.Positive(t, denied)
	c := benchClean.FindStringSubmatch(stdout)
	require.NotNil(t, c, "cleanup line")
	assert.Equal(t, prefix[1], c[2])
	assert.Empty(t, mr.Keys(), "every bucket it wrote is deleted, and only those")
	n, _ := strconv.Atoi(c[1])
	assert.Zero(t, n%2, "both plans' buckets of each key that took tokens")
	assert.LessOrEqual(t, n, 2*5)
	assert.LessOrEqual(t, n/2, allowed)
	assert.Positive(t, n)
}

func TestBenchLeavesOtherKeysAlone(t *testing.T) {
	mr := miniredis.RunT(t)
	require.NoError(t, mr.Set("tollgate:{key-1}:2:p", "someone else's"))
	lim := newLimiter(t, mr)
	_, err := lim.Allow(context.Background(), "key-2", "gold")
	require.NoError(t, err)
	before := mr.Dump()
	code, _, stderr := cli(t, context.Background(), mr.Addr(), "bench", "-duration", "100ms", "-keys", "5", "-plans", "p:5:1,gold:4:2")
	require.Equal(t, exitOK, code, stderr)
	assert.Equal(t, before, mr.Dump())
}

// TestBenchStopsOnInterrupt: Ctrl-C ends the run early, with a summary
// and the cleanup.
func TestBenchStopsOnInterrupt(t *testing.T) {
	mr := miniredis.RunT(t)
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	began := time.Now()
	code, stdout, stderr := cli(t, ctx, mr.Addr(), "bench", "-duration", "1m", "-keys", "10")
	require.Equal(t, exitOK, code, stderr)
	assert.Less(t, time.Since(began), 10*time.Second)
	assert.Regexp(t, benchTotal, stdout)
	assert.Regexp(t, benchClean, stdout)
	assert.Empty(t, mr.Keys())
}

// TestBenchCountsErrors: under FailClosed an outage is errors, each
// counted, and logged by the Limiter without keys. A failed cleanup says
// the buckets expire anyway.
func TestBenchCountsErrors(t *testing.T) {
	mr := miniredis.RunT(t)
	client := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = client.Close() })
	cfg := benchConfig{duration: 300 * time.Millisecond, concurrency: 2, keys: 5, progress: time.Hour,
		plans: []tollgate.Plan{{Name: "p", Capacity: 5, Rate: 1}}}
	var out, errOut bytes.Buffer
	done := make(chan error, 1)
	go func() { done <- bench(context.Background(), &out, &errOut, client, cfg) }()
	time.Sleep(100 * time.Millisecond)
	mr.SetError("ERR injected failure")
	err := <-done
	require.Error(t, err, "a run with errors fails")
	assert.Regexp(t, `^[1-9]\d* decisions failed`, err.Error())
	// miniredis fails the script's own redis.call too, so the text varies.
	assert.Regexp(t, `errors +[1-9]\d*\nfirst error: tollgate: store unavailable: redis answered ERR`, out.String())
	assert.Contains(t, errOut.String(), `level=WARN msg="tollgate: store failing; deciding by failure policy until it recovers" policy=fail-closed`)
	assert.Contains(t, errOut.String(), "tollgate: cleanup: ERR injected failure; the bench's buckets expire by TTL within 5s")
	assert.NotContains(t, out.String()+errOut.String(), "key-")
}

func TestLatencies(t *testing.T) {
	var l latencies
	for us := 1; us <= 10_000; us++ {
		l.record(time.Duration(us) * time.Microsecond)
	}
	for _, tc := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 5 * time.Millisecond}, {0.99, 9900 * time.Microsecond}, {0.999, 9990 * time.Microsecond}, {1, 10 * time.Millisecond}} {
		got := l.quantile(tc.q)
		assert.InEpsilon(t, float64(tc.want), float64(got), 1.0/subBuckets, "q %v: got %s want %s", tc.q, got, tc.want)
		assert.GreaterOrEqual(t, got, tc.want-time.Microsecond, "q %v: the upper end of the bucket", tc.q)
	}
	assert.Equal(t, 10*time.Millisecond, l.max)
	var empty latencies
	assert.Zero(t, empty.quantile(0.5))

	// Buckets are contiguous, ordered and at most 1/32 wide.
	prev := -1
	for v := int64(0); v < 1<<40; v = v*17/16 + 1 {
		b := bucketOf(v)
		require.GreaterOrEqual(t, b, prev, "v %d", v)
		require.GreaterOrEqual(t, upperOf(b), v, "v %d", v)
		require.LessOrEqual(t, float64(upperOf(b)-v), float64(v)/subBuckets+1, "v %d", v)
		if b > 0 {
			require.Less(t, upperOf(b-1), v, "v %d", v)
		}
		prev = b
	}
	assert.Less(t, bucketOf(1<<62), len(l.counts))
}

func TestParsePlansReadsWindows(t *testing.T) {
	plans, err := parsePlans("api:100:1m,burst:5:2.5")
	require.NoError(t, err)
	assert.Equal(t, []tollgate.Plan{
		{Name: "api", Capacity: 100, Window: time.Minute},
		{Name: "burst", Capacity: 5, Rate: 2.5},
	}, plans)
	assert.Equal(t, "api:100:1m0s", planSpec(plans[0]))
	assert.Equal(t, "burst:5:2.5", planSpec(plans[1]))
	assert.Equal(t, 2*time.Minute, maxRefill(plans))
}
