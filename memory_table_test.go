package tollgate

import (
	"context"
	"fmt"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// liveKeys returns the keys of the live entries in s's table, and checks
// that the shard's count agrees.
func liveKeys(t *testing.T, s *memShard) []string {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	var keys []string
	for i, tb := 0, *s.table.Load(); i < len(tb); i++ {
		if e := tb[i].Load(); e != nil && e != tombstone {
			e.mu.Lock()
			assert.False(t, e.gone, "a gone entry left in a slot")
			keys = append(keys, e.key)
			e.mu.Unlock()
		}
	}
	assert.Len(t, keys, s.n, "the shard's count")
	return keys
}

// TestMemShardGrowsAndFindsEveryKey inserts 5,000 keys into one shard,
// which resizes its table many times on the way: every key is found, once.
func TestMemShardGrowsAndFindsEveryKey(t *testing.T) {
	m := NewMemoryStore(WithMaxKeys(minShardKeys * 100))
	m.shards = m.shards[:1]
	m.perCap = 10_000
	for i := range 5000 {
		e, _ := m.lock(fmt.Sprint("k", i), true, 1)
		e.unlock()
	}
	s := &m.shards[0]
	keys := liveKeys(t, s)
	assert.Len(t, keys, 5000)
	seen := map[string]bool{}
	for _, k := range keys {
		assert.False(t, seen[k], "key %s twice", k)
		seen[k] = true
	}
	for i := range 5000 {
		k := fmt.Sprint("k", i)
		_, h := m.shard(k)
		e, _ := s.find(k, h)
		require.NotNil(t, e, k)
		e.unlock()
	}
	assert.LessOrEqual(t, len(*s.table.Load()), 4*5000, "live keys fill at least a quarter of the table")
}

// TestMemShardChurnUnderRace has 4 goroutines decide, reset and read 1,000
// keys on a store bounded to one shard of 64, so that keys are evicted,
// reused, removed and re-inserted while other goroutines probe for them.
// Under the race detector: the bound holds, no entry is in the table twice
// or gone, and a key in use keeps its state (a drained key stays drained).
func TestMemShardChurnUnderRace(t *testing.T) {
	ctx := context.Background()
	m := NewMemoryStore(WithMaxKeys(minShardKeys))
	require.Len(t, m.shards, 1)
	drained := []Plan{{Name: "d", Capacity: 5, Rate: 1e-6}}
	churn := []Plan{{Name: "c", Capacity: 10, Rate: 1e6}} // full again at once: first to go
	_, err := m.Take(ctx, "hot", 5, drained)
	require.NoError(t, err)
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Go(func() {
			for i := range 5000 {
				k := fmt.Sprint("k", (g*7919+i)%1000)
				switch i % 10 {
				case 0:
					assert.NoError(t, m.Reset(ctx, k, churn))
				case 1:
					_, err := m.Take(ctx, k, 0, churn)
					assert.NoError(t, err)
				case 2:
					r, err := m.Take(ctx, "hot", 1, drained)
					assert.NoError(t, err)
					assert.False(t, r.Allowed, "the drained key was evicted and read as full")
				default:
					_, err := m.Take(ctx, k, 1, churn)
					assert.NoError(t, err)
				}
			}
		})
	}
	wg.Wait()
	keys := liveKeys(t, &m.shards[0])
	assert.LessOrEqual(t, len(keys), minShardKeys)
	seen := map[string]bool{}
	for _, k := range keys {
		assert.False(t, seen[k], "key %s twice", k)
		seen[k] = true
	}
}
