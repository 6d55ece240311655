package tollgate

import (
	"context"
	"path"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// FuzzHold feeds the same reservations, settlements, decisions and clock
// steps to a MemoryStore and to the scripts on miniredis, and demands the
// same answers: Go and Lua agree on refunds, charges and debt, and on
// the refunds a Reset voids. Each op is three bytes: what, a number, and
// a reservation to settle.
func FuzzHold(f *testing.F) {
	f.Add(uint8(10), 0.5, []byte{0, 7, 0, 1, 2, 0, 2, 200, 0, 3, 3, 0})
	f.Add(uint8(10), 0.5, []byte{0, 7, 0, 2, 3, 0, 4, 0, 0, 0, 2, 0, 2, 1, 0, 0, 5, 0, 1, 2, 0, 1, 1, 1, 1, 0, 2, 3, 4, 0})
	f.Add(uint8(3), 1000.0, []byte{0, 3, 0, 0, 3, 0, 1, 9, 0, 1, 0, 1, 2, 50, 0})
	f.Add(uint8(50), 0.01, []byte{0, 50, 0, 1, 120, 0, 3, 0, 0, 2, 255, 0, 1, 1, 0})
	f.Fuzz(func(t *testing.T, capacity uint8, rate float64, ops []byte) {
		runHoldOps(t, capacity, rate, ops, false)
	})
}

// TestSettleAfterAClockStepAgrees settles reservations, a refund and a
// charge, after Redis's clock stepped back, while the buckets hold tokens
// with their stamps ahead: Go and Lua agree. FuzzHold does not step back:
// Redis forgets a bucket once it is full and the MemoryStore keeps it,
// which reads the same until the clock steps back past that moment.
func TestSettleAfterAClockStepAgrees(t *testing.T) {
	runHoldOps(t, 100, 10, []byte{
		0, 20, 0, // reserve 20
		0, 30, 0, // reserve 30
		3, 5, 0, // take 5
		2, 245, 0, // step back 0.6 s
		1, 3, 0, // settle the first with 3: a refund of 17
		1, 90, 1, // settle the second with 90: a charge of 60
		3, 1, 0, // take 1
		2, 100, 0, // forward 0.4 s: still behind the stamps
		3, 40, 0, // take 40
	}, true)
}

// runHoldOps runs FuzzHold's ops. With backwards, a clock op of 240 or more
// steps the clock back by up to 1.6 s, keys' expiries too, as Redis keeps
// them at absolute times of its clock.
func runHoldOps(t *testing.T, capacity uint8, rate float64, ops []byte, backwards bool) {
	plans := []Plan{{Name: "p", Capacity: int64(capacity) + 1, Rate: rate}, {Name: "q", Capacity: 40, Rate: 3}}
	if plans[0].validateNumbers() != nil || len(ops) > 3*40 {
		return
	}
	ctx := context.Background()
	rs, mr, setTime := newMiniredisStore(t)
	now := t0
	ms := newClockedMemoryStore(&now)
	type pair struct {
		n              int64
		mem, red       hold
		settled, taken bool
	}
	var holds []*pair
	for i := 0; i+2 < len(ops); i += 3 {
		what, x, which := ops[i]%5, int64(ops[i+1]), int(ops[i+2])
		cost := min(x%(plans[0].Capacity+1), 40)
		switch what {
		case 0: // reserve
			if cost == 0 {
				continue
			}
			p := &pair{n: cost, mem: hold{ttl: time.Second}, red: hold{ttl: time.Second}}
			mr, _ := ms.decide(ctx, op{key: "k", n: cost, mode: modeHold, plans: plans, hold: &p.mem})
			rr, err := rs.hold(ctx, "k", cost, plans, &p.red)
			require.NoError(t, err)
			require.Equal(t, mr, rr, "op %d: reserve %d", i/3, cost)
			p.taken = mr.Allowed
			holds = append(holds, p)
		case 1: // settle
			if len(holds) == 0 {
				continue
			}
			p := holds[which%len(holds)]
			if !p.taken || p.settled {
				continue
			}
			p.settled = true
			mst, mstatus, _ := ms.settle(ctx, settleOp{key: "k", plans: plans, hold: &p.mem, n: p.n, used: x})
			rst, rstatus, err := rs.settle(ctx, settleOp{key: "k", plans: plans, hold: &p.red, n: p.n, used: x})
			require.NoError(t, err)
			require.Equal(t, mstatus, rstatus, "op %d: settle %d of %d", i/3, x, p.n)
			require.Equal(t, mst, rst, "op %d: settle %d of %d", i/3, x, p.n)
		case 2: // the clock moves, by up to about 2.6s
			step := x * x * 40
			if backwards && x >= 240 {
				step = -(x - 239) * 100_000
			}
			now += step
			setTime(now)
			mr.FastForward(time.Duration(step) * time.Microsecond)
		case 3: // a decision, or a read
			mres, err := ms.Take(ctx, "k", cost, plans)
			require.NoError(t, err)
			rres, err := rs.Take(ctx, "k", cost, plans)
			require.NoError(t, err)
			require.Equal(t, mres, rres, "op %d: take %d", i/3, cost)
		case 4: // a Reset of the key, which voids the refunds of the holds taken before
			require.NoError(t, ms.Reset(ctx, "k", plans))
			require.NoError(t, rs.Reset(ctx, "k", plans))
		}
	}
}

// TestSettleStatusesAgree checks settleDelta and settlement against the
// table of what each status of a hold does.
func TestSettleStatusesAgree(t *testing.T) {
	tests := []struct {
		status            settleStatus
		n, actual         int64
		delta             int64
		refunded, charged int64
	}{
		{holdLive, 5, 2, 3_000_000, 3, 0},
		{holdLive, 5, 9, -4_000_000, 0, 4},
		{holdLive, 5, 5, 0, 0, 0},
		{holdSettled, 5, 9, 0, 0, 0},
		{holdGone, 5, 2, 0, 0, 0},
		{holdGone, 5, 9, -4_000_000, 0, 4},
		{holdBad, 5, 9, -4_000_000, 0, 4},
		{holdReset, 5, 2, 0, 0, 0},
		{holdReset, 5, 9, -4_000_000, 0, 4},
	}
	p := []Plan{llm}
	for _, tt := range tests {
		assert.Equal(t, tt.delta, settleDelta(tt.n, tt.actual, tt.status), "%+v", tt)
		st := settlement(settleOp{plans: p, n: tt.n, used: tt.actual}, []TokenBucket{fullBucket(llm, t0)}, t0, 0, tt.status)
		assert.Equal(t, tt.refunded, st.Refunded, "%+v", tt)
		assert.Equal(t, tt.charged, st.Charged, "%+v", tt)
	}
}

// TestUnchargedAgreesNearTheLargestCapacity charges a bucket whose debt is
// at its cap, on a plan near the largest capacity, where a sum in
// settle.lua's adjust would pass 2^53 and round: Go and Lua report the
// same Uncharged.
func TestUnchargedAgreesNearTheLargestCapacity(t *testing.T) {
	ctx := context.Background()
	plan := Plan{Name: "big", Capacity: 9_007_198_840, Rate: 13}
	got := map[string]Settlement{}
	eachStore(t, []Plan{plan}, func(t *testing.T, l clockedLimiter) {
		var rs [3]*Reservation
		for i := range rs {
			r, err := l.Reserve(ctx, "k", 1)
			require.NoError(t, err)
			require.True(t, r.OK())
			rs[i] = r
		}
		var st Settlement
		for _, r := range rs { // the second reaches the cap on debt, the third is all uncharged
			var err error
			st, err = r.Settle(ctx, plan.Capacity)
			require.NoError(t, err)
		}
		got[path.Base(t.Name())] = st
		assert.Equal(t, plan.Capacity-1, st.Uncharged, "the third charge found the debt at its cap")
	})
	assert.Equal(t, got["memory"].Uncharged, got["redis"].Uncharged, "Go and Lua agree")
}

// TestHoldWhoseKeyExistsTakesNothing: a hold's script call that finds its
// hold's key takes nothing. Its own hold (a client's retry of the call
// that ran) is allowed again, a tombstone (the hold settled or given back
// before the call arrived) or data not ours is denied; so a hold given
// back by its id after a lost reply comes back once, however late its
// call arrives.
func TestHoldWhoseKeyExistsTakesNothing(t *testing.T) {
	ctx := context.Background()
	rs, mr, _ := newMiniredisStore(t)
	plans := []Plan{{Name: "p", Capacity: 100, Rate: 1}}
	left := func() int64 {
		r, err := rs.take(ctx, "k", 0, plans)
		require.NoError(t, err)
		return r.Remaining
	}
	h := hold{ttl: time.Minute, id: "a"}
	r, err := rs.holdAs(ctx, "k", 20, plans, &h)
	require.NoError(t, err)
	assert.True(t, r.Allowed)
	r, err = rs.holdAs(ctx, "k", 20, plans, &h)
	require.NoError(t, err)
	assert.True(t, r.Allowed, "the hold's own call, run again: allowed")
	assert.Equal(t, int64(80), left(), "taken once")

	_, err = rs.take(ctx, "k", 30, plans)
	require.NoError(t, err)
	back := settleOp{key: "k", plans: plans, hold: &h, n: 20}
	st, status, err := rs.settle(ctx, back)
	require.NoError(t, err)
	assert.Equal(t, holdLive, status)
	assert.Equal(t, int64(20), st.Refunded)
	_, status, err = rs.settle(ctx, back)
	require.NoError(t, err)
	assert.Equal(t, holdSettled, status, "given back twice: once")
	r, err = rs.holdAs(ctx, "k", 20, plans, &h)
	require.NoError(t, err)
	assert.False(t, r.Allowed, "the call, arriving after its give-back")
	assert.Equal(t, int64(70), left(), "100 - 30: the hold's 20 back once")

	require.NoError(t, mr.Set(rs.Key("k", "~b"), "20"+"0"))
	mr.HSet(rs.Key("k", "~c"), "f", "v")
	for _, id := range []string{"b", "c"} {
		r, err = rs.holdAs(ctx, "k", 20, plans, &hold{ttl: time.Minute, id: id})
		require.NoError(t, err)
		assert.False(t, r.Allowed, "hold %s: data not ours", id)
	}
	assert.Equal(t, int64(70), left())
}

// TestSettleOfAMissingHoldLeavesATombstone: a hold given back before its
// script call arrives (the call's reply was lost, and Redis runs it later)
// refunds nothing and leaves a tombstone for the hold's TTL, on which the
// call then takes nothing.
func TestSettleOfAMissingHoldLeavesATombstone(t *testing.T) {
	ctx := context.Background()
	rs, mr, _ := newMiniredisStore(t)
	plans := []Plan{{Name: "p", Capacity: 100, Rate: 1}}
	h := hold{ttl: time.Minute, id: "d"}
	st, status, err := rs.settle(ctx, settleOp{key: "k", plans: plans, hold: &h, n: 20})
	require.NoError(t, err)
	assert.Equal(t, holdGone, status)
	assert.Zero(t, st.Refunded)
	tomb, err := mr.Get(rs.Key("k", "~d"))
	require.NoError(t, err)
	assert.Equal(t, "s", tomb)
	assert.Equal(t, time.Minute, mr.TTL(rs.Key("k", "~d")))

	r, err := rs.holdAs(ctx, "k", 20, plans, &h)
	require.NoError(t, err)
	assert.False(t, r.Allowed, "the hold's call, arriving after its give-back")
	r, err = rs.take(ctx, "k", 30, plans)
	require.NoError(t, err)
	assert.Equal(t, int64(70), r.Remaining, "the hold took nothing")
}

// TestSettleAfterAResetRefundsNothingInDoubt: settle.lua refunds a live
// hold taken after the key's reset mark, and nothing, charging the excess
// all the same, when the hold may have been taken before it: its time is
// unknown (a give-back after a lost reply), Redis TIME reads before the
// hold's time (it stepped back since, so the mark may be a Reset after the
// hold, dated before it), or the mark holds data not ours.
func TestSettleAfterAResetRefundsNothingInDoubt(t *testing.T) {
	ctx := context.Background()
	plans := []Plan{{Name: "p", Capacity: 100, Rate: 1}}
	tests := []struct {
		name   string
		doubt  func(h *hold, mr *miniredis.Miniredis, setTime func(int64), mark string)
		status settleStatus
	}{
		{"taken after", func(*hold, *miniredis.Miniredis, func(int64), string) {}, holdLive},
		{"time unknown", func(h *hold, _ *miniredis.Miniredis, _ func(int64), _ string) { h.at = 0 }, holdReset},
		{"clock stepped back", func(_ *hold, _ *miniredis.Miniredis, setTime func(int64), _ string) { setTime(t0 + 1) }, holdReset},
		{"mark not ours", func(_ *hold, mr *miniredis.Miniredis, _ func(int64), mark string) {
			require.NoError(t, mr.Set(mark, "soon"))
		}, holdReset},
		{"mark of another type", func(_ *hold, mr *miniredis.Miniredis, _ func(int64), mark string) {
			mr.HSet(mark, "f", "v")
		}, holdReset},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rs, mr, setTime := newMiniredisStore(t)
			require.NoError(t, rs.Reset(ctx, "k", plans)) // the mark: t0
			setTime(t0 + 2)
			h := hold{ttl: time.Minute, id: "a"}
			_, err := rs.holdAs(ctx, "k", 20, plans, &h)
			require.NoError(t, err)
			require.Equal(t, t0+2, h.at, "the hold's time, from its reply")
			tt.doubt(&h, mr, setTime, rs.Key("k", resetMarkName))
			st, status, err := rs.settle(ctx, settleOp{key: "k", plans: plans, hold: &h, n: 20, used: 25})
			require.NoError(t, err)
			assert.Equal(t, tt.status, status)
			assert.Equal(t, int64(5), st.Charged, "the excess is charged either way")
			if status == holdReset {
				_, status, err = rs.settle(ctx, settleOp{key: "k", plans: plans, hold: &h, n: 20})
				require.NoError(t, err)
				assert.Equal(t, holdSettled, status, "the tombstone")
			}
		})
	}
}
