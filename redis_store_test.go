package tollgate

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"math/rand/v2"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/bucketvalue"
	"github.com/tollgate-go/tollgate/internal/redisscript"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

var gold = Plan{Name: "gold", Capacity: 4, Rate: 2}

func TestRedisStoreTTLIsTimeUntilFull(t *testing.T) {
	ctx := context.Background()
	s, mr, setTime := newMiniredisStore(t)
	_, err := s.Take(ctx, "k", 3, []Plan{gold})
	require.NoError(t, err)
	key := s.Key("k", "gold")
	// 3 tokens at 2/s: full in 1.5 s; the TTL rounds up and adds a margin.
	ttl := mr.TTL(key)
	assert.GreaterOrEqual(t, ttl, 1500*time.Millisecond)
	assert.LessOrEqual(t, ttl, 1502*time.Millisecond)

	// An expired bucket reads as full, which is what it would be by then.
	setTime(t0 + 1_502_000)
	mr.FastForward(ttl)
	assert.False(t, mr.Exists(key))
	r, err := s.Take(ctx, "k", 0, []Plan{gold})
	require.NoError(t, err)
	assert.Equal(t, int64(4), r.Remaining)
}

// TestRedisStoreTTLCountsFromTheStamp steps Redis TIME back after a take:
// the bucket then fills from its stamp, which is ahead of the clock, and
// must not expire, and read as full, before it would be full.
func TestRedisStoreTTLCountsFromTheStamp(t *testing.T) {
	ctx := context.Background()
	s, mr, setTime := newMiniredisStore(t)
	_, err := s.Take(ctx, "k", 3, []Plan{gold}) // 1 token left at t0
	require.NoError(t, err)
	setTime(t0 - 1_000_000) // TIME steps back 1 s
	r, err := s.Take(ctx, "k", 1, []Plan{gold})
	require.NoError(t, err)
	require.True(t, r.Allowed)
	// Empty at the stamp t0, 4 tokens at 2/s: full at t0 + 2 s, which is
	// 3 s after the stepped-back clock.
	ttl := mr.TTL(s.Key("k", "gold"))
	assert.GreaterOrEqual(t, ttl, 3000*time.Millisecond)
	assert.LessOrEqual(t, ttl, 3002*time.Millisecond)
}

func TestRedisStoreDenialWritesNothing(t *testing.T) {
	ctx := context.Background()
	s, mr, setTime := newMiniredisStore(t)
	_, err := s.Take(ctx, "k", 4, []Plan{gold})
	require.NoError(t, err)
	key := s.Key("k", "gold")
	before, err := mr.Get(key)
	require.NoError(t, err)
	setTime(t0 + 100_000)
	r, err := s.Take(ctx, "k", 1, []Plan{gold})
	require.NoError(t, err)
	assert.False(t, r.Allowed)
	assert.Equal(t, 400*time.Millisecond, r.RetryAfter)
	assert.Equal(t, bucketvalue.Bucket{Tokens: 0, Stamp: t0}, storedBucket(t, s.client, key))
	after, err := mr.Get(key)
	require.NoError(t, err)
	assert.Equal(t, before, after, "written again")
}

// storedBucket returns the bucket stored at the Redis key rk, failing the
// test if rk holds no bucket.
func storedBucket(t testing.TB, c redis.Cmdable, rk string) bucketvalue.Bucket {
	t.Helper()
	v, err := c.Get(context.Background(), rk).Result()
	require.NoError(t, err)
	b, ok := bucketvalue.Decode(v)
	require.True(t, ok, "not a bucket: %q", v)
	require.Equal(t, bucketvalue.Encode(b), v, "byte for byte what Go writes")
	return b
}

// plantBucket stores b at the Redis key rk, as the scripts would.
func plantBucket(t testing.TB, c redis.Cmdable, rk string, b TokenBucket) {
	t.Helper()
	v := bucketvalue.Encode(bucketvalue.Bucket{Tokens: b.Tokens, Stamp: b.Stamp})
	require.NoError(t, c.Set(context.Background(), rk, v, 0).Err())
}

// TestRedisStoreReplacesForeignData puts data of other shapes at a bucket's
// key: the store treats the bucket as new and replaces it, never erring.
func TestRedisStoreReplacesForeignData(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name  string
		plant func(c *redis.Client, key string) error
	}{
		{"short string", func(c *redis.Client, key string) error { return c.Set(ctx, key, "hello", 0).Err() }},
		{"string of 15 bytes", func(c *redis.Client, key string) error { return c.Set(ctx, key, strings.Repeat("\x00", 15), 0).Err() }},
		{"empty string", func(c *redis.Client, key string) error { return c.Set(ctx, key, "", 0).Err() }},
		{"list", func(c *redis.Client, key string) error { return c.RPush(ctx, key, "a", "b").Err() }},
		{"hash of the schema before ADR 28", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "t", "1", "ts", "1", "v", "1").Err()
		}},
		{"window", func(c *redis.Client, key string) error { return c.HSet(ctx, key, "v", "w1000/4", "7", "1").Err() }},
		{"tokens beyond 2^53", func(c *redis.Client, key string) error {
			return c.Set(ctx, key, "\x00\x00\x00\x00\x00\x00\x01"+strings.Repeat("\xff", 7), 0).Err()
		}},
		{"stamp beyond 2^53", func(c *redis.Client, key string) error {
			return c.Set(ctx, key, strings.Repeat("\xff", 7)+"\x00", 0).Err()
		}},
		{"versioned bucket's length, tokens beyond 2^53", func(c *redis.Client, key string) error {
			return c.Set(ctx, key, "\x00\x00\x00\x00\x00\x00\x01"+strings.Repeat("\xff", 7)+strings.Repeat("\x00", 14), 0).Err()
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, mr, _ := newMiniredisStore(t)
			c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
			defer c.Close()
			key := s.Key("k", "gold")
			require.NoError(t, tt.plant(c, key))

			r, err := s.Take(ctx, "k", 0, []Plan{gold})
			require.NoError(t, err, "a read must not fail")
			assert.Equal(t, int64(4), r.Remaining)

			r, err = s.Take(ctx, "k", 1, []Plan{gold})
			require.NoError(t, err)
			assert.True(t, r.Allowed)
			assert.Equal(t, int64(3), r.Remaining)
			assert.Equal(t, bucketvalue.Bucket{Tokens: 3_000_000, Stamp: 1_700_000_000_000_000}, storedBucket(t, c, key))
		})
	}
}

// TestRedisStoreHealsNoscript flushes the script cache between calls: the
// store reloads the script and no call fails.
func TestRedisStoreHealsNoscript(t *testing.T) {
	ctx := context.Background()
	s, mr, _ := newMiniredisStore(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer c.Close()
	for i := int64(1); i <= 3; i++ {
		require.NoError(t, c.ScriptFlush(ctx).Err())
		r, err := s.Take(ctx, "k", 1, []Plan{gold})
		require.NoError(t, err)
		assert.True(t, r.Allowed)
		assert.Equal(t, 4-i, r.Remaining)
		assert.Equal(t, i, s.ScriptLoads())
	}
	_, err := s.Take(ctx, "k", 0, []Plan{gold})
	require.NoError(t, err)
	assert.Equal(t, int64(3), s.ScriptLoads(), "a cached script needs no reload")
}

func TestRedisStoreBadOptions(t *testing.T) {
	ctx := context.Background()
	s := NewRedisStore(nil)
	_, err := s.Take(ctx, "k", 1, []Plan{gold})
	assert.ErrorIs(t, err, ErrInvalidOption)

	c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	defer c.Close()
	s = NewRedisStore(c, WithKeyPrefix("app{1}"))
	_, err = s.Take(ctx, "k", 1, []Plan{gold})
	assert.ErrorIs(t, err, ErrInvalidOption)
	assert.ErrorIs(t, s.Reset(ctx, "k", []Plan{gold}), ErrInvalidOption)

	// Given to a Limiter, as its store or its fallback, the mistake fails
	// New: at startup, not on every request.
	for _, bad := range []*RedisStore{NewRedisStore(nil), s} {
		_, err = New(bad, testPlans)
		assert.ErrorIs(t, err, ErrInvalidOption)
		_, err = New(NewMemoryStore(), testPlans, WithFallback(bad))
		assert.ErrorIs(t, err, ErrInvalidOption)
	}
}

func TestParseReply(t *testing.T) {
	plans := []Plan{gold}
	tests := []struct {
		name  string
		reply any
		ok    bool
	}{
		{"good", []any{int64(1), t0, int64(3_000_000), t0}, true},
		{"stamp after now is a clock step, not an error", []any{int64(0), t0, int64(0), t0 + 5}, true},
		{"nil", nil, false},
		{"string", "OK", false},
		{"short", []any{int64(1), t0}, false},
		{"long", []any{int64(1), t0, int64(0), t0, int64(0)}, false},
		{"string element", []any{int64(1), t0, "3000000", t0}, false},
		{"float element", []any{int64(1), t0, 3e6, t0}, false},
		{"nil element", []any{int64(1), t0, nil, t0}, false},
		{"flag 2", []any{int64(2), t0, int64(0), t0}, false},
		{"negative tokens", []any{int64(1), t0, int64(-1), t0}, false},
		{"negative now", []any{int64(1), int64(-1), int64(0), t0}, false},
		{"tokens past what Lua holds exactly", []any{int64(1), t0, int64(1<<53 + 1), t0}, false},
		{"tokens above a capacity that shrank are Refill's to clamp", []any{int64(1), t0, int64(4_000_001), t0}, true},
	}
	win := Plan{Name: "w", Capacity: 5, Window: time.Second}
	windowTests := []struct {
		name  string
		reply any
		ok    bool
	}{
		{"window", []any{int64(0), t0, int64(5), int64(0), t0 + 50_000, t0 + 1_000_000}, true},
		{"window short", []any{int64(0), t0, int64(5), int64(0), t0}, false},
		{"window ready before now", []any{int64(0), t0, int64(5), int64(0), t0 - 1, t0}, false},
		{"window reset before now", []any{int64(0), t0, int64(5), int64(0), t0, t0 - 1}, false},
		{"window wait too long", []any{int64(0), t0, int64(5), int64(0), t0 + maxWait + 1, t0}, false},
		{"window negative count", []any{int64(0), t0, int64(-1), int64(0), t0, t0}, false},
	}
	for _, tt := range windowTests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, _, err := parseReply(make([]TokenBucket, 1), make([]planState, 1), tt.reply, []Plan{win}, 1)
			if tt.ok {
				assert.NoError(t, err)
			} else {
				assert.ErrorIs(t, err, redisscript.ErrBadReply)
			}
		})
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, _, err := parseReply(make([]TokenBucket, 1), make([]planState, 1), tt.reply, plans, 1)
			if tt.ok {
				assert.NoError(t, err)
			} else {
				assert.ErrorIs(t, err, redisscript.ErrBadReply)
			}
		})
	}
}

// TestRedisStoreManyPlans chains more plans than the store's fixed-size
// buffers hold, on miniredis.
func TestRedisStoreManyPlans(t *testing.T) {
	ctx := context.Background()
	s, _, _ := newMiniredisStore(t)
	var plans []Plan
	for i := range 10 {
		plans = append(plans, Plan{Name: fmt.Sprint("p", i), Capacity: int64(10 + i), Rate: 1})
	}
	r, err := s.Take(ctx, "k", 3, plans)
	require.NoError(t, err)
	assert.True(t, r.Allowed)
	require.Len(t, r.PlanResults(), 10)
	for i, pr := range r.PlanResults() {
		assert.Equal(t, int64(10+i-3), pr.Remaining, "plan %d", i)
	}
	assert.Equal(t, "p0", r.Plan)
}

// scriptCounter is a go-redis hook that counts the script and function
// commands sent alone and sent in pipelines.
type scriptCounter struct {
	alone, piped atomic.Int64
}

// countedClient returns a client with options o, closed at the test's
// end, and the scriptCounter hooked to it.
func countedClient(t *testing.T, o *redis.Options) (*redis.Client, *scriptCounter) {
	t.Helper()
	c := redis.NewClient(o)
	t.Cleanup(func() { _ = c.Close() })
	h := &scriptCounter{}
	c.AddHook(h)
	return c, h
}

func isScriptCmd(cmd redis.Cmder) bool {
	return cmd.Name() == "evalsha" || cmd.Name() == "eval" || cmd.Name() == "fcall"
}

func (h *scriptCounter) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *scriptCounter) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScriptCmd(cmd) {
			h.alone.Add(1)
		}
		return next(ctx, cmd)
	}
}

func (h *scriptCounter) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return func(ctx context.Context, cmds []redis.Cmder) error {
		for _, cmd := range cmds {
			if isScriptCmd(cmd) {
				h.piped.Add(1)
			}
		}
		return next(ctx, cmds)
	}
}

// TestRedisStoreAutoPipelines checks that decisions made through go-redis's
// auto-pipeliner are pipelined: it runs raw Do commands outside its
// pipeline, one round trip each, so the store must not use Do.
func TestRedisStoreAutoPipelines(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	var h scriptCounter
	c.AddHook(&h)
	ap, err := c.AutoPipeline()
	require.NoError(t, err)
	s := NewRedisStore(ap, WithoutBatching()) // each decision its own command
	// Found to have no functions, and loaded: no FCALL, NOSCRIPT or EVAL
	// from here.
	_, err = s.Take(ctx, "warm", 1, []Plan{gold})
	require.NoError(t, err)
	h.alone.Store(0)
	h.piped.Store(0)
	var wg sync.WaitGroup
	for g := range 32 {
		wg.Go(func() {
			for i := range 10 {
				_, err := s.Take(ctx, fmt.Sprint("k", g, "-", i), 1, []Plan{gold})
				assert.NoError(t, err)
			}
		})
	}
	wg.Wait()
	// A batch of one may go alone; most must not.
	assert.Equal(t, int64(320), h.alone.Load()+h.piped.Load())
	assert.Greater(t, h.piped.Load(), 3*h.alone.Load(), "script commands sent outside the auto-pipeline")
}

// replyReader builds a script reply, and the plans it is for, from fuzzed
// bytes: every shape go-redis can hand over (integers, strings, nil,
// nested arrays, floats, errors, bytes, booleans) and, often, the shape
// the script returns with values near the bounds.
type replyReader struct{ b []byte }

// wellFormed is parseReply's contract, written independently: an array of
// 2+2n integers, a flag of 0 or 1, each bucket's tokens within 0 and its
// plan's capacity, and, after a take allowed, each bucket's stamp at most
// the longest refill after now.
func wellFormed(reply any, plans []Plan, cost int64) bool {
	arr, ok := reply.([]any)
	if !ok || len(arr) != replyLen(plans) {
		return false
	}
	for _, v := range arr {
		if _, ok := v.(int64); !ok {
			return false
		}
	}
	for _, v := range arr {
		if x := v.(int64); x < 0 || x > 1<<53 {
			return false // beyond what Lua's doubles hold exactly
		}
	}
	now, vals := arr[1].(int64), arr[2:]
	for _, p := range plans {
		if !p.isWindow() {
			if arr[0] == int64(1) && cost > 0 && vals[1].(int64)-now > maxRefillPeriod.Microseconds() {
				return false
			}
			vals = vals[2:]
			continue
		}
		for _, at := range vals[2:4] { // ready and reset
			if at := at.(int64); at < now || at-now > maxWait {
				return false
			}
		}
		vals = vals[4:]
	}
	return arr[0].(int64) <= 1 // the allowed flag
}

// FuzzParseReply hands parseReply replies of fuzzed shapes: it never
// panics, and it accepts exactly the well-formed ones, returning their
// values; every other reply is an error wrapping redisscript.ErrBadReply.
func FuzzParseReply(f *testing.F) {
	// data: plans-1, then per plan a, b, m (capacity 1+a×b, maxCapacity
	// if m%8 == 0), then the reply; tag 10 is the script's shape, whose
	// values are chosen by near.
	f.Add([]byte{0, 1, 3, 1, 10, 1, 5, 3, 5})                                              // good: tokens at the capacity
	f.Add([]byte{0, 1, 3, 1, 10, 1, 5, 4, 5})                                              // tokens one above the capacity: Refill clamps
	f.Add([]byte{0, 1, 3, 1, 10, 2, 5, 0, 5})                                              // flag -1
	f.Add([]byte{0, 1, 3, 1, 5, 0, 2, 0, 3, 6, 0, 0, 0, 0, 0, 0, 0, 0, 9, 1})              // the right length, wrong types
	f.Add([]byte{0, 1, 3, 1, 4, 3, 4, 2, 4, 1, 4, 0})                                      // nested arrays
	f.Add([]byte{3, 1, 1, 0, 2, 2, 1, 3, 3, 1, 4, 4, 1, 10, 0, 5, 3, 5, 0, 5, 1, 5, 3, 6}) // four plans, one of maxCapacity
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &replyReader{b: data}
		plans := make([]Plan, 1+r.byte()%4)
		for i := range plans {
			plans[i] = Plan{Name: "p", Capacity: 1 + int64(r.byte())*int64(r.byte()), Rate: 1}
			switch r.byte() % 8 {
			case 0:
				plans[i].Capacity = maxCapacity
			case 1:
				plans[i].Rate, plans[i].Window = 0, time.Minute
			case 2:
				plans[i].Rate, plans[i].Window, plans[i].Suppress = 0, time.Minute, 1.5
			}
		}
		cost := int64(r.byte() % 3)
		reply := r.value(plans, 0)
		buckets, windows := make([]TokenBucket, len(plans)), make([]planState, len(plans))
		allowed, now, _, err := parseReply(buckets, windows, reply, plans, cost)
		if !wellFormed(reply, plans, cost) {
			if !errors.Is(err, redisscript.ErrBadReply) {
				t.Fatalf("reply %#v for %d plans: err %v, want redisscript.ErrBadReply", reply, len(plans), err)
			}
			return
		}
		if err != nil {
			t.Fatalf("well-formed reply %#v rejected: %v", reply, err)
		}
		arr := reply.([]any)
		if allowed != (arr[0] == int64(1)) || now != arr[1] {
			t.Fatalf("reply %#v parsed as %v, %d", reply, allowed, now)
		}
		vals := arr[2:]
		for i, p := range plans {
			if p.isWindow() {
				want := windowState(&p, windowCounts{vals[0].(int64), vals[1].(int64), vals[2].(int64), vals[3].(int64)}, now, cost, allowed)
				if windows[i] != want {
					t.Fatalf("reply %#v: window %d parsed as %+v, want %+v", reply, i, windows[i], want)
				}
				vals = vals[4:]
				continue
			}
			if want := (TokenBucket{Tokens: vals[0].(int64), Stamp: vals[1].(int64)}); buckets[i] != want {
				t.Fatalf("reply %#v: bucket %d parsed as %+v, want %+v", reply, i, buckets[i], want)
			}
			vals = vals[2:]
		}
	})
}

func (r *replyReader) byte() byte {
	if len(r.b) == 0 {
		return 0
	}
	c := r.b[0]
	r.b = r.b[1:]
	return c
}

func (r *replyReader) int64() int64 {
	var buf [8]byte
	n := copy(buf[:], r.b)
	r.b = r.b[n:]
	return int64(binary.BigEndian.Uint64(buf[:]))
}

// near returns a value near the edges a reply's integer must respect.
func (r *replyReader) near(limit int64) int64 {
	switch r.byte() % 8 {
	case 0:
		return 0
	case 1:
		return 1
	case 2:
		return -1
	case 3:
		return limit
	case 4:
		return limit + 1
	case 5:
		return t0
	case 6:
		return math.MinInt64
	}
	return r.int64()
}

func (r *replyReader) value(plans []Plan, depth int) any {
	switch tag := r.byte(); tag % 11 {
	case 0:
		return r.int64()
	case 1:
		return int64(int8(r.byte()))
	case 2:
		return string(make([]byte, r.byte()%8))
	case 3:
		return nil
	case 4, 5:
		n := int(r.byte() % 8)
		if tag%11 == 5 {
			n = replyLen(plans) // the right length, maybe the wrong contents
		}
		if depth > 3 {
			n = 0
		}
		arr := make([]any, n)
		for i := range arr {
			arr[i] = r.value(plans, depth+1)
		}
		return arr
	case 6:
		return math.Float64frombits(uint64(r.int64()))
	case 7:
		return errors.New("ERR fuzzed")
	case 8:
		return []byte{r.byte()}
	case 9:
		return r.byte()%2 == 0
	}
	// The script's shape: {allowed, now, then tokens, stamp per bucket,
	// and admitted, offered, ready, reset per window}.
	arr := []any{r.near(1), r.near(t0)}
	for _, p := range plans {
		if p.isWindow() {
			arr = append(arr, r.near(p.Capacity), r.near(p.Capacity), r.near(t0+maxWait), r.near(t0+maxWait))
			continue
		}
		arr = append(arr, r.near(p.Capacity*microTokens), r.near(t0))
	}
	return arr
}

// agreementPlans have rates whose products round in every way: whole,
// fractional, tiny and large.
var agreementPlans = []Plan{
	{Name: "whole", Capacity: 5, Rate: 2},
	{Name: "third", Capacity: 3, Rate: 1.0 / 3},
	{Name: "odd", Capacity: 17, Rate: 7.77},
	{Name: "daily", Capacity: 1000, Rate: Per(1000, 24*time.Hour)},
	{Name: "fast", Capacity: 100_000, Rate: 123_456.789},
	// Window plans: the default slots, one slot, uneven sub-windows,
	// suppressed, and sub-windows so narrow that their numbers pass 10^14.
	{Name: "win", Capacity: 5, Window: time.Second},
	{Name: "win1", Capacity: 3, Window: 10 * time.Second, Slots: 1},
	{Name: "oddwin", Capacity: 17, Window: 777 * time.Millisecond, Slots: 7},
	{Name: "sup", Capacity: 4, Window: 2 * time.Second, Slots: 10, Suppress: 2},
	{Name: "fine", Capacity: 10, Window: time.Millisecond, Slots: 64},
}

// bucketPlans returns the bucket plans of plans.
func bucketPlans(plans []Plan) []Plan {
	return slices.DeleteFunc(slices.Clone(plans), Plan.isWindow)
}

type agreementStep struct {
	advance int64 // µs since the previous step; negative steps the clock back
	cost    int64 // 0 reads, as Peek does
	plans   []Plan
}

// agreementOp is a step on one of several keys, or a Reset.
type agreementOp struct {
	agreementStep
	key   int  // which of the sequence's keys
	reset bool // Reset the plans of key instead of taking
}

// onOneKey turns steps into takes on one key.
func onOneKey(steps []agreementStep) []agreementOp {
	ops := make([]agreementOp, len(steps))
	for i, s := range steps {
		ops[i] = agreementOp{agreementStep: s}
	}
	return ops
}

// newMiniredisStore returns a RedisStore on a fresh miniredis whose TIME is
// set by the returned function, in µs.
func newMiniredisStore(t *testing.T) (*RedisStore, *miniredis.Miniredis, func(int64)) {
	t.Helper()
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	setTime := func(us int64) {
		mr.SetTime(time.UnixMicro(us))
	}
	setTime(t0)
	return NewRedisStore(c), mr, setTime
}

// newClockedMemoryStore returns a MemoryStore whose clock is *now.
func newClockedMemoryStore(now *int64) *MemoryStore {
	m := NewMemoryStore()
	m.fakeNow = func() int64 { return *now }
	return m
}

// runAgreement feeds the same steps to the Lua script (on miniredis, whose
// TIME the test sets), to MemoryStore (whose clock the test sets) and to
// the pure TokenBucket, and demands identical answers and identical state.
func runAgreement(t *testing.T, steps []agreementOp) {
	t.Helper()
	ctx := context.Background()
	rs, mr, setTime := newMiniredisStore(t)
	now := t0
	ms := newClockedMemoryStore(&now)
	// MemoryStore forgets a bucket once it is full again, which no clock
	// that only moves forward can tell from keeping it; the steps here move
	// the clock back too. Giving each key a shard of its own keeps inserting
	// one key from sweeping another.
	keys := keysInOwnShards(ms, steps)
	// Both stores draw the same numbers for suppressed plans.
	rs.random, ms.random = sameDraws(), sameDraws()
	pure := map[string]TokenBucket{} // by key and plan name
	for i, s := range steps {
		now += s.advance
		setTime(now)
		key := keys[s.key]
		if s.reset {
			require.NoError(t, rs.Reset(ctx, key, s.plans), "step %d", i)
			require.NoError(t, ms.Reset(ctx, key, s.plans), "step %d", i)
			for _, p := range s.plans {
				delete(pure, key+"/"+p.Name)
				assert.False(t, mr.Exists(rs.Key(key, p.Name)), "step %d plan %s: Reset leaves no bucket in Redis", i, p.Name)
			}
			continue
		}
		got, err := rs.Take(ctx, key, s.cost, s.plans)
		require.NoError(t, err, "step %d", i)
		want, err := ms.Take(ctx, key, s.cost, s.plans)
		require.NoError(t, err, "step %d", i)
		assert.Equal(t, want, got, "step %d: Lua and MemoryStore disagree", i)

		// The pure model: TokenBucket for the bucket plans; a chain with
		// windows takes from its buckets exactly when the stores allowed.
		var bplans []Plan
		var buckets []TokenBucket
		for _, p := range s.plans {
			if p.isWindow() {
				continue
			}
			b, ok := pure[key+"/"+p.Name]
			if !ok {
				b = fullBucket(p, now)
			}
			bplans, buckets = append(bplans, p), append(buckets, b)
		}
		stored := slices.Clone(buckets) // what a denial or a read leaves
		allowed, _ := takeAll(bplans, buckets, now, s.cost)
		if len(bplans) == len(s.plans) {
			if allowed && s.cost > 0 {
				stored = buckets
			}
			want := newResult(&outcome{plans: s.plans, buckets: stored, windows: make([]planState, len(s.plans)), now: now, cost: s.cost, allowed: allowed})
			assert.Equal(t, want, got, "step %d: Lua and TokenBucket disagree", i)
		} else if got.Allowed && s.cost > 0 {
			assert.True(t, allowed, "step %d: allowed, though a bucket lacks the tokens", i)
		}
		for _, p := range s.plans {
			if p.isWindow() {
				assertSameWindow(t, rs, ms, key, p, now, "step %d plan %s", i, p.Name)
			}
		}
		if !got.Allowed || s.cost == 0 {
			if s.cost > 0 { // a denial writes back only a stamp brought back
				for j, p := range bplans {
					if stored[j].tooFarAhead(&p, now) {
						pure[key+"/"+p.Name] = stored[j].Refill(p, now)
					}
				}
			}
			continue
		}
		for j, p := range bplans {
			pure[key+"/"+p.Name] = buckets[j]
			got := storedBucket(t, rs.client, rs.Key(key, p.Name))
			assert.Equal(t, buckets[j], TokenBucket{Tokens: got.Tokens, Stamp: got.Stamp}, "step %d plan %s", i, p.Name)
		}
	}
}

// assertSameWindow checks that the window of plan p for key holds the
// same counts, digit for digit, in Redis (rs, on miniredis) and in ms:
// every count that still counts at now.
func assertSameWindow(t *testing.T, rs *RedisStore, ms *MemoryStore, key string, p Plan, now int64, msgAndArgs ...any) {
	t.Helper()
	fields, err := rs.client.HGetAll(context.Background(), rs.Key(key, p.Name)).Result()
	require.NoError(t, err)
	inRedis := map[string]string{}
	first := now/p.width() - p.slots()
	newest := int64(math.MinInt64)
	for f, v := range fields {
		x, err := strconv.ParseInt(strings.TrimPrefix(f, "o"), 10, 64)
		if f != "v" && f != "c" && (err != nil || x >= first) && v != "0" {
			inRedis[f] = v
			newest = max(newest, x)
		}
	}
	b := strconv.FormatInt(now/p.width(), 10)
	if newest > first+2*p.slots() {
		// A window ahead of the clock counts all it holds in now's
		// sub-window.
		var admitted, offered int64
		for f, v := range inRedis {
			c, _ := strconv.ParseInt(v, 10, 64)
			if strings.HasPrefix(f, "o") {
				offered += c
			} else {
				admitted += c
			}
		}
		clear(inRedis)
		putCounts(inRedis, b, admitted, offered)
	}
	inMemory := map[string]string{}
	e, unlock := lockedEntry(ms, key)
	w := e.window(&p, now)
	if w.ahead(now) {
		admitted, offered := w.counts(now)
		putCounts(inMemory, b, admitted, offered)
	}
	lo, hi := w.span(now)
	for i := lo; i <= hi; i++ {
		n := int64(len(w.admitted))
		if c := w.admitted[i%n]; c != 0 {
			inMemory[strconv.FormatInt(i, 10)] = strconv.FormatInt(c, 10)
		}
		if w.offered != nil && w.offered[i%n] != 0 {
			inMemory["o"+strconv.FormatInt(i, 10)] = strconv.FormatInt(w.offered[i%n], 10)
		}
	}
	unlock()
	if len(inMemory) > 0 {
		shape := "w"
		if p.Suppress != 0 {
			shape = "s"
		}
		inMemory["v"] = fmt.Sprintf("%s%d/%d", shape, p.width(), p.slots())
		inRedis["v"] = fields["v"]
	}
	assert.Equal(t, inMemory, inRedis, msgAndArgs...)
}

// putCounts sets in fields, as a window's hash holds them, the counts of
// sub-window b that are not 0.
func putCounts(fields map[string]string, b string, admitted, offered int64) {
	if admitted != 0 {
		fields[b] = strconv.FormatInt(admitted, 10)
	}
	if offered != 0 {
		fields["o"+b] = strconv.FormatInt(offered, 10)
	}
}

// sameDraws returns a source of the random numbers of suppressed plans
// that gives the same sequence each time it is made.
func sameDraws() func() uint64 {
	rng := rand.New(rand.NewPCG(3, 5))
	return func() uint64 { return rng.Uint64() >> 11 }
}

// keysInOwnShards names the keys the steps use, each in a shard of m's
// own.
func keysInOwnShards(m *MemoryStore, steps []agreementOp) []string {
	n := 1
	for _, s := range steps {
		n = max(n, s.key+1)
	}
	taken := map[*memShard]bool{}
	var keys []string
	for i := 0; len(keys) < n; i++ {
		k := fmt.Sprint("user-", i)
		if s, _ := m.shard(k); !taken[s] {
			taken[s] = true
			keys = append(keys, k)
		}
	}
	return keys
}

// randomSteps returns n random steps on agreementPlans: chains of one to
// three plans, costs from 0 to 4 or, one time in eight, the smallest
// capacity asked. With keys > 1 and resets, steps spread over that many
// keys and one in fifteen is a Reset; with backwards, one in five steps the
// clock back by up to 5 s.
func randomSteps(rng *rand.Rand, n, keys int, resets, backwards bool) []agreementOp {
	steps := make([]agreementOp, n)
	for i := range steps {
		var plans []Plan
		for _, j := range rng.Perm(len(agreementPlans))[:1+rng.IntN(3)] {
			plans = append(plans, agreementPlans[j])
		}
		limit := plans[0].Capacity
		for _, p := range plans {
			limit = min(limit, p.Capacity)
		}
		s := agreementOp{
			agreementStep: agreementStep{
				advance: []int64{0, 1, 999, rng.Int64N(1_000_000), rng.Int64N(60_000_000)}[rng.IntN(5)],
				cost:    rng.Int64N(min(limit, 4) + 1),
				plans:   plans,
			},
			key:   rng.IntN(keys),
			reset: resets && rng.IntN(15) == 0,
		}
		if rng.IntN(8) == 0 {
			s.cost = limit
		}
		if backwards && rng.IntN(5) == 0 {
			s.advance = -[]int64{1, rng.Int64N(1_000_000), rng.Int64N(5_000_000)}[rng.IntN(3)]
		}
		steps[i] = s
	}
	return steps
}

func TestLuaAgreesWithGoTable(t *testing.T) {
	whole, third, odd, daily := agreementPlans[0:1], agreementPlans[1:2], agreementPlans[2:3], agreementPlans[3:4]
	chain := []Plan{agreementPlans[0], agreementPlans[3]}
	tests := []struct {
		name  string
		steps []agreementStep
	}{
		{"burst, deny, refill", []agreementStep{
			{0, 1, whole}, {0, 4, whole}, {0, 1, whole}, {499_999, 1, whole}, {1, 1, whole},
		}},
		{"fractional rate carries", []agreementStep{
			{0, 3, third}, {1, 1, third}, {2_999_999, 1, third}, {1, 1, third}, {1_500_000, 0, third},
		}},
		{"odd rate, uneven steps", []agreementStep{
			{0, 17, odd}, {1, 1, odd}, {128_700, 1, odd}, {3, 1, odd}, {777, 2, odd}, {1_000_000, 5, odd},
		}},
		{"slow plan polled every ms", []agreementStep{
			{0, 1000, daily}, {1000, 1, daily}, {1000, 1, daily}, {86_400_000, 1, daily}, {1000, 0, daily},
		}},
		{"chain is all or nothing", []agreementStep{
			{0, 5, whole}, {0, 995, daily}, {1_000_000, 2, chain}, {0, 3, chain}, {100_000_000, 5, chain},
		}},
		{"clock steps back", []agreementStep{
			{0, 5, whole}, {-2_000_000, 1, whole}, {2_600_000, 1, whole},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) { runAgreement(t, onOneKey(tt.steps)) })
	}
}

// extremeRates are plans at the ends of what Plan accepts, whose rates
// formatted with %g would read "1e-05" or "1e+07": gopher-lua's tonumber,
// which miniredis runs, reads those as nil.
var extremeRates = []Plan{
	{Name: "slowest", Capacity: 3, Rate: 3 / maxRefillPeriod.Seconds() * (1 + 1e-9)},
	{Name: "micro", Capacity: 3, Rate: 1e-5},
	{Name: "mega", Capacity: 2_000_000, Rate: 1e6},
	{Name: "tera", Capacity: 20_000_000, Rate: 1e7},
	{Name: "fastest", Capacity: maxCapacity, Rate: 1e12},
	{Name: "largest", Capacity: 3, Rate: math.MaxFloat64}, // a refill of 2 µs overflows to +Inf
}

func TestExtremeRatesAgree(t *testing.T) {
	for _, p := range extremeRates {
		t.Run(p.Name, func(t *testing.T) {
			require.NoError(t, p.validate())
			one := []Plan{p}
			runAgreement(t, onOneKey([]agreementStep{
				{0, 1, one}, {0, p.Capacity - 1, one}, {1, 1, one}, {7, 1, one},
				{1_000_000, 1, one}, {86_400_000_000, p.Capacity, one}, {1, 0, one},
			}))
		})
	}
}

func TestLuaAgreesWithGoRandom(t *testing.T) {
	seeds := uint64(4)
	if testing.Short() {
		seeds = 1
	}
	for seed := uint64(1); seed <= seeds; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			runAgreement(t, randomSteps(rand.New(rand.NewPCG(seed, 42)), 300, 1, false, false))
		})
	}
}

// TestStoresAgreeOnRandomOperations is the property test of the three
// implementations of the bucket: random sequences of takes of every cost
// (0 is what Peek does), chains, Resets, on several keys, with the clock
// jumping forwards and back, must give identical answers and state from the
// pure TokenBucket, the MemoryStore and the script on miniredis.
func TestStoresAgreeOnRandomOperations(t *testing.T) {
	seeds := uint64(8)
	if testing.Short() {
		seeds = 2
	}
	for seed := uint64(1); seed <= seeds; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			runAgreement(t, randomSteps(rand.New(rand.NewPCG(seed, 7)), 400, 4, true, true))
		})
	}
}

// TestLuaAgreesWithGoOnRealRedis plants bucket states in a real Redis and
// checks the script's answer against takeAll at the time the script read.
func TestLuaAgreesWithGoOnRealRedis(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: redistest.Addr(t)})
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	rng := rand.New(rand.NewPCG(7, 7))
	plans := append(bucketPlans(agreementPlans), extremeRates...)
	for i := 0; i < 500; i++ {
		p := plans[rng.IntN(len(plans))]
		key := s.Key("user", p.Name)
		nowApprox := time.Now().UnixMicro()
		planted := TokenBucket{
			Tokens: rng.Int64N(p.Capacity*microTokens + 1),
			Stamp:  nowApprox - rng.Int64N(int64(min(float64(p.Capacity)/p.Rate*1e6, 1e15))+1),
		}
		plantBucket(t, c, key, planted)
		cost := rng.Int64N(min(p.Capacity, 5) + 1)
		keys := []string{key}
		args := s.args(cost, []Plan{p})
		reply, err := c.Eval(ctx, limitScript, keys, args...).Result()
		require.NoError(t, err)
		got := make([]TokenBucket, 1)
		allowed, now, _, err := parseReply(got, make([]planState, 1), reply, []Plan{p}, cost)
		require.NoError(t, err)
		want := []TokenBucket{planted}
		wantAllowed, _ := takeAll([]Plan{p}, want, now, cost)
		assert.Equal(t, wantAllowed, allowed, "case %d", i)
		written := planted // denials and reads write nothing
		if allowed && cost > 0 {
			written = want[0]
		}
		assert.Equal(t, []TokenBucket{written}, got, "case %d: planted %+v, cost %d, plan %+v", i, planted, cost, p)
		v, err := c.Get(ctx, key).Result()
		if errors.Is(err, redis.Nil) && allowed && cost > 0 {
			// The key expired before it was read back (a slow machine and
			// a fast plan): that may only happen once it is full again.
			serverNow, err := c.Time(ctx).Result()
			require.NoError(t, err)
			assert.GreaterOrEqual(t, serverNow.UnixMicro(), written.FullAt(p, now),
				"case %d: the bucket expired before it was full", i)
			continue
		}
		require.NoError(t, err)
		assert.Equal(t, bucketvalue.Encode(bucketvalue.Bucket{Tokens: written.Tokens, Stamp: written.Stamp}), v,
			"case %d: the stored state is byte for byte the Go state", i)
		require.NoError(t, c.Del(ctx, key).Err())
	}
}

// These tests run on real Redis: TOLLGATE_REDIS_ADDR, or servers they start
// themselves when redis-server is on PATH. Otherwise they skip, and the
// miniredis tests cover the same code.

// hammer runs workers goroutines that call decide until stop is closed,
// and counts what they saw.
type tally struct {
	allowed, denied, errs, fallback atomic.Int64
	firstErr                        atomic.Value
}

func (ta *tally) record(r Result, err error) {
	switch {
	case err != nil:
		ta.errs.Add(1)
		ta.firstErr.CompareAndSwap(nil, err.Error())
	case r.Source != SourceStore:
		ta.fallback.Add(1)
	case r.Allowed:
		ta.allowed.Add(1)
	default:
		ta.denied.Add(1)
	}
}

// TestMultiInstanceExactOnRealRedis runs several Limiters, each with its own
// client, from many goroutines on one key for half a second, and checks the
// admitted count against capacity + rate × elapsed, elapsed read from Redis
// TIME: never above, and close below, with the denial cache off (every
// decision reaches Redis) and on (most are answered locally).
func TestMultiInstanceExactOnRealRedis(t *testing.T) {
	addr := redistest.Addr(t)
	for _, tc := range []struct {
		name  string
		cache int
	}{{"store", 0}, {"denial-cache", defaultDenialCacheKeys}} {
		t.Run(tc.name, func(t *testing.T) {
			prefix := redistest.KeyPrefix()
			plans := []Plan{{Name: "p", Capacity: 20, Rate: 400}}
			var limiters []*Limiter
			for i := 0; i < 4; i++ {
				l, err := New(NewRedisStore(redistest.NewClient(t, &redis.Options{Addr: addr}), WithKeyPrefix(prefix)), plans,
					WithFailurePolicy(breaker.FailClosed), WithLogger(nil), WithDenialCache(tc.cache))
				require.NoError(t, err)
				limiters = append(limiters, l)
			}
			probe := redistest.NewClient(t, &redis.Options{Addr: addr})
			var ta tally
			start := redistest.Time(t, probe)
			deadline := time.Now().Add(500 * time.Millisecond)
			var wg sync.WaitGroup
			for _, l := range limiters {
				for g := 0; g < 8; g++ {
					wg.Go(func() {
						for time.Now().Before(deadline) {
							ta.record(l.Allow(context.Background(), "shared"))
						}
					})
				}
			}
			wg.Wait()
			end := redistest.Time(t, probe)
			require.Zero(t, ta.errs.Load(), "first error: %v", ta.firstErr.Load())
			bound := float64(plans[0].Capacity) + plans[0].Rate*float64(end-start)/1e6
			admitted := float64(ta.allowed.Load())
			t.Logf("admitted %d of %d decisions in %.3f s; bound %.1f", ta.allowed.Load(), ta.allowed.Load()+ta.denied.Load(), float64(end-start)/1e6, bound)
			assert.LessOrEqual(t, admitted, bound, "over-admission")
			// Well below the bound: on a CPU-starved machine no caller asks for
			// a while, and a full bucket refills nothing meanwhile. A bug that
			// loses refills admits about the capacity alone.
			assert.Greater(t, admitted, 0.5*bound, "refills must be admitted, not lost")
			assert.Positive(t, ta.denied.Load(), "the test must push past the limit")
		})
	}
}

// TestPollingRefillOnRealRedis polls every millisecond a bucket that
// refills 2 tokens a second, and demands 2 admissions a second.
func TestPollingRefillOnRealRedis(t *testing.T) {
	c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
	s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	// Capacity 2 holds a second of refill, so a loaded machine's pause in
	// polling loses no token; a floored refill would still admit nothing.
	p := []Plan{{Name: "p", Capacity: 2, Rate: 2}}
	ctx := context.Background()
	r, err := s.Take(ctx, "poll", 2, p) // empty the bucket
	require.NoError(t, err)
	require.True(t, r.Allowed)
	start := redistest.Time(t, c)
	admitted := 0
	for time.Since(time.UnixMicro(start)) < 2100*time.Millisecond {
		r, err := s.Take(ctx, "poll", 1, p)
		require.NoError(t, err)
		if r.Allowed {
			admitted++
		}
		time.Sleep(time.Millisecond)
	}
	elapsed := float64(redistest.Time(t, c)-start) / 1e6
	t.Logf("%d admitted in %.3f s of polling", admitted, elapsed)
	assert.InDelta(t, 2*elapsed, float64(admitted), 1.0)
}

// loadUntilStopped runs workers goroutines, each calling decide(g, i) with
// its number g and a count i, until the returned stop is called; stop waits
// for them to return.
func loadUntilStopped(workers int, decide func(g, i int)) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	for g := 0; g < workers; g++ {
		wg.Go(func() {
			for i := 0; ; i++ {
				select {
				case <-done:
					return
				default:
				}
				decide(g, i)
			}
		})
	}
	return func() {
		close(done)
		wg.Wait()
	}
}

// TestNoscriptUnderLoad flushes the script cache and the functions over
// and over while many goroutines decide, on a chain (the general script)
// and on one bucket (the lean function), through a plain client and
// through go-redis's auto-pipeliner, where NOSCRIPT and "function not
// found" arrive inside a pipeline. Under FailClosed any store failure
// would surface as an error, so none may.
func TestNoscriptUnderLoad(t *testing.T) {
	srv := redistest.StartServer(t)
	for _, tc := range []struct {
		name   string
		client func(c *redis.Client) redis.UniversalClient
	}{
		{"client", func(c *redis.Client) redis.UniversalClient { return c }},
		{"autopipeline", func(c *redis.Client) redis.UniversalClient {
			ap, err := c.AutoPipeline()
			require.NoError(t, err)
			return ap
		}},
		{"autopipeline-full-duplex", func(c *redis.Client) redis.UniversalClient {
			ap, err := c.AutoPipelineWithOptions(&redis.AutoPipelineOptions{FullDuplex: true})
			require.NoError(t, err)
			return ap
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			store := NewRedisStore(tc.client(srv.Client(t)))
			// No denial cache: every decision must meet the flushed cache.
			l, err := New(store, withWindow, WithFailurePolicy(breaker.FailClosed), WithLogger(nil), WithDenialCache(0))
			require.NoError(t, err)
			admin := srv.Client(t)
			var ta tally
			stop := loadUntilStopped(16, func(g, i int) {
				plans := []string{"gold", "daily", "minute"}
				if g%2 == 0 {
					plans = plans[:1]
				}
				ta.record(l.Allow(context.Background(), fmt.Sprint("user-", i%50), plans...))
			})
			flushes := 0
			for deadline := time.Now().Add(time.Second); time.Now().Before(deadline); flushes++ {
				require.NoError(t, admin.ScriptFlush(context.Background()).Err())
				require.NoError(t, admin.FunctionFlush(context.Background()).Err())
				time.Sleep(5 * time.Millisecond)
			}
			stop()
			t.Logf("%d flushes, %d reloads, %d decisions", flushes, store.ScriptLoads(), ta.allowed.Load()+ta.denied.Load())
			assert.Zero(t, ta.errs.Load(), "first error: %v", ta.firstErr.Load())
			assert.Zero(t, ta.fallback.Load())
			assert.GreaterOrEqual(t, store.ScriptLoads(), int64(flushes/2), "the flushes must have bitten")
			assert.Positive(t, store.scripts.limit.Loads(), "the general script met NOSCRIPT")
			assert.Positive(t, store.scripts.take.Loads(), "the lean function went missing")
		})
	}
}

// TestOutageFallbackRecovery kills the Redis under load, checks that
// decisions go on from the fallback with no error, then restarts it and
// checks that decisions return to Redis: through a plain client, and
// through go-redis's auto-pipeliners, which README recommends under load.
func TestOutageFallbackRecovery(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts *redis.AutoPipelineOptions // nil: a plain client
	}{
		{"client", nil},
		{"autopipeline", redis.DefaultBlockingAutoPipelineOptions()},
		{"autopipeline-full-duplex", &redis.AutoPipelineOptions{FullDuplex: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redistest.StartServer(t)
			var client redis.UniversalClient = redistest.NewClient(t, redistest.FailFast(srv.Addr()))
			if tc.opts != nil {
				ap, err := client.(*redis.Client).AutoPipelineWithOptions(tc.opts)
				require.NoError(t, err)
				client = ap
			}
			testOutageFallbackRecovery(t, srv, client)
		})
	}
}

func testOutageFallbackRecovery(t *testing.T, srv *redistest.Server, client redis.UniversalClient) {
	logs := &logCounter{}
	// No denial cache: every decision must meet the outage.
	l, err := New(NewRedisStore(client), withWindow, WithDenialCache(0),
		WithLogger(slog.New(logs)), WithBreaker(breaker.Settings{Failures: 3, Cooldown: 200 * time.Millisecond}))
	require.NoError(t, err)

	var (
		mu      sync.Mutex
		sources = map[Source]int{}
		errs    []error
		slowest time.Duration
		last    atomic.Int32 // the Source of the latest decision
	)
	stop := loadUntilStopped(4, func(g, i int) {
		began := time.Now()
		r, err := l.Allow(context.Background(), fmt.Sprint("user-", g, "-", i%10), "gold", "minute")
		took := time.Since(began)
		mu.Lock()
		if err != nil {
			errs = append(errs, err)
		} else {
			sources[r.Source]++
			last.Store(int32(r.Source))
		}
		slowest = max(slowest, took)
		mu.Unlock()
		time.Sleep(time.Millisecond)
	})
	waitFor := func(src Source, within time.Duration) time.Duration {
		began := time.Now()
		for time.Since(began) < within {
			if Source(last.Load()) == src {
				return time.Since(began)
			}
			time.Sleep(5 * time.Millisecond)
		}
		t.Fatalf("decisions did not move to %s within %s", src, within)
		return 0
	}
	time.Sleep(100 * time.Millisecond)
	srv.Kill()
	toFallback := waitFor(SourceFallback, 2*time.Second)
	time.Sleep(300 * time.Millisecond)
	srv.Restart()
	toStore := waitFor(SourceStore, 3*time.Second)
	// The recovery is logged once no call has failed for two cooldowns.
	time.Sleep(500 * time.Millisecond)
	stop()

	t.Logf("to fallback in %s, back to Redis in %s after restart; slowest decision %s; sources %v", toFallback, toStore, slowest, sources)
	assert.Empty(t, errs, "no error may reach the caller under breaker.Fallback")
	assert.Greater(t, sources[SourceFallback], 100, "decisions go on at full speed during the outage")
	assert.Less(t, toStore, 1500*time.Millisecond, "back to Redis within about a second")
	// One line per outage and one per recovery; a starved machine may see
	// a second, short outage after the restart.
	require.NotEmpty(t, logs.levels)
	require.Zero(t, len(logs.levels)%2, "every outage logged its recovery: %v", logs.levels)
	for i, level := range logs.levels {
		want := slog.LevelWarn
		if i%2 == 1 {
			want = slog.LevelInfo
		}
		assert.Equal(t, want, level, "outage and recovery lines alternate: %v", logs.levels)
	}
}

// TestTopologies runs the same chained decisions through every go-redis
// client kind.
// withWindow chains a sliding window after testPlans' buckets: a bucket
// binds, and the window must take its token atomically beside them, on
// one hash slot.
var withWindow = append(slices.Clone(testPlans), Plan{Name: "minute", Capacity: 6, Window: time.Minute})

func TestTopologies(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	check := func(t *testing.T, c redis.UniversalClient) {
		l, err := New(NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix())), withWindow, WithFailurePolicy(breaker.FailClosed), WithLogger(nil))
		require.NoError(t, err)
		for _, key := range []string{"a", "b}", "c{x}"} {
			for want := int64(3); want >= 0; want-- {
				r, err := l.Allow(context.Background(), key, "gold", "daily", "minute")
				require.NoError(t, err)
				require.True(t, r.Allowed)
				assert.Equal(t, want, r.Remaining)
				assert.Equal(t, want+2, r.PlanResults()[2].Remaining, "the window, chained")
			}
			r, err := l.Allow(context.Background(), key, "gold", "daily", "minute")
			require.NoError(t, err)
			assert.False(t, r.Allowed)
			// One token at 2/s: at most 500 ms, less the time since the drain.
			assert.LessOrEqual(t, r.RetryAfter, 500*time.Millisecond)
			assert.Greater(t, r.RetryAfter, 250*time.Millisecond)
			// A hold and its buckets share a hash slot: a Cluster would
			// refuse the script otherwise.
			res, err := l.Reserve(context.Background(), key, 50, "daily")
			require.NoError(t, err)
			require.True(t, res.OK())
			st, err := res.Settle(context.Background(), 10)
			require.NoError(t, err)
			assert.Equal(t, int64(86), st.Remaining, "4 allowed, 10 used")
			// So does the key's reset mark.
			require.NoError(t, l.Reset(context.Background(), key, "daily"))
		}
	}
	t.Run("client", func(t *testing.T) {
		check(t, redistest.StartServer(t).Client(t))
	})
	t.Run("ring", func(t *testing.T) {
		ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{
			"a": redistest.StartServer(t).Addr(), "b": redistest.StartServer(t).Addr(),
		}})
		t.Cleanup(func() { _ = ring.Close() })
		check(t, ring)
	})
	t.Run("sentinel", func(t *testing.T) {
		check(t, redistest.StartSentinel(t).Client(t, nil))
	})
	t.Run("cluster", func(t *testing.T) {
		check(t, redistest.StartCluster(t, 3, 0).Client(t, nil))
	})
}

// TestRealRedisForeignType checks the WRONGTYPE path on real Redis, whose
// pcall error shape miniredis only imitates.
func TestRealRedisForeignType(t *testing.T) {
	c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
	s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	ctx := context.Background()
	key := s.Key("k", "gold")
	require.NoError(t, c.SAdd(ctx, key, "member").Err())
	t.Cleanup(func() { c.Del(ctx, key) })
	r, err := s.Take(ctx, "k", 1, []Plan{gold})
	require.NoError(t, err)
	assert.True(t, r.Allowed)
	assert.Equal(t, int64(3_000_000), storedBucket(t, c, key).Tokens)
	ttl, err := c.PTTL(ctx, key).Result()
	require.NoError(t, err)
	assert.InDelta(t, float64(500*time.Millisecond), float64(ttl), float64(5*time.Millisecond))
}

// TestPartialOutagesOnRealRedis runs decisions against a redis-server that
// fails writes and answers reads: one at maxmemory under noeviction (OOM),
// and a read-only replica (READONLY). Reads (Peek) succeed throughout, so
// a count of consecutive failures would never open the breaker and each
// failure would log a line of its own.
func TestPartialOutagesOnRealRedis(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	oom := redistest.StartServer(t, "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
	fill := oom.Client(t)
	ctx := context.Background()
	// Fill in large values, then small ones, until even a small one is
	// refused after a pause: Redis frees a large query buffer some time
	// after the command that failed, which can bring it back under its
	// limit for a while.
	for i, size, oom := 0, 64<<10, 0; oom < 3; i++ {
		if err := fill.Set(ctx, fmt.Sprint("ballast-", i), strings.Repeat("x", size), 0).Err(); err != nil {
			require.True(t, strings.HasPrefix(err.Error(), "OOM"), "filling: %v", err)
			size, oom = 64, oom+1
			time.Sleep(50 * time.Millisecond)
		}
	}
	master := redistest.StartServer(t)
	replica := redistest.StartServer(t, "--replicaof", "127.0.0.1", fmt.Sprint(master.Port()))

	for _, tc := range []struct {
		name  string
		addr  string
		class string
	}{
		{"oom", oom.Addr(), "OOM"},
		{"read-only-replica", replica.Addr(), "READONLY"},
	} {
		for _, policy := range []breaker.FailurePolicy{breaker.Fallback, breaker.FailClosed} {
			t.Run(tc.name+"/"+policy.String(), func(t *testing.T) {
				logs := &logCounter{}
				l, err := New(NewRedisStore(redistest.NewClient(t, redistest.FailFast(tc.addr))), testPlans,
					WithLogger(slog.New(logs)), WithFailurePolicy(policy), WithDenialCache(0))
				require.NoError(t, err)
				for i := 0; i < 1000; i++ {
					key := fmt.Sprint("user-", i%10)
					_, _ = l.Peek(ctx, key)
					r, err := l.Allow(ctx, key)
					if policy == breaker.FailClosed {
						require.ErrorIs(t, err, ErrStoreUnavailable, "decision %d", i)
						continue
					}
					require.NoError(t, err, "decision %d", i)
					require.Equal(t, SourceFallback, r.Source, "decision %d", i)
				}
				t.Logf("log: %s", logs.text.String())
				assert.LessOrEqual(t, len(logs.levels), 2, "a handful of lines for 1,000 decisions")
				s := l.Stats()
				assert.True(t, s.Outage)
				assert.GreaterOrEqual(t, s.BreakerOpened, uint64(1))
				assert.Positive(t, s.StoreErrors[tc.class], "errors by class: %v", s.StoreErrors)
			})
		}
	}
}

// TestCallerDeadlinesOnRealRedisAreNotOutages mixes callers whose deadlines
// are too short for a round trip with patient callers, on a healthy Redis,
// through a client with ContextTimeoutEnabled as README recommends: go-redis
// then ends a call at the caller's deadline with an i/o timeout, a moment
// before the context itself reports DeadlineExceeded. Those are the
// callers' errors: the breaker must stay closed, no decision may come from
// the fallback, nothing is logged, and the key admits no more than its
// bound.
func TestCallerDeadlinesOnRealRedisAreNotOutages(t *testing.T) {
	addr := redistest.Addr(t)
	logs := &logCounter{}
	plan := Plan{Name: "p", Capacity: 5, Rate: 50}
	// Patient callers get seconds, so that a machine starved by other
	// tests cannot fail their calls: only the callers' deadlines may cut
	// calls short here.
	opt := redistest.FailFast(addr)
	opt.ReadTimeout, opt.WriteTimeout, opt.PoolTimeout = 5*time.Second, 5*time.Second, 5*time.Second
	l, err := New(NewRedisStore(redistest.NewClient(t, opt), WithKeyPrefix(redistest.KeyPrefix())), []Plan{plan},
		WithLogger(slog.New(logs)), WithDenialCache(0))
	require.NoError(t, err)

	var admitted, callerErrs, decided atomic.Int64
	began := time.Now()
	stop := loadUntilStopped(16, func(g, i int) {
		ctx := context.Background()
		if g%2 == 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, time.Duration(50+(i*37)%250)*time.Microsecond)
			defer cancel()
		}
		r, err := l.Allow(ctx, "hot")
		switch {
		case err != nil:
			require.ErrorIs(t, err, context.DeadlineExceeded)
			callerErrs.Add(1)
		default:
			decided.Add(1)
			require.Equal(t, SourceStore, r.Source, "no decision from the fallback")
			if r.Allowed {
				admitted.Add(1)
			}
		}
	})
	time.Sleep(time.Second)
	stop()
	elapsed := time.Since(began)
	bound := float64(plan.Capacity) + plan.Rate*elapsed.Seconds()
	t.Logf("%d decided, %d admitted (bound %.1f), %d caller errors; store errors %v", decided.Load(), admitted.Load(), bound, callerErrs.Load(), l.Stats().StoreErrors)
	require.Positive(t, callerErrs.Load(), "the test must cut calls short")
	assert.LessOrEqual(t, float64(admitted.Load()), bound)
	assert.Empty(t, logs.levels, "nothing logged as an outage: %s", logs.text.String())
	s := l.Stats()
	assert.Zero(t, s.BreakerOpened)
	assert.False(t, s.Outage)
	assert.Zero(t, s.Plans[0].Allowed[SourceFallback]+s.Plans[0].Denied[SourceFallback])
}

// TestRedisErrorsNeverCarryKeys renames EVALSHA and FCALL away, so that
// Redis answers "unknown command 'evalsha', with args beginning with: ..."
// and quotes the command's arguments, the caller's key among them. Neither
// the error a caller gets nor any log line may hold the key.
func TestRedisErrorsNeverCarryKeys(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	srv := redistest.StartServer(t, "--rename-command", "EVALSHA", `""`, "--rename-command", "FCALL", "FCALL_OFF")
	const key = "alice@example.com"
	logs := &logCounter{minLevel: slog.LevelDebug}
	l, err := New(NewRedisStore(redistest.NewClient(t, redistest.FailFast(srv.Addr()))), testPlans,
		WithLogger(slog.New(logs)), WithFailurePolicy(breaker.FailClosed))
	require.NoError(t, err)
	_, first := l.Allow(context.Background(), key)
	var rerr *redisscript.Error
	require.ErrorAs(t, first, &rerr, "the class survives: %v", first)
	assert.Equal(t, "ERR", rerr.Class)
	for i := 0; i < 5; i++ {
		_, err = l.Allow(context.Background(), key)
		require.ErrorIs(t, err, ErrStoreUnavailable)
		assert.NotContains(t, err.Error(), "alice")
	}
	t.Logf("first error: %v; log: %s", first, logs.text.String())
	assert.NotContains(t, first.Error(), "alice")
	require.NotEmpty(t, logs.levels)
	assert.NotContains(t, logs.text.String(), "alice")
	assert.NotContains(t, logs.text.String(), "tollgate:{")
}

// Sanitize takes a pre-7.0 class from the word after the last
// ": -" of an ERR reply. Redis's "unknown command" reply quotes the key,
// so a key holding ": -" followed by capitals puts those capitals in the
// class: in the caller's error, the outage warning and Stats.StoreErrors
// (whose map keys a client then chooses, one new metric label each).
func TestRedisErrorClassesNeverComeFromKeys(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	srv := redistest.StartServer(t, "--rename-command", "EVALSHA", `""`, "--rename-command", "FCALL", "FCALL_OFF")
	const key = "x: -ALICESMITH y"
	logs := &logCounter{minLevel: slog.LevelDebug}
	l, err := New(NewRedisStore(redistest.NewClient(t, redistest.FailFast(srv.Addr())), WithKeyPrefix(redistest.KeyPrefix())),
		testPlans, WithLogger(slog.New(logs)), WithFailurePolicy(breaker.FailClosed))
	require.NoError(t, err)
	for i := 0; i < 3; i++ {
		_, err = l.Allow(context.Background(), key)
		require.ErrorIs(t, err, ErrStoreUnavailable)
		assert.NotContains(t, err.Error(), "ALICESMITH", "error text")
	}
	assert.NotContains(t, logs.text.String(), "ALICESMITH", "log")
	for class := range l.Stats().StoreErrors {
		assert.NotEqual(t, "ALICESMITH", class, "Stats.StoreErrors class")
	}
}

// BenchmarkServerTime reports the Redis server time of one decision, from
// INFO commandstats on a redis-server of its own, in µs (server-µs/op),
// and the CPU time the server used per decision (cpu-µs/op, which
// includes reading the request and writing the reply):
// a bucket plan, window plans of 1, 20 and 64 sub-windows, a suppressed
// window, and a bucket chained with a window; each on 100 keys, so that
// every sub-window holds counts, and on 10,000, so that most decisions
// open a sub-window of their own. ADR 16 compares a bucket's with the
// script before windows (scripts/token_bucket.lua at f823a98).
func BenchmarkServerTime(b *testing.B) {
	redistest.SkipIfUnavailable(b)
	srv := redistest.StartServer(b)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr(), PoolSize: 16})
	b.Cleanup(func() { _ = c.Close() })
	bucket := Plan{Name: "b", Capacity: 1 << 30, Rate: 1}
	window := func(slots int) Plan {
		return Plan{Name: fmt.Sprint("w", slots), Capacity: 1 << 30, Window: time.Second, Slots: slots}
	}
	suppressed := Plan{Name: "s", Capacity: 1 << 30, Window: time.Second, Suppress: 1.5}
	for _, keys := range []int{100, 10_000} {
		for _, tc := range []struct {
			name  string
			plans []Plan
		}{
			{"bucket", []Plan{bucket}},
			{"window-1", []Plan{window(1)}},
			{"window-20", []Plan{window(20)}},
			{"window-64", []Plan{window(64)}},
			{"suppressed-20", []Plan{suppressed}},
			{"bucket+window-20", []Plan{bucket, window(20)}},
		} {
			b.Run(fmt.Sprintf("%s/keys-%d", tc.name, keys), func(b *testing.B) {
				s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
				names := benchKeys(keys)
				decide := func(key string) error {
					_, err := s.Take(context.Background(), key, 1, tc.plans)
					return err
				}
				for _, k := range names { // every key exists, and the scripts are loaded
					require.NoError(b, decide(k))
				}
				calls, usec := scriptStats(b, c)
				cpu := serverCPU(b, c)
				var next atomic.Int64
				b.SetParallelism(8)
				b.ResetTimer()
				b.RunParallel(func(pb *testing.PB) {
					i := int(next.Add(1)) * 7919
					for pb.Next() {
						i++
						if err := decide(names[i%len(names)]); err != nil {
							b.Error(err)
							return
						}
					}
				})
				b.StopTimer()
				calls2, usec2 := scriptStats(b, c)
				b.ReportMetric(float64(usec2-usec)/float64(calls2-calls), "server-µs/op")
				b.ReportMetric((serverCPU(b, c)-cpu)*1e6/float64(calls2-calls), "cpu-µs/op")
			})
		}
	}
}

// serverCPU returns the CPU time, user and system, that Redis has used,
// in seconds, from INFO cpu: unlike the time INFO commandstats counts, it
// stops while the server waits for a core.
func serverCPU(b *testing.B, c *redis.Client) float64 {
	info, err := c.Info(context.Background(), "cpu").Result()
	require.NoError(b, err)
	total := 0.0
	for _, line := range strings.Split(info, "\n") {
		k, v, _ := strings.Cut(strings.TrimSpace(line), ":")
		if k == "used_cpu_user" || k == "used_cpu_sys" {
			x, err := strconv.ParseFloat(v, 64)
			require.NoError(b, err)
			total += x
		}
	}
	return total
}

// scriptStats returns the calls of EVALSHA and FCALL (the lean
// decision's, on Redis 7) and the µs Redis spent in them, from INFO
// commandstats.
func scriptStats(b *testing.B, c *redis.Client) (calls, usec int64) {
	info, err := c.Info(context.Background(), "commandstats").Result()
	require.NoError(b, err)
	for _, line := range strings.Split(info, "\n") {
		line = strings.TrimSpace(line)
		rest, ok := strings.CutPrefix(line, "cmdstat_evalsha:")
		if !ok {
			rest, ok = strings.CutPrefix(line, "cmdstat_fcall:")
		}
		if ok {
			for _, kv := range strings.Split(rest, ",") {
				k, v, _ := strings.Cut(kv, "=")
				n, _ := strconv.ParseInt(v, 10, 64)
				switch k {
				case "calls":
					calls += n
				case "usec":
					usec += n
				}
			}
		}
	}
	return calls, usec
}

// planVariants are plans of two names with other parameters, versions
// and shadows: debt run up under one is read by another; and of names
// that change kind, bucket and window: each reads what the other left.
var planVariants = [][]Plan{
	{
		{Name: "a", Capacity: 10, Rate: 0.1},
		{Name: "a", Capacity: 10, Rate: 5},
		{Name: "a", Capacity: 3, Rate: 1.0 / 3},
		{Name: "a", Capacity: 50, Rate: 0.01, Version: 1, Inherit: InheritProportional},
		{Name: "a", Capacity: 7, Rate: 7.77, Version: 2, Inherit: InheritAdditive},
		{Name: "a", Capacity: 10, Rate: 5, Shadow: true},
		{Name: "a", Capacity: 20, Rate: 2, Version: 3, Inherit: InheritReset},
	},
	{
		{Name: "b", Capacity: 40, Rate: 3},
		{Name: "b", Capacity: 4, Rate: 0.5},
		{Name: "b", Capacity: 40, Rate: 3, Shadow: true},
		{Name: "b", Capacity: 40, Rate: 3, Version: 1},
		{Name: "b", Capacity: 30, Window: 2 * time.Second, Slots: 4},
		{Name: "b", Capacity: 8, Window: time.Second, Suppress: 2},
	},
	{
		{Name: "w", Capacity: 5, Window: time.Second},
		{Name: "w", Capacity: 5, Rate: 2},
		{Name: "w", Capacity: 3, Rate: 0.5, Version: 1, Inherit: InheritReset},
	},
}

// farAhead counts the decisions that met a stamp more than a full refill
// ahead (ADR 29).
var farAhead atomic.Int64

// TestStoresAgreeOnPlanVariants runs random decisions, reads (cost 0 and
// PeekN's -n), reservations and settlements on a MemoryStore and on the
// scripts (miniredis, which expires nothing here, as the MemoryStore
// forgets nothing), with plans of one name that differ in rate, capacity,
// version and shadow, windows chained with them, and clock steps back:
// debt run up under one plan is read by another, and stamps more than a
// full refill ahead are brought back and written back on denials. Both
// must answer alike.
func TestStoresAgreeOnPlanVariants(t *testing.T) {
	seeds := uint64(16)
	if testing.Short() {
		seeds = 4
	}
	for seed := uint64(1); seed <= seeds; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) { runVariants(t, seed) })
	}
	require.Positive(t, farAhead.Load(), "some decisions met a stamp too far ahead")
}

func runVariants(t *testing.T, seed uint64) {
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(seed, 11))
	rs, _, setTime := newMiniredisStore(t)
	now := t0
	ms := newClockedMemoryStore(&now)
	rs.random, ms.random = sameDraws(), sameDraws()
	type pair struct {
		n        int64
		mem, red hold
		plans    []Plan
		skip     uint64
	}
	var holds []*pair
	pick := func(windows bool) []Plan {
		var plans []Plan
		for gi, g := range planVariants {
			if gi == 2 && !windows {
				continue
			}
			if rng.IntN(2) == 0 || (gi == 0 && len(plans) == 0) {
				if !windows {
					g = slices.DeleteFunc(slices.Clone(g), func(p Plan) bool { return p.isWindow() })
				}
				plans = append(plans, g[rng.IntN(len(g))])
			}
		}
		rng.Shuffle(len(plans), func(i, j int) { plans[i], plans[j] = plans[j], plans[i] })
		return plans
	}
	minCap := func(plans []Plan) int64 {
		c := int64(1 << 40)
		for _, p := range plans {
			c = min(c, p.Capacity)
		}
		return c
	}
	for i := 0; i < 300; i++ {
		switch step := rng.IntN(10); {
		case step < 2: // the clock
			step := rng.Int64N(3_000_000)
			if rng.IntN(6) == 0 {
				step = -rng.Int64N(20_000_000)
			}
			now += step
			setTime(now)
		case step < 5: // a decision or a read
			plans := pick(true)
			c := minCap(plans)
			cost := rng.Int64N(c+1) - rng.Int64N(2)*rng.Int64N(c+1)
			if cost < 0 && len(plans) > 0 {
				cost = max(cost, -c)
			}
			var m Result
			for _, q := range plans {
				e, unlock := lockedEntry(ms, "k")
				if b := e.find(&q); b != nil && !q.isWindow() && b.win == nil && b.ver.inherit(b.TokenBucket, &q, now).tooFarAhead(&q, now) {
					farAhead.Add(1)
				}
				unlock()
			}
			o := op{key: "k", n: cost, plans: plans}
			if cost <= 0 { // a read: for 1 token (0), or for -cost
				o.n, o.mode = max(-cost, 1), modeRead
			}
			m, _ = ms.decide(ctx, o)
			r, err := rs.take(ctx, "k", cost, plans)
			require.NoError(t, err)
			require.Equal(t, m, r, "op %d: take %d on %v", i, cost, plans)
		case step < 8: // reserve
			plans := pick(false)
			n := 1 + rng.Int64N(minCap(plans))
			p := &pair{n: n, mem: hold{ttl: time.Hour}, red: hold{ttl: time.Hour}, plans: plans}
			m, _ := ms.decide(ctx, op{key: "k", n: n, mode: modeHold, plans: plans, hold: &p.mem})
			r, err := rs.hold(ctx, "k", n, plans, &p.red)
			require.NoError(t, err)
			require.Equal(t, m, r, "op %d: reserve %d on %v", i, n, plans)
			if m.Allowed {
				p.skip = untaken(&m)
				p.red.skip = p.skip
				holds = append(holds, p)
			}
		default: // settle, maybe with other variants of the names
			if len(holds) == 0 {
				continue
			}
			j := rng.IntN(len(holds))
			p := holds[j]
			holds = append(holds[:j], holds[j+1:]...)
			plans := p.plans
			if rng.IntN(2) == 0 {
				plans = append([]Plan(nil), plans...)
				for k := range plans {
					for _, g := range planVariants {
						if v := g[rng.IntN(len(g))]; g[0].Name == plans[k].Name && !v.isWindow() {
							v.Shadow = plans[k].Shadow
							plans[k] = v
						}
					}
				}
			}
			actual := rng.Int64N(3 * p.n)
			p.mem.skip = p.skip
			m, ms1, _ := ms.settle(ctx, settleOp{key: "k", plans: plans, hold: &p.mem, n: p.n, used: actual})
			r, rs1, err := rs.settle(ctx, settleOp{key: "k", plans: plans, hold: &p.red, n: p.n, used: actual})
			require.NoError(t, err)
			require.Equal(t, ms1, rs1, "op %d", i)
			require.Equal(t, m, r, "op %d: settle %d of %d on %v", i, actual, p.n, plans)
		}
	}
}

func TestRedisStoreRefusesATypedNilClient(t *testing.T) {
	ctx := context.Background()
	var c *redis.Client
	var cc *redis.ClusterClient
	for name, client := range map[string]redis.UniversalClient{"client": c, "cluster": cc} {
		t.Run(name, func(t *testing.T) {
			s := NewRedisStore(client)
			_, err := s.Take(ctx, "k", 1, []Plan{gold})
			assert.ErrorIs(t, err, ErrInvalidOption, "used on its own")
			_, err = New(s, testPlans)
			assert.ErrorIs(t, err, ErrInvalidOption, "given to New")
		})
	}
}

// TestAllowedReplyWithAStampFarAheadIsBadReply: a take the script allowed
// refilled its bucket first, so the bucket it replies has a stamp at most
// a full refill after now. A reply that says otherwise is not a decision
// the script made: it must be ErrBadReply, not a Result whose waits wrap
// around an int64 of nanoseconds.
func TestAllowedReplyWithAStampFarAheadIsBadReply(t *testing.T) {
	slow := Plan{Name: "slow", Capacity: 1, Rate: 1 / maxRefillPeriod.Seconds()} // a token a century
	for _, stamp := range []int64{t0 + maxRefillPeriod.Microseconds() + 1, 1 << 53} {
		buckets := make([]TokenBucket, 1)
		reply := []any{int64(1), t0, int64(0), stamp}
		allowed, now, wd, err := parseReply(buckets, make([]planState, 1), reply, []Plan{slow}, 1)
		if err == nil {
			r := newResult(&outcome{plans: []Plan{slow}, buckets: buckets, now: now, cost: 1, allowed: allowed, wd: wd})
			t.Errorf("stamp %d µs ahead: accepted, ResetAfter %v", stamp-t0, r.ResetAfter)
			continue
		}
		assert.ErrorIs(t, err, redisscript.ErrBadReply)
	}
}
