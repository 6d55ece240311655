package tollgate

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/bucketvalue"
	"github.com/tollgate-go/tollgate/internal/redisscript"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

func TestLeanOnlyForOnePlainBucket(t *testing.T) {
	versioned := gold
	versioned.Version = 1
	window := Plan{Name: "minute", Capacity: 3, Window: time.Minute}
	for _, tc := range []struct {
		plans []Plan
		want  bool
	}{
		{[]Plan{gold}, true},
		{[]Plan{{Name: "slow", Capacity: 1 << 30, Rate: 0.001}}, true},
		{nil, false},
		{[]Plan{gold, gold}, false},
		{[]Plan{window}, false},
		{[]Plan{shadowed(gold)}, false},
		{[]Plan{versioned}, false},
	} {
		assert.Equal(t, tc.want, lean(tc.plans), "%+v", tc.plans)
	}
}

// scriptLog is a go-redis hook that records, for each script or function
// command, its name and what it runs: a function's name or a script's SHA.
type scriptLog struct {
	mu   sync.Mutex
	runs []string
}

func (h *scriptLog) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *scriptLog) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScriptCmd(cmd) && cmd.Name() != "eval" {
			h.mu.Lock()
			h.runs = append(h.runs, fmt.Sprint(cmd.Name(), " ", cmd.Args()[1]))
			h.mu.Unlock()
		}
		return next(ctx, cmd)
	}
}

func (h *scriptLog) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// take returns the runs recorded since the last take.
func (h *scriptLog) take() []string {
	h.mu.Lock()
	defer h.mu.Unlock()
	runs := h.runs
	h.runs = nil
	return runs
}

// TestStoreChoosesTheLeanDecision: a take or a read on one plain bucket
// runs the lean decision, and a chain, a window, a shadowed or versioned
// plan and any hold run the general script: on miniredis, which has no
// functions, the lean one is a script of another SHA.
func TestStoreChoosesTheLeanDecision(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	mr.SetTime(time.UnixMicro(t0))
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	var h scriptLog
	c.AddHook(&h)
	s := NewRedisStore(c)
	general := "evalsha " + s.scripts.limit.SHA()

	_, err := s.Take(ctx, "k", 1, []Plan{gold})
	require.NoError(t, err)
	runs := h.take()
	require.Len(t, runs, 2)
	assert.Equal(t, "fcall "+s.scripts.take.Name(), runs[0], "functions first")
	leanScript := runs[1]
	assert.NotEqual(t, general, leanScript)

	versioned := gold
	versioned.Version = 2
	for _, tc := range []struct {
		name   string
		decide func() error
		want   string
	}{
		{"take", func() error { _, err := s.Take(ctx, "k", 1, []Plan{gold}); return err }, leanScript},
		{"read", func() error {
			_, err := s.decide(ctx, op{key: "k", n: 2, mode: modeRead, plans: []Plan{gold}})
			return err
		}, leanScript},
		{"chain", func() error { _, err := s.Take(ctx, "k", 1, testPlans); return err }, general},
		{"window", func() error { _, err := s.Take(ctx, "k", 1, withWindow[2:]); return err }, general},
		{"shadowed", func() error { _, err := s.Take(ctx, "k", 1, []Plan{shadowed(gold)}); return err }, general},
		{"versioned", func() error { _, err := s.Take(ctx, "k", 1, []Plan{versioned}); return err }, general},
		{"hold", func() error { _, err := s.hold(ctx, "k", 1, []Plan{gold}, &hold{ttl: time.Minute}); return err }, general},
	} {
		require.NoError(t, tc.decide(), tc.name)
		assert.Equal(t, []string{tc.want}, h.take(), tc.name)
	}
}

// leanState is what a bucket's key holds before a decision, planted at
// the Redis key rk as of now (µs); expiring ones hold a key that expires
// within a millisecond.
type leanState struct {
	name     string
	plant    func(ctx context.Context, c redis.Cmdable, rk string, now int64) error
	expiring bool
}

// setBucket plants b, as the scripts write it.
func setBucket(b bucketvalue.Bucket) func(context.Context, redis.Cmdable, string, int64) error {
	return func(ctx context.Context, c redis.Cmdable, rk string, now int64) error {
		b := b
		b.Stamp += now
		return c.Set(ctx, rk, bucketvalue.Encode(b), 0).Err()
	}
}

// leanStates are the states the lean and the general decision must read
// alike: nothing, buckets of every length and kind, debt, a stamp too far
// ahead, a window (a plan that changed kind) and data of other shapes.
var leanStates = []leanState{
	{name: "missing", plant: func(context.Context, redis.Cmdable, string, int64) error { return nil }},
	{name: "expired", expiring: true, plant: func(ctx context.Context, c redis.Cmdable, rk string, now int64) error {
		return c.Set(ctx, rk, bucketvalue.Encode(bucketvalue.Bucket{Tokens: 1, Stamp: now - 1}), time.Millisecond).Err()
	}},
	{name: "draining", plant: setBucket(bucketvalue.Bucket{Tokens: 1_500_000, Stamp: -200_000})},
	{name: "full", plant: setBucket(bucketvalue.Bucket{Tokens: 4_000_000, Stamp: -3_600_000_000})},
	{name: "empty", plant: setBucket(bucketvalue.Bucket{Tokens: 0, Stamp: -1})},
	{name: "debt", plant: setBucket(bucketvalue.Bucket{Tokens: 0, Stamp: 700_000})},
	{name: "tokens-ahead", plant: setBucket(bucketvalue.Bucket{Tokens: 2_000_000, Stamp: 50_000})},
	{name: "too-far-ahead", plant: setBucket(bucketvalue.Bucket{Tokens: 2_000_000, Stamp: 3_600_000_000_000})},
	{name: "above-capacity", plant: setBucket(bucketvalue.Bucket{Tokens: 5_000_000_000, Stamp: -1000})},
	{name: "versioned", plant: setBucket(bucketvalue.Bucket{Tokens: 3_000_000, Stamp: -100_000, Version: 3, Capacity: 10})},
	{name: "window", plant: func(ctx context.Context, c redis.Cmdable, rk string, now int64) error {
		return c.HSet(ctx, rk, "v", "w60000000/1", "c", "6", fmt.Sprint(now/60_000_000), "2").Err()
	}},
	{name: "foreign-hash", plant: func(ctx context.Context, c redis.Cmdable, rk string, _ int64) error {
		return c.HSet(ctx, rk, "name", "alice").Err()
	}},
	{name: "foreign-string", plant: func(ctx context.Context, c redis.Cmdable, rk string, _ int64) error {
		return c.Set(ctx, rk, "not a bucket, 26 bytes lon", 0).Err()
	}},
	{name: "beyond-2^53", plant: func(ctx context.Context, c redis.Cmdable, rk string, _ int64) error {
		return c.Set(ctx, rk, strings.Repeat("\xff", 28), 0).Err()
	}},
	{name: "list", plant: func(ctx context.Context, c redis.Cmdable, rk string, _ int64) error {
		return c.RPush(ctx, rk, "x").Err()
	}},
}

// leanPlans are plans of every size: expiries below and above 10^8 ms,
// which the scripts format differently.
var leanPlans = []Plan{
	{Name: "p", Capacity: 4, Rate: 2},
	{Name: "p", Capacity: 1000, Rate: 0.001},
	{Name: "p", Capacity: 1 << 30, Rate: 1},
}

// leanCase is one state, plan and first cost; a second decision of one
// token follows it.
type leanCase struct {
	state leanState
	plan  Plan
	cost  int64
}

func (k leanCase) String() string {
	return fmt.Sprintf("%s/%g-per-%g/cost-%d", k.state.name, float64(k.plan.Capacity), k.plan.Rate, k.cost)
}

func leanCases() []leanCase {
	var cases []leanCase
	for _, st := range leanStates {
		for _, p := range leanPlans {
			for _, cost := range []int64{1, 3, 5, 0, -2} {
				cases = append(cases, leanCase{st, p, cost})
			}
		}
	}
	return cases
}

// leanEnv is a Redis on which the lean and the general decision run at
// instants of the test's choosing.
type leanEnv struct {
	c redis.UniversalClient
	// at returns a store's scripts whose clock reads now.
	at func(t *testing.T, now int64) *decisionScripts
	// wait lets the keys planted with a millisecond's expiry expire.
	wait func()
	// realClock tells that the keys' expiries run on the real clock, where
	// two keys written with the same PX a moment apart differ by that
	// moment; miniredis's stands still.
	realClock bool
}

// leanEnvs returns miniredis, whose clock the test sets, and a real
// Redis if there is one, where the scripts' clock reads a given instant:
// TIME is the only line that differs from the scripts a store sends.
func leanEnvs(t *testing.T) map[string]leanEnv {
	mr := miniredis.RunT(t)
	mc := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = mc.Close() })
	d := newDecisionScripts()
	envs := map[string]leanEnv{"miniredis": {
		c:    mc,
		at:   func(_ *testing.T, now int64) *decisionScripts { mr.SetTime(time.UnixMicro(now)); return d },
		wait: func() { mr.FastForward(5 * time.Millisecond) },
	}}
	if !redistest.Available() {
		return envs
	}
	byNow := map[int64]*decisionScripts{}
	envs["redis"] = leanEnv{
		c: redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)}),
		at: func(t *testing.T, now int64) *decisionScripts {
			if byNow[now] == nil {
				const line = "  local time = redis.call('TIME')\n"
				require.Equal(t, 1, strings.Count(luaBucket, line), "bucket.lua reads TIME in readClock")
				byNow[now] = decisionScriptsOn(strings.Replace(luaBucket, line,
					fmt.Sprintf("  local time = {'%d', '%d'}\n", now/1_000_000, now%1_000_000), 1))
			}
			return byNow[now]
		},
		wait:      func() { time.Sleep(5 * time.Millisecond) },
		realClock: true,
	}
	return envs
}

// storedAs returns what the key rk holds, as text: its type and value,
// and its expiry.
func storedAs(t *testing.T, c redis.Cmdable, rk string) (string, time.Duration) {
	t.Helper()
	ctx := context.Background()
	typ, err := c.Type(ctx, rk).Result()
	require.NoError(t, err)
	v := ""
	switch typ {
	case "string":
		v = c.Get(ctx, rk).Val()
	case "hash":
		var fields []string
		for f, x := range c.HGetAll(ctx, rk).Val() {
			fields = append(fields, f+"="+x)
		}
		slices.Sort(fields)
		v = strings.Join(fields, ",")
	case "list":
		v = strings.Join(c.LRange(ctx, rk, 0, -1).Val(), ",")
	}
	return typ + ":" + fmt.Sprintf("%q", v), c.PTTL(ctx, rk).Val()
}

// sameStored demands that the keys a and b, written since since, hold
// the same, and expire at the same time: exactly on miniredis's clock,
// which the test moves; on a real clock, within the time since then,
// which separates their writes and the reads of their expiries, and
// 10 ms more for the rounding of PX and PTTL to whole ms and a loaded
// machine's Redis, whose clock a command reads may lag (4 ms seen).
func sameStored(t *testing.T, env leanEnv, since time.Time, a, b string, msg string) {
	t.Helper()
	va, ta := storedAs(t, env.c, a)
	vb, tb := storedAs(t, env.c, b)
	slack := time.Duration(0)
	if env.realClock {
		slack = time.Since(since) + 10*time.Millisecond
	}
	assert.Equal(t, va, vb, "%s: stored", msg)
	assert.InDelta(t, float64(ta), float64(tb), float64(slack), "%s: expiry", msg)
}

// TestLeanAgreesWithGeneral plants every state under three keys and
// decides on each with the general script, the lean function and the
// lean function's script, at the same instants: a first decision, then
// one of one token 300 ms later. The replies and the stored values must
// be the same.
func TestLeanAgreesWithGeneral(t *testing.T) {
	for name, env := range leanEnvs(t) {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			s := NewRedisStore(env.c, WithKeyPrefix(redistest.KeyPrefix()))
			cases := leanCases()
			key := func(side string, i int) string { return s.Key(fmt.Sprint(side, i), "p") }
			sides := []string{"general", "lean", "lean-script"}
			for i, k := range cases {
				for _, side := range sides {
					require.NoError(t, k.state.plant(ctx, env.c, key(side, i), t0), "%v", k)
				}
			}
			env.wait()
			// Case by case, both steps: on real Redis a key's expiry runs on
			// the real clock, and a key of the first step must not expire
			// before its second while the other cases run.
			for i, k := range cases {
				for step, now := range []int64{t0, t0 + 300_000} {
					d := env.at(t, now)
					cost := k.cost
					if step == 1 {
						cost = 1
					}
					args := s.args(cost, []Plan{k.plan})
					var replies [][]int64
					since := time.Now()
					for _, side := range sides {
						var reply any
						var err error
						switch keys := []string{key(side, i)}; side {
						case "general":
							reply, err = d.limit.Run(ctx, env.c, keys, args...)
						case "lean":
							reply, err = d.take.Run(ctx, env.c, keys, args...)
						default:
							reply, err = d.take.Script().Run(ctx, env.c, keys, args...)
						}
						require.NoError(t, err, "%v %s step %d", k, side, step)
						vals, err := redisscript.Ints(nil, reply, 4)
						require.NoError(t, err)
						replies = append(replies, vals)
					}
					msg := fmt.Sprintf("%v step %d", k, step)
					assert.Equal(t, replies[0], replies[1], "%s: reply", msg)
					assert.Equal(t, replies[0], replies[2], "%s: the script's reply", msg)
					sameStored(t, env, since, key("general", i), key("lean", i), msg)
					sameStored(t, env, since, key("general", i), key("lean-script", i), msg+" (script)")
				}
			}
		})
	}
}

// TestLeanBatchAgreesWithGeneralBatch decides every case in one batch of
// the general script and in one of the lean function, at the same
// instant, with the cases' plans in runs and alternating, each run of
// one plan of several costs; and then ordered by cost and plan, so that
// each run of one plan has one cost, which the lean batch sends once:
// each call's reply and stored value must be the same.
func TestLeanBatchAgreesWithGeneralBatch(t *testing.T) {
	byCostAndPlan := slices.SortedStableFunc(slices.Values(leanCases()), func(a, b leanCase) int {
		return cmp.Or(cmp.Compare(a.cost, b.cost), cmp.Compare(fmt.Sprint(a.plan), fmt.Sprint(b.plan)))
	})
	for name, env := range leanEnvs(t) {
		for order, cases := range map[string][]leanCase{"listed": leanCases(), "by cost and plan": byCostAndPlan} {
			t.Run(name+"/"+order, func(t *testing.T) { leanBatchAgrees(t, env, cases) })
		}
	}
}

// leanBatchAgrees is TestLeanBatchAgreesWithGeneralBatch for cases in
// their order on env.
func leanBatchAgrees(t *testing.T, env leanEnv, cases []leanCase) {
	ctx := context.Background()
	s := NewRedisStore(env.c, WithKeyPrefix(redistest.KeyPrefix()))
	key := func(side string, i int) string { return s.Key(fmt.Sprint(side, i), "p") }
	calls := map[string][]*redisscript.Call{}
	for i, k := range cases {
		for _, side := range []string{"general", "lean"} {
			require.NoError(t, k.state.plant(ctx, env.c, key(side, i), t0), "%v", k)
			calls[side] = append(calls[side], &redisscript.Call{Keys: []string{key(side, i)}, Args: s.args(k.cost, []Plan{k.plan})})
		}
	}
	env.wait()
	d := env.at(t, t0)
	since := time.Now()
	d.limitMany.Run(ctx, env.c, calls["general"])
	d.takeMany.Run(ctx, env.c, calls["lean"])
	for i, k := range cases {
		g, l := calls["general"][i], calls["lean"][i]
		require.NoError(t, g.Err, "%v", k)
		require.NoError(t, l.Err, "%v", k)
		gv, err := redisscript.Ints(nil, g.Reply, 4)
		require.NoError(t, err)
		lv, err := replyInts(nil, l.Reply, 4)
		require.NoError(t, err)
		assert.Equal(t, gv, lv, "%v: reply", k)
		sameStored(t, env, since, key("general", i), key("lean", i), k.String())
	}
}

// TestLeanFunctionReadsTheClockEachCall: a library's prelude runs once
// for all its calls, so a clock it kept would stop. Two calls a moment
// apart must see two instants.
func TestLeanFunctionReadsTheClockEachCall(t *testing.T) {
	c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
	d := newDecisionScripts()
	ctx := context.Background()
	key := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix())).Key("clock", "p")
	var nows []int64
	for range 2 {
		reply, err := d.take.Run(ctx, c, []string{key}, 0, 4, "2")
		require.NoError(t, err)
		vals, err := redisscript.Ints(nil, reply, 4)
		require.NoError(t, err)
		nows = append(nows, vals[1])
		time.Sleep(2 * time.Millisecond)
	}
	assert.Greater(t, nows[1], nows[0])
	calls := []*redisscript.Call{{Keys: []string{key}, Args: []any{0, 4, "2"}}, {Keys: []string{key}, Args: []any{0, 4, "2"}}}
	d.takeMany.Run(ctx, c, calls)
	require.NoError(t, calls[0].Err)
	vals, err := replyInts(nil, calls[0].Reply, 4)
	require.NoError(t, err)
	assert.Greater(t, vals[1], nows[1], "the batch too")
	// At most one load: the library may be on a shared server already.
	assert.LessOrEqual(t, d.take.Loads(), int64(1), "FCALL ran both times")
}

// TestLeanIntsReadsARecord reads a lean decision's record in a batch as
// the four integers takeOne replies, and refuses a flag other than 0 or
// 1, bytes that are not a bucket, and a clock that is not 7 bytes.
func TestLeanIntsReadsARecord(t *testing.T) {
	now := string([]byte{0, 0, 0, 0, 0, 1, 2})
	bucket := bucketvalue.Encode(bucketvalue.Bucket{Tokens: 300, Stamp: 5})
	vals, err := replyInts(nil, redisscript.Record{Shared: now, Own: "\x01" + bucket}, 4)
	require.NoError(t, err)
	assert.Equal(t, []int64{1, 258, 300, 5}, vals)
	for _, bad := range []redisscript.Record{
		{Shared: now, Own: "\x02" + bucket},
		{Shared: now, Own: ""},
		{Shared: now, Own: "\x00" + bucket[:7]},
		{Shared: now[:6], Own: "\x00" + bucket},
	} {
		_, err := replyInts(nil, bad, 4)
		assert.ErrorIs(t, err, redisscript.ErrBadReply, "%q", bad)
	}
	_, err = replyInts(nil, redisscript.Record{Shared: now, Own: "\x01" + bucket}, 6)
	assert.ErrorIs(t, err, redisscript.ErrBadReply, "a record answers a lean decision only")
}

// FuzzLeanInts: whatever a record holds, reading it gives four integers
// or ErrBadReply, and never panics.
func FuzzLeanInts(f *testing.F) {
	f.Add(string([]byte{0, 0, 0, 0, 0, 1, 2}), "\x01"+bucketvalue.Encode(bucketvalue.Bucket{Tokens: 300, Stamp: 5}))
	f.Add("", "")
	f.Fuzz(func(t *testing.T, shared, own string) {
		vals, err := replyInts(nil, redisscript.Record{Shared: shared, Own: own}, 4)
		if err != nil {
			assert.ErrorIs(t, err, redisscript.ErrBadReply)
			return
		}
		assert.Len(t, vals, 4)
	})
}

// TestBatchForbiddenKeyFailsNoOther runs a batch, general and lean, in
// which an ACL forbids one decision's key: Redis refuses the whole script
// call (NOPERM) before it runs, so the batch is sent again one decision
// at a time, and only the forbidden one fails, as it would alone.
func TestBatchForbiddenKeyFailsNoOther(t *testing.T) {
	srv := redistest.StartServer(t)
	ctx := context.Background()
	require.NoError(t, srv.Client(t).Do(ctx, "ACL", "SETUSER", "lim", "on", ">pw",
		"~tollgate:{a}*", "~tollgate:{b}*", "+@all").Err())
	c := redistest.NewClient(t, &redis.Options{Addr: srv.Addr(), Username: "lim", Password: "pw", MaxRetries: -1})
	s := NewRedisStore(c)
	window := Plan{Name: "w", Capacity: 5, Window: time.Minute}
	for name, plans := range map[string][]Plan{"general": {gold, window}, "lean": {gold}} {
		reqs := []batchReq{{"a", 1, plans}, {"forbidden", 1, plans}, {"b", 1, plans}}
		got, errs := gather(t, s, background(len(reqs)), reqs)()
		for _, i := range []int{0, 2} {
			require.NoError(t, errs[i], "%s: request %d", name, i)
			assert.True(t, got[i].Allowed, "%s: request %d", name, i)
		}
		var rerr *redisscript.Error
		require.ErrorAs(t, errs[1], &rerr, name)
		assert.Equal(t, "NOPERM", rerr.Class, name)
	}
}
