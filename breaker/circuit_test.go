package breaker

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// epochUs is where the tests' Redis clock starts, in µs since the Unix
// epoch.
const epochUs = int64(1_800_000_000_000_000)

// scriptRunner runs circuit_breaker.lua on a miniredis whose clock the
// test sets.
type scriptRunner struct {
	mr  *miniredis.Miniredis
	c   *redis.Client
	key string
}

func newScriptRunner(t *testing.T) *scriptRunner {
	t.Helper()
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	return &scriptRunner{mr: mr, c: c, key: "tollgate:{k}:cb"}
}

// step runs in at now µs (Redis TIME), moving TTLs along too.
func (s *scriptRunner) step(t *testing.T, now int64, in input, p params) reply {
	t.Helper()
	s.mr.SetTime(time.UnixMicro(now))
	args := []any{in.op, strconv.FormatUint(in.token, 10), in.gen, in.b.calls, in.b.failures, in.b.slow, in.b.run, boolInt(in.b.succeeded)}
	args = append(args, p.args()...)
	raw, err := script.Run(context.Background(), s.c, []string{s.key}, args...)
	require.NoError(t, err)
	vals, err := redisscript.Ints(nil, raw, replyLen)
	require.NoError(t, err)
	return reply{vals[0], vals[1], vals[2], vals[3], vals[4], vals[5], vals[6], vals[7], vals[8], vals[9], vals[10], vals[11]}
}

var testParams = params{
	window: 1_000_000, minCalls: 4, rate: 500_000, slowRate: 0, consecutive: 0,
	openFor: 100_000, maxOpenFor: 400_000, probes: 2, probeTimeout: 50_000,
}

func TestCircuitTable(t *testing.T) {
	ok := batch{calls: 1, succeeded: true}
	fail := batch{calls: 1, failures: 1, run: 1}
	type step struct {
		at   int64 // µs after epochUs
		in   input
		want reply // only the fields named in check
	}
	// A trip, two probes, one failing (open time doubles), then closing.
	steps := []step{
		{0, input{op: opAcquire, token: 7}, reply{state: 0, gen: 0, grant: grantClosed}},
		{1, input{op: opRecord, gen: 0, b: fail}, reply{state: 0, calls: 1, failures: 1}},
		{2, input{op: opRecord, gen: 0, b: ok}, reply{state: 0, calls: 2, failures: 1}},
		{3, input{op: opRecord, gen: 0, b: ok}, reply{state: 0, calls: 3, failures: 1}},
		{4, input{op: opRecord, gen: 0, b: fail}, reply{state: 1, gen: 1, wait: 100_000, from: 1, trips: 1}},     // 2 of 4
		{5, input{op: opRecord, gen: 0, b: fail}, reply{state: 1, gen: 1, wait: 99_999, trips: 1, ignored: 1}},   // fenced
		{100_003, input{op: opAcquire, token: 9}, reply{state: 1, gen: 1, wait: 1, trips: 1}},                    // not yet
		{100_004, input{op: opAcquire, token: 9}, reply{state: 2, gen: 2, grant: grantProbe, from: 2, trips: 1}}, // lease 1
		{100_005, input{op: opAcquire, token: 10}, reply{state: 2, gen: 2, grant: grantProbe, trips: 1}},         // lease 2
		{100_006, input{op: opAcquire, token: 11}, reply{state: 2, gen: 2, wait: 49_998, trips: 1}},              // none left
		{100_007, input{op: opRecord, token: 9, gen: 2, b: ok}, reply{state: 2, gen: 2, trips: 1}},               // 1 of 2
		{100_008, input{op: opRecord, token: 9, gen: 2, b: ok}, reply{state: 2, gen: 2, trips: 1, ignored: 1}},   // twice
		{100_009, input{op: opRecord, token: 10, gen: 2, b: fail}, reply{state: 1, gen: 3, wait: 200_000, from: 3, trips: 1}},
		{300_009, input{op: opAcquire, token: 12}, reply{state: 2, gen: 4, grant: grantProbe, from: 2, trips: 1}},
		{400_000, input{op: opAcquire, token: 13}, reply{state: 2, gen: 4, grant: grantProbe, trips: 1}},        // 12's lease expired
		{400_001, input{op: opRecord, token: 12, gen: 4, b: ok}, reply{state: 2, gen: 4, trips: 1, ignored: 1}}, // too late
		{400_002, input{op: opAcquire, token: 14}, reply{state: 2, gen: 4, grant: grantProbe, trips: 1}},        // 12's slot again
		{400_003, input{op: opRecord, token: 13, gen: 4, b: ok}, reply{state: 2, gen: 4, trips: 1}},
		{400_004, input{op: opRecord, token: 14, gen: 4, b: ok}, reply{state: 0, gen: 5, from: 3, trips: 1}},
		{400_005, input{op: opRecord, gen: -1, b: fail}, reply{state: 0, gen: 5, trips: 1, calls: 1, failures: 1}}, // unfenced
		{400_006, input{op: opForceOpen}, reply{state: 1, gen: 6, wait: 100_000, from: 1, trips: 1, held: 1}},
		{9_000_000, input{op: opAcquire, token: 15}, reply{state: 1, gen: 6, wait: 100_000, trips: 1, held: 1}}, // held
		{9_000_001, input{op: opReset}, reply{state: 0, gen: 7, from: 2}},
	}
	sr := newScriptRunner(t)
	var c circuit
	for i, s := range steps {
		now := epochUs + s.at
		got := c.step(now, s.in, testParams)
		assert.Equal(t, s.want, got, "step %d: Go circuit.step(%+v)", i, s.in)
		lua := sr.step(t, now, s.in, testParams)
		assert.Equal(t, s.want, lua, "step %d: script(%+v)", i, s.in)
	}
}

// TestCircuitAgreesWithScript feeds the Go state machine and the script
// the same random steps, and demands the same replies.
func TestCircuitAgreesWithScript(t *testing.T) {
	seeds := uint64(6)
	if testing.Short() {
		seeds = 2 // one without and one with a slow-call rate
	}
	for seed := range seeds {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			rng := rand.New(rand.NewPCG(seed, 14))
			p := testParams
			p.consecutive = int64(rng.IntN(4))
			p.probes = int64(1 + rng.IntN(3))
			if seed%2 == 1 {
				p.slowRate = 700_000
			}
			sr := newScriptRunner(t)
			var c circuit
			now := epochUs
			var tokens []uint64
			var last reply
			for i := range 600 {
				now = randomStep(rng, now)
				in := randomInput(rng, last, tokens)
				if in.op == opAcquire {
					tokens = append(tokens, in.token)
				}
				got := c.step(now, in, p)
				lua := sr.step(t, now, in, p)
				require.Equal(t, lua, got, "step %d at %d: %+v", i, now-epochUs, in)
				last = got
			}
		})
	}
}

// randomStep returns the next instant after now, in µs: mostly up to 40 ms
// later, but now and then Redis's clock steps back, by up to one and a
// half windows (testParams') or by an hour.
func randomStep(rng *rand.Rand, now int64) int64 {
	switch n := rng.IntN(100); {
	case n < 4:
		return now - rng.Int64N(1_500_000)
	case n == 4:
		return now - int64(time.Hour/time.Microsecond)
	}
	return now + int64(rng.IntN(40_000))
}

// randomInput returns a step that is often meaningful: outcomes of the
// current generation, probes of tokens granted before.
func randomInput(rng *rand.Rand, last reply, tokens []uint64) input {
	in := input{op: opAcquire, token: rng.Uint64N(1<<40) + 1}
	switch n := rng.IntN(100); {
	case n < 35:
	case n < 85:
		in.op, in.token = opRecord, 0
		in.gen = last.gen
		if rng.IntN(10) == 0 {
			in.gen = max(last.gen-1, 0)
		}
		if rng.IntN(10) == 0 {
			in.gen = -1
		}
		if len(tokens) > 0 && rng.IntN(2) == 0 {
			in.token = tokens[len(tokens)-1-rng.IntN(min(len(tokens), 3))]
		}
		in.b = randomBatch(rng, in.token != 0)
	case n < 90:
		in.op, in.token, in.b = opAcquire, rng.Uint64N(1<<40)+1, randomBatch(rng, false)
		in.gen = last.gen
	case n < 94:
		in.op, in.token = opRead, 0
	case n < 96:
		in.op, in.token = opForceOpen, 0
	case n < 98:
		in.op, in.token = opForceClosed, 0
	default:
		in.op, in.token = opReset, 0
	}
	return in
}

func randomBatch(rng *rand.Rand, probe bool) batch {
	if probe {
		switch rng.IntN(5) {
		case 0:
			return batch{}
		case 1, 2:
			return batch{calls: 1, failures: 1, run: 1}
		}
		return batch{calls: 1, succeeded: true}
	}
	var b batch
	for range rng.IntN(4) + 1 {
		o := batch{calls: 1, succeeded: true}
		if rng.IntN(2) == 0 {
			o = batch{calls: 1, failures: 1, run: 1}
		}
		o.slow = int64(rng.IntN(2))
		b = b.add(o)
	}
	return b
}

// FuzzCircuit runs random steps through the Go state machine and checks
// that it never panics, also as the clock steps back, moves only along
// the breaker's edges, never lets the generation go back, and never has
// more live leases than Probes.
func FuzzCircuit(f *testing.F) {
	f.Add(uint64(1), uint64(2), uint8(1))
	f.Add(uint64(99), uint64(7), uint8(3))
	f.Fuzz(func(t *testing.T, s1, s2 uint64, probes uint8) {
		rng := rand.New(rand.NewPCG(s1, s2))
		p := testParams
		p.probes = int64(probes%5) + 1
		p.consecutive = int64(rng.IntN(3))
		var c circuit
		now := epochUs
		var tokens []uint64
		var last reply
		for i := range 300 {
			now = randomStep(rng, now)
			in := randomInput(rng, last, tokens)
			if in.op == opAcquire {
				tokens = append(tokens, in.token)
			}
			r := c.step(now, in, p)
			if r.state < 0 || r.state > 2 || r.gen < last.gen {
				t.Fatalf("step %d: %+v after %+v", i, r, last)
			}
			if r.from != 0 && in.op < opForceOpen {
				from, to := r.from-1, r.state
				legal := (from == stateClosed && to == stateOpen) || (from == stateOpen && to == stateHalfOpen) ||
					(from == stateHalfOpen && (to == stateOpen || to == stateClosed))
				if !legal {
					t.Fatalf("step %d: illegal transition %d → %d on %+v", i, from, to, in)
				}
			}
			if r.grant != grantNone && r.state != stateClosed && r.state != stateHalfOpen {
				t.Fatalf("step %d: granted in state %d", i, r.state)
			}
			live := 0
			for _, l := range c.leases {
				if l.token != 0 && !l.used && l.expires > now {
					live++
				}
			}
			if live > int(p.probes) {
				t.Fatalf("step %d: %d live leases, Probes %d", i, live, p.probes)
			}
			last = r
		}
	})
}

// TestCircuitBringsBackAFarTime: an open time or a lease further ahead
// than the settings allow, used or not, holds the breaker for at most
// MaxOpenFor or ProbeTimeout, in the script and in Go alike.
func TestCircuitBringsBackAFarTime(t *testing.T) {
	p := testParams
	p.probes = 1
	now, far := epochUs, epochUs+int64(24*time.Hour/time.Microsecond)
	farS := strconv.FormatInt(far, 10)
	for name, tc := range map[string]struct {
		c     circuit
		hash  []string
		state int64
		wait  int64
	}{
		"open":      {circuit{state: stateOpen, gen: 1, openUntil: far}, []string{"s", "1", "g", "1", "ou", farS}, stateOpen, p.maxOpenFor},
		"half-open": {circuit{state: stateHalfOpen, gen: 2, leases: []lease{{token: 77, expires: far}}}, []string{"s", "2", "g", "2", "l1", "77", "e1", farS}, stateHalfOpen, p.probeTimeout},
		// A used lease with no success counted: the breaker would never close.
		"half-open, used lease": {circuit{state: stateHalfOpen, gen: 2, leases: []lease{{token: 77, expires: far, used: true}}}, []string{"s", "2", "g", "2", "l1", "-", "e1", farS}, stateHalfOpen, p.probeTimeout},
	} {
		t.Run(name, func(t *testing.T) {
			sr := newScriptRunner(t)
			sr.mr.HSet(sr.key, append([]string{"v", "1"}, tc.hash...)...)
			lua := sr.step(t, now, input{op: opAcquire, token: 5}, p)
			got := tc.c.step(now, input{op: opAcquire, token: 5}, p)
			require.Equal(t, lua, got)
			assert.Equal(t, tc.state, got.state)
			assert.Equal(t, tc.wait, got.wait)
			lua = sr.step(t, now+tc.wait, input{op: opAcquire, token: 6}, p)
			assert.Equal(t, int64(grantProbe), lua.grant, "a probe once the brought-back time is over")
		})
	}
}

// TestCircuitWindowAfterAClockStepBack: Redis's clock steps back (a
// failover) behind the window's newest step. Steps stamped ahead of now
// still count, as a Limiter's sliding window's do, until the newest
// leaves the window, and do not count again when the clock catches up;
// a window whose newest step is more than a window ahead counts nothing,
// then or later. Reads change nothing. The script and Go agree at each
// step.
func TestCircuitWindowAfterAClockStepBack(t *testing.T) {
	fail := batch{calls: 1, failures: 1, run: 1}
	ok := batch{calls: 1, succeeded: true}
	type step struct {
		at    int64 // µs after epochUs; a step is 100 ms
		in    input
		calls int64
	}
	for name, steps := range map[string][]step{
		"within a window": {
			{500_000, input{op: opRecord, b: fail}, 1},
			{200_000, input{op: opAcquire, token: 1}, 1},   // 3 steps back: step 5 still counts
			{250_000, input{op: opRecord, b: ok}, 2},       // recorded in step 2
			{550_000, input{op: opRead}, 2},                // caught up: both count, once
			{1_450_000, input{op: opRead}, 1},              // step 5 still in, step 2 out
			{1_550_000, input{op: opAcquire, token: 2}, 0}, // step 5 leaves
		},
		"more than a window": {
			{500_000, input{op: opRecord, b: fail}, 1},
			{-600_000, input{op: opRead}, 0}, // 11 steps back: nothing counts
			{-500_000, input{op: opAcquire, token: 1}, 0},
			{550_000, input{op: opRead}, 0}, // and not again once caught up
		},
		"read only": {
			{500_000, input{op: opRecord, b: fail}, 1},
			{-600_000, input{op: opRead}, 0},
			{550_000, input{op: opRead}, 1}, // a read wrote nothing
		},
	} {
		t.Run(name, func(t *testing.T) {
			sr := newScriptRunner(t)
			var c circuit
			p := testParams
			p.minCalls = 100
			for i, s := range steps {
				now := epochUs + s.at
				got := c.step(now, s.in, p)
				lua := sr.step(t, now, s.in, p)
				require.Equal(t, lua, got, "step %d: Go and the script", i)
				assert.Equal(t, s.calls, got.calls, "step %d: calls in the window", i)
			}
		})
	}
}

// TestCircuitUsedLeaseFreesAfterProbeTimeout: a half-open breaker whose
// every lease is used but that has not counted Probes successes (Probes
// lowered by a deploy while it probed) grants a probe again once the
// used lease's ProbeTimeout is over, and that probe's success closes it.
func TestCircuitUsedLeaseFreesAfterProbeTimeout(t *testing.T) {
	ok := batch{calls: 1, succeeded: true}
	two, one := testParams, testParams
	two.probes, one.probes = 2, 1
	type step struct {
		at    int64 // µs after epochUs
		in    input
		p     params
		state int64
		grant int64
	}
	steps := []step{
		{0, input{op: opForceOpen}, two, stateOpen, grantNone},
		{1, input{op: opForceClosed}, two, stateClosed, grantNone}, // gen 2
		{2, input{op: opRecord, gen: 2, b: batch{calls: 4, failures: 4, run: 4}}, two, stateOpen, grantNone},
		{100_002, input{op: opAcquire, token: 7}, two, stateHalfOpen, grantProbe}, // gen 4
		{100_003, input{op: opAcquire, token: 8}, two, stateHalfOpen, grantProbe},
		{100_004, input{op: opRecord, token: 7, gen: 4, b: ok}, two, stateHalfOpen, grantNone},
		{100_005, input{op: opAcquire, token: 9}, one, stateHalfOpen, grantNone}, // lease 1 used, 1 success of 2
		{150_001, input{op: opAcquire, token: 9}, one, stateHalfOpen, grantNone},
		{150_002, input{op: opAcquire, token: 9}, one, stateHalfOpen, grantProbe}, // 7's lease is over
		{150_003, input{op: opRecord, token: 9, gen: 4, b: ok}, one, stateClosed, grantNone},
	}
	sr := newScriptRunner(t)
	var c circuit
	for i, s := range steps {
		now := epochUs + s.at
		got := c.step(now, s.in, s.p)
		lua := sr.step(t, now, s.in, s.p)
		require.Equal(t, lua, got, "step %d: Go and the script", i)
		assert.Equal(t, s.state, got.state, "step %d: state", i)
		assert.Equal(t, s.grant, got.grant, "step %d: grant", i)
	}
}
