package tollgate

import (
	"context"
	"slices"
	"sync"
	"time"
)

// memMarks are the reset marks of a shard's keys: the time of each key's
// latest Reset, µs on the store's clock, kept as long as a hold taken
// before it may be settled. Its lock is taken after a key's (memLock),
// never before.
type memMarks struct {
	mu   sync.Mutex
	book markBook
}

// Reset implements Store: it drops the buckets and windows, which then
// read as full and empty, but never a concurrency plan's permits, which
// are their holders' until released, as the RedisStore keeps them: a
// plan of the name in another Limiter sharing the store may be of
// another kind. It also marks the key as reset now, under the key's lock,
// so that a reservation of the key taken before it, by any Limiter that
// shares the store, is refunded nothing when it settles: the buckets
// Reset filled hold its tokens already. The mark is kept 15 minutes, the
// default hold TTL; a Limiter's Reset keeps it for its own hold TTL if
// that is longer. Reset with no plan changes nothing.
func (m *MemoryStore) Reset(ctx context.Context, key string, plans []Plan) error {
	return m.resetHolds(ctx, key, plans, minResetKeep)
}

// resetHolds implements holdResetter: Reset, with a mark kept at least
// keep, and never less than minResetKeep. Past maxResetMarks keys reset
// within that time, spread over the shards, a shard forgets its marks and
// voids the refunds of every hold of its keys taken before them.
func (m *MemoryStore) resetHolds(_ context.Context, key string, plans []Plan, keep time.Duration) error {
	if err := checkReset(key, plans); err != nil {
		return err
	}
	if len(plans) == 0 {
		return nil
	}
	s, h := m.shard(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	// Read under the key's lock: after every decision on the key before
	// the Reset, so that a hold taken before it is dated at or before it;
	// and seen by the key's entry (visit), so that a decision that read
	// the clock before it waited for the lock reads it again: it dates a
	// hold it takes after the Reset at or after the mark, and stamps no
	// bucket the Reset filled with an earlier time.
	var now int64
	if e, i := s.table.Load().lookup(key, h); e != nil {
		e.mu.Lock()
		defer e.mu.Unlock()
		now = m.visit(e, m.now())
		if e.dropPlans(plans) {
			s.drop(e, i)
		}
	} else {
		now = m.now()
	}
	s.marks.mark(key, now, now+max(keep, minResetKeep).Microseconds(), maxResetMarks/len(m.shards))
	return nil
}

// dropPlans drops the buckets and windows of plans, but never permits,
// and reports whether the entry holds nothing left.
func (e *memEntry) dropPlans(plans []Plan) bool {
	kept := e.buckets[:0]
	for _, b := range e.buckets {
		if b.sem != nil || !slices.ContainsFunc(plans, func(p Plan) bool { return p.Name == b.plan.Name }) {
			kept = append(kept, b)
		}
	}
	clear(e.buckets[len(kept):]) // the dropped plans' windows go with them
	e.buckets = kept
	return len(kept) == 0
}

// mark marks key as reset at now, until until at least (µs), keeping at
// most limit keys' marks. A later mark already kept stays, as does a
// later until.
func (ms *memMarks) mark(key string, now, until int64, limit int) {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	ms.book.set(key, bookMark{mark: now, until: until}, now, limit)
}

// voids reports whether a settlement at now of a hold of key taken at
// (µs) refunds nothing: the key was reset at or after it, or may have
// been; or it was reset once and the clock reads before the hold now,
// which the Reset may have come after, dated before it.
// scripts/settle.lua decides the same for a RedisStore.
func (ms *memMarks) voids(key string, at, now int64) bool {
	ms.mu.Lock()
	defer ms.mu.Unlock()
	since, marked := ms.book.since(key, at)
	return since || marked && now < at
}
