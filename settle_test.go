package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// FuzzHold feeds the same reservations, settlements, decisions and clock
// steps to a MemoryStore and to the scripts on miniredis, and demands the
// same answers: Go and Lua agree on refunds, charges and debt. Each op is
// three bytes: what, a number, and a reservation to settle.
func FuzzHold(f *testing.F) {
	f.Add(uint8(10), 0.5, []byte{0, 7, 0, 1, 2, 0, 2, 200, 0, 3, 3, 0})
	f.Add(uint8(3), 1000.0, []byte{0, 3, 0, 0, 3, 0, 1, 9, 0, 1, 0, 1, 2, 50, 0})
	f.Add(uint8(50), 0.01, []byte{0, 50, 0, 1, 120, 0, 3, 0, 0, 2, 255, 0, 1, 1, 0})
	f.Fuzz(func(t *testing.T, capacity uint8, rate float64, ops []byte) {
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
			what, x, which := ops[i]%4, int64(ops[i+1]), int(ops[i+2])
			cost := min(x%(plans[0].Capacity+1), 40)
			switch what {
			case 0: // reserve
				if cost == 0 {
					continue
				}
				p := &pair{n: cost, mem: hold{ttl: time.Second}, red: hold{ttl: time.Second}}
				var mr Result
				ms.holdInto(&mr, "k", cost, plans, &p.mem)
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
				mst, mstatus := ms.settle("k", plans, 0, p.n, x, p.mem.expires)
				rst, rstatus, err := rs.settle(ctx, "k", plans, &p.red, p.n, x)
				require.NoError(t, err)
				require.Equal(t, mstatus, rstatus, "op %d: settle %d of %d", i/3, x, p.n)
				require.Equal(t, mst, rst, "op %d: settle %d of %d", i/3, x, p.n)
			case 2: // the clock moves, by up to about 2.5s
				now += x * x * 40
				setTime(now)
				mr.FastForward(time.Duration(x*x*40) * time.Microsecond)
			case 3: // a decision, or a read
				mres, err := ms.Take(ctx, "k", cost, plans)
				require.NoError(t, err)
				rres, err := rs.Take(ctx, "k", cost, plans)
				require.NoError(t, err)
				require.Equal(t, mres, rres, "op %d: take %d", i/3, cost)
			}
		}
	})
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
	}
	p := []Plan{llm}
	for _, tt := range tests {
		assert.Equal(t, tt.delta, settleDelta(tt.n, tt.actual, tt.status), "%+v", tt)
		st := settlement(p, []TokenBucket{fullBucket(llm, t0)}, t0, tt.n, tt.actual, 0, tt.status)
		assert.Equal(t, tt.refunded, st.Refunded, "%+v", tt)
		assert.Equal(t, tt.charged, st.Charged, "%+v", tt)
	}
}
