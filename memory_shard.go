package tollgate

import (
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
)

// memShard is one shard of a MemoryStore's keys. A decision on a key the
// shard holds probes its table and locks the key's entry alone (memLock);
// the shard's lock serializes what changes the table: a key inserted,
// evicted or removed, and the table's growth. It is taken before an
// entry's lock, never after.
type memShard struct {
	mu    sync.Mutex
	table atomic.Pointer[memTable]
	n     int      // keys in the table, under mu
	_     [40]byte // keeps the reset marks, and neighbouring shards, off this cache line
	marks memMarks // the reset marks of the shard's keys (MemoryStore.Reset)
	_     [40]byte
}

// evictSample is how many keys an insertion into a shard at its bound
// examines to pick a victim.
const evictSample = 16

func (s *memShard) init() {
	s.table.Store(newMemTable(minTableSlots))
}

// insert adds an entry for key, of hash h, with room for n plans, and
// returns it, locked. A shard at its bound of perCap keys evicts one
// first and reuses its entry, so that the copy of key is the only
// allocation. A shard above its bound, which keys holding permits kept
// it past, evicts one more, so that it comes back to its bound once their
// permits end. Requires s.mu, and key absent.
func (s *memShard) insert(key string, h uint64, n, perCap int, now int64) *memEntry {
	var e *memEntry
	if s.n >= perCap {
		e = s.evict(now)
	}
	if e != nil && s.n >= perCap {
		if extra := s.evict(now); extra != nil {
			extra.mu.Unlock() // dropped: a decision that finds it looks again
		}
	}
	if e == nil {
		e = newMemEntry(n)
	}
	e.claim(key, now)
	t := s.table.Load()
	if 2*(s.n+1) > len(t.slots) {
		t = t.grown()
		s.table.Store(t)
	}
	t.put(h, e)
	s.n++
	return e
}

// drop removes e, locked, from slot i of the table. A decision that found
// e before and waits for its lock then finds its key gone, and looks
// again. Requires s.mu.
func (s *memShard) drop(e *memEntry, i int) {
	s.table.Load().remove(i)
	s.n--
	e.key = ""
}

// evict drops a key to make room, and returns its entry, locked, or nil
// if the shard is empty or every key holds live permits: the first full
// key of a sample of evictSample, from a random slot on, which gives
// nothing back, or else the one that would get back the fewest tokens,
// per µs it has been away, if it returned after as long again. A key that
// a decision holds at that moment is in use and stays, unless every key
// sampled that it may drop is held: then it waits for each and chooses
// among them by the same rule. A key holding live permits is never
// dropped, since its permits would read as free while their holders
// work: while every key sampled holds some, it samples on, and if every
// key it finds does, it drops none and the shard holds one key more than
// its bound. Requires s.mu.
func (s *memShard) evict(now int64) *memEntry {
	t := s.table.Load()
	v := victim{harm: math.Inf(1)}
	start, examined := rand.Uint64(), 0
	for n := uint64(0); n <= t.mask && v.harm != math.Inf(-1) &&
		(examined < evictSample || v.harm == holdsPermits); n++ {
		i := (start + n) & t.mask
		if e := t.slots[i].e.Load(); e != nil {
			examined++
			if e.mu.TryLock() {
				v.consider(e, int(i), now)
			} else if v.nbusy < len(v.busy) {
				v.busy[v.nbusy] = slot{e, int(i)}
				v.nbusy++
			}
		}
	}
	if v.e == nil || v.harm == holdsPermits { // every key it may drop is held: wait for them
		// A decision that holds an entry waits for nothing, and none can
		// come to hold a second one: waiting for each in turn is safe.
		for _, b := range v.busy[:v.nbusy] {
			b.e.mu.Lock()
			v.consider(b.e, b.i, now)
		}
	}
	if v.harm == holdsPermits {
		v.e.mu.Unlock()
		return nil
	}
	if v.e != nil {
		s.drop(v.e, v.at)
	}
	return v.e
}

// holdsPermits is the harm of dropping a key that holds live permits:
// more than any other key's, and never dropped.
const holdsPermits = math.MaxFloat64

// slot is an entry and its slot in the table.
type slot struct {
	e *memEntry
	i int
}

// victim is evict's choice so far: an entry, locked, its slot and the
// harm of dropping it; and the entries it found held.
type victim struct {
	e     *memEntry
	at    int
	harm  float64 // -Inf: full, nothing given back
	busy  [evictSample]slot
	nbusy int
}

// consider weighs e, locked, in slot i, against the victim so far, and
// unlocks the one it does not keep.
func (v *victim) consider(e *memEntry, i int, now int64) {
	harm := math.Inf(-1)
	if at := e.fullAt(now); at > now {
		// What it would get back if it returned after as long as it has
		// been away, per µs away: a key seen once long ago is a better
		// victim than a drained key that keeps asking.
		away := max(now-e.seen, 0) // its last decision may have read the clock after ours
		harm = float64(at-now-away) / float64(away+1)
	}
	if e.holdsPermits(now) {
		harm = holdsPermits
	}
	if harm >= v.harm {
		e.mu.Unlock()
		return
	}
	if v.e != nil {
		v.e.mu.Unlock()
	}
	v.e, v.at, v.harm = e, i, harm
}
