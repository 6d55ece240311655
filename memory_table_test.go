package tollgate

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestMemTableAgreesWithAMap inserts and removes keys at random in a table
// of 16 slots, with hashes that differ but share the slot their probe
// starts at far more often than real ones do, so that probes run long and
// wrap around the end: after every step each key present is found by
// lookup and by probe, in one slot, and each key removed is not.
func TestMemTableAgreesWithAMap(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	for run := range 200 {
		tab := newMemTable(16)
		model := map[string]uint64{} // key -> hash
		for step := range 200 {
			if len(model) < 8 && rng.IntN(2) == 0 {
				key := fmt.Sprint("k", run, "-", step)
				h := uint64(step)<<8 | rng.Uint64N(4)*4 + 12 // starts at slot 12 or above, or at 0 after a wrap
				tab.put(h, &memEntry{key: key})
				model[key] = h
			} else {
				for key, h := range model { // one at random: map order
					_, i := tab.lookup(key, h)
					require.GreaterOrEqual(t, i, 0, "run %d step %d: %s", run, step, key)
					tab.remove(i)
					delete(model, key)
					require.Nil(t, tab.probe(h), "run %d step %d: %s removed", run, step, key)
					break
				}
			}
			requireTableHolds(t, tab, model)
		}
		requireTableHolds(t, tab.grown(), model)
	}
}

// requireTableHolds checks that tab holds exactly the keys of model, each
// once, where lookup and probe find it.
func requireTableHolds(t *testing.T, tab *memTable, model map[string]uint64) {
	t.Helper()
	n := 0
	for i := range tab.slots {
		if tab.slots[i].e.Load() != nil {
			n++
		}
	}
	require.Equal(t, len(model), n, "entries in the table")
	for key, h := range model {
		e, i := tab.lookup(key, h)
		require.NotNil(t, e, key)
		require.Equal(t, key, e.key)
		require.Same(t, e, tab.slots[i].e.Load())
		require.Same(t, e, tab.probe(h), key)
	}
}
