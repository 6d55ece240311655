package tollgate

import (
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
)

// memShard holds one shard of a MemoryStore's keys in an open-addressed
// table that a decision probes with atomic loads and no lock, then locks
// the one entry it found: two cores deciding on different keys write no
// cache line in common, as a shard lock would make them (ADR 25). Only
// inserting, evicting, removing and resizing take the shard's mutex.
//
// An entry's hash is read without a lock and its key under the entry's
// lock, so a probe that meets an entry evicted or reused for another key
// while it looked finds it gone, or another key's, and moves on. A table
// is never written once a resize has replaced it; a probe of an old one
// may miss a key inserted since, and the caller then looks again under
// the mutex.
type memShard struct {
	mu    sync.Mutex                                 // inserts, evictions, removals, resizes
	table atomic.Pointer[[]atomic.Pointer[memEntry]] // a power of two long; nil slots end probes
	n     int                                        // live entries, under mu
	dead  int                                        // tombstones in the table, under mu
	_     [32]byte                                   // keeps neighbouring shards off one cache line
}

// tombstone fills the slot of an entry that left, so that probes pass it.
var tombstone = &memEntry{gone: true}

// minTable is the length of a shard's first table.
const minTable = 8

func (s *memShard) init() {
	t := make([]atomic.Pointer[memEntry], minTable)
	s.table.Store(&t)
}

// slot is where a probe for hash h starts: the low bits chose the shard.
func slot(h uint64, t []atomic.Pointer[memEntry]) uint64 {
	return (h >> 16) & uint64(len(t)-1)
}

// find returns key's entry, locked, and its slot, or nil and -1. Under
// s.mu the slot is one of the current table's.
func (s *memShard) find(key string, h uint64) (*memEntry, int) {
	t := *s.table.Load()
	mask := uint64(len(t) - 1)
	for i := slot(h, t); ; i = (i + 1) & mask {
		e := t[i].Load()
		switch {
		case e == nil:
			return nil, -1
		case e == tombstone || e.hash.Load() != h:
			continue
		}
		e.mu.Lock()
		if !e.gone && e.key == key {
			return e, int(i)
		}
		e.mu.Unlock()
	}
}

// insert puts e, of hash h, in the table. Requires s.mu, and key absent.
func (s *memShard) insert(e *memEntry, h uint64) {
	t := *s.table.Load()
	if 4*(s.n+s.dead+1) > 3*len(t) {
		t = s.resize()
	}
	mask := uint64(len(t) - 1)
	for i := slot(h, t); ; i = (i + 1) & mask {
		switch t[i].Load() {
		case tombstone:
			s.dead--
			fallthrough
		case nil:
			t[i].Store(e)
			s.n++
			return
		}
	}
}

// resize replaces the table with one that its live entries fill at most
// half, leaving the tombstones behind, and returns it. Requires s.mu.
func (s *memShard) resize() []atomic.Pointer[memEntry] {
	old := *s.table.Load()
	size := minTable
	for size < 2*(s.n+1) {
		size *= 2
	}
	t := make([]atomic.Pointer[memEntry], size)
	mask := uint64(size - 1)
	for i := range old {
		e := old[i].Load()
		if e == nil || e == tombstone {
			continue
		}
		h := e.hash.Load()
		j := slot(h, t)
		for t[j].Load() != nil {
			j = (j + 1) & mask
		}
		t[j].Store(e)
	}
	s.table.Store(&t)
	s.dead = 0
	return t
}

// remove marks e, locked, gone and turns its slot i into a tombstone.
// Requires s.mu.
func (s *memShard) remove(e *memEntry, i int) {
	e.gone = true
	(*s.table.Load())[i].Store(tombstone)
	s.n--
	s.dead++
}

// sample calls f with up to n live entries, unlocked, and their slots,
// from a random place in the table, until f returns false. Requires s.mu.
func (s *memShard) sample(n int, f func(e *memEntry, i int) bool) {
	t := *s.table.Load()
	mask := uint64(len(t) - 1)
	start := rand.Uint64() & mask
	for k, seen := uint64(0), 0; k < uint64(len(t)) && seen < n; k++ {
		i := (start + k) & mask
		e := t[i].Load()
		if e == nil || e == tombstone {
			continue
		}
		seen++
		if !f(e, int(i)) {
			return
		}
	}
}

// claim readies e, locked, to hold key, of hash h, from now on: a new
// entry, or an evicted one whose plans go with the key it held. Requires
// s.mu; insert publishes it.
func (e *memEntry) claim(key string, h uint64, now int64) {
	clear(e.buckets) // the evicted key's windows and plans go with it
	e.buckets = e.buckets[:0]
	e.key, e.gone, e.seen = strings.Clone(key), false, now
	e.hash.Store(h)
}
