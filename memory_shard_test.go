package tollgate

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestMemoryStoreNeverEvictsLivePermits fills a MemoryStore of one shard
// of 64 keys with 64 keys each holding the one permit of a plan, then has
// 64 more keys acquire theirs: no insertion may drop a key whose permits
// are alive, or its permit reads as free while its holder works (before:
// 2 permits held of 1 on the evicted keys).
func TestMemoryStoreNeverEvictsLivePermits(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := NewMemoryStore(WithMaxKeys(minShardKeys)) // one shard, exact bound
	m.fakeNow = func() int64 { return now }
	one := []Plan{{Name: "c", Capacity: 1, Concurrency: true}}
	acquire := func(key, id string) bool {
		r, err := m.decide(ctx, op{key: key, n: 1, mode: modeAcquire, plans: one, grant: &permit{id: id, lease: time.Hour}})
		require.NoError(t, err)
		return r.Allowed
	}
	for i := range 2 * minShardKeys {
		now += 1_000
		require.True(t, acquire(fmt.Sprint("k", i), "first"), "key %d is new", i)
	}
	granted := 0
	for i := range 2 * minShardKeys {
		if acquire(fmt.Sprint("k", i), "second") {
			granted++
		}
	}
	assert.Zero(t, granted, "keys granted a second permit of 1 while the first is held")
}

// TestMemoryStoreEvictsAroundLivePermits fills a MemoryStore of one shard
// of 64 keys with 63 keys holding permits and one holding a bucket: each
// newcomer finds that key however many of its sample hold permits, so the
// store stays at its bound and every permit stays held.
func TestMemoryStoreEvictsAroundLivePermits(t *testing.T) {
	ctx := context.Background()
	now := t0
	m := NewMemoryStore(WithMaxKeys(minShardKeys))
	m.fakeNow = func() int64 { return now }
	one := []Plan{{Name: "c", Capacity: 1, Concurrency: true}}
	acquire := func(key, id string) bool {
		r, err := m.decide(ctx, op{key: key, n: 1, mode: modeAcquire, plans: one, grant: &permit{id: id, lease: time.Hour}})
		require.NoError(t, err)
		return r.Allowed
	}
	for i := range minShardKeys - 1 {
		require.True(t, acquire(fmt.Sprint("k", i), "first"))
	}
	daily := []Plan{{Name: "p", Capacity: 10, Rate: Per(10, 24*time.Hour)}}
	for i := range 100 {
		now += 1_000
		_, err := m.Take(ctx, fmt.Sprint("plain", i), 1, daily)
		require.NoError(t, err)
		require.Equal(t, minShardKeys, m.Len(), "the store holds its bound, newcomer %d", i)
	}
	for i := range minShardKeys - 1 {
		assert.False(t, acquire(fmt.Sprint("k", i), "second"), "key %d holds its permit", i)
	}
}
