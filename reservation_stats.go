package tollgate

import "sync/atomic"

// reservationCounters are what Stats.Reservations counts. Reservations are
// rare next to decisions: one copy of each counter serves.
type reservationCounters struct {
	held, settled, expired, refunded, charged, uncharged atomic.Uint64
}

// count counts a settlement that found its hold as status says.
func (c *reservationCounters) count(st *Settlement, status settleStatus) {
	if status == holdSettled {
		return
	}
	c.settled.Add(1)
	if status == holdGone || status == holdBad {
		c.expired.Add(1)
	}
	c.refunded.Add(uint64(st.Refunded))
	c.charged.Add(uint64(st.Charged))
	c.uncharged.Add(uint64(st.Uncharged))
}

// snapshot reads the counters into s.
func (c *reservationCounters) snapshot(s *Stats) {
	r := &s.Reservations
	r.Held, r.Settled, r.Expired = c.held.Load(), c.settled.Load(), c.expired.Load()
	r.Refunded, r.Charged, r.Uncharged = c.refunded.Load(), c.charged.Load(), c.uncharged.Load()
}
