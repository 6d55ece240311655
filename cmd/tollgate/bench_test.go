package main

import (
	"bytes"
	"context"
	"regexp"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
)

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

// TestBenchRefusesMoreThanItCanHold asks for more workers or keys than
// memory holds: bench says so, rather than failing to allocate them.
func TestBenchRefusesMoreThanItCanHold(t *testing.T) {
	mr := miniredis.RunT(t)
	for _, args := range [][]string{{"-concurrency", "1000000000000"}, {"-keys", "1000000000000"}} {
		code, _, stderr := cli(t, context.Background(), mr.Addr(), append([]string{"bench", "-duration", "10ms"}, args...)...)
		assert.Equal(t, exitUsage, code, "%v", args)
		assert.Contains(t, stderr, "at most", "%v", args)
	}
	assert.Empty(t, mr.Keys())
}
