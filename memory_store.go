package tollgate

import (
	"context"
	"hash/maphash"
	"strings"
	"sync"
	"time"
)

// DefaultMaxKeys is the default bound on the buckets a MemoryStore holds.
const DefaultMaxKeys = 100_000

// MemoryStore is a Store that keeps buckets in this process, for a single
// instance and as the fallback while Redis is down. It is safe for
// concurrent use, starts no goroutine and needs no Close.
//
// A bucket is dropped once it is full again, since a missing bucket reads as
// full: at the latest when the store needs room. The store never holds more
// than its MaxKeys buckets (one per key and plan); when it is at the bound
// and none is full, it drops the bucket closest to full among a sample, and
// that key may get those few tokens early. This keeps a flood of distinct
// keys from exhausting memory.
type MemoryStore struct {
	seed   maphash.Seed
	shards []memShard
	perCap int // buckets one shard may hold

	epoch      time.Time // monotonic clock base
	epochMicro int64
	now        func() int64 // microseconds; tests replace it
}

type memShard struct {
	mu      sync.Mutex
	buckets map[memKey]*memBucket
	_       [40]byte // keeps neighbouring shard locks off one cache line
}

type memKey struct{ key, plan string }

type memBucket struct {
	TokenBucket
	fullAt int64 // microseconds; the bucket may be dropped from then on
}

// MemoryOption configures a MemoryStore.
type MemoryOption func(*MemoryStore)

// WithMaxKeys bounds the buckets a MemoryStore holds, one per key and plan.
// Values below 1 mean the default, DefaultMaxKeys.
func WithMaxKeys(n int) MemoryOption {
	return func(m *MemoryStore) { m.perCap = n }
}

// maxShards bounds the shards of a MemoryStore; a parallel benchmark shows
// no lock contention left at this count on the machines we measured.
const maxShards = 64

// Buckets an insertion examines: a few on every insertion, so that full
// buckets go without pressure; a larger sample once the shard is at its
// bound, to pick a good victim.
const (
	sweepSample = 4
	evictSample = 16
)

// NewMemoryStore returns an empty MemoryStore.
func NewMemoryStore(opts ...MemoryOption) *MemoryStore {
	m := &MemoryStore{seed: maphash.MakeSeed(), epoch: time.Now()}
	m.epochMicro = m.epoch.UnixMicro()
	m.now = m.monotonicMicros
	for _, o := range opts {
		o(m)
	}
	maxKeys := m.perCap
	if maxKeys < 1 {
		maxKeys = DefaultMaxKeys
	}
	n := maxShards
	for n > 1 && n > maxKeys {
		n /= 2
	}
	m.shards = make([]memShard, n)
	for i := range m.shards {
		m.shards[i].buckets = make(map[memKey]*memBucket)
	}
	m.perCap = maxKeys / n
	return m
}

// monotonicMicros reads the wall clock once, at construction, and the
// monotonic clock after that, so a stepped wall clock cannot refill buckets.
func (m *MemoryStore) monotonicMicros() int64 {
	return m.epochMicro + int64(time.Since(m.epoch)/time.Microsecond)
}

// Len returns the number of buckets the store holds.
func (m *MemoryStore) Len() int {
	n := 0
	for i := range m.shards {
		s := &m.shards[i]
		s.mu.Lock()
		n += len(s.buckets)
		s.mu.Unlock()
	}
	return n
}

func (m *MemoryStore) shard(key string) *memShard {
	return &m.shards[maphash.String(m.seed, key)&uint64(len(m.shards)-1)]
}

// Take implements Store. ctx is unused: the store never blocks on I/O.
func (m *MemoryStore) Take(_ context.Context, key string, cost int64, plans []Plan) (Result, error) {
	if err := checkTake(key, cost, plans); err != nil {
		return Result{}, err
	}
	// Fixed arrays keep a decision on up to four chained plans off the heap.
	var bufB [4]TokenBucket
	var bufE [4]*memBucket
	buckets, found := bufB[:0], bufE[:0]

	now := m.now() // before the lock; Refill never moves a Stamp back
	s := m.shard(key)
	s.mu.Lock()
	for _, p := range plans {
		e := s.buckets[memKey{key, p.Name}]
		b := FullBucket(p, now)
		if e != nil {
			b = e.TokenBucket
		}
		buckets, found = append(buckets, b), append(found, e)
	}
	allowed := TakeAll(plans, buckets, now, cost)
	if allowed && cost > 0 {
		for i, p := range plans {
			fullAt := buckets[i].FullAt(p, now)
			if e := found[i]; e != nil {
				e.TokenBucket, e.fullAt = buckets[i], fullAt
				continue
			}
			s.insert(memKey{strings.Clone(key), p.Name}, &memBucket{buckets[i], fullAt}, m.perCap, now)
		}
	}
	s.mu.Unlock()
	return newResult(plans, buckets, now, cost, allowed), nil
}

// insert adds a bucket, dropping full buckets it comes across and, at the
// bound, the one closest to full. It never drops a bucket of k.key, whose
// other plans the caller may be writing. Requires s.mu.
func (s *memShard) insert(k memKey, b *memBucket, perCap int, now int64) {
	examined := 0
	var victim memKey
	victimAt := int64(-1)
	for ok, e := range s.buckets {
		if examined >= evictSample || examined >= sweepSample && len(s.buckets) < perCap {
			break
		}
		examined++
		if ok.key == k.key {
			continue
		}
		if e.fullAt <= now {
			delete(s.buckets, ok)
			continue
		}
		if victimAt < 0 || e.fullAt < victimAt {
			victim, victimAt = ok, e.fullAt
		}
	}
	if len(s.buckets) >= perCap && victimAt >= 0 {
		delete(s.buckets, victim)
	}
	s.buckets[k] = b
}

// Reset implements Store: it drops the buckets, which then read as full.
func (m *MemoryStore) Reset(_ context.Context, key string, plans []Plan) error {
	if err := checkKey(key); err != nil {
		return err
	}
	s := m.shard(key)
	s.mu.Lock()
	for _, p := range plans {
		delete(s.buckets, memKey{key, p.Name})
	}
	s.mu.Unlock()
	return nil
}
