package tollgate

import (
	"context"
	"hash/maphash"
	"math"
	"slices"
	"strings"
	"sync"
	"time"
)

// defaultMaxKeys is the default bound on the keys a MemoryStore holds.
const defaultMaxKeys = 100_000

// MemoryStore is a Store that keeps buckets in this process, for a single
// instance and as the fallback while Redis is down. It is safe for
// concurrent use, starts no goroutine and needs no Close.
//
// A key stays resident, full or not, until the store needs room for
// another, whose entry then reuses the dropped one's: a key that refills
// between visits, like most users under their limit, costs no allocation
// (ADR 25). The store never holds more than WithMaxKeys keys (bounded per
// shard, of at least 64 keys each), so a flood of distinct keys cannot
// exhaust memory. When a shard is at its bound it drops a full key of a
// sample of 16, which reads the same as a missing one, or, if none is
// full, the one that would get back the fewest tokens, per µs it has been
// away, if it returned after as long again: a key in use is kept over keys
// seen once, and a key that will be full by its return goes first. A key
// that is dropped before it is full reads as full when it returns, so it
// gets back at most one capacity of each plan per eviction.
type MemoryStore struct {
	seed   maphash.Seed
	shards []memShard
	perCap int // keys one shard may hold

	epoch      time.Time // monotonic clock base
	epochMicro int64
	err        error         // a wiring mistake: New reports it, and so does Take
	fakeNow    func() int64  // replaces the clock in tests
	random     func() uint64 // draws for suppressed plans; tests replace it
}

type memShard struct {
	mu   sync.Mutex
	keys map[string]*memEntry
	_    [48]byte // keeps neighbouring shard locks off one cache line
}

// memEntry holds the buckets and windows of one key, one per plan it was
// charged to.
type memEntry struct {
	buckets []memBucket
	seen    int64 // µs: the last decision on the key, denials and reads included
}

// memBucket is the state of one plan: its bucket, or its window when the
// plan is a window plan.
type memBucket struct {
	plan Plan
	TokenBucket
	win *window
	ver bucketVersion // of versioned plans (Plan.Version)
}

// find returns the stored state of plan p's name, or nil. e may be nil: a
// key without state.
func (e *memEntry) find(p *Plan) *memBucket {
	if e != nil {
		for i := range e.buckets {
			if e.buckets[i].plan.Name == p.Name {
				return &e.buckets[i]
			}
		}
	}
	return nil
}

// bucket returns the stored bucket of plan p, or a full one at now if
// there is none. A window kept for a plan of the name reads as fromWindow
// makes it, as the script reads it.
func (e *memEntry) bucket(p *Plan, now int64) TokenBucket {
	if b := e.find(p); b != nil {
		if b.win == nil {
			return b.ver.inherit(b.TokenBucket, p, now)
		}
		return fromWindow(b.win, b.plan.Capacity, p, now)
	}
	return fullBucket(*p, now)
}

// bringBack writes back b, plan p's bucket as e.bucket reads it, refilled
// to now, if its stamp is too far ahead (TokenBucket.Refill): a decision
// that is not allowed writes nothing else, and the stamp must not stay out
// of reach of a clock that only catches up with it. e may be nil: its
// buckets read as full, never too far ahead.
func (e *memEntry) bringBack(p *Plan, b TokenBucket, now int64) {
	if b.tooFarAhead(p, now) {
		e.store(p, b.refill(p, now))
	}
}

// window returns the stored window of plan p, or nil, which counts
// nothing, if there is none. A window kept for a plan of another shape
// reads as carry makes it, and a bucket kept for a plan of the name as
// fromBucket makes it, as the script reads them.
func (e *memEntry) window(p *Plan, now int64) *window {
	b := e.find(p)
	switch {
	case b == nil:
		return nil
	case b.win == nil:
		return fromBucket(b.TokenBucket, p, now)
	case sameShape(&b.plan, p):
		return b.win
	}
	return carry(b.win, b.plan.Suppress != 0, p, now)
}

// sameShape reports whether window plans a and b count in the same
// sub-windows, so that one may read the other's window.
func sameShape(a, b *Plan) bool {
	if (a.Suppress != 0) != (b.Suppress != 0) || a.slots() != b.slots() {
		return false
	}
	return a.Window == b.Window || a.width() == b.width() // the same window, or rounded alike
}

// store sets the bucket of plan p.
func (e *memEntry) store(p *Plan, b TokenBucket) {
	for i := range e.buckets {
		switch eb := &e.buckets[i]; {
		case eb.plan.Name != p.Name:
		case eb.win != nil:
			*eb = memBucket{plan: *p, TokenBucket: b, ver: bucketVersion{}.written(p)}
			return
		case eb.plan.Capacity != p.Capacity || eb.plan.Rate != p.Rate:
			// Another Limiter with other plans of that name shares the store.
			*eb = memBucket{plan: *p, TokenBucket: b, ver: eb.ver.written(p)}
			return
		default: // no pointer written, no write barrier
			eb.TokenBucket = b
			if p.Version != 0 {
				eb.ver = eb.ver.written(p)
			}
			return
		}
	}
	e.buckets = append(e.buckets, memBucket{plan: *p, TokenBucket: b, ver: bucketVersion{}.written(p)})
}

// storeWindow returns plan p's window to write in: new if there is none,
// carried over if it was kept for a plan of another shape, and made from
// the bucket if a plan of the name kept one.
func (e *memEntry) storeWindow(p *Plan, now int64) *window {
	eb := e.find(p)
	switch {
	case eb == nil:
		e.buckets = append(e.buckets, memBucket{plan: *p, win: &window{}})
		return e.buckets[len(e.buckets)-1].win
	case eb.win == nil:
		*eb = memBucket{plan: *p, win: fromBucket(eb.TokenBucket, p, now)}
	case !sameShape(&eb.plan, p):
		*eb = memBucket{plan: *p, win: carry(eb.win, eb.plan.Suppress != 0, p, now)}
	case eb.plan.Capacity != p.Capacity || eb.plan.Suppress != p.Suppress:
		eb.plan = *p
	}
	return eb.win
}

// fullAt returns when every bucket of the entry is full again, and every
// window counts nothing: when the store may forget it for free. A bucket
// that holds a version counts one fence longer, as Redis keeps it.
func (e *memEntry) fullAt(now int64) int64 {
	at := int64(0)
	for _, b := range e.buckets {
		if b.win != nil {
			at = max(at, b.win.emptyAt())
		} else {
			at = max(at, b.FullAt(b.plan, now)+b.ver.fence(&b.plan))
		}
	}
	return at
}

// maxShards bounds the shards of a MemoryStore; a parallel benchmark shows
// no lock contention left at this count on the machines we measured.
// Smaller stores have fewer, so that each shard holds minShardKeys.
const (
	maxShards    = 64
	minShardKeys = 64
)

// evictSample is how many keys an insertion into a shard at its bound
// examines to pick a victim.
const evictSample = 16

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore(opts ...Option) *MemoryStore {
	var c config
	m := &MemoryStore{seed: maphash.MakeSeed(), epoch: time.Now(), random: random53}
	m.err = applyOptions(&c, takerMemoryStore, opts)
	m.epochMicro = m.epoch.UnixMicro()
	maxKeys := c.maxKeys
	if maxKeys < 1 {
		maxKeys = defaultMaxKeys
	}
	// The bound holds per shard, so a shard must hold enough keys for the
	// sample to find a good victim: a store of 100 keys in 64 shards would
	// evict a drained key, and give back its quota, to make room for one
	// newcomer that happened to land in its shard.
	n := maxShards
	for n > 1 && maxKeys/n < minShardKeys {
		n /= 2
	}
	m.shards = make([]memShard, n)
	for i := range m.shards {
		m.shards[i].keys = make(map[string]*memEntry)
	}
	m.perCap = maxKeys / n
	return m
}

// now returns the time in microseconds since the Unix epoch. It reads the
// wall clock once, at construction, and the monotonic clock after that,
// so a stepped wall clock cannot refill buckets.
func (m *MemoryStore) now() int64 {
	if m.fakeNow != nil {
		return m.fakeNow()
	}
	return m.epochMicro + int64(time.Since(m.epoch)/time.Microsecond)
}

// Len returns the number of keys the store holds.
func (m *MemoryStore) Len() int {
	n := 0
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.Lock()
		n += len(s.keys)
		s.mu.Unlock()
	}
	return n
}

func (m *MemoryStore) shard(key string) *memShard {
	return &m.shards[maphash.String(m.seed, key)&uint64(len(m.shards)-1)]
}

// Take implements Store. The store never blocks on I/O; like a RedisStore,
// it takes nothing for a ctx that has ended, and returns ctx's error.
func (m *MemoryStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (r Result, err error) {
	if m.err != nil {
		return Result{}, m.err
	}
	if err := checkTake(key, cost, plans); err != nil {
		return Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	m.takeInto(&r, key, cost, plans)
	return r, nil
}

// decide implements decider: a take, a read or a hold, already checked.
// A hold is the Reservation itself, in this process: the store only dates
// its expiry.
func (m *MemoryStore) decide(_ context.Context, o op) (r Result, _ error) {
	m.takeInto(&r, o.key, o.cost(), o.plans)
	if o.mode == modeHold {
		o.hold.granted(m, m.now()+o.hold.ttl.Microseconds())
	}
	return r, nil
}

func (m *MemoryStore) self() Store { return m }

// wiringError implements wiredStore: an option of another constructor.
func (m *MemoryStore) wiringError() error { return m.err }

// inProcess implements localStore: a MemoryStore cannot fail.
func (*MemoryStore) inProcess() {}

// takeInto is Take for a request already checked, with its Result built
// in *r.
func (m *MemoryStore) takeInto(r *Result, key string, cost int64, plans []Plan) {
	if windowIn(plans) {
		m.takeWindows(r, key, cost, plans)
		return
	}
	// A chain of buckets alone skips the windows' bookkeeping (callgrind,
	// BenchmarkLimiterAllow/memory/one-key: see README). A fixed array
	// keeps up to four plans off the heap.
	var buf [4]TokenBucket
	buckets := buf[:0]
	s, e, now := m.lock(key)
	for i := range plans {
		buckets = append(buckets, e.bucket(&plans[i], now))
	}
	allowed, wd := takeAll(plans, buckets, now, cost)
	if allowed && cost > 0 {
		if e == nil {
			e = s.entry(key, len(plans), m.perCap, now)
		}
		for i := range plans {
			if wd&(1<<i) == 0 { // a shadowed plan that would deny is left as it was, but for bringBack
				e.store(&plans[i], buckets[i])
			} else {
				e.bringBack(&plans[i], e.bucket(&plans[i], now), now)
			}
		}
	} else {
		// A denial or a read leaves the buckets as they were, but a
		// denial brings back a stamp too far ahead.
		for i := range plans {
			buckets[i] = e.bucket(&plans[i], now)
			if cost > 0 {
				e.bringBack(&plans[i], buckets[i], now)
			}
		}
	}
	s.mu.Unlock()
	r.describe(&outcome{plans: plans, buckets: buckets, now: now, cost: cost, allowed: allowed, wd: wd})
}

// lock locks the shard of key and returns it, the key's entry (nil if
// none) and the time. The clock is read before the lock, which it would
// otherwise lengthen. If a decision that read the clock later took the
// lock first, the clock is read again under the lock, where it can only
// be later than that decision's: a stale now would see that decision's
// stamps from the future, and a stamp a whole refill ahead passes for
// garbage.
func (m *MemoryStore) lock(key string) (*memShard, *memEntry, int64) {
	now := m.now()
	s := m.shard(key)
	s.mu.Lock()
	e := s.keys[key]
	if e != nil {
		if now < e.seen {
			now = m.now()
		}
		e.seen = now
	}
	return s, e, now
}

// entry inserts an empty entry for key, with room for n plans, and
// returns it. At the bound it reuses the entry of the key it evicts, so
// that the key's copy is the only allocation. Requires s.mu.
func (s *memShard) entry(key string, n, perCap int, now int64) *memEntry {
	var e *memEntry
	if len(s.keys) >= perCap {
		e = s.evict(now)
	}
	if e == nil {
		e = &memEntry{buckets: make([]memBucket, 0, n)}
	} else {
		clear(e.buckets) // the evicted key's windows and plans go with it
		e.buckets = e.buckets[:0]
	}
	e.seen = now
	s.keys[strings.Clone(key)] = e
	return e
}

// takeWindows is takeInto for a chain with window plans.
func (m *MemoryStore) takeWindows(r *Result, key string, cost int64, plans []Plan) {
	// Fixed arrays keep a decision on up to four chained plans off the heap.
	var bbuf [4]TokenBucket
	var wbuf [4]*window
	var sbuf [4]planState
	buckets, windows, states := bbuf[:], wbuf[:], sbuf[:] // states of windows
	if len(plans) > len(bbuf) {
		buckets, windows, states = make([]TokenBucket, len(plans)), make([]*window, len(plans)), make([]planState, len(plans))
	}
	var u uint64
	suppressed := suppressedIn(plans)
	if suppressed {
		u = m.random()
	}

	s, e, now := m.lock(key)
	for i := range plans {
		if p := &plans[i]; p.isWindow() {
			windows[i] = e.window(p, now)
		} else {
			buckets[i] = e.bucket(p, now)
		}
	}
	allowed, wd := chain(plans, buckets, windows, now, cost, u)
	taken := allowed && cost > 0
	if (taken || suppressed && cost > 0) && e == nil {
		e = s.entry(key, len(plans), m.perCap, now)
	}
	if taken || suppressed && cost > 0 {
		for i := range plans {
			taken := taken && wd&(1<<i) == 0 // a shadowed plan that would deny takes nothing
			switch p := &plans[i]; {
			case !p.isWindow():
				if taken {
					buckets[i].Tokens -= cost * microTokens
					e.store(p, buckets[i])
				} else {
					e.bringBack(p, e.bucket(p, now), now)
				}
			case taken:
				windows[i] = e.storeWindow(p, now)
				windows[i].add(p, now, cost, cost)
			case p.Suppress != 0:
				windows[i] = e.storeWindow(p, now)
				windows[i].add(p, now, 0, cost)
			}
		}
	}
	for i := range plans {
		switch p := &plans[i]; {
		case p.isWindow():
			// Windows change in place: they are described under the lock.
			states[i] = describeWindow(p, windows[i], now, cost, allowed && wd&(1<<i) == 0)
		case !taken:
			// A denial or a read leaves the buckets as they were, but a
			// denial brings back a stamp too far ahead.
			buckets[i] = e.bucket(p, now)
			if cost > 0 {
				e.bringBack(p, buckets[i], now)
			}
		}
	}
	s.mu.Unlock()
	r.describe(&outcome{plans: plans, buckets: buckets, windows: states, now: now, cost: cost, allowed: allowed, wd: wd})
}

// describeWindow returns what a Result reports of window w of plan p after
// a decision that wrote in it what the decision wrote: its counts before
// the decision are its counts now, less what it took.
func describeWindow(p *Plan, w *window, now, cost int64, allowed bool) planState {
	admitted, offered := w.counts(now)
	ready := now
	if allowed && cost > 0 {
		admitted -= cost
	} else {
		ready = w.readyAt(p, now, asked(cost))
	}
	if p.Suppress != 0 && cost > 0 {
		offered -= cost
	}
	return windowState(p, windowCounts{admitted, offered, ready, w.resetAt(now)}, now, cost, allowed)
}

// evict drops a key to make room, and returns its entry, or nil if the
// shard is empty: the first full key of a sample of evictSample, which
// gives nothing back, or else the one that would get back the fewest
// tokens, per µs it has been away, if it returned after as long again
// (ADR 15). Requires s.mu.
func (s *memShard) evict(now int64) *memEntry {
	examined := 0
	var victim string
	var ve *memEntry
	victimHarm := math.Inf(1)
	for k, e := range s.keys {
		if examined == evictSample {
			break
		}
		examined++
		at := e.fullAt(now)
		if at <= now {
			victim, ve = k, e
			break
		}
		// What it would get back if it returned after as long as it has
		// been away, per µs away: a key seen once long ago is a better
		// victim than a drained key that keeps asking.
		away := max(now-e.seen, 0) // its last decision may have read the clock after ours
		if harm := float64(at-now-away) / float64(away+1); harm < victimHarm {
			victim, ve, victimHarm = k, e, harm
		}
	}
	if ve != nil {
		delete(s.keys, victim)
	}
	return ve
}

// Reset implements Store: it drops the buckets, which then read as full.
func (m *MemoryStore) Reset(_ context.Context, key string, plans []Plan) error {
	if err := checkKey(key); err != nil {
		return err
	}
	s := m.shard(key)
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.keys[key]
	if e == nil {
		return nil
	}
	kept := e.buckets[:0]
	for _, b := range e.buckets {
		if !slices.ContainsFunc(plans, func(p Plan) bool { return p.Name == b.plan.Name }) {
			kept = append(kept, b)
		}
	}
	e.buckets = kept
	if len(kept) == 0 {
		delete(s.keys, key)
	}
	return nil
}
