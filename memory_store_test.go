package tollgate

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestMemoryStoreChainIsAllOrNothing(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := newClockedMemoryStore(&now)
	burst, daily := Plan{Name: "burst", Capacity: 5, Rate: 1}, Plan{Name: "daily", Capacity: 2, Rate: 0.0001}
	chain := []Plan{burst, daily}
	for i := 0; i < 2; i++ {
		r, err := m.Take(ctx, "k", 1, chain)
		require.NoError(t, err)
		require.True(t, r.Allowed)
	}
	r, err := m.Take(ctx, "k", 1, chain)
	require.NoError(t, err)
	assert.False(t, r.Allowed)
	assert.Equal(t, "daily", r.Plan, "the plan that makes the caller wait is binding")
	assert.Equal(t, []int64{3, 0}, []int64{r.PlanResults()[0].Remaining, r.PlanResults()[1].Remaining})
	assert.Equal(t, time.Duration(0), r.PlanResults()[0].RetryAfter)
	assert.Equal(t, 10_000*time.Second, r.PlanResults()[1].RetryAfter)
	assert.Equal(t, r.PlanResults()[1].RetryAfter, r.RetryAfter)

	r, err = m.Take(ctx, "k", 1, []Plan{burst})
	require.NoError(t, err)
	assert.Equal(t, int64(2), r.Remaining, "the denied chain took nothing from burst")
}

func TestMemoryStoreBindingPlanWhenAllowed(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := newClockedMemoryStore(&now)
	a, b := Plan{Name: "a", Capacity: 10, Rate: 1}, Plan{Name: "b", Capacity: 3, Rate: 1}
	r, err := m.Take(ctx, "k", 1, []Plan{a, b})
	require.NoError(t, err)
	assert.Equal(t, "b", r.Plan)
	assert.Equal(t, int64(2), r.Remaining)
	assert.Equal(t, int64(3), r.Limit)
	assert.Equal(t, time.Second, r.ResetAfter)
}

// TestMemoryStoreConcurrentExact hammers one key from many goroutines on
// the real clock and checks the admitted count against its bound.
func TestMemoryStoreConcurrentExact(t *testing.T) {
	ctx := context.Background()
	m := NewMemoryStore()
	p := Plan{Name: "p", Capacity: 50, Rate: 1000}
	var admitted atomic.Int64
	start := m.now()
	var wg sync.WaitGroup
	for g := 0; g < 16; g++ {
		wg.Go(func() {
			for i := 0; i < 5000; i++ {
				r, err := m.Take(ctx, "hot", 1, []Plan{p})
				if err != nil {
					t.Error(err)
					return
				}
				if r.Allowed {
					admitted.Add(1)
				}
			}
		})
	}
	wg.Wait()
	elapsed := float64(m.now()-start) / 1e6
	bound := float64(p.Capacity) + p.Rate*elapsed
	assert.LessOrEqual(t, float64(admitted.Load()), bound)
	assert.Greater(t, admitted.Load(), p.Capacity, "refills must be admitted too")
}

func TestMemoryStoreBoundsKeys(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := NewMemoryStore(WithMaxKeys(1000))
	m.fakeNow = func() int64 { return now }
	p := Plan{Name: "p", Capacity: 10, Rate: 0.001} // nothing refills during the test
	for i := 0; i < 50_000; i++ {
		_, err := m.Take(ctx, fmt.Sprint("flood-", i), 1, []Plan{p})
		require.NoError(t, err)
	}
	assert.LessOrEqual(t, m.Len(), 1000)
	assert.Greater(t, m.Len(), 900, "the bound is used, not undershot")
}

// TestMemoryStoreKeepsFullKeysResident decides on keys that are full
// again at every visit: below the bound they stay, so a decision inserts
// nothing and allocates nothing. A store that dropped full keys eagerly
// re-inserted them, 3 allocations a decision.
func TestMemoryStoreKeepsFullKeysResident(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := newClockedMemoryStore(&now)
	p := []Plan{{Name: "p", Capacity: 2, Rate: 1}}
	keys := make([]string, 1000)
	for i := range keys {
		keys[i] = fmt.Sprint("user-", i)
		now += 2_000_000 // the keys before are full again
		_, err := m.Take(ctx, keys[i], 1, p)
		require.NoError(t, err)
	}
	i := 0
	allocs := testing.AllocsPerRun(5000, func() {
		now += 2_000_000 // every bucket is full again
		r, _ := m.Take(ctx, keys[i%len(keys)], 1, p)
		if !r.Allowed || r.Remaining != 1 {
			t.Fatalf("step %d: Take = %v, %d remaining, want allowed, 1 remaining", i, r.Allowed, r.Remaining)
		}
		i++
	})
	assert.Equal(t, 0.0, allocs)
	assert.Equal(t, len(keys), m.Len(), "full keys stay until the store needs room")
}

// TestMemoryStoreEvictsFullKeysFirst fills a one-shard store with a
// drained key and keys that are full again by the next insertion, then
// pushes 2,000 new keys through it: every victim must be a full key, which
// gives nothing back, and never the drained one, which would get its quota
// back.
func TestMemoryStoreEvictsFullKeysFirst(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := NewMemoryStore(WithMaxKeys(minShardKeys)) // one shard, exact bound
	m.fakeNow = func() int64 { return now }
	require.Len(t, m.shards, 1)
	daily := []Plan{{Name: "p", Capacity: 10, Rate: Per(10, 24*time.Hour)}}
	fast := []Plan{{Name: "p", Capacity: 10, Rate: 10}} // full 0.1 s after one take
	_, err := m.Take(ctx, "drained", 10, daily)
	require.NoError(t, err)
	for i := 0; i < 2000; i++ {
		now += 1_000_000
		_, err := m.Take(ctx, fmt.Sprint("k", i), 1, fast)
		require.NoError(t, err)
		require.LessOrEqual(t, m.Len(), minShardKeys)
	}
	assert.Equal(t, minShardKeys, m.Len(), "full keys stay resident up to the bound")
	r, err := m.Take(ctx, "drained", 1, daily)
	require.NoError(t, err)
	assert.False(t, r.Allowed, "the drained key was never evicted")
}

// TestMemoryStoreKeepsKeysHoldingPermits fills a one-shard store with
// drained keys, each a worse victim than the last by the refill rule,
// while one key holds every permit of a concurrency plan with a long
// lease: the key holding permits stays, so its permits never read as
// free while their holder works.
func TestMemoryStoreKeepsKeysHoldingPermits(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := NewMemoryStore(WithMaxKeys(minShardKeys)) // one shard, exact bound
	m.fakeNow = func() int64 { return now }
	inflight := []Plan{{Name: "c", Capacity: 2, Concurrency: true}}
	acquire := op{key: "held", n: 2, mode: modeAcquire, plans: inflight, grant: &permit{id: "a", lease: time.Hour}}
	r, err := m.decide(ctx, acquire)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	daily := []Plan{{Name: "p", Capacity: 10, Rate: Per(10, 24*time.Hour)}}
	for i := 0; i < 2000; i++ {
		now += 1_000
		_, err := m.Take(ctx, fmt.Sprint("k", i), 10, daily)
		require.NoError(t, err)
	}
	acquire.grant = &permit{id: "b", lease: time.Hour}
	r, err = m.decide(ctx, acquire)
	require.NoError(t, err)
	assert.False(t, r.Allowed, "the key holding permits was never evicted")
}

// TestMemoryStoreRereadsAStaleClock has a decision read the clock before
// one that took the lock first, as the store reads it outside its lock:
// the later decision reads the clock again under the lock, so it sees no
// stamp from its future.
func TestMemoryStoreRereadsAStaleClock(t *testing.T) {
	ctx := context.Background()
	reads := []int64{t0}
	m := NewMemoryStore()
	m.fakeNow = func() int64 {
		now := reads[0]
		if len(reads) > 1 {
			reads = reads[1:]
		}
		return now
	}
	plans := []Plan{{Name: "p", Capacity: 10, Rate: 1}}
	_, err := m.Take(ctx, "k", 10, plans)
	require.NoError(t, err)
	reads = []int64{t0 - 500_000, t0} // read 0.5 s before the drain took the lock, then again
	r, err := m.Take(ctx, "k", 1, plans)
	require.NoError(t, err)
	assert.False(t, r.Allowed)
	assert.Equal(t, time.Second, r.RetryAfter, "one token, a second after the drain")
	assert.Len(t, reads, 1, "the clock was read again")
}

// TestMemoryStoreNewKeyAtTheBoundAllocatesOnce inserts new keys into a
// store at its bound: each reuses its victim's entry, so copying the key is
// the one allocation.
func TestMemoryStoreNewKeyAtTheBoundAllocatesOnce(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := NewMemoryStore(WithMaxKeys(1000))
	m.fakeNow = func() int64 { return now }
	p := []Plan{{Name: "p", Capacity: 10, Rate: 1}}
	keys := make([]string, 20_000)
	for i := range keys {
		keys[i] = fmt.Sprint("user-", i)
	}
	for _, k := range keys[:5000] { // fill, and churn the map to its steady size
		_, err := m.Take(ctx, k, 1, p)
		require.NoError(t, err)
	}
	i := 5000
	allocs := testing.AllocsPerRun(10_000, func() {
		_, _ = m.Take(ctx, keys[i%len(keys)], 1, p)
		i++
	})
	assert.LessOrEqual(t, allocs, 1.0)
	assert.LessOrEqual(t, m.Len(), 1000)
}

func TestMemoryStoreEvictsClosestToFull(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := NewMemoryStore(WithMaxKeys(minShardKeys)) // one shard, exact bound
	m.fakeNow = func() int64 { return now }
	require.Len(t, m.shards, 1)
	p := Plan{Name: "p", Capacity: 10, Rate: 1}
	_, err := m.Take(ctx, "drained", 10, []Plan{p}) // full in 10 s
	require.NoError(t, err)
	for i := 1; i < minShardKeys; i++ { // full in 1 s each
		_, err := m.Take(ctx, fmt.Sprint("k", i), 1, []Plan{p})
		require.NoError(t, err)
	}
	require.Equal(t, minShardKeys, m.Len())
	for i := 0; i < 20; i++ { // no room: one must go each time
		_, err := m.Take(ctx, fmt.Sprint("new", i), 1, []Plan{p})
		require.NoError(t, err)
	}
	assert.Equal(t, minShardKeys, m.Len())
	r, err := m.Take(ctx, "drained", 0, []Plan{p})
	require.NoError(t, err)
	assert.Equal(t, int64(0), r.Remaining, "the drained key is the last to go")
}

func TestMemoryStoreSmallBoundDoesNotGiveQuotasBack(t *testing.T) {
	ctx := context.Background()
	m := NewMemoryStore(WithMaxKeys(100))
	daily := []Plan{{Name: "daily", Capacity: 10, Rate: Per(10, 24*time.Hour)}}
	_, err := m.Take(ctx, "victim", 10, daily)
	require.NoError(t, err)
	for i := 0; i < 50; i++ {
		_, err := m.Take(ctx, fmt.Sprint("other-", i), 1, daily)
		require.NoError(t, err)
	}
	r, err := m.Take(ctx, "victim", 1, daily)
	require.NoError(t, err)
	assert.False(t, r.Allowed, "50 keys in a store of 100 must not evict the drained one")
}

func TestMemoryStoreChainIsOneKey(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := NewMemoryStore(WithMaxKeys(minShardKeys))
	m.fakeNow = func() int64 { return now }
	chain := []Plan{{Name: "a", Capacity: 10, Rate: 1}, {Name: "b", Capacity: 10, Rate: 1}}
	_, err := m.Take(ctx, "k", 9, chain)
	require.NoError(t, err)
	r, err := m.Take(ctx, "k", 1, chain)
	require.NoError(t, err)
	assert.Equal(t, []int64{0, 0}, []int64{r.PlanResults()[0].Remaining, r.PlanResults()[1].Remaining})
	assert.Equal(t, 1, m.Len(), "the plans of one key count as one key against the bound")
}

func TestMemoryStoreTakeDoesNotAllocate(t *testing.T) {
	ctx := context.Background()
	m := NewMemoryStore()
	plans := []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1e6}}
	_, err := m.Take(ctx, "k", 1, plans)
	require.NoError(t, err)
	allocs := testing.AllocsPerRun(1000, func() {
		_, _ = m.Take(ctx, "k", 1, plans)
	})
	assert.Equal(t, 0.0, allocs)
}

// TestMemoryStoreKeepsKeysInUse floods a full store with keys that each
// drain their bucket once, while one key is asked about between them and
// denied: the key in use must stay, or it would get its quota back each
// time it is dropped. It admits no more than its bound.
func TestMemoryStoreKeepsKeysInUse(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := NewMemoryStore(WithMaxKeys(1000))
	m.fakeNow = func() int64 { return now }
	p := Plan{Name: "p", Capacity: 5, Rate: Per(5, 24*time.Hour)}
	admitted := 0
	for i := 0; i < 100_000; i++ {
		now += 10 // µs
		_, err := m.Take(ctx, fmt.Sprint("flood-", i), p.Capacity, []Plan{p})
		require.NoError(t, err)
		if i%10 == 0 {
			r, err := m.Take(ctx, "hot", 1, []Plan{p})
			require.NoError(t, err)
			if r.Allowed {
				admitted++
			}
		}
	}
	bound := float64(p.Capacity) + p.Rate*float64(now-t0)/1e6
	assert.LessOrEqual(t, float64(admitted), bound, "100,000 other drained keys through a store of 1,000")
	assert.LessOrEqual(t, m.Len(), 1000)
}

// TestEvictionKeepsAVersionAsRedisWould fills a store of two keys with a
// key whose bucket holds a version, full again for 50 ms, and a key of an
// unversioned plan, full as long: a newcomer evicts the second, whose
// bucket gives nothing back, and not the version, which Redis would still
// keep. Had the version gone, the old plan would drain the key and the
// new plan would reset it again. Map order picks among keys alike, so it
// runs 20 times.
func TestEvictionKeepsAVersionAsRedisWould(t *testing.T) {
	ctx := context.Background()
	old := Plan{Name: "p", Capacity: 20, Rate: 200}
	next := Plan{Name: "p", Capacity: 20, Rate: 200, Version: 2, Inherit: InheritReset}
	for run := range 20 {
		now := t0
		m := NewMemoryStore(WithMaxKeys(2))
		m.fakeNow = func() int64 { return now }
		for _, k := range []struct {
			key  string
			plan Plan
		}{{"k", next}, {"x", old}} {
			_, err := m.Take(ctx, k.key, 1, []Plan{k.plan})
			require.NoError(t, err)
		}
		now += 55_000 // both full 5 ms after their decision
		_, err := m.Take(ctx, "newcomer", 1, []Plan{old})
		require.NoError(t, err)
		r, err := m.Take(ctx, "k", old.Capacity, []Plan{old})
		require.NoError(t, err)
		require.True(t, r.Allowed)
		r, err = m.Take(ctx, "k", 1, []Plan{next})
		require.NoError(t, err)
		assert.False(t, r.Allowed, "run %d: the reset applied again", run)
	}
}

// TestResetKeepsPermitsOfAPlanOfAnotherKind has one Limiter hold the only
// permit of concurrency plan "x" while another, whose "x" is a window,
// resets the key: the permit is still held in both stores, as the script
// keeps a concurrency plan's permits, so a second is refused.
func TestResetKeepsPermitsOfAPlanOfAnotherKind(t *testing.T) {
	for _, name := range []string{"memory", "redis"} {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			var s Store = NewMemoryStore()
			if name == "redis" {
				s, _, _ = newMiniredisStore(t)
			}
			held, err := New(s, []Plan{{Name: "x", Capacity: 1, Concurrency: true}})
			require.NoError(t, err)
			windowed, err := New(s, []Plan{{Name: "x", Capacity: 5, Window: time.Second}})
			require.NoError(t, err)
			p, err := held.Acquire(ctx, "k", 1, "x")
			require.NoError(t, err)
			require.True(t, p.OK())
			require.NoError(t, windowed.Reset(ctx, "k", "x"))
			q, err := held.Acquire(ctx, "k", 1, "x")
			require.NoError(t, err)
			assert.False(t, q.OK(), "a second permit of a capacity of 1")
		})
	}
}
