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
// A key's buckets are dropped once they are all full again, since a missing
// bucket reads as full: at the latest when the store needs room. The store
// never holds more than WithMaxKeys keys (bounded per shard, of at least 64
// keys each), so a flood of distinct keys cannot exhaust memory. When a
// shard is at its bound and none of a sample of 16 keys is full, it drops
// the one that would get back the fewest tokens, per µs it has been away,
// if it returned after as long again: a key in use is kept over keys seen
// once, and a key that will be full by its return goes first. A key that
// is dropped before it is full reads as full when it returns, so it gets
// back at most one capacity of each plan per eviction.
type MemoryStore struct {
	seed   maphash.Seed
	shards []memShard
	perCap int // keys one shard may hold

	epoch      time.Time // monotonic clock base
	epochMicro int64
	fakeNow    func() int64 // replaces the clock in tests
}

type memShard struct {
	mu   sync.Mutex
	keys map[string]*memEntry
	_    [48]byte // keeps neighbouring shard locks off one cache line
}

// memEntry holds the buckets of one key, one per plan it was charged to.
type memEntry struct {
	buckets []memBucket
	seen    int64 // µs: the last decision on the key, denials and reads included
}

type memBucket struct {
	plan Plan
	TokenBucket
}

// bucket returns the stored bucket of plan p, or a full one at now if
// there is none. e may be nil: a key without buckets.
func (e *memEntry) bucket(p Plan, now int64) TokenBucket {
	if e != nil {
		for i := range e.buckets {
			if e.buckets[i].plan.Name == p.Name {
				return e.buckets[i].TokenBucket
			}
		}
	}
	return fullBucket(p, now)
}

// store sets the bucket of plan p.
func (e *memEntry) store(p Plan, b TokenBucket) {
	for i := range e.buckets {
		switch eb := &e.buckets[i]; {
		case eb.plan.Name != p.Name:
		case eb.plan.Capacity != p.Capacity || eb.plan.Rate != p.Rate:
			// Another Limiter with other plans of that name shares the store.
			*eb = memBucket{p, b}
			return
		default: // no pointer written, no write barrier
			eb.TokenBucket = b
			return
		}
	}
	e.buckets = append(e.buckets, memBucket{p, b})
}

// fullAt returns when every bucket of the entry is full again.
func (e *memEntry) fullAt(now int64) int64 {
	at := int64(0)
	for _, b := range e.buckets {
		at = max(at, b.FullAt(b.plan, now))
	}
	return at
}

// MemoryOption configures a MemoryStore.
type MemoryOption func(*MemoryStore)

// WithMaxKeys bounds the keys a MemoryStore holds. Values below 1 mean the
// default, 100,000 keys.
func WithMaxKeys(n int) MemoryOption {
	return func(m *MemoryStore) { m.perCap = n }
}

// maxShards bounds the shards of a MemoryStore; a parallel benchmark shows
// no lock contention left at this count on the machines we measured.
// Smaller stores have fewer, so that each shard holds minShardKeys.
const (
	maxShards    = 64
	minShardKeys = 64
)

// Keys an insertion examines: a few on every insertion, so that full keys
// go without pressure; a larger sample once the shard is at its bound, to
// pick a good victim.
const (
	sweepSample = 4
	evictSample = 16
)

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore(opts ...MemoryOption) *MemoryStore {
	m := &MemoryStore{seed: maphash.MakeSeed(), epoch: time.Now()}
	m.epochMicro = m.epoch.UnixMicro()
	for _, o := range opts {
		o(m)
	}
	maxKeys := m.perCap
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
	if err := checkTake(key, cost, plans); err != nil {
		return Result{}, err
	}
	if err := ctx.Err(); err != nil {
		return Result{}, err
	}
	m.takeInto(&r, key, cost, plans)
	return r, nil
}

// takeInto is Take for a request already checked, with its Result built
// in *r.
func (m *MemoryStore) takeInto(r *Result, key string, cost int64, plans []Plan) {
	// A fixed array keeps a decision on up to four chained plans off the heap.
	var buf [4]TokenBucket
	buckets := buf[:0]

	s := m.shard(key)
	s.mu.Lock()
	// The clock is read under the lock, so no decision on this key can
	// have stamped a bucket later than now: a stale now, after a long
	// preemption, could pass for a garbage stamp a whole refill ahead.
	now := m.now()
	e := s.keys[key]
	if e != nil {
		e.seen = now
	}
	for _, p := range plans {
		buckets = append(buckets, e.bucket(p, now))
	}
	allowed := takeAll(plans, buckets, now, cost)
	if allowed && cost > 0 {
		if e == nil {
			e = &memEntry{buckets: make([]memBucket, 0, len(plans)), seen: now}
			s.insert(strings.Clone(key), e, m.perCap, now)
		}
		for i, p := range plans {
			e.store(p, buckets[i])
		}
	} else {
		// A denial or a read leaves the buckets as they were.
		for i, p := range plans {
			buckets[i] = e.bucket(p, now)
		}
	}
	s.mu.Unlock()
	r.describe(plans, buckets, now, cost, allowed)
}

// insert adds a key, dropping full keys it comes across and, at the bound,
// the one that would get back the fewest tokens, per µs it has been away,
// if it returned after as long again. Requires s.mu.
func (s *memShard) insert(key string, e *memEntry, perCap int, now int64) {
	examined := 0
	var victim string
	victimHarm := math.Inf(1)
	for k, old := range s.keys {
		if examined >= evictSample || examined >= sweepSample && len(s.keys) < perCap {
			break
		}
		examined++
		at := old.fullAt(now)
		if at <= now {
			delete(s.keys, k)
			continue
		}
		// What it would get back if it returned after as long as it has
		// been away, per µs away: a key seen once long ago is a better
		// victim than a drained key that keeps asking.
		away := now - old.seen
		if harm := float64(at-now-away) / float64(away+1); harm < victimHarm {
			victim, victimHarm = k, harm
		}
	}
	if len(s.keys) >= perCap && !math.IsInf(victimHarm, 1) {
		delete(s.keys, victim)
	}
	s.keys[key] = e
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
