package tollgate

import "sync/atomic"

// memTable is one shard's index of its entries by the hash of their key:
// open addressing with linear probing, in which a decision finds its
// key's entry with atomic loads alone, writing nothing that another core
// reads. Slots change only under the shard's lock.
//
// A probe without the lock may meet a slot half written, an entry that
// has since left the table or been reused for another key, or miss an
// entry that a deletion is moving back: what it finds is a candidate,
// confirmed by the entry's key under the entry's lock, and what it misses
// is looked up again under the shard's lock. A table that growth has
// replaced is never written again.
type memTable struct {
	slots []memSlot // a power of two long, never more than half full
	mask  uint64
}

// memSlot holds an entry and the hash of its key, or nothing: a nil
// entry ends a probe.
type memSlot struct {
	hash atomic.Uint64
	e    atomic.Pointer[memEntry]
}

// minTableSlots is the length of a shard's first table.
const minTableSlots = 8

func newMemTable(slots int) *memTable {
	return &memTable{slots: make([]memSlot, slots), mask: uint64(slots - 1)}
}

// probe returns the first entry with hash h, or nil: a candidate, which
// the caller must confirm (see memTable). It takes no lock.
func (t *memTable) probe(h uint64) *memEntry {
	for i, n := h&t.mask, 0; n < len(t.slots); i, n = (i+1)&t.mask, n+1 {
		s := &t.slots[i]
		e := s.e.Load()
		if e == nil {
			return nil
		}
		if s.hash.Load() == h {
			return e
		}
	}
	return nil
}

// lookup returns the entry of key, of hash h, and its slot, or nil and
// -1. Requires the shard's lock, under which an entry's key is stable.
func (t *memTable) lookup(key string, h uint64) (*memEntry, int) {
	for i := h & t.mask; ; i = (i + 1) & t.mask {
		s := &t.slots[i]
		e := s.e.Load()
		if e == nil {
			return nil, -1
		}
		if s.hash.Load() == h && e.key == key {
			return e, int(i)
		}
	}
}

// put places e, of hash h, in the first free slot of its probe. Requires
// the shard's lock and a free slot.
func (t *memTable) put(h uint64, e *memEntry) {
	i := h & t.mask
	for t.slots[i].e.Load() != nil {
		i = (i + 1) & t.mask
	}
	t.slots[i].hash.Store(h)
	t.slots[i].e.Store(e)
}

// remove empties slot i and moves back the entries after it that it
// would keep from the start of their probe, so that no probe needs a
// tombstone. Requires the shard's lock.
func (t *memTable) remove(i int) {
	at := uint64(i)
	for j := (at + 1) & t.mask; ; j = (j + 1) & t.mask {
		e := t.slots[j].e.Load()
		if e == nil {
			break
		}
		h := t.slots[j].hash.Load()
		if (j-h)&t.mask < (j-at)&t.mask {
			continue // its probe starts after the empty slot: it stays
		}
		t.slots[at].hash.Store(h)
		t.slots[at].e.Store(e)
		at = j
	}
	t.slots[at].e.Store(nil)
	t.slots[at].hash.Store(0)
}

// grown returns a table twice as long with t's entries. Requires the
// shard's lock.
func (t *memTable) grown() *memTable {
	g := newMemTable(2 * len(t.slots))
	for i := range t.slots {
		if e := t.slots[i].e.Load(); e != nil {
			g.put(t.slots[i].hash.Load(), e)
		}
	}
	return g
}
