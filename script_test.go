package tollgate

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// agreementPlans have rates whose products round in every way: whole,
// fractional, tiny and large.
var agreementPlans = []Plan{
	{Name: "whole", Capacity: 5, Rate: 2},
	{Name: "third", Capacity: 3, Rate: 1.0 / 3},
	{Name: "odd", Capacity: 17, Rate: 7.77},
	{Name: "daily", Capacity: 1000, Rate: Per(1000, 24*time.Hour)},
	{Name: "fast", Capacity: 100_000, Rate: 123_456.789},
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

		buckets := make([]TokenBucket, len(s.plans))
		for j, p := range s.plans {
			b, ok := pure[key+"/"+p.Name]
			if !ok {
				b = FullBucket(p, now)
			}
			buckets[j] = b
		}
		stored := slices.Clone(buckets) // what a denial or a read leaves
		allowed := TakeAll(s.plans, buckets, now, s.cost)
		if allowed && s.cost > 0 {
			stored = buckets
		}
		assert.Equal(t, newResult(s.plans, stored, now, s.cost, allowed), got, "step %d: Lua and TokenBucket disagree", i)
		if !allowed || s.cost == 0 {
			continue // nothing is written
		}
		for j, p := range s.plans {
			pure[key+"/"+p.Name] = buckets[j]
			rk := rs.Key(key, p.Name)
			assert.Equal(t, strconv.FormatInt(buckets[j].Tokens, 10), mr.HGet(rk, "t"), "step %d plan %s: tokens", i, p.Name)
			assert.Equal(t, strconv.FormatInt(buckets[j].Stamp, 10), mr.HGet(rk, "ts"), "step %d plan %s: stamp", i, p.Name)
		}
	}
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
		if k := fmt.Sprint("user-", i); !taken[m.shard(k)] {
			taken[m.shard(k)] = true
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

func TestLuaAgreesWithGoRandom(t *testing.T) {
	for seed := uint64(1); seed <= 4; seed++ {
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
	for seed := uint64(1); seed <= 8; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			runAgreement(t, randomSteps(rand.New(rand.NewPCG(seed, 7)), 400, 4, true, true))
		})
	}
}

// TestLuaAgreesWithGoOnRealRedis plants bucket states in a real Redis and
// checks the script's answer against TakeAll at the time the script read.
func TestLuaAgreesWithGoOnRealRedis(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: redistest.Addr(t)})
	t.Cleanup(func() { _ = c.Close() })
	ctx := context.Background()
	s := NewRedisStore(c, WithKeyPrefix(testPrefix(t)))
	rng := rand.New(rand.NewPCG(7, 7))
	for i := 0; i < 500; i++ {
		p := agreementPlans[rng.IntN(len(agreementPlans))]
		key := s.Key("user", p.Name)
		nowApprox := time.Now().UnixMicro()
		planted := TokenBucket{
			Tokens: rng.Int64N(p.Capacity*MicroTokens + 1),
			Stamp:  nowApprox - rng.Int64N(int64(float64(p.Capacity)/p.Rate*1e6)+1),
		}
		require.NoError(t, c.HSet(ctx, key, "t", planted.Tokens, "ts", planted.Stamp, "v", 1).Err())
		cost := rng.Int64N(min(p.Capacity, 5) + 1)
		keys := []string{key}
		args := []any{cost, p.Capacity, strconv.FormatFloat(p.Rate, 'g', -1, 64)}
		reply, err := c.Eval(ctx, tokenBucketLua, keys, args...).Result()
		require.NoError(t, err)
		allowed, now, got, err := parseReply(reply, []Plan{p})
		require.NoError(t, err)
		want := []TokenBucket{planted}
		wantAllowed := TakeAll([]Plan{p}, want, now, cost)
		assert.Equal(t, wantAllowed, allowed, "case %d", i)
		written := planted // denials and reads write nothing
		if allowed && cost > 0 {
			written = want[0]
		}
		assert.Equal(t, []TokenBucket{written}, got, "case %d: planted %+v, cost %d, plan %+v", i, planted, cost, p)
		stored, err := c.HMGet(ctx, key, "t", "ts").Result()
		require.NoError(t, err)
		if stored[0] == nil && allowed && cost > 0 {
			// The key expired before it was read back (a slow machine and
			// a fast plan): that may only happen once it is full again.
			serverNow, err := c.Time(ctx).Result()
			require.NoError(t, err)
			assert.GreaterOrEqual(t, serverNow.UnixMicro(), written.FullAt(p, now),
				"case %d: the bucket expired before it was full", i)
			continue
		}
		assert.Equal(t, []any{strconv.FormatInt(written.Tokens, 10), strconv.FormatInt(written.Stamp, 10)}, stored,
			"case %d: the stored state is digit for digit the Go state", i)
		require.NoError(t, c.Del(ctx, key).Err())
	}
}

// testPrefix returns a key prefix of its own for a test on a shared Redis.
func testPrefix(t testing.TB) string {
	return fmt.Sprintf("tollgate-test-%d-%x", time.Now().UnixNano(), rand.Uint32())
}
