package tollgate

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// takeWindow decides cost on window plan p alone, as the stores do, and
// writes what they would write: a window ahead of now is written back
// into now's sub-window by any decision that asks for tokens.
func takeWindow(w *window, p Plan, now, cost int64, u uint64) bool {
	ok, _ := chain([]Plan{p}, make([]TokenBucket, 1), []*window{w}, now, cost, u)
	if cost > 0 && w.ahead(now) {
		w.add(&p, now, 0, 0)
	}
	if cost > 0 && (ok || p.Suppress != 0) {
		admitted := int64(0)
		if ok {
			admitted = cost
		}
		w.add(&p, now, admitted, cost)
	}
	return ok
}

// clone returns a deep copy of w.
func (w *window) clone() *window {
	c := *w
	c.admitted, c.offered = slices.Clone(w.admitted), slices.Clone(w.offered)
	return &c
}

func TestWindowSteps(t *testing.T) {
	// 3 per second in 4 sub-windows of 250 ms; t0 starts a sub-window.
	p := Plan{Name: "w", Capacity: 3, Window: time.Second, Slots: 4}
	const ms = 1000
	type step struct {
		at      int64 // µs after t0
		cost    int64
		ok      bool
		readyAt int64 // µs after t0 at which cost fits, before the step
		count   int64 // admitted in the window after the step
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"fill, deny, and the oldest sub-window leaves whole", []step{
			{0, 1, true, 0, 1},
			{100 * ms, 2, true, 100 * ms, 3},
			{200 * ms, 1, false, 1250 * ms, 3},
			// Exactly one Window after the first admission the exact log
			// would admit; the grid waits until the whole sub-window left.
			{1000 * ms, 1, false, 1250 * ms, 3},
			{1250*ms - 1, 1, false, 1250 * ms, 3},
			{1250 * ms, 1, true, 1250 * ms, 1},
		}},
		{"a straddling sub-window counts in full", []step{
			{240 * ms, 3, true, 240 * ms, 3},    // sub-window 0, near its end
			{1240 * ms, 1, false, 1250 * ms, 3}, // 1 s later, still counted
			{1250 * ms, 3, true, 1250 * ms, 3},
		}},
		{"only as many old sub-windows leave as the cost needs", []step{
			{0, 1, true, 0, 1},
			{300 * ms, 1, true, 300 * ms, 2},
			{600 * ms, 1, true, 600 * ms, 3},
			{700 * ms, 2, false, 1500 * ms, 3}, // sub-windows 0 and 1 must leave
			{1250 * ms, 1, true, 1250 * ms, 3},
		}},
		{"cost 0 reads", []step{
			{0, 3, true, 0, 3},
			{0, 0, true, 1250 * ms, 3}, // a read asks about one token
		}},
		{"a clock step back still counts later sub-windows", []step{
			{750 * ms, 3, true, 750 * ms, 3},
			{100 * ms, 1, false, 2000 * ms, 3},
		}},
		{"a window far ahead of the clock counts in now's sub-window", []step{
			{10_000 * ms, 3, true, 10_000 * ms, 3},
			{0, 3, false, 1250 * ms, 3}, // the denial writes the counts back at 0
			{1250*ms - 1, 1, false, 1250 * ms, 3},
			{1250 * ms, 3, true, 1250 * ms, 3},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w := &window{}
			for i, s := range tt.steps {
				now := t0 + s.at
				assert.Equal(t, t0+s.readyAt, w.readyAt(&p, now, max(s.cost, 1)), "step %d: readyAt", i)
				assert.Equal(t, s.ok, takeWindow(w, p, now, s.cost, 0), "step %d: take %d at %d", i, s.cost, s.at)
				count, _ := w.counts(now)
				assert.Equal(t, s.count, count, "step %d: count", i)
			}
		})
	}
}

func TestWindowNearTheEpoch(t *testing.T) {
	// Sub-windows before 0 have negative numbers; the rings still work.
	p := Plan{Name: "w", Capacity: 2, Window: time.Second, Slots: 4}
	w := &window{}
	assert.True(t, takeWindow(w, p, 0, 1, 0))
	assert.True(t, takeWindow(w, p, 500_000, 1, 0))
	assert.False(t, takeWindow(w, p, 600_000, 1, 0))
	count, _ := w.counts(600_000)
	assert.Equal(t, int64(2), count)
	assert.Equal(t, int64(1_250_000), w.readyAt(&p, 600_000, 1))
	assert.Equal(t, int64(1_750_000), w.resetAt(600_000))
}

func TestWindowWidthRoundsUp(t *testing.T) {
	for _, tt := range []struct {
		window time.Duration
		slots  int
		width  int64
	}{
		{time.Second, 0, 50_000},
		{time.Second, 3, 333_334},
		{time.Millisecond, 64, 16},
		{time.Millisecond + 1, 1, 1001}, // a nanosecond more is a µs more
	} {
		p := Plan{Name: "w", Capacity: 1, Window: tt.window, Slots: tt.slots}
		assert.Equal(t, tt.width, p.width(), "%v in %d", tt.window, tt.slots)
		assert.GreaterOrEqual(t, p.width()*p.slots(), tt.window.Microseconds(), "k sub-windows span the window")
	}
}

func TestSuppressionSteps(t *testing.T) {
	// Soft limit 10, hard limit 15, in one sub-window of a minute.
	p := Plan{Name: "s", Capacity: 10, Window: time.Minute, Slots: 1, Suppress: 1.5}
	w := &window{}
	for i := range 10 {
		assert.True(t, takeWindow(w, p, t0, 1, 0), "request %d: below the soft limit, even with u = 0", i)
	}
	// offered 10, admitted 10: the next request would make 11 of 11.
	factor := func(offered float64) float64 { return 1 - 10/offered } // at run time, as the stores compute it
	assert.Equal(t, factor(11), suppression(&p, 10, 10, 1))
	half := uint64(randomScale / 2)
	assert.False(t, takeWindow(w, p, t0, 1, 0), "u = 0 is refused in the band")
	assert.Equal(t, factor(12), suppression(&p, 10, 11, 1), "the refusal counts as offered load")
	assert.True(t, takeWindow(w, p, t0, 1, half), "u = 1/2 passes at a factor of 1/6")
	for range 4 {
		assert.True(t, takeWindow(w, p, t0, 1, randomScale-1))
	}
	assert.Equal(t, 1.0, suppression(&p, 15, 20, 1), "past the hard limit")
	assert.False(t, takeWindow(w, p, t0, 1, randomScale-1), "past the hard limit no draw passes")
	admitted, offered := w.counts(t0)
	assert.Equal(t, int64(15), admitted)
	assert.Equal(t, int64(17), offered)
	// Certain admission again once the sub-window has left.
	assert.Equal(t, (t0/p.width()+2)*p.width(), w.readyAt(&p, t0, 1))
}

// FuzzWindow drives a window plan through fuzzed steps and checks it
// against a log of every admission: no span of Window ever holds more
// than Capacity; a refusal of a plain window is justified, the log
// holding more than Capacity − cost over the last (k+1)·g µs (Window +
// Window/k, and up to k µs more where g is rounded up); readyAt is the
// first µs at which the request passes; and nothing is ever negative.
// The bound on admissions holds in real time, which a clock step back
// does not move: a second log stamps each admission with the time elapsed
// in steps forward, and no span of Window of it holds more than Capacity,
// however far the clock stepped back. A step back ends the check of
// refusals, since the window still counts what was admitted at clock
// times the clock now reaches again. The suppressed form never passes
// its hard limit.
func FuzzWindow(f *testing.F) {
	f.Add(int64(3), uint32(1_000_000), uint8(4), false, []byte{0, 1, 0, 1, 1, 1, 0, 1, 2, 0, 9, 1, 3, 1, 0, 0})
	f.Add(int64(100), uint32(60_000_000), uint8(0), true, []byte{2, 0, 5, 9, 1, 1, 1, 200, 2, 7, 0, 3})
	f.Add(int64(1), uint32(1_000), uint8(64), false, []byte{0, 0, 1, 1, 0, 0, 16, 1, 0, 0, 15, 1})
	f.Fuzz(func(t *testing.T, capacity int64, windowUs uint32, slots uint8, suppress bool, ops []byte) {
		p := Plan{Name: "f", Capacity: capacity, Window: time.Duration(windowUs) * time.Microsecond, Slots: int(slots)}
		if suppress {
			p.Suppress = 1.5
		}
		if p.validateNumbers() != nil {
			return
		}
		// The grid counts k+1 sub-windows of g µs: a look-back of at most
		// (k+1)·g, which is Window + Window/k when g divides evenly and
		// up to k µs more when g is rounded up.
		W, g := p.Window.Microseconds(), p.width()
		lookBack := (p.slots() + 1) * g
		limit := p.Capacity
		if suppress {
			limit = p.hardLimit()
		}
		w := &window{}
		now := t0
		type admission struct{ at, cost int64 }
		var log, lived []admission                            // by the clock, and by real time
		monotonic := true                                     // no step back yet: the log holds every count
		elapsed := int64(0)                                   // real time: the sum of the steps forward
		in := func(log []admission, from int64) (sum int64) { // admitted after from
			for _, a := range log {
				if a.at > from {
					sum += a.cost
				}
			}
			return sum
		}
		for step := 0; len(ops) >= 4; step++ {
			op := ops[:4]
			ops = ops[4:]
			scale := []int64{1, 1_000, 1_000_000, g}[op[0]%4]
			delta := int64(int8(op[1])) * scale
			if delta < 0 {
				log, monotonic = nil, false // a new log: see the doc comment
			}
			was := now
			now = min(max(now+delta, 0), t0+maxRefillPeriod.Microseconds())
			elapsed += max(now-was, 0)
			cost := min(int64(op[2]), p.Capacity)
			u := uint64(op[3]) << 45

			ready := w.readyAt(&p, now, max(cost, 1))
			if ready < now {
				t.Fatalf("step %d: readyAt %d before now %d", step, ready, now)
			}
			if !suppress && cost > 0 && ready > now {
				// After the refusal at now, which writes back a window
				// ahead of now.
				refused := w.clone()
				takeWindow(refused, p, now, cost, u)
				if !takeWindow(refused.clone(), p, ready, cost, u) {
					t.Fatalf("step %d: refused at readyAt %d", step, ready)
				}
				if ready-1 > now && takeWindow(refused, p, ready-1, cost, u) {
					t.Fatalf("step %d: passes at %d, before readyAt %d", step, ready-1, ready)
				}
			}
			ok := takeWindow(w, p, now, cost, u)
			if !suppress && cost > 0 && ok != (ready == now) {
				t.Fatalf("step %d: take = %v, but readyAt %d (now %d)", step, ok, ready, now)
			}
			for _, c := range append(slices.Clone(w.admitted), w.offered...) {
				if c < 0 {
					t.Fatalf("step %d: negative count %d", step, c)
				}
			}
			if cost == 0 {
				continue
			}
			if ok {
				log, lived = append(log, admission{now, cost}), append(lived, admission{elapsed, cost})
				if sum := in(lived, elapsed-W); sum > limit {
					t.Fatalf("step %d: %d admitted in the Window of real time ending %d, limit %d", step, sum, elapsed, limit)
				}
			} else if !suppress && monotonic && in(log, now-lookBack)+cost <= p.Capacity {
				t.Fatalf("step %d: refused %d with %d admitted in the last (k+1)·g µs", step, cost, in(log, now-lookBack))
			}
		}
	})
}

// TestSuppressionConverges offers a suppressed plan twice and four times
// its soft limit S, evenly, for 54 windows, and counts what passes in each
// of the 50 windows after the first four, while the offered count builds
// up: within 5% of S each time, and never more than the hard limit in any
// span of Window. The draws are seeded, so the test is repeatable; over
// 20 seeds the largest deviation was 4.3% (2S) and 4.1% (4S).
func TestSuppressionConverges(t *testing.T) {
	const (
		S       = 1000
		windows = 54
		warmup  = 4
	)
	p := Plan{Name: "s", Capacity: S, Window: time.Second, Suppress: 1.5}
	W := p.Window.Microseconds()
	for _, load := range []int64{2, 4} {
		t.Run(fmt.Sprintf("%dS", load), func(t *testing.T) {
			now := (t0/W + 1) * W // windows start on a sub-window
			start := now
			m := newClockedMemoryStore(&now)
			m.random = sameDraws()
			gap := W / (load * S)
			var admitted []int64 // times
			for i := int64(0); i < windows*load*S; i++ {
				now = start + i*gap
				r, err := m.Take(context.Background(), "k", 1, []Plan{p})
				require.NoError(t, err)
				if r.Allowed {
					admitted = append(admitted, now)
				}
			}
			perWindow := make([]int, windows)
			for _, at := range admitted {
				perWindow[(at-start)/W]++
			}
			t.Logf("admitted per window: %v", perWindow)
			for i := warmup; i < windows; i++ {
				assert.InDelta(t, S, perWindow[i], 0.05*S, "window %d", i)
			}
			most, j := 0, 0
			for i, at := range admitted { // the most in any span of Window
				for admitted[j] <= at-W {
					j++
				}
				most = max(most, i-j+1)
			}
			assert.LessOrEqual(t, int64(most), p.hardLimit())
		})
	}
}

// windowChildEnv carries a windowJob to the test binary run as a child
// process by TestWindowExactAcrossProcessesOnRealRedis.
const windowChildEnv = "TOLLGATE_WINDOW_CHILD"

type windowJob struct {
	Addr    string        `json:"addr"`
	Prefix  string        `json:"prefix"`
	Workers int           `json:"workers"`
	Run     time.Duration `json:"run"`
}

// windowEvent is one decision, at the Redis time its script read.
type windowEvent struct {
	At      int64 `json:"at"`
	Cost    int64 `json:"cost"`
	Allowed bool  `json:"allowed"`
}

// windowProof is the window plan the processes share, chained after a
// bucket that binds now and then: 50 in any 200 ms, in 10 ms sub-windows.
var windowProof = []Plan{
	{Name: "burst", Capacity: 20, Rate: 400},
	{Name: "win", Capacity: 50, Window: 200 * time.Millisecond},
}

// TestWindowChildProcess is not a test of its own: the parent test runs
// the test binary again with this test selected and a job in its
// environment. It decides through the store's own script call and reply
// parser, so that it knows the Redis time of each decision, and prints
// every decision as JSON.
func TestWindowChildProcess(t *testing.T) {
	spec := os.Getenv(windowChildEnv)
	if spec == "" {
		t.Skip("runs only as a child of TestWindowExactAcrossProcessesOnRealRedis")
	}
	var job windowJob
	require.NoError(t, json.Unmarshal([]byte(spec), &job))
	c := redis.NewClient(&redis.Options{Addr: job.Addr})
	defer c.Close()
	s := NewRedisStore(c, WithKeyPrefix(job.Prefix))
	keys := []string{s.Key("shared", windowProof[0].Name), s.Key("shared", windowProof[1].Name)}
	var mu sync.Mutex
	var events []windowEvent
	var wg sync.WaitGroup
	deadline := time.Now().Add(job.Run)
	for w := range job.Workers {
		wg.Go(func() {
			for i := 0; time.Now().Before(deadline); i++ {
				cost := int64(1 + (i+w)%3)
				reply, err := s.scripts.limit.Run(context.Background(), c, keys, s.args(cost, windowProof)...)
				require.NoError(t, err)
				allowed, now, _, err := parseReply(make([]TokenBucket, 2), make([]planState, 2), reply, windowProof, cost)
				require.NoError(t, err)
				mu.Lock()
				events = append(events, windowEvent{now, cost, allowed})
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	out, err := json.Marshal(events)
	require.NoError(t, err)
	fmt.Printf("%s\n", out)
}

// TestWindowExactAcrossProcessesOnRealRedis runs 4 processes of 16
// goroutines each on one key, chained bucket then window, and slides the
// window over every admission at the Redis time its script read: never
// more than the window's Capacity in any span of its Window, and every
// refusal that the bucket does not explain justified by the admissions
// of the last Window + Window/k.
func TestWindowExactAcrossProcessesOnRealRedis(t *testing.T) {
	if os.Getenv(windowChildEnv) != "" {
		t.Skip("a child runs only TestWindowChildProcess")
	}
	addr := redistest.Addr(t)
	var events []windowEvent
	for _, line := range runChildren(t, 4, "TestWindowChildProcess", windowChildEnv,
		windowJob{Addr: addr, Prefix: redistest.KeyPrefix(), Workers: 16, Run: time.Second}) {
		var evs []windowEvent
		require.NoError(t, json.Unmarshal([]byte(line), &evs))
		events = append(events, evs...)
	}
	slices.SortStableFunc(events, func(a, b windowEvent) int { return cmp.Compare(a.At, b.At) })

	win := windowProof[1]
	W, g := win.Window.Microseconds(), win.width()
	var admitted []windowEvent
	for _, e := range events {
		if e.Allowed {
			admitted = append(admitted, e)
		}
	}
	// The most admitted in any span of W: spans that end on an admission.
	most, sum, j := int64(0), int64(0), 0
	for _, a := range admitted {
		sum += a.Cost
		for admitted[j].At <= a.At-W {
			sum -= admitted[j].Cost
			j++
		}
		most = max(most, sum)
	}
	// Replay the bucket over every decision in Redis-time order: each
	// admission must find its tokens in the bucket (all or nothing), and
	// each refusal must lack them in the bucket, or in the window, which
	// counted at least what was admitted in the last Window + Window/k.
	// At one µs, admissions replay before refusals.
	slices.SortStableFunc(events, func(a, b windowEvent) int {
		if c := cmp.Compare(a.At, b.At); c != 0 {
			return c
		}
		return cmp.Compare(btoi(b.Allowed), btoi(a.Allowed))
	})
	bucket := fullBucket(windowProof[0], events[0].At)
	unjustified, overdrawn, refusals, first := 0, 0, 0, 0
	for _, e := range events {
		bucket = bucket.Refill(windowProof[0], e.At)
		if e.Allowed {
			if bucket.Tokens < e.Cost*microTokens {
				overdrawn++
			}
			bucket.Tokens -= e.Cost * microTokens
			continue
		}
		refusals++
		for admitted[first].At <= e.At-W-g && first < len(admitted)-1 {
			first++
		}
		var recent int64
		for _, a := range admitted[first:] {
			if a.At > e.At {
				break
			}
			if a.At > e.At-W-g {
				recent += a.Cost
			}
		}
		if recent+e.Cost <= win.Capacity && bucket.Tokens >= e.Cost*microTokens {
			unjustified++
		}
	}
	t.Logf("%d decisions, %d admitted, %d refused; most in any %v: %d of %d", len(events), len(admitted), refusals, win.Window, most, win.Capacity)
	assert.LessOrEqual(t, most, win.Capacity, "a span of Window held more than Capacity")
	assert.Zero(t, unjustified, "refusals with room in the window and the bucket")
	assert.Zero(t, overdrawn, "admissions the bucket had no tokens for")
	assert.Greater(t, len(admitted), int(win.Capacity), "the load must get past the first window")
	assert.Positive(t, refusals, "the load must push past the limit")
}

// runChildren runs n processes of this test binary, each running only
// test with job, as JSON, in its environment variable env, and returns
// the first line each printed.
func runChildren(t *testing.T, n int, test, env string, job any) []string {
	t.Helper()
	spec, err := json.Marshal(job)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute) // a hung child is killed
	defer cancel()
	var cmds []*exec.Cmd
	var outs []*bytes.Buffer
	for range n {
		cmd := exec.CommandContext(ctx, os.Args[0], "-test.run=^"+test+"$", "-test.count=1")
		cmd.Env = append(os.Environ(), env+"="+string(spec))
		out := &bytes.Buffer{}
		cmd.Stdout, cmd.Stderr = out, out
		require.NoError(t, cmd.Start())
		cmds, outs = append(cmds, cmd), append(outs, out)
	}
	lines := make([]string, n)
	for i, cmd := range cmds {
		require.NoError(t, cmd.Wait(), "child %d:\n%s", i, outs[i])
		lines[i], _, _ = strings.Cut(outs[i].String(), "\n")
	}
	return lines
}

func btoi(b bool) int {
	if b {
		return 1
	}
	return 0
}

// TestWindowChainRetryAfterIsExact chains a bucket and a window on both
// stores and checks the binding plan and RetryAfter of each refusal: the
// same request is refused 1 µs before RetryAfter and passes at it.
func TestWindowChainRetryAfterIsExact(t *testing.T) {
	plans := []Plan{
		{Name: "sec", Capacity: 2, Rate: 1},
		{Name: "win", Capacity: 3, Window: 10 * time.Second, Slots: 5},
	}
	stores := map[string]func(t *testing.T) (Store, func(int64)){
		"memory": func(t *testing.T) (Store, func(int64)) {
			now := new(int64)
			return newClockedMemoryStore(now), func(us int64) { *now = us }
		},
		"redis": func(t *testing.T) (Store, func(int64)) {
			s, _, setTime := newMiniredisStore(t)
			return s, setTime
		},
	}
	for name, newStore := range stores {
		t.Run(name, func(t *testing.T) {
			store, setTime := newStore(t)
			l, err := New(store, plans, WithDenialCache(0))
			require.NoError(t, err)
			ctx := context.Background()
			now := (t0/2_000_000 + 1) * 2_000_000 // a sub-window starts
			setTime(now)
			take := func(cost int64) Result {
				r, err := l.AllowN(ctx, "k", cost, "sec", "win")
				require.NoError(t, err)
				return r
			}
			// retryAt checks that cost is refused by plan just before its
			// RetryAfter, passes at it, and moves the clock there.
			retryAt := func(cost int64, plan string) {
				r := take(cost)
				require.False(t, r.Allowed)
				assert.Equal(t, plan, r.Plan, "the binding plan")
				at := now + r.RetryAfter.Microseconds()
				setTime(at - 1)
				assert.False(t, take(cost).Allowed, "%s: passes before RetryAfter %v", plan, r.RetryAfter)
				setTime(at)
				assert.True(t, take(cost).Allowed, "%s: refused at RetryAfter %v", plan, r.RetryAfter)
				now = at
			}
			require.True(t, take(2).Allowed)
			retryAt(1, "sec") // the bucket is empty; the window has room for 1
			r := take(1)
			require.False(t, r.Allowed)
			assert.Equal(t, "win", r.Plan, "the window is full, the bucket refills in 1 s")
			prs := r.PlanResults()
			assert.Equal(t, time.Second, prs[0].RetryAfter)
			assert.Equal(t, int64(0), prs[1].Remaining)
			retryAt(1, "win")
		})
	}
}

// TestWindowMemoryOnRealRedis measures MEMORY USAGE of a window whose
// every sub-window holds a count, beside a bucket's (README), and checks
// that a plain window of up to 64 sub-windows stays a listpack, Redis's
// compact encoding of small hashes (hash-max-listpack-entries 128).
func TestWindowMemoryOnRealRedis(t *testing.T) {
	c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
	ctx := context.Background()
	s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	_, err := s.Take(ctx, "k", 1, []Plan{{Name: "bucket", Capacity: 100, Rate: 1}})
	require.NoError(t, err)
	bucket, err := c.MemoryUsage(ctx, s.Key("k", "bucket")).Result()
	require.NoError(t, err)
	t.Logf("bucket: %d B", bucket)
	for _, p := range []Plan{
		{Name: "w1", Capacity: 1000, Window: time.Minute, Slots: 1},
		{Name: "w20", Capacity: 1000, Window: time.Minute},
		{Name: "w64", Capacity: 1000, Window: time.Minute, Slots: 64},
		{Name: "s20", Capacity: 1000, Window: time.Minute, Suppress: 1.5},
	} {
		key := s.Key("k", p.Name)
		r := takeFromFullWindow(t, s, key, p)
		require.Equal(t, 1000-7*(p.slots()+1)-1, r.Remaining, "plan %s", p.Name)
		used, err := c.MemoryUsage(ctx, key).Result()
		require.NoError(t, err)
		enc, err := c.ObjectEncoding(ctx, key).Result()
		require.NoError(t, err)
		t.Logf("%s: %d B (%s)", p.Name, used, enc)
		if p.Suppress == 0 {
			assert.Equal(t, "listpack", enc, "plan %s", p.Name)
		}
	}
}

// takeFromFullWindow plants at key a window of plan p that counts 7 in
// each of its sub-windows that count at Redis's now (and has offered 12 in
// each, if it is suppressed), and takes 1 from it. A planted sub-window
// leaves the count if Redis's clock enters a new one between the planting
// and the take; then it plants and takes again.
func takeFromFullWindow(t *testing.T, s *RedisStore, key string, p Plan) Result {
	ctx := context.Background()
	c := s.client
	subWindow := func() int64 {
		now, err := c.Time(ctx).Result()
		require.NoError(t, err)
		return now.UnixMicro() / p.width()
	}
	for {
		newest := subWindow()
		fields := []any{"v", fmt.Sprintf("%c%d/%d", "ws"[btoi(p.Suppress != 0)], p.width(), p.slots())}
		for i := newest - p.slots(); i <= newest; i++ {
			fields = append(fields, strconv.FormatInt(i, 10), 7)
			if p.Suppress != 0 {
				fields = append(fields, "o"+strconv.FormatInt(i, 10), 12)
			}
		}
		require.NoError(t, c.Del(ctx, key).Err())
		require.NoError(t, c.HSet(ctx, key, fields...).Err())
		r, err := s.Take(ctx, "k", 1, []Plan{p}) // the script reads it as its own
		require.NoError(t, err)
		if subWindow() == newest {
			return r
		}
	}
}

// TestWindowReplacesForeignData plants what a window plan's key may hold
// that is not its own window (another type, a bucket of the same name,
// a window of another width whose counts have all left, garbage counts):
// it reads as an empty window, a refusal writes nothing, and the next
// admission replaces it with the window alone. A window of another shape
// that still counts is carried over (TestWindowShapeChangeCarriesCounts),
// and counts far ahead of the clock count (TestWindowFarAheadGarbage).
func TestWindowReplacesForeignData(t *testing.T) {
	ctx := context.Background()
	win := Plan{Name: "api", Capacity: 3, Window: time.Second, Slots: 4} // v = w250000/4
	b := strconv.FormatInt(t0/250_000, 10)
	tests := []struct {
		name  string
		plant func(c *redis.Client, key string) error
	}{
		{"string", func(c *redis.Client, key string) error { return c.Set(ctx, key, "hello", 0).Err() }},
		{"a bucket of the same name", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "t", "0", "ts", t0, "v", "1").Err()
		}},
		{"a window of another width, its counts gone", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "v", "w100000/4", b, "3").Err()
		}},
		{"no schema", func(c *redis.Client, key string) error { return c.HSet(ctx, key, b, "3").Err() }},
		{"garbage count", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "v", "w250000/4", b, "lots").Err()
		}},
		{"negative count", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "v", "w250000/4", b, "-3").Err()
		}},
		{"fractional sub-window", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "v", "w250000/4", b+".5", "3").Err()
		}},
		// Counts and names Lua's tonumber reads as whole numbers, but on
		// which HINCRBY would fail for ever.
		{"count 1.0", func(c *redis.Client, key string) error { return c.HSet(ctx, key, "v", "w250000/4", b, "1.0").Err() }},
		{"count 1e0", func(c *redis.Client, key string) error { return c.HSet(ctx, key, "v", "w250000/4", b, "1e0").Err() }},
		{"count 0x1", func(c *redis.Client, key string) error { return c.HSet(ctx, key, "v", "w250000/4", b, "0x1").Err() }},
		{"count with a space", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "v", "w250000/4", b, " 1").Err()
		}},
		{"sub-window in exponent form", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "v", "w250000/4", "1e3", "1").Err()
		}},
		{"a stranger field", func(c *redis.Client, key string) error {
			return c.HSet(ctx, key, "v", "w250000/4", "t", "3").Err()
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, mr, _ := newMiniredisStore(t)
			c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
			defer c.Close()
			key := s.Key("k", win.Name)
			require.NoError(t, tt.plant(c, key))
			before := mr.Dump()

			r, err := s.Take(ctx, "k", 0, []Plan{win})
			require.NoError(t, err, "a read must not fail")
			assert.Equal(t, int64(3), r.Remaining, "foreign data reads as an empty window")
			assert.Equal(t, before, mr.Dump(), "a read writes nothing")
			r, err = s.Take(ctx, "k", 1, []Plan{{Name: "other", Capacity: 1, Rate: 1}, win})
			require.NoError(t, err)
			require.True(t, r.Allowed)
			r, err = s.Take(ctx, "k", 1, []Plan{{Name: "other", Capacity: 1, Rate: 1}, win})
			require.NoError(t, err)
			require.False(t, r.Allowed, "the bucket refuses")
			mr.Del(s.Key("k", "other"))

			r, err = s.Take(ctx, "k", 2, []Plan{win})
			require.NoError(t, err)
			assert.True(t, r.Allowed)
			assert.Equal(t, int64(0), r.Remaining)
			fields, err := c.HGetAll(ctx, key).Result()
			require.NoError(t, err)
			assert.Equal(t, map[string]string{"v": "w250000/4", "c": "3", b: "3"}, fields)

			full := mr.Dump()
			r, err = s.Take(ctx, "k", 1, []Plan{win})
			require.NoError(t, err)
			assert.False(t, r.Allowed)
			assert.Equal(t, full, mr.Dump(), "a refusal writes nothing")
		})
	}
}

// TestWindowShapeChangeCarriesCounts alternates two versions of a plan,
// as a rolling deploy does: another Slots, then another Window, then
// suppression switched on and off. The counts of the old shape move into
// the new one, so the key never admits more than the larger limit in a
// window; both stores agree on every decision.
func TestWindowShapeChangeCarriesCounts(t *testing.T) {
	ctx := context.Background()
	base := Plan{Name: "api", Capacity: 10, Window: time.Minute}
	for _, tt := range []struct {
		name  string
		other Plan
		limit int64
	}{
		{"slots", Plan{Name: "api", Capacity: 10, Window: time.Minute, Slots: 30}, 10},
		{"window", Plan{Name: "api", Capacity: 10, Window: time.Minute + 500*time.Millisecond}, 10},
		{"suppressed", Plan{Name: "api", Capacity: 10, Window: time.Minute, Suppress: 1.5}, 15},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rs, _, setTime := newMiniredisStore(t)
			now := t0
			ms := newClockedMemoryStore(&now)
			rs.random, ms.random = sameDraws(), sameDraws()
			admitted := int64(0)
			for i := range 40 {
				now = t0 + int64(i)*1000 // 40 requests in 40 ms
				setTime(now)
				p := []Plan{base, tt.other}[i%2]
				got, err := rs.Take(ctx, "k", 1, []Plan{p})
				require.NoError(t, err)
				want, err := ms.Take(ctx, "k", 1, []Plan{p})
				require.NoError(t, err)
				require.Equal(t, want, got, "step %d: Lua and MemoryStore disagree", i)
				if got.Allowed {
					admitted++
				}
			}
			assert.LessOrEqual(t, admitted, tt.limit, "the versions together")
			assert.GreaterOrEqual(t, admitted, base.Capacity, "the first version's limit at least")
		})
	}
}

// TestWindowShapeChangeRetryAfterIsExact fills a window, and near the
// end of its window asks a plan of the name of another shape, on both
// stores: the denial writes nothing, so the counts stay in the old shape
// and leave when it says. RetryAfter, which the denial cache remembers,
// is the wait until then, not a whole window of the new shape.
func TestWindowShapeChangeRetryAfterIsExact(t *testing.T) {
	old := Plan{Name: "api", Capacity: 10, Window: time.Minute} // 20 sub-windows of 3 s
	for _, other := range []Plan{
		{Name: "api", Capacity: 10, Window: time.Minute, Slots: 30},
		{Name: "api", Capacity: 8, Window: 2 * time.Minute},
		{Name: "api", Capacity: 10, Window: time.Minute, Slots: 30, Shadow: true},
	} {
		t.Run(fmt.Sprint(other.Window, other.Slots, other.Shadow), func(t *testing.T) {
			b := newBothStores(t)
			require.True(t, b.take(t, 10, old).Allowed)
			leaves := (t0/old.width() + 1 + old.slots()) * old.width()
			b.now = leaves - time.Second.Microseconds()
			r := b.take(t, 1, other)
			require.False(t, r.Allowed && !other.Shadow)
			require.True(t, !other.Shadow || r.ShadowDenied)
			assert.Equal(t, time.Second, r.PlanResults()[0].RetryAfter, "until the old shape's counts leave")
			b.now = leaves - 1
			require.False(t, b.take(t, 0, other).PlanResults()[0].RetryAfter == 0, "a µs before")
			b.now = leaves
			assert.True(t, b.take(t, 1, other).Allowed, "the old shape's counts have left")
		})
	}
}

// TestChangeOfKindCarriesConsumption alternates a token bucket and a
// sliding window of one plan name on one key at one instant, as instances
// with either plan, SetPlans or a resolver do: each kind reads what the
// other has left, so together they admit no more than the larger
// capacity (and a suppressed window's band above its capacity), and no
// less than the smaller capacity. Both stores agree on every decision, whichever kind starts.
func TestChangeOfKindCarriesConsumption(t *testing.T) {
	ctx := context.Background()
	bucket := Plan{Name: "p", Capacity: 10, Rate: 1}
	win := Plan{Name: "p", Capacity: 10, Window: time.Minute}
	for _, tt := range []struct {
		name    string
		b, w    Plan
		bound   int64
		atLeast int64
	}{
		{"equal", bucket, win, 10, 10},
		{"a larger bucket", Plan{Name: "p", Capacity: 100, Rate: 1}, win, 100, 10},
		{"a larger window", bucket, Plan{Name: "p", Capacity: 100, Window: time.Minute}, 100, 10},
		{"a suppressed window", bucket, Plan{Name: "p", Capacity: 10, Window: time.Minute, Suppress: 1.5}, 15, 10},
		{"a versioned bucket that resets", Plan{Name: "p", Capacity: 10, Rate: 1, Version: 2, Inherit: InheritReset}, win, 10, 10},
	} {
		for first := range 2 {
			t.Run(fmt.Sprint(tt.name, "/", []string{"bucket", "window"}[first], " first"), func(t *testing.T) {
				rs, _, _ := newMiniredisStore(t)
				now := t0
				ms := newClockedMemoryStore(&now)
				rs.random, ms.random = sameDraws(), sameDraws()
				admitted := int64(0)
				for i := range 100 {
					p := []Plan{tt.b, tt.w}[(i+first)%2]
					got, err := rs.Take(ctx, "k", 1, []Plan{p})
					require.NoError(t, err)
					want, err := ms.Take(ctx, "k", 1, []Plan{p})
					require.NoError(t, err)
					require.Equal(t, want, got, "step %d: Lua and MemoryStore disagree", i)
					if got.Allowed {
						admitted++
					}
				}
				t.Logf("%d of 100 admitted", admitted)
				assert.LessOrEqual(t, admitted, tt.bound, "the kinds together")
				assert.GreaterOrEqual(t, admitted, tt.atLeast, "the smaller capacity at least")
			})
		}
	}
	t.Run("SetPlans", func(t *testing.T) {
		now := t0
		l, err := New(newClockedMemoryStore(&now), []Plan{bucket}, WithLogger(nil))
		require.NoError(t, err)
		admitted := 0
		for i := range 100 {
			require.NoError(t, l.SetPlans([]Plan{[]Plan{bucket, win}[i%2]}))
			r, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			if r.Allowed {
				admitted++
			}
		}
		assert.Equal(t, 10, admitted)
	})
}

// FuzzChangeOfKind has a token bucket and a sliding window of one plan
// name, of fuzzed capacities, take fuzzed costs from one key in a fuzzed
// order at one instant: since each kind reads what the other has left,
// never more, together they admit no more than the larger capacity, and
// a suppressed window's band above its capacity, up to its hard limit.
func FuzzChangeOfKind(f *testing.F) {
	f.Add(uint16(10), uint16(10), false, []byte{1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2, 1, 2})
	f.Add(uint16(100), uint16(10), true, []byte{9, 1, 3, 0, 255, 7, 2, 2, 2, 2, 130, 1})
	f.Add(uint16(1), uint16(64), false, []byte{0, 1, 0, 1, 3, 3, 3, 3})
	f.Fuzz(func(t *testing.T, capB, capW uint16, suppress bool, ops []byte) {
		b := Plan{Name: "p", Capacity: int64(capB), Rate: 1}
		w := Plan{Name: "p", Capacity: int64(capW), Window: time.Minute}
		if suppress {
			w.Suppress = 1.5
		}
		if b.validateNumbers() != nil || w.validateNumbers() != nil {
			return
		}
		now := t0
		m := newClockedMemoryStore(&now)
		m.random = sameDraws()
		limit := max(b.Capacity, w.Capacity)
		if suppress {
			limit += w.hardLimit() - w.Capacity // the band a suppressed window admits in
		}
		admitted := int64(0)
		for i, op := range ops {
			p := []Plan{b, w}[op%2]
			cost := min(int64(op/2)%8, p.Capacity)
			r, err := m.Take(context.Background(), "k", cost, []Plan{p})
			require.NoError(t, err)
			if r.Allowed {
				admitted += cost
			}
			if admitted > limit {
				t.Fatalf("op %d: %d admitted at one instant, limit %d", i, admitted, limit)
			}
		}
	})
}

// bothStores is a RedisStore on miniredis and a MemoryStore on one clock,
// now, in µs, which each take sets on both.
type bothStores struct {
	rs      *RedisStore
	mr      *miniredis.Miniredis
	setTime func(int64)
	ms      *MemoryStore
	now     int64
}

// newBothStores returns both stores at t0.
func newBothStores(t *testing.T) *bothStores {
	b := &bothStores{now: t0}
	b.rs, b.mr, b.setTime = newMiniredisStore(t)
	b.ms = newClockedMemoryStore(&b.now)
	return b
}

// take takes cost of key "k" on plan p in both stores at now, and demands
// the same Result of both.
func (b *bothStores) take(t *testing.T, cost int64, p Plan) Result {
	t.Helper()
	ctx := context.Background()
	b.setTime(b.now)
	got, err := b.rs.Take(ctx, "k", cost, []Plan{p})
	require.NoError(t, err)
	want, err := b.ms.Take(ctx, "k", cost, []Plan{p})
	require.NoError(t, err)
	require.Equal(t, want, got, "Lua and MemoryStore disagree")
	return got
}

// TestWindowClockFarBackKeepsCounts takes a window's capacity, steps the
// clock back by more than a Window (a failover to a server whose clock is
// behind, an NTP step), and asks for as much again at once, on both stores:
// nothing more is admitted. The counts move into the current sub-window of
// the new clock, a read reports them and writes nothing, the first denial
// writes them back there, and they leave one Window (and a sub-window)
// later, not when the clock catches up with them. A step back of half a
// Window keeps the counts where they were.
func TestWindowClockFarBackKeepsCounts(t *testing.T) {
	p := Plan{Name: "w", Capacity: 10, Window: time.Second} // 20 sub-windows of 50 ms
	for _, back := range []int64{1_040_000, 500_000, 3_600_000_000} {
		t.Run(fmt.Sprint(back), func(t *testing.T) {
			b := newBothStores(t)
			rs, mr, now := b.rs, b.mr, &b.now
			take := func(cost int64) Result {
				t.Helper()
				got := b.take(t, cost, p)
				assertSameWindow(t, rs, b.ms, "k", p, *now)
				return got
			}
			for range 10 {
				require.True(t, take(1).Allowed)
			}
			*now -= back
			before := mr.Dump()
			r := take(0)
			assert.Equal(t, int64(0), r.Remaining, "a read after the step back still counts all 10")
			assert.Equal(t, before, mr.Dump(), "a read writes nothing")
			for i := range 10 {
				assert.False(t, take(1).Allowed, "request %d after a step back of %d µs", i, back)
			}
			if back > p.Window.Microseconds() {
				// Written back into now's sub-window: it leaves when the
				// sub-window k+1 later begins.
				leaves := (*now/p.width() + 1 + p.slots()) * p.width()
				assert.Equal(t, time.Duration(leaves-*now)*time.Microsecond, take(1).RetryAfter)
				*now = leaves - 1
				assert.False(t, take(1).Allowed, "a µs before the counts leave")
				*now = leaves
				assert.True(t, take(1).Allowed, "the counts have left, one Window after the denial wrote them back")
			}
		})
	}
}

// TestWindowFarAheadGarbage plants a window whose counts lie 100
// sub-windows ahead of the clock, as garbage or a clock stepped back far
// would leave it: a read counts them and writes nothing, a refusal writes
// them back into now's sub-window, to expire with it, and they leave one
// Window and a sub-window later, not when the clock reaches them.
func TestWindowFarAheadGarbage(t *testing.T) {
	ctx := context.Background()
	win := Plan{Name: "api", Capacity: 3, Window: time.Second, Slots: 4} // v = w250000/4
	s, mr, setTime := newMiniredisStore(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer c.Close()
	key := s.Key("k", win.Name)
	require.NoError(t, c.HSet(ctx, key, "v", "w250000/4", strconv.FormatInt(t0/250_000+100, 10), "3").Err())
	before := mr.Dump()

	r, err := s.Take(ctx, "k", 0, []Plan{win})
	require.NoError(t, err)
	assert.Equal(t, int64(0), r.Remaining, "counts ahead of the clock count")
	assert.Equal(t, before, mr.Dump(), "a read writes nothing")
	r, err = s.Take(ctx, "k", 1, []Plan{win})
	require.NoError(t, err)
	require.False(t, r.Allowed)
	assert.Equal(t, 1250*time.Millisecond, r.RetryAfter)
	fields, err := c.HGetAll(ctx, key).Result()
	require.NoError(t, err)
	assert.Equal(t, map[string]string{"v": "w250000/4", "c": "3", strconv.FormatInt(t0/250_000, 10): "3"}, fields,
		"the refusal wrote the counts back into now's sub-window")
	assert.Positive(t, mr.TTL(key), "and the key expires with it")

	setTime(t0 + 1_250_000 - 1)
	r, err = s.Take(ctx, "k", 1, []Plan{win})
	require.NoError(t, err)
	assert.False(t, r.Allowed)
	setTime(t0 + 1_250_000)
	r, err = s.Take(ctx, "k", 3, []Plan{win})
	require.NoError(t, err)
	assert.True(t, r.Allowed, "the counts left one Window and a sub-window after the refusal")
}

// TestWindowFarBackAcrossAChange fills a window, steps the clock back an
// hour, and decides on a plan of the name of another shape or kind, on
// both stores: the new plan counts what the window holds, its refusal
// writes that back, so it admits again after its own RetryAfter, a Window
// or a refill, not an hour later.
func TestWindowFarBackAcrossAChange(t *testing.T) {
	win := Plan{Name: "w", Capacity: 10, Window: time.Second}
	for _, other := range []Plan{
		{Name: "w", Capacity: 10, Window: 2 * time.Second},
		{Name: "w", Capacity: 10, Window: time.Second, Suppress: 1.5},
		{Name: "w", Capacity: 10, Rate: 10},
	} {
		t.Run(fmt.Sprint(other.Window, other.Suppress, other.Rate), func(t *testing.T) {
			b := newBothStores(t)
			b.rs.random, b.ms.random = sameDraws(), sameDraws()
			require.True(t, b.take(t, 10, win).Allowed)
			b.now -= time.Hour.Microseconds()
			r := b.take(t, 10, other)
			require.False(t, r.Allowed, "the window's 10 still count")
			require.LessOrEqual(t, r.RetryAfter, 3*time.Second)
			b.now += r.RetryAfter.Microseconds()
			assert.True(t, b.take(t, 1, other).Allowed, "the refusal wrote the counts back: the wait counts down")
		})
	}
}

// TestWindowFarAheadOnRealRedis plants, on a real Redis, a full window
// whose counts lie 100 sub-windows ahead of Redis's clock, as a server
// whose clock is behind finds a window after a failover: the script
// counts them, refuses, and writes them back into the sub-window of its
// now, with the key set to expire with it.
func TestWindowFarAheadOnRealRedis(t *testing.T) {
	c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
	ctx := context.Background()
	s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
	p := Plan{Name: "ahead", Capacity: 3, Window: 10 * time.Second, Slots: 4} // v = w2500000/4
	key := s.Key("k", p.Name)
	require.NoError(t, c.Del(ctx, key).Err())
	from := redistest.Time(t, c) / p.width()
	require.NoError(t, c.HSet(ctx, key, "v", "w2500000/4", strconv.FormatInt(from+100, 10), "3").Err())
	r, err := s.Take(ctx, "k", 1, []Plan{p})
	require.NoError(t, err)
	to := redistest.Time(t, c) / p.width()
	assert.False(t, r.Allowed, "counts ahead of the clock count")
	assert.Equal(t, int64(0), r.Remaining)
	fields, err := c.HGetAll(ctx, key).Result()
	require.NoError(t, err)
	assert.Len(t, fields, 3, "v, c and one sub-window: %v", fields)
	assert.Equal(t, "3", fields["c"])
	found := false
	for b := from; b <= to; b++ {
		found = found || fields[strconv.FormatInt(b, 10)] == "3"
	}
	assert.True(t, found, "written back into now's sub-window, %d to %d: %v", from, to, fields)
	ttl, err := c.PTTL(ctx, key).Result()
	require.NoError(t, err)
	assert.Greater(t, ttl, 9*time.Second, "the key expires after the sub-window leaves, some 10 s on")
	assert.LessOrEqual(t, ttl, 12500*time.Millisecond+2*time.Millisecond)
}

// TestBucketAfterAWindowThatCountsNothing has a bucket of 10 read a
// window of 5 of its name whose counts have all left, on both stores:
// at the instant its last sub-window leaves, and after Redis expired the
// window's key (miniredis's TTLs moved on with FastForward). A window
// that counts nothing is what a missing one is, a full bucket, on both
// stores, whether the MemoryStore, which keeps keys resident, still holds
// it, or Redis did not yet expire it.
func TestBucketAfterAWindowThatCountsNothing(t *testing.T) {
	win := Plan{Name: "p", Capacity: 5, Window: time.Second} // 20 sub-windows of 50 ms
	bucket := Plan{Name: "p", Capacity: 10, Rate: 0.001}
	for _, after := range []int64{0, 3_000} { // µs after the last sub-window leaves
		t.Run(fmt.Sprint(after), func(t *testing.T) {
			b := newBothStores(t)
			require.True(t, b.take(t, 5, win).Allowed)
			leaves := (t0/win.width() + 1 + win.slots()) * win.width()
			b.mr.FastForward(time.Duration(leaves+after-b.now) * time.Microsecond)
			b.now = leaves + after
			r := b.take(t, 10, bucket)
			assert.True(t, r.Allowed, "the window counts nothing: the bucket is full")
		})
	}
}

// TestSuppressedOfferedCountPast2To53 offers a suppressed window of the
// largest capacity a million requests of its capacity in one
// sub-window, after it admitted one: the offered count passes 2^53,
// where a Lua number no longer holds it exactly. The window must still
// count what it admitted, on both stores alike, and admit no second
// capacity within its Window.
func TestSuppressedOfferedCountPast2To53(t *testing.T) {
	p := Plan{Name: "s", Capacity: maxCapacity, Window: time.Hour, Slots: 1, Suppress: 1}
	require.NoError(t, p.validate())
	b := newBothStores(t)
	b.rs.random, b.ms.random = sameDraws(), sameDraws()
	require.True(t, b.take(t, maxCapacity, p).Allowed)
	// What 999,998 refusals of the capacity offer, planted in the
	// MemoryStore through its own arithmetic, and in Redis as the
	// MemoryStore then holds it.
	e, unlock := lockedEntry(b.ms, "k")
	w := e.storeWindow(&p, b.now)
	w.add(&p, b.now, 0, maxCapacity*999_998)
	_, offered := w.counts(b.now)
	unlock()
	sub := strconv.FormatInt(b.now/p.width(), 10)
	require.NoError(t, b.rs.client.HSet(context.Background(), b.rs.Key("k", p.Name), "o"+sub, offered).Err())
	for i := range 3 {
		b.now += time.Second.Microseconds()
		r := b.take(t, maxCapacity, p)
		assert.False(t, r.Allowed, "request %d: a second capacity within the hour", i)
	}
}

// FuzzWindowStoresAgree drives one plan name on one key through fuzzed
// plans (a window, one of another shape, a suppressed one, and with
// buckets a token bucket), costs (0 reads) and clock moves on both
// stores, and demands the same Result of each at every step. The clock
// lands on sub-window boundaries, a µs before them, past the expiry of
// Redis's keys (miniredis's TTLs move with the clock through
// FastForward, as real Redis's do, also back) and steps back, a little
// and by more than a window, until it has moved forward 400 ms in all.
// Later, a key may have expired in Redis, which a step back does not bring
// back, where the MemoryStore, which forgets nothing below its bound,
// counts it again: the stores then disagree, the MemoryStore on the side
// of refusing (a window of the name counts again an admission that left
// it, or a window reads a bucket long full as the tokens it last stored).
// That is a known gap, not checked here; with a bucket, which a window
// reads as the tokens it stored, not refilled, a run ends there.
func FuzzWindowStoresAgree(f *testing.F) {
	f.Add(uint8(5), uint8(10), false, []byte{0, 0, 5, 3, 4, 0, 3, 5, 7})
	f.Add(uint8(3), uint8(3), false, []byte{2, 0, 3, 2, 1, 1, 0, 7, 2, 1, 3, 1, 2, 5, 3, 0, 4, 1})
	f.Add(uint8(10), uint8(4), false, []byte{0, 1, 4, 1, 6, 4, 2, 7, 3, 0, 3, 6, 2, 2, 2, 1, 0, 0})
	f.Fuzz(func(t *testing.T, capW, capB uint8, buckets bool, ops []byte) {
		plans := []Plan{
			{Name: "p", Capacity: int64(capW), Window: time.Second, Slots: 4},
			{Name: "p", Capacity: int64(capW), Window: 2 * time.Second, Slots: 5},
			{Name: "p", Capacity: int64(capW), Window: time.Second, Slots: 4, Suppress: 1.5},
		}
		if buckets {
			plans = append(plans, Plan{Name: "p", Capacity: int64(capB), Rate: 2})
		}
		for _, p := range plans {
			if p.validateNumbers() != nil {
				return
			}
		}
		b := newBothStores(t)
		b.rs.random, b.ms.random = sameDraws(), sameDraws()
		const g = 250_000   // the first plan's sub-window, µs
		forward := int64(0) // µs the clock moved forward, in all
		for step := 0; len(ops) >= 3; step++ {
			op := ops[:3]
			ops = ops[3:]
			p := plans[int(op[0])%len(plans)]
			at := []int64{b.now, b.now + 1, b.now + 1000, (b.now/g + 1) * g, (b.now/g+1)*g - 1,
				b.now + 1_250_000 + 3_000, b.now - 1000, b.now - 2_000_000}[op[1]%8]
			if at < b.now && forward >= 400_000 {
				at = b.now // see the doc comment
			}
			forward += max(at-b.now, 0)
			if buckets && forward >= 400_000 {
				break // see the doc comment: a bucket's key expires in 0.5 s at least
			}
			// Redis keeps a key's expiry as a time on its clock, so a step
			// back lengthens what is left of it, as a negative FastForward
			// does.
			b.mr.FastForward(time.Duration(at-b.now) * time.Microsecond)
			b.now = at
			cost := min(int64(op[2]%8), p.Capacity)
			t.Logf("step %d: plan %d at %d, cost %d", step, int(op[0])%len(plans), at-t0, cost)
			b.take(t, cost, p)
		}
	})
}
