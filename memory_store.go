package tollgate

import (
	"context"
	"hash/maphash"
	"math/bits"
	"time"
)

// defaultMaxKeys is the default bound on the keys a MemoryStore holds.
const defaultMaxKeys = 100_000

// MemoryStore is a Store that keeps buckets in this process, for a single
// instance and as the fallback while Redis is down. It is safe for
// concurrent use, starts no goroutine and needs no Close. A decision on a
// key the store holds locks that key alone: decisions on other keys share
// no lock with it and write no memory in common.
//
// A key stays resident, full or not, until the store needs room for
// another, whose entry then reuses the dropped one's: a key that refills
// between visits, like most users under their limit, costs no
// allocation. The store never holds more than WithMaxKeys keys (bounded per
// shard, of at least 64 keys each), but for keys holding live permits
// (Limiter.Acquire), which it never drops, so a flood of distinct keys
// cannot exhaust memory. When a shard is at its bound it drops a full key of a
// sample of 16, which reads the same as a missing one, or, if none is
// full, the one that would get back the fewest tokens, per µs it has been
// away, if it returned after as long again: a key in use is kept over keys
// seen once, and a key that will be full by its return goes first; a key
// being decided on at that moment stays. A key that is dropped before it
// is full reads as full when it returns, so it gets back at most one
// capacity of each plan per eviction, and a key in debt (a reservation
// settled beyond what it held) its debt too: at most one capacity more.
type MemoryStore struct {
	seed       maphash.Seed
	shards     []memShard
	shardShift uint // a key's shard is its hash shifted right by this much
	perCap     int  // keys one shard may hold

	epoch      time.Time // monotonic clock base
	epochMicro int64
	err        error         // a wiring mistake: New reports it, and so does Take
	fakeNow    func() int64  // replaces the clock in tests
	random     func() uint64 // draws for suppressed plans; tests replace it
}

// maxShards bounds the shards of a MemoryStore, whose locks serialize the
// insertion and eviction of keys. Smaller stores have fewer, so that each
// shard holds minShardKeys.
const (
	maxShards    = 64
	minShardKeys = 64
)

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
		m.shards[i].init()
	}
	m.shardShift = uint(64 - bits.TrailingZeros(uint(n)))
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
		n += s.n
		s.mu.Unlock()
	}
	return n
}

// shard returns the shard of key and the key's hash: its high bits choose
// the shard, its low bits the slot in the shard's table.
func (m *MemoryStore) shard(key string) (*memShard, uint64) {
	h := maphash.String(m.seed, key)
	return &m.shards[h>>m.shardShift], h
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
	if cost == 0 {
		return m.decide(ctx, op{key: key, n: 1, mode: modeRead, plans: plans})
	}
	return m.decide(ctx, op{key: key, n: cost, plans: plans})
}

// decide implements decider: a take, a read or a hold, already checked.
func (m *MemoryStore) decide(_ context.Context, o op) (r Result, _ error) {
	m.decideIn(&r, &o)
	return r, nil
}

// decideIn is decide with the Result built in *r, which a Limiter calls
// without copying it: an interface's method would move it to the heap. A
// hold is the Reservation itself, in this process: the store only dates
// its expiry.
func (m *MemoryStore) decideIn(r *Result, o *op) {
	// A chain of buckets alone skips the windows' bookkeeping, which it
	// would otherwise pay for nothing.
	var now int64
	if windowIn(o.plans) || o.mode == modeAcquire {
		now = m.takeChain(r, o)
	} else {
		now = m.takeBuckets(r, o.key, o.cost(), o.plans)
	}
	switch {
	case o.mode == modeHold:
		m.dateHold(o.hold, now)
	case o.mode == modeAcquire && r.Allowed:
		o.grant.store = m
	}
}

// takeBuckets is decideIn for a chain of bucket plans: cost is the op's
// (see op.cost). It returns the time it decided at, µs.
func (m *MemoryStore) takeBuckets(r *Result, key string, cost int64, plans []Plan) int64 {
	// A fixed array keeps up to four plans off the heap.
	var buf [4]TokenBucket
	var buckets []TokenBucket
	if len(plans) <= len(buf) {
		buckets = buf[:len(plans)]
	} else {
		buckets = make([]TokenBucket, len(plans))
	}
	lk, now := m.lock(key)
	e := lk.e
	for i := range plans {
		buckets[i] = e.bucket(&plans[i], now)
	}
	allowed, wd := takeAll(plans, buckets, now, cost)
	if allowed && cost > 0 {
		if e == nil {
			e = lk.insert(m, key, len(plans), now)
		}
		for i := range plans {
			if wd&(1<<i) == 0 {
				e.store(&plans[i], buckets[i])
				continue
			}
			// A shadowed plan that would deny is left, and described, as
			// it was stored, as a denial leaves it, but for bringBack.
			buckets[i] = e.bucket(&plans[i], now)
			e.bringBack(&plans[i], buckets[i], now)
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
	lk.unlock()
	if len(plans) == 1 {
		r.describeBucket(&plans[0], buckets[0], now, cost, allowed, wd)
	} else {
		r.describe(&outcome{plans: plans, buckets: buckets, now: now, cost: cost, allowed: allowed, wd: wd})
	}
	return now
}

// inProcess implements localStore: a MemoryStore cannot fail.
func (*MemoryStore) inProcess() {}

// dateHold dates a hold it granted, decided at now (µs): when it was
// taken, which a Reset of its key after it voids the refund of
// (resetHolds), and when it expires.
func (m *MemoryStore) dateHold(h *hold, now int64) {
	h.at = now
	h.granted(m, now+h.ttl.Microseconds())
}

func (m *MemoryStore) self() Store { return m }

// wiringError implements wiredStore: an option of another constructor.
func (m *MemoryStore) wiringError() error { return m.err }
