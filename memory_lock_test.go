package tollgate

import (
	"context"
	"fmt"
	"math/rand/v2"
	"runtime"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// lockedEntry returns key's entry, locked, or nil, without dating a
// decision on it, and the function that unlocks it.
func lockedEntry(m *MemoryStore, key string) (*memEntry, func()) {
	s, h := m.shard(key)
	s.mu.Lock()
	e, _ := s.table.Load().lookup(key, h)
	if e == nil {
		return nil, s.mu.Unlock
	}
	e.mu.Lock()
	s.mu.Unlock()
	return e, e.mu.Unlock
}

// TestMemoryStoreTakesDuringEvictionsLoseNothing has four goroutines each
// take from one key of one token, a token a millisecond, insert a new key
// into the store's one shard of 8 keys, and advance the clock by 7 µs,
// 5,000 times. Each insertion evicts a key that is full: at times the hot
// one, while another goroutine's decision on it has found its entry and
// waits for the entry's lock, or has found none and waits for the shard's.
// Every eviction gives nothing back, so the hot key admits no more than
// its bound, unless a decision is lost in an entry evicted and reused for
// another key, or dates the key's new bucket by a clock it read before the
// key was dropped.
func TestMemoryStoreTakesDuringEvictionsLoseNothing(t *testing.T) {
	ctx := context.Background()
	var clock atomic.Int64
	clock.Store(t0)
	m := NewMemoryStore(WithMaxKeys(8))
	require.Len(t, m.shards, 1)
	m.fakeNow = clock.Load
	hot := []Plan{{Name: "hot", Capacity: 1, Rate: 1000}}
	flood := []Plan{{Name: "flood", Capacity: 1, Rate: 1e6}} // full again 1 µs after a take
	var admitted, inserted, hotAbsent atomic.Int64
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 5000 {
				clock.Add(7) // every key of flood is full again, and at times hot
				_, err := m.Take(ctx, fmt.Sprint("flood-", inserted.Add(1)), 1, flood)
				assert.NoError(t, err)
				if _, h := m.shard("hot"); m.shards[0].table.Load().probe(h) == nil {
					hotAbsent.Add(1)
				}
				r, err := m.Take(ctx, "hot", 1, hot)
				assert.NoError(t, err)
				if r.Allowed {
					admitted.Add(1)
				}
			}
		})
	}
	wg.Wait()
	elapsed := float64(clock.Load()-t0) / 1e6
	assert.LessOrEqual(t, float64(admitted.Load()), float64(hot[0].Capacity)+hot[0].Rate*elapsed)
	assert.Positive(t, hotAbsent.Load(), "the hot key was evicted, and decided on again")
	assert.LessOrEqual(t, m.Len(), 8)
}

// hotFullAgain returns a store of one key on the clock *now, and its plan
// of one token a second, in which the key hot took its token at *now,
// which it then moves a second on: hot is full again.
func hotFullAgain(t *testing.T, now *int64) (*MemoryStore, []Plan) {
	t.Helper()
	m := NewMemoryStore(WithMaxKeys(1))
	p := []Plan{{Name: "p", Capacity: 1, Rate: 1}}
	m.fakeNow = func() int64 { return *now }
	r, err := m.Take(context.Background(), "hot", 1, p)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	*now += 1_000_000
	return m, p
}

// TestMemoryStoreDecisionOnAnEvictedEntryLooksAgain evicts a full key, and
// reuses its entry for another key, between the moment a decision on it
// finds the entry and the moment it locks it (the clock is read there).
// The decision must see the entry gone and decide on the key anew; had it
// taken from the reused entry, it would have read the other key's bucket,
// and left its own key full for a second admission.
func TestMemoryStoreDecisionOnAnEvictedEntryLooksAgain(t *testing.T) {
	ctx := context.Background()
	now := t0
	m, p := hotFullAgain(t, &now) // hot goes first
	evict := true
	m.fakeNow = func() int64 {
		if evict { // the decision on hot has found its entry
			evict = false
			r, err := m.Take(ctx, "other", 1, p)
			require.NoError(t, err)
			require.True(t, r.Allowed)
		}
		return now
	}
	r, err := m.Take(ctx, "hot", 1, p)
	require.NoError(t, err)
	assert.False(t, evict, "the entry was evicted while the decision held it")
	assert.True(t, r.Allowed, "hot was full")
	r, err = m.Take(ctx, "hot", 1, p)
	require.NoError(t, err)
	assert.False(t, r.Allowed, "hot has one token, and it was taken")
	assert.Equal(t, 1, m.Len())
}

// TestMemoryStoreChurnKeepsItsIndex has four goroutines take, read and
// reset keys at random, three times as many as the store holds, so that
// insertions evict keys that other decisions hold or are about to find,
// in a store of 2 keys (where every key sampled is often held) and of 4
// shards of 64. Then every key is in its shard's table once, where a
// lookup finds it, and Len counts each.
func TestMemoryStoreChurnKeepsItsIndex(t *testing.T) {
	ctx := context.Background()
	p := []Plan{{Name: "p", Capacity: 3, Rate: 1e4}}
	for _, maxKeys := range []int{2, 4 * minShardKeys} {
		m := NewMemoryStore(WithMaxKeys(maxKeys))
		var wg sync.WaitGroup
		for g := range 4 {
			wg.Go(func() {
				rng := rand.New(rand.NewPCG(uint64(g), uint64(maxKeys)))
				for range 5000 {
					key := fmt.Sprint("k", rng.IntN(3*maxKeys))
					var err error
					switch rng.IntN(10) {
					case 0:
						err = m.Reset(ctx, key, p)
					case 1:
						_, err = m.Take(ctx, key, 0, p)
					default:
						_, err = m.Take(ctx, key, 1, p)
					}
					assert.NoError(t, err)
				}
			})
		}
		wg.Wait()
		keys := map[string]bool{}
		for i := range m.shards {
			s := &m.shards[i]
			tab, n := s.table.Load(), 0
			for j := range tab.slots {
				e := tab.slots[j].e.Load()
				if e == nil {
					continue
				}
				n++
				require.False(t, keys[e.key], "%s is in the store twice", e.key)
				keys[e.key] = true
				home, h := m.shard(e.key)
				require.Same(t, s, home, e.key)
				found, _ := tab.lookup(e.key, h)
				require.Same(t, e, found, e.key)
			}
			require.Equal(t, n, s.n, "shard %d's count", i)
		}
		assert.Equal(t, len(keys), m.Len())
		assert.LessOrEqual(t, m.Len(), maxKeys)
		assert.Positive(t, m.Len())
	}
}

// TestMemEntryDecisionWritesOneCacheLine pins the layout that keeps what a
// decision on a key of one plan writes, the entry's lock, seen and its
// bucket, on the entry's first cache line, at the start of which the
// allocator places an entry whose size is a multiple of 64 bytes.
func TestMemEntryDecisionWritesOneCacheLine(t *testing.T) {
	var e memEntry
	assert.Zero(t, unsafe.Sizeof(e)%64, "size %d", unsafe.Sizeof(e))
	assert.Zero(t, unsafe.Offsetof(e.mu))
	last := unsafe.Offsetof(e.one) + unsafe.Offsetof(e.one[0].TokenBucket) + unsafe.Sizeof(e.one[0].TokenBucket)
	assert.LessOrEqual(t, last, uintptr(64))
	assert.Less(t, unsafe.Offsetof(e.seen), uintptr(64))
	for range 100 {
		assert.Zero(t, uintptr(unsafe.Pointer(newMemEntry(1)))%64)
	}
}

// TestMemoryStoreInsertWaitsWhenEveryKeyIsHeld holds the entries of both
// keys of a full store, as two decisions in progress would, while a third
// key arrives: its insertion finds no key it may evict, waits for one,
// and keeps the bound.
func TestMemoryStoreInsertWaitsWhenEveryKeyIsHeld(t *testing.T) {
	ctx := context.Background()
	m := NewMemoryStore(WithMaxKeys(2))
	p := []Plan{{Name: "p", Capacity: 3, Rate: 1}}
	var unlocks []func()
	for _, k := range []string{"a", "b"} {
		_, err := m.Take(ctx, k, 1, p)
		require.NoError(t, err)
		e, unlock := lockedEntry(m, k)
		require.NotNil(t, e)
		unlocks = append(unlocks, unlock)
	}
	done := make(chan Result, 1)
	go func() {
		r, err := m.Take(ctx, "c", 1, p)
		assert.NoError(t, err)
		done <- r
	}()
	for len(done) == 0 && m.shards[0].mu.TryLock() { // until the insertion holds the shard
		m.shards[0].mu.Unlock()
		runtime.Gosched()
	}
	time.Sleep(10 * time.Millisecond) // not asserted: gives it time to find both keys held
	for _, unlock := range unlocks {
		unlock()
	}
	assert.True(t, (<-done).Allowed)
	assert.Equal(t, 2, m.Len())
	e, unlock := lockedEntry(m, "c")
	assert.NotNil(t, e)
	unlock()
}

// TestMemoryStoreDecisionOnADroppedKeyReadsTheClockAgain has a decision on
// a key read the clock, then wait for a second while another decision
// takes the key's token and a newcomer evicts the key, full again. The
// key has no entry when the first decision goes on: had it decided at
// the time it read, a second before the other, its bucket would be
// stamped a second early and would give a token at once that the clock
// has not refilled.
func TestMemoryStoreDecisionOnADroppedKeyReadsTheClockAgain(t *testing.T) {
	ctx := context.Background()
	now := t0
	m, p := hotFullAgain(t, &now)
	wait := true
	m.fakeNow = func() int64 {
		if !wait {
			return now
		}
		wait = false
		read := now // the decision on hot reads the clock here, and waits
		r, err := m.Take(ctx, "hot", 1, p)
		require.NoError(t, err)
		require.True(t, r.Allowed, "hot was full")
		now += 1_000_000 // full again, and evicted
		r, err = m.Take(ctx, "newcomer", 1, p)
		require.NoError(t, err)
		require.True(t, r.Allowed)
		return read
	}
	r, err := m.Take(ctx, "hot", 1, p)
	require.NoError(t, err)
	assert.False(t, wait)
	assert.True(t, r.Allowed, "hot was full when it was dropped")
	r, err = m.Take(ctx, "hot", 1, p)
	require.NoError(t, err)
	assert.False(t, r.Allowed, "3 tokens in 2 s of one token a second were taken; a fourth is not there")
}

// TestMemoryStoreInsertWaitingForHeldKeysKeepsPermits fills a store of 2
// keys with one holding permits and one holding a bucket, holds both
// entries as decisions in progress would, and lets a third key arrive:
// its insertion must wait, and then drop the key without permits, which
// it may, not the first held key that frees up. Released first, the key
// holding permits would otherwise be dropped half the time, its permits
// read as free while their holder works.
func TestMemoryStoreInsertWaitingForHeldKeysKeepsPermits(t *testing.T) {
	ctx := context.Background()
	inflight := []Plan{{Name: "c", Capacity: 1, Concurrency: true}}
	bucket := []Plan{{Name: "p", Capacity: 3, Rate: 1}}
	for trial := range 20 {
		m := NewMemoryStore(WithMaxKeys(2))
		acquire := op{key: "held", n: 1, mode: modeAcquire, plans: inflight, grant: &permit{id: "a", lease: time.Hour}}
		r, err := m.decide(ctx, acquire)
		require.NoError(t, err)
		require.True(t, r.Allowed)
		_, err = m.Take(ctx, "other", 1, bucket)
		require.NoError(t, err)
		var unlocks []func()
		for _, k := range []string{"held", "other"} {
			e, unlock := lockedEntry(m, k)
			require.NotNil(t, e)
			unlocks = append(unlocks, unlock)
		}
		done := make(chan struct{})
		go func() {
			defer close(done)
			_, err := m.Take(ctx, "new", 1, bucket)
			assert.NoError(t, err)
		}()
		for m.shards[0].mu.TryLock() { // until the insertion holds the shard
			m.shards[0].mu.Unlock()
			runtime.Gosched()
		}
		time.Sleep(20 * time.Millisecond) // not asserted: gives it time to find both keys held
		unlocks[0]()                      // the key holding permits first
		time.Sleep(5 * time.Millisecond)
		unlocks[1]()
		<-done
		acquire.grant = &permit{id: "b", lease: time.Hour}
		r, err = m.decide(ctx, acquire)
		require.NoError(t, err)
		require.False(t, r.Allowed, "trial %d: the key holding permits was dropped", trial)
	}
}
