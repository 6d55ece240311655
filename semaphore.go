package tollgate

import "context"

// semaphore is the state of one concurrency plan of a key in a
// MemoryStore: the permits held, by holder. scripts/semaphore.lua keeps
// the same state in Redis, and a test feeds both the same steps.
type semaphore struct {
	held    int64                  // the permits of every holder
	holders map[string]permitLease // by holder id
}

// permitLease is one holder's permits: how many, and when their lease
// ends, in µs on the store's clock.
type permitLease struct {
	n, ends int64
}

// reclaim removes the permits whose lease ended at or before now, and
// returns how many there were.
func (s *semaphore) reclaim(now int64) (n int64) {
	for id, h := range s.holders {
		if h.ends <= now {
			delete(s.holders, id)
			n += h.n
		}
	}
	s.held -= n
	return n
}

// free returns the permits of plan p that no holder holds: all of them
// for a nil s, a plan without state, and none when its holders hold more
// than its capacity: adopted permits, or a capacity lowered while they
// held them.
func (s *semaphore) free(p *Plan) int64 {
	if s == nil {
		return p.Capacity
	}
	return max(p.Capacity-s.held, 0)
}

// add gives holder id n permits, their lease ending at ends.
func (s *semaphore) add(id string, n, ends int64) {
	if s.holders == nil {
		s.holders = make(map[string]permitLease)
	}
	s.held += n - s.holders[id].n
	s.holders[id] = permitLease{n: n, ends: ends}
}

// holds reports whether holder id holds n permits, alive at now.
func (s *semaphore) holds(id string, n, now int64) bool {
	h, ok := s.holders[id]
	return ok && h.n == n && h.ends > now
}

// remove takes holder id's permits away.
func (s *semaphore) remove(id string) {
	s.held -= s.holders[id].n
	delete(s.holders, id)
}

// endsAt returns when the last lease ends, in µs: when the semaphore
// holds nothing any more.
func (s *semaphore) endsAt() int64 {
	at := int64(0)
	for _, h := range s.holders {
		at = max(at, h.ends)
	}
	return at
}

// permits implements permitStore: it releases, renews or adopts, as
// permit.lua does, the permits o names.
func (m *MemoryStore) permits(_ context.Context, o permitOp) (permitReply, error) {
	lk, now := m.lock(o.key)
	defer lk.unlock()
	var reclaimed int64
	sems := make([]*semaphore, len(o.plans))
	for i := range o.plans {
		if sems[i] = lk.e.semaphore(&o.plans[i]); sems[i] != nil {
			reclaimed += sems[i].reclaim(now)
		}
	}
	if o.adopt {
		if lk.e == nil {
			lk.insert(m, o.key, len(o.plans), now)
		}
		for i := range o.plans {
			sems[i] = lk.e.storeSemaphore(&o.plans[i])
		}
	}
	live := make([]bool, len(o.holders))
	for h, x := range o.holders {
		live[h] = true
		for i, s := range sems {
			if !o.adopt && x.mask&(1<<i) != 0 {
				live[h] = live[h] && s != nil && s.holds(x.id, x.n, now)
			}
		}
		for i, s := range sems {
			switch {
			case s == nil || x.mask&(1<<i) == 0:
			case live[h] && o.lease > 0:
				s.add(x.id, x.n, now+o.lease.Microseconds())
			default:
				s.remove(x.id)
			}
		}
	}
	return permitReply{now: now, live: live, reclaimed: reclaimed}, nil
}

// reclaim removes the permits of concurrency plan p whose lease ended,
// and returns what a Result tells of the plan before a decision: its
// free permits, and how many it reclaimed. e may be nil.
func (e *memEntry) reclaim(p *Plan, now int64) planState {
	s := e.semaphore(p)
	var st planState
	if s != nil {
		st.reclaimed = s.reclaim(now)
	}
	st.remaining = s.free(p)
	return st
}

// addPermits gives the holder of o, an acquire that was allowed, its
// permits of each concurrency plan of o, their lease ending from now.
func (e *memEntry) addPermits(o *op, now int64) {
	for i := range o.plans {
		if p := &o.plans[i]; p.Concurrency {
			e.storeSemaphore(p).add(o.grant.id, o.n, now+o.grant.lease.Microseconds())
		}
	}
}

// permitState returns what a Result reports of a concurrency plan after
// a decision of cost that found free permits and reclaimed others.
func permitState(free, reclaimed, cost int64, allowed bool) planState {
	st := planState{remaining: free, reclaimed: reclaimed, full: free < cost}
	if allowed {
		st.remaining -= cost
	}
	return st
}

// holdsPermits reports whether a permit of e, of any concurrency plan,
// is alive at now.
func (e *memEntry) holdsPermits(now int64) bool {
	for _, b := range e.buckets {
		if b.sem != nil && b.sem.endsAt() > now {
			return true
		}
	}
	return false
}
