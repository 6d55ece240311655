package tollgate

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
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

func TestRedisStoreDenialWritesNothing(t *testing.T) {
	ctx := context.Background()
	s, mr, setTime := newMiniredisStore(t)
	_, err := s.Take(ctx, "k", 4, []Plan{gold})
	require.NoError(t, err)
	key := s.Key("k", "gold")
	before := mr.HGet(key, "ts")
	setTime(t0 + 100_000)
	r, err := s.Take(ctx, "k", 1, []Plan{gold})
	require.NoError(t, err)
	assert.False(t, r.Allowed)
	assert.Equal(t, 400*time.Millisecond, r.RetryAfter)
	assert.Equal(t, before, mr.HGet(key, "ts"))
	assert.Equal(t, "0", mr.HGet(key, "t"))
}

// TestRedisStoreReplacesForeignData puts data of other shapes at a bucket's
// key: the store treats the bucket as new and replaces it, never erring.
func TestRedisStoreReplacesForeignData(t *testing.T) {
	ctx := context.Background()
	tests := []struct {
		name  string
		plant func(c *redis.Client, key string) error
	}{
		{"string", func(c *redis.Client, key string) error { return c.Set(ctx, key, "hello", 0).Err() }},
		{"list", func(c *redis.Client, key string) error { return c.RPush(ctx, key, "a", "b").Err() }},
		{"hash of an older schema", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "tokens", "3.5", "lastRefillTime", "1", "v", "0").Err()
		}},
		{"hash without version", func(c *redis.Client, key string) error { return c.HSet(ctx, key, "t", "1", "ts", "1").Err() }},
		{"garbage numbers", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "t", "abc", "ts", "1.5", "v", "1").Err()
		}},
		{"negative tokens", func(c *redis.Client, key string) error { return c.HSet(ctx, key, "t", "-5", "ts", "1", "v", "1").Err() }},
		{"tokens beyond 2^53", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "t", "1e20", "ts", "1", "v", "1").Err()
		}},
		{"infinite tokens", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "t", "inf", "ts", "1", "v", "1").Err()
		}},
		{"negative stamp", func(c *redis.Client, key string) error { return c.HSet(ctx, key, "t", "0", "ts", "-1", "v", "1").Err() }},
		{"stamp beyond 2^53", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "t", "0", "ts", "1e300", "v", "1").Err()
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
			fields, err := c.HGetAll(ctx, key).Result()
			require.NoError(t, err)
			assert.Equal(t, map[string]string{"t": "3000000", "ts": "1700000000000000", "v": "1"}, fields)
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

func TestRedisStoreReset(t *testing.T) {
	ctx := context.Background()
	s, mr, _ := newMiniredisStore(t)
	daily := Plan{Name: "daily", Capacity: 10, Rate: 0.01}
	_, err := s.Take(ctx, "k", 4, []Plan{gold, daily})
	require.NoError(t, err)
	require.NoError(t, s.Reset(ctx, "k", []Plan{gold, daily}))
	assert.Empty(t, mr.Keys())
	r, err := s.Take(ctx, "k", 0, []Plan{gold, daily})
	require.NoError(t, err)
	assert.Equal(t, []int64{4, 10}, []int64{r.Plans[0].Remaining, r.Plans[1].Remaining})
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
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, _, _, err := parseReply(tt.reply, plans)
			if tt.ok {
				assert.NoError(t, err)
			} else {
				assert.ErrorIs(t, err, ErrBadReply)
			}
		})
	}
}

// hashTag returns the part of a Redis key that Cluster hashes, by the rule
// of the Cluster specification.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

func TestKeyScheme(t *testing.T) {
	s := NewRedisStore(redis.NewClient(&redis.Options{}))
	assert.Equal(t, "tollgate:{user:42}:gold", s.Key("user:42", "gold"), "plain keys are verbatim")
	keys := []string{
		"a", "}", "{", "{}", "}{", "a}b", "{a}", "=", "=a", "==", "a=", "=YQ", "x}:gold", "\x00", "\xff\xfe",
		"tollgate:{a}:gold", strings.Repeat("}", 1024), strings.Repeat("é", 512),
	}
	seen := map[string]string{}
	for _, k := range keys {
		var tag string
		for _, plan := range []string{"gold", "daily", "a.b-c_d"} {
			rk := s.Key(k, plan)
			if prev, dup := seen[rk]; dup {
				t.Errorf("key %q plan %s collides with %s", k, plan, prev)
			}
			seen[rk] = k + "/" + plan
			if tag == "" {
				tag = hashTag(rk)
			}
			assert.Equal(t, tag, hashTag(rk), "key %q: plans must share a hash tag", k)
			assert.NotEqual(t, rk, tag, "key %q: the tag must not be empty", k)
		}
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
	require.Len(t, r.Plans, 10)
	for i, pr := range r.Plans {
		assert.Equal(t, int64(10+i-3), pr.Remaining, "plan %d", i)
	}
	assert.Equal(t, "p0", r.Plan)
}

// scriptCounter is a go-redis hook that counts the script commands sent
// alone and sent in pipelines.
type scriptCounter struct {
	alone, piped atomic.Int64
}

func isScriptCmd(cmd redis.Cmder) bool {
	return cmd.Name() == "evalsha" || cmd.Name() == "eval"
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
	require.NoError(t, c.ScriptLoad(ctx, tokenBucketLua).Err()) // no NOSCRIPT, and no EVAL
	var h scriptCounter
	c.AddHook(&h)
	ap, err := c.AutoPipeline()
	require.NoError(t, err)
	s := NewRedisStore(ap)
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
