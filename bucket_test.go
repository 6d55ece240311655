package tollgate

import (
	"context"
	"encoding/binary"
	"math"
	"path"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

const t0 = int64(1_700_000_000_000_000) // µs, an arbitrary epoch for tests

func TestTokenBucketSteps(t *testing.T) {
	p := Plan{Name: "p", Capacity: 3, Rate: 2} // 2 tokens/s: one every 500ms
	type step struct {
		at      int64 // µs after t0
		cost    int64
		ok      bool
		tokens  int64 // micro-tokens after the step
		readyAt int64 // µs after t0 at which cost tokens are there
	}
	tests := []struct {
		name  string
		steps []step
	}{
		{"burst then deny", []step{
			{0, 1, true, 2_000_000, 0},
			{0, 1, true, 1_000_000, 0},
			{0, 1, true, 0, 0},
			{0, 1, false, 0, 500_000},
			{499_999, 1, false, 999_998, 500_000},
			{500_000, 1, true, 0, 500_000},
		}},
		{"refill caps at capacity", []step{
			{0, 3, true, 0, 0},
			{10_000_000, 1, true, 2_000_000, 10_000_000},
		}},
		{"cost larger than tokens takes nothing", []step{
			{0, 2, true, 1_000_000, 0},
			{0, 2, false, 1_000_000, 500_000},
			{250_000, 2, false, 1_500_000, 500_000},
			{500_000, 2, true, 0, 500_000},
		}},
		{"time going back refills nothing", []step{
			{1_000_000, 3, true, 0, 1_000_000},
			{0, 1, false, 0, 1_500_000},
			{1_250_000, 1, false, 500_000, 1_500_000},
		}},
		{"cost 0 reads", []step{
			{0, 0, true, 3_000_000, 0},
			{0, 3, true, 0, 0},
			{100_000, 0, true, 200_000, 100_000},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := fullBucket(p, t0)
			for i, s := range tt.steps {
				now := t0 + s.at
				assert.Equal(t, t0+s.readyAt, b.ReadyAt(p, now, s.cost), "step %d: ReadyAt", i)
				var ok bool
				b, ok = b.Take(p, now, s.cost)
				assert.Equal(t, s.ok, ok, "step %d: Take(%d, %d)", i, s.at, s.cost)
				assert.Equal(t, s.tokens, b.Tokens, "step %d: tokens", i)
				assert.LessOrEqual(t, b.Stamp, max(now, t0+1_000_000), "step %d: stamp", i)
			}
		})
	}
}

func TestTokenBucketStampNeverMovesBack(t *testing.T) {
	p := Plan{Name: "p", Capacity: 10, Rate: 3} // refills in 3.33 s
	b := TokenBucket{Tokens: 0, Stamp: t0}
	b = b.Refill(p, t0-3_000_000)
	assert.Equal(t, TokenBucket{Tokens: 0, Stamp: t0}, b)
	b = TokenBucket{Tokens: 20_000_000, Stamp: t0} // above capacity, e.g. after the plan shrank
	assert.Equal(t, int64(10_000_000), b.Refill(p, t0-1).Tokens)
}

// TestTokenBucketCarry checks that the part of a refill too small to be a
// micro-token is carried in the stamp, not dropped.
func TestTokenBucketCarry(t *testing.T) {
	p := Plan{Name: "p", Capacity: 1, Rate: 0.25} // a quarter micro-token per µs
	b := TokenBucket{Tokens: 0, Stamp: t0}
	b = b.Refill(p, t0+3) // 0.75 µtok: nothing whole yet
	assert.Equal(t, TokenBucket{Tokens: 0, Stamp: t0}, b)
	b = b.Refill(p, t0+5) // 1.25 µtok: one whole, 1 µs carried
	assert.Equal(t, TokenBucket{Tokens: 1, Stamp: t0 + 4}, b)
}

// TestPollingDoesNotStarve polls every millisecond, far faster than the
// bucket refills, and demands exactly the refill rate: the bug of seed 000,
// which floored each refill and reset the timestamp, admitted nothing.
func TestPollingDoesNotStarve(t *testing.T) {
	for _, rate := range []float64{2, 1.0 / 3, Per(1, 24*3600e9)} {
		p := Plan{Name: "p", Capacity: 1, Rate: rate}
		b := TokenBucket{Tokens: 0, Stamp: t0}
		admitted := int64(0)
		const polls = 200_000 // 200 s at one poll per ms
		for i := int64(1); i <= polls; i++ {
			var ok bool
			if b, ok = b.Take(p, t0+i*1000, 1); ok {
				admitted++
			}
		}
		want := int64(math.Floor(rate * polls / 1000))
		assert.Equal(t, want, admitted, "rate %v", rate)
	}
}

// TestMillionOperationsExact drives one bucket through a million requests
// at irregular intervals and compares the admitted count with the bound
// capacity + rate × elapsed: never above it, and below it by less than one
// token plus what the last partial refill holds.
func TestMillionOperationsExact(t *testing.T) {
	for _, p := range []Plan{
		{Name: "int", Capacity: 10, Rate: 100},
		{Name: "frac", Capacity: 7, Rate: 33.3},
		{Name: "slow", Capacity: 5, Rate: 0.7},
	} {
		b := fullBucket(p, t0)
		now, admitted := t0, int64(0)
		x := uint64(88172645463325252)
		for i := 0; i < 1_000_000; i++ {
			x ^= x << 13
			x ^= x >> 7
			x ^= x << 17
			now += int64(x % 2000) // 0 to 2 ms, mean 1 ms
			var ok bool
			if b, ok = b.Take(p, now, 1); ok {
				admitted++
			}
		}
		bound := float64(p.Capacity) + p.Rate*float64(now-t0)/1e6
		left := float64(b.Refill(p, now).Tokens) / microTokens
		assert.LessOrEqual(t, float64(admitted), bound, "plan %s", p.Name)
		assert.InDelta(t, bound, float64(admitted)+left, 1, "plan %s: admitted %d + left %.6f vs bound %.6f", p.Name, admitted, left, bound)
	}
}

func TestTakeAllIsAllOrNothing(t *testing.T) {
	plans := []Plan{{Name: "burst", Capacity: 5, Rate: 1}, {Name: "daily", Capacity: 2, Rate: 0.001}}
	buckets := []TokenBucket{fullBucket(plans[0], t0), fullBucket(plans[1], t0)}
	ok, _ := takeAll(plans, buckets, t0, 2)
	require.True(t, ok)
	assert.Equal(t, []int64{3_000_000, 0}, []int64{buckets[0].Tokens, buckets[1].Tokens})
	ok, _ = takeAll(plans, buckets, t0, 1)
	require.False(t, ok, "daily is empty")
	assert.Equal(t, int64(3_000_000), buckets[0].Tokens, "burst must not pay for a denied request")
}

func TestAccrualMicrosIsSmallestSufficient(t *testing.T) {
	for _, rate := range []float64{1, 3, 0.1, 1.0 / 3, 7.77, 1e-6, 123456.789, 0.009523809523809523, 26.666666666666664} {
		for _, deficit := range []int64{1, 2, 999_999, 1_000_000, 12_345_678, 19_000_000, 47_999_883} {
			w := accrualMicros(deficit, rate)
			assert.GreaterOrEqual(t, math.Floor(float64(w)*rate), float64(deficit), "rate %v deficit %d", rate, deficit)
			assert.Less(t, math.Floor(float64(w-1)*rate), float64(deficit), "rate %v deficit %d: not smallest", rate, deficit)
		}
	}
}

// TestFarFutureStampIsBroughtBack: a stamp more than a full refill ahead
// is brought back to a full refill ahead, its tokens kept (ADR 29).
func TestFarFutureStampIsBroughtBack(t *testing.T) {
	p := Plan{Name: "p", Capacity: 2, Rate: 1} // refills in 2 s
	b := TokenBucket{Tokens: 0, Stamp: t0 + 2_000_000}
	assert.Equal(t, TokenBucket{Tokens: 0, Stamp: t0 + 2_000_000}, b.Refill(p, t0), "a clock step of a full refill is kept")
	b.Stamp++
	assert.Equal(t, TokenBucket{Tokens: 0, Stamp: t0 + 2_000_000}, b.Refill(p, t0), "beyond a full refill it is brought back")
	b = TokenBucket{Tokens: 1_000_000, Stamp: t0 + 10*365*24*3600*1_000_000}
	assert.Equal(t, TokenBucket{Tokens: 1_000_000, Stamp: t0 + 2_000_000}, b.Refill(p, t0), "its tokens kept")
	assert.Equal(t, t0, b.ReadyAt(p, t0, 1))
	assert.Equal(t, t0+3_000_000, b.ReadyAt(p, t0, 2), "a stamp ten years ahead blocks the key for one refill, not ten years")
}

// FuzzBucket drives one bucket through a fuzzed plan and a fuzzed sequence
// of takes (cost 0 is a read) at times that jump forwards and backwards,
// and checks after every step that the tokens stay within 0 and the
// capacity, that the stamp never moves back (unless the clock stepped back
// by more than a full refill) nor past the time, that Take
// succeeds exactly when ReadyAt says the tokens are there, and that a denied
// request passes at ReadyAt and not a microsecond earlier. At the end, the tokens admitted may not exceed capacity + rate ×
// elapsed, elapsed being how far time ever got past the start.
func FuzzBucket(f *testing.F) {
	f.Add(int64(3), 2.0, []byte{0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 0x01, 0xf4, 1})
	f.Add(int64(1), 1.0/3, []byte{1, 0, 1, 1, 2, 0xff, 0xff, 1, 2, 0, 3, 1})
	f.Add(int64(maxCapacity), 1e9, []byte{3, 0x7f, 0xff, 0xff, 0, 0, 1, 0xff})
	f.Add(int64(1000), Per(1000, 24*time.Hour), []byte{2, 0, 86, 200, 3, 0x80, 0, 7})
	f.Add(int64(17), 7.77, []byte{0, 0, 3, 17, 1, 0, 128, 1, 0, 0x80, 0x01, 2})
	f.Fuzz(func(t *testing.T, capacity int64, rate float64, ops []byte) {
		p := Plan{Name: "f", Capacity: capacity, Rate: rate}
		if p.validateNumbers() != nil {
			return // New rejects such plans
		}
		full := capacity * microTokens
		b := fullBucket(p, t0)
		now, reached := t0, t0
		admitted, steps := int64(0), int64(0) // micro-tokens admitted
		segment, accrued := t0, 0.0           // a step back past a full refill starts a new span of time to accrue in
		for len(ops) >= 4 {
			op := ops[:4]
			ops = ops[4:]
			steps++
			// op[0] picks the scale of the time step, op[1:3] its size and
			// sign, op[3] the cost.
			scale := []int64{1, 1_000, 1_000_000, 1_000_000_000}[op[0]%4]
			now += int64(int16(binary.BigEndian.Uint16(op[1:3]))) * scale
			now = min(max(now, 0), t0+maxRefillPeriod.Microseconds()) // Redis TIME: after 1970, before 2123
			cost := int64(op[3])
			if op[0]&4 != 0 {
				cost = capacity // the largest cost
			}
			cost = min(cost, capacity)

			ready := b.ReadyAt(p, now, cost)
			next, ok := b.Take(p, now, cost)
			if next.Tokens < 0 || next.Tokens > full {
				t.Fatalf("step %d: %d micro-tokens, outside 0..%d", steps, next.Tokens, full)
			}
			if next.Stamp < b.Stamp {
				// Only a stamp more than a full refill ahead gives way: it is
				// brought back to a full refill ahead, its tokens kept.
				if !b.tooFarAhead(&p, now) || next.Stamp != now+int64(math.Floor(float64(full)/rate)) {
					t.Fatalf("step %d: stamp moved back from %d to %d", steps, b.Stamp, next.Stamp)
				}
				// Nothing accrues until the stamp brought back, a full
				// refill from now.
				accrued += rate * float64(max(reached-segment, 0))
				segment, reached = next.Stamp, now
			}
			if next.Stamp > max(now, b.Stamp) {
				t.Fatalf("step %d: stamp %d is past now %d", steps, next.Stamp, now)
			}
			if ready < now || ok != (ready == now) {
				t.Fatalf("step %d: Take(%d) = %v but ReadyAt = %d (now %d)", steps, cost, ok, ready, now)
			}
			if !ok {
				stored := b // as the denial leaves it: a stamp too far ahead is written back
				if b.tooFarAhead(&p, now) {
					stored = b.Refill(p, now)
				}
				if _, ok := stored.Take(p, ready, cost); !ok {
					t.Fatalf("step %d: denied at ReadyAt %d (bucket %+v, cost %d)", steps, ready, stored, cost)
				}
				// ReadyAt is the first microsecond at which Take finds the
				// tokens in the bucket as stored: no earlier.
				if _, early := stored.Take(p, ready-1, cost); early && ready-1 > now {
					t.Fatalf("step %d: passes at %d, before ReadyAt %d (bucket %+v, cost %d)", steps, ready-1, ready, stored, cost)
				}
			}
			if ok {
				admitted += cost * microTokens
			}
			b, reached = next, max(reached, now)
		}
		// Each refill may round up by less than a micro-token; steps covers
		// it. A clock step back gives no bucketful: time accrues again from
		// the step (a new segment), and only from a full refill after it.
		accrued += rate * float64(max(reached-segment, 0))
		bound := float64(full) + accrued + float64(steps)
		if float64(admitted) > bound {
			t.Fatalf("admitted %d micro-tokens; bound %.0f", admitted, bound)
		}
	})
}

func TestTokenBucketAdjust(t *testing.T) {
	p := Plan{Name: "p", Capacity: 10, Rate: 2} // a token every 500ms; a full refill in 5s
	tests := []struct {
		name      string
		b         TokenBucket
		at        int64 // µs after t0
		delta     int64 // micro-tokens
		want      TokenBucket
		uncharged int64
	}{
		{"refund", TokenBucket{Tokens: 4_000_000, Stamp: t0}, 0, 3_000_000, TokenBucket{7_000_000, t0}, 0},
		{"refund caps at full", TokenBucket{Tokens: 9_000_000, Stamp: t0}, 0, 3_000_000, TokenBucket{10_000_000, t0}, 0},
		{"refund after a refill", TokenBucket{Tokens: 4_000_000, Stamp: t0}, 500_000, 3_000_000, TokenBucket{8_000_000, t0 + 500_000}, 0},
		{"charge from tokens", TokenBucket{Tokens: 4_000_000, Stamp: t0}, 0, -3_000_000, TokenBucket{1_000_000, t0}, 0},
		{"charge into debt", TokenBucket{Tokens: 1_000_000, Stamp: t0}, 0, -3_000_000, TokenBucket{0, t0 + 1_000_000}, 0},
		{"debt grows", TokenBucket{Stamp: t0 + 1_000_000}, 0, -1_000_000, TokenBucket{0, t0 + 1_500_000}, 0},
		{"refund repays debt", TokenBucket{Stamp: t0 + 1_000_000}, 0, 1_000_000, TokenBucket{0, t0 + 500_000}, 0},
		{"refund beyond debt", TokenBucket{Stamp: t0 + 1_000_000}, 0, 3_000_000, TokenBucket{1_000_000, t0}, 0},
		{"debt capped at one capacity", TokenBucket{Tokens: 2_000_000, Stamp: t0}, 0, -15_000_000, TokenBucket{0, t0 + 5_000_000}, 3_000_000},
		{"debt at the cap takes nothing more", TokenBucket{Stamp: t0 + 5_000_000}, 0, -1_000_000, TokenBucket{0, t0 + 5_000_000}, 1_000_000},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			now := t0 + tt.at
			got, uncharged := tt.b.adjust(p, now, tt.delta)
			assert.Equal(t, tt.want, got)
			assert.Equal(t, tt.uncharged, uncharged)
		})
	}
}

func TestTokenBucketInDebt(t *testing.T) {
	p := Plan{Name: "p", Capacity: 10, Rate: 2}
	b, _ := fullBucket(p, t0).adjust(p, t0, -14_000_000) // 4 tokens of debt: 2s
	for _, at := range []int64{0, 1_999_999} {
		assert.Equal(t, int64(0), b.Refill(p, t0+at).Tokens, "in debt at +%dµs", at)
	}
	assert.Equal(t, t0+2_500_000, b.ReadyAt(p, t0, 1), "a token comes 500ms after the debt is paid")
	assert.Equal(t, t0+7_000_000, b.FullAt(p, t0), "full a whole refill after the debt is paid")
	// The debt outlives any refill that would read it as garbage.
	worst, lost := b.adjust(p, t0, -100_000_000)
	assert.Equal(t, t0+5_000_000, worst.Stamp)
	assert.Positive(t, lost)
	assert.Equal(t, int64(0), worst.Refill(p, t0).Tokens)
}

// FuzzAdjust checks that no adjustment mints: the tokens at any later time
// never exceed what the bucket would hold with the delta applied exactly,
// and a charge leaves nothing uncharged unless its debt is at the cap.
func FuzzAdjust(f *testing.F) {
	f.Add(uint64(10), 2.0, int64(3_000_000), int64(-15_000_000), int64(0), int64(700_000))
	f.Add(uint64(1), 0.001, int64(0), int64(-1_000_000), int64(5), int64(1))
	f.Add(uint64(7), 3.3, int64(5_000_000), int64(2_500_000), int64(123_456), int64(9_000_000))
	f.Add(uint64(1000), 10.0, int64(900_000_000), int64(-100_000_000), int64(-1000), int64(1000)) // a step back
	f.Fuzz(func(t *testing.T, capacity uint64, rate float64, tokens, delta, lag, later int64) {
		p := Plan{Name: "p", Capacity: int64(capacity%1000) + 1, Rate: rate}
		if p.validateNumbers() != nil {
			return
		}
		full := p.Capacity * microTokens
		tokens = min(max(tokens, 0), full)
		delta = max(min(delta, 2*full), -2*full)
		lag = min(max(lag, -10_000_000), 10_000_000) // below 0: the clock stepped back since the write
		later = min(max(later, 0), 10_000_000_000)
		now := t0 + lag
		b := TokenBucket{Tokens: tokens, Stamp: t0}
		before := b.Refill(p, now)
		got, uncharged := b.adjust(p, now, delta)
		require.GreaterOrEqual(t, got.Tokens, int64(0))
		require.LessOrEqual(t, got.Tokens, full)
		require.LessOrEqual(t, got.Stamp-now, int64(math.Floor(float64(full)/p.Rate)), "never a garbage stamp")
		require.GreaterOrEqual(t, uncharged, int64(0))
		if uncharged > 0 {
			require.Negative(t, delta)
		}
		// What the bucket holds at now+later, against the exact balance:
		// the refilled tokens plus delta (less what was not charged), plus
		// what accrues, capped at full.
		accrued := func(at int64) int64 { // since the stamp, which is ahead of now after a step back
			return int64(math.Floor(float64(float64(max(at-before.Stamp, 0)) * p.Rate)))
		}
		exact := before.Tokens + delta + uncharged + accrued(now+later) - accrued(now)
		have := got.Refill(p, now+later).Tokens
		require.LessOrEqual(t, have, max(min(exact+1, full), 0), "adjust minted tokens")
	})
}

// TestChargeBeyondAnInt64OfMicrosecondsIsCapped settles a reservation of
// 1 token of a plan of 10 a year with 5,000,000 used: the debt would take
// 1.6 × 10^19 µs to accrue, more than an int64 holds. It is capped at one
// full refill, as any debt past it, and the rest is uncharged, on both
// stores alike: the bucket holds nothing for a year and a token's time.
func TestChargeBeyondAnInt64OfMicrosecondsIsCapped(t *testing.T) {
	ctx := context.Background()
	plan := Plan{Name: "yearly", Capacity: 10, Rate: Per(10, 365*24*time.Hour)}
	got := map[string]Settlement{}
	eachStore(t, []Plan{plan}, func(t *testing.T, l clockedLimiter) {
		r, err := l.Reserve(ctx, "k", 1)
		require.NoError(t, err)
		require.True(t, r.OK())
		st, err := r.Settle(ctx, 5_000_000)
		require.NoError(t, err)
		got[path.Base(t.Name())] = st
		assert.Equal(t, int64(5_000_000-1), st.Charged)
		assert.Equal(t, int64(5_000_000-1-9-10), st.Uncharged, "9 left and 10 of debt, a full refill's, were charged")
		peek, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, int64(0), peek.Remaining)
		assert.Equal(t, (365+36)*24*time.Hour+12*time.Hour, peek.RetryAfter.Round(time.Hour), "a full refill of debt, then a token's time")
	})
	assert.Equal(t, got["memory"], got["redis"], "Go and Lua agree")
}

// TestAdjustAfterAClockStepKeepsTheTokens adjusts a bucket that holds
// tokens with its stamp ahead of now, as after Redis's clock steps back
// (Refill keeps both, so that a step back mints nothing): it is not in
// debt, which only a bucket holding nothing is (ADR 21), so a refund adds
// to its tokens and a charge takes from them.
func TestAdjustAfterAClockStepKeepsTheTokens(t *testing.T) {
	p := Plan{Name: "p", Capacity: 1000, Rate: 10}
	now := t0
	b := TokenBucket{Tokens: 900 * microTokens, Stamp: now + 1000} // written 1 ms "later", before the step back
	require.Equal(t, b, b.Refill(p, now), "Refill keeps both")
	got, _ := b.adjust(p, now, 100*microTokens)
	assert.GreaterOrEqual(t, got.Refill(p, now+1000).Tokens, int64(900*microTokens), "a refund never takes tokens away")
	got, _ = b.adjust(p, now, -100*microTokens)
	assert.GreaterOrEqual(t, got.Refill(p, now+1000).Tokens, int64(799*microTokens), "a charge of 100 takes 100")
}

// drainThenStepBack takes both tokens of key k (a plan of capacity 2, 1 a
// second), then steps the clock back an hour, far more than a full refill.
func drainThenStepBack(t *testing.T, l clockedLimiter) {
	t.Helper()
	r, err := l.AllowN(context.Background(), "k", 2)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	l.advance(-time.Hour)
}

// TestClockFarBackBlocksForOneRefill drains a key, then steps the clock
// back by an hour, far more than the plan's full refill of 2 s: the stamp
// is brought back to 2 s ahead and written back by the denial, so the key
// gets its tokens 2 s and a token's time later, on both stores, not an
// hour later and not at once.
func TestClockFarBackBlocksForOneRefill(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{{Name: "p", Capacity: 2, Rate: 1}}, func(t *testing.T, l clockedLimiter) {
		drainThenStepBack(t, l)
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.False(t, r.Allowed, "a step back mints nothing")
		assert.Equal(t, 3*time.Second, r.RetryAfter)
		l.advance(2 * time.Second)
		r, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.False(t, r.Allowed)
		assert.Equal(t, time.Second, r.RetryAfter, "the denial wrote the stamp back: the wait counts down")
		l.advance(time.Second)
		r, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.True(t, r.Allowed)
	}, WithDenialCache(0))
}

// TestReadsDoNotBringBackAFarStamp: Peek and PeekN (cost 0 and -n) find a
// stamp more than a full refill ahead, after the clock stepped back an
// hour, and report it brought back, but write nothing (ADR 29): 3 s
// later a read still finds it a full refill ahead, not admitted.
func TestReadsDoNotBringBackAFarStamp(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{{Name: "p", Capacity: 2, Rate: 1}}, func(t *testing.T, l clockedLimiter) {
		drainThenStepBack(t, l)
		r, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, 3*time.Second, r.RetryAfter)
		r, err = l.PeekN(ctx, "k", 2)
		require.NoError(t, err)
		assert.Equal(t, 4*time.Second, r.RetryAfter)
		l.advance(3 * time.Second)
		r, err = l.Peek(ctx, "k")
		require.NoError(t, err)
		assert.False(t, r.Allowed, "a read wrote the stamp back")
		assert.Equal(t, 3*time.Second, r.RetryAfter)
	}, WithDenialCache(0))
}
