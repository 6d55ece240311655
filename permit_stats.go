package tollgate

import "sync/atomic"

// permitCounters are what Stats.Permits counts.
type permitCounters struct {
	granted, refused, released, lost, unreleased, reclaimed, adopted atomic.Uint64
}

// acquired counts the Acquire call that decided r; not one on a key
// exempt from every plan, as PlanStats does not.
func (c *permitCounters) acquired(r *Result) {
	switch {
	case r.Source == SourceExempt:
		return
	case r.Allowed:
		c.granted.Add(1)
	default:
		c.refused.Add(1)
	}
	if r.reclaimed > 0 {
		c.reclaimed.Add(uint64(r.reclaimed))
	}
}

// snapshot reads the counters into s.
func (c *permitCounters) snapshot(s *Stats) {
	p := &s.Permits
	p.Granted, p.Refused, p.Released = c.granted.Load(), c.refused.Load(), c.released.Load()
	p.Lost, p.Unreleased, p.Reclaimed = c.lost.Load(), c.unreleased.Load(), c.reclaimed.Load()
	p.Adopted = c.adopted.Load()
}

// snapshot sets, in the stats of each plan of s, the permits of it the
// book holds, on every key.
func (b *permitBook) snapshot(s *Stats) {
	held := map[string]int64{}
	b.mu.Lock()
	for _, ps := range b.byKey {
		for _, p := range ps {
			for i := range p.plans {
				held[p.plans[i].Name] += p.n
			}
		}
	}
	b.mu.Unlock()
	for i := range s.Plans {
		s.Plans[i].PermitsHeld = held[s.Plans[i].Plan]
	}
}
