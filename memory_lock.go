package tollgate

// memLock is what a decision on a key holds: the key's entry, locked, or,
// for a key without one, its shard's lock, under which the decision may
// insert an entry.
//
// A decision finds the entry by probing the shard's table, which takes
// no lock, then locks the entry and checks its key: an entry that was
// evicted or removed meanwhile has another key or none, and the decision
// looks again under the shard's lock. A decision never writes to an entry
// that has left its shard, so none is lost when its key is dropped and
// inserted anew at once.
type memLock struct {
	s     *memShard
	e     *memEntry // locked; nil for a key without an entry, while s.mu is held
	h     uint64    // the key's hash
	shard bool      // s.mu is held
}

// lock locks key's entry, or its shard if it has none, and returns the
// time. A decision on a key the store holds reads the clock before the
// entry's lock, which it would otherwise lengthen. If a decision that read
// the clock later took the lock first, the clock is read again under the
// lock, where it can only be later than that decision's: a stale now would
// see that decision's stamps from the future, and a stamp a whole refill
// ahead passes for garbage. A decision that finds no entry reads the clock
// under the shard's lock, after every decision on the entry the key had
// before it was dropped: deciding at a time read before those, it would
// stamp a new bucket early, and refill it with tokens they took.
func (m *MemoryStore) lock(key string) (memLock, int64) {
	s, h := m.shard(key)
	if e := s.table.Load().probe(h); e != nil {
		now := m.now()
		e.mu.Lock()
		if e.key == key {
			return memLock{s: s, e: e, h: h}, m.visit(e, now)
		}
		e.mu.Unlock()
	}
	return m.lockShard(s, key, h)
}

// lockShard is lock for a key that the probe missed or found gone: it
// looks again under the shard's lock, where no entry can move.
func (m *MemoryStore) lockShard(s *memShard, key string, h uint64) (memLock, int64) {
	s.mu.Lock()
	now := m.now()
	e, _ := s.table.Load().lookup(key, h)
	if e == nil {
		return memLock{s: s, h: h, shard: true}, now
	}
	e.mu.Lock()
	s.mu.Unlock()
	return memLock{s: s, e: e, h: h}, m.visit(e, now)
}

// visit dates a decision on e, locked, that read the clock at now, and
// returns the time it decides at (see lock).
func (m *MemoryStore) visit(e *memEntry, now int64) int64 {
	if now < e.seen {
		now = m.now()
	}
	e.seen = now
	return now
}

// insert gives key, which has no entry, one with room for n plans, and
// returns it: the decision holds it until unlock.
func (l *memLock) insert(m *MemoryStore, key string, n int, now int64) *memEntry {
	l.e = l.s.insert(key, l.h, n, m.perCap, now)
	return l.e
}

// unlock releases what the decision holds.
func (l *memLock) unlock() {
	if l.e != nil {
		l.e.mu.Unlock()
	}
	if l.shard {
		l.s.mu.Unlock()
	}
}
