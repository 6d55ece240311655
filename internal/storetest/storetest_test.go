package storetest_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/storetest"
)

// gold refills so slowly that no test sees a token come back.
var gold = []tollgate.Plan{{Name: "gold", Capacity: 2, Rate: tollgate.Per(2, time.Hour)}}

// take takes one token of key from s in gold and returns whether it was
// allowed.
func take(t *testing.T, s tollgate.Store, key string) bool {
	t.Helper()
	r, err := s.Take(context.Background(), key, 1, gold)
	require.NoError(t, err)
	return r.Allowed
}

func TestFlakyPassesThrough(t *testing.T) {
	f := storetest.NewFlaky()
	assert.Equal(t, []bool{true, true, false}, []bool{take(t, f, "k"), take(t, f, "k"), take(t, f, "k")})
	require.NoError(t, f.Reset(context.Background(), "k", gold))
	assert.True(t, take(t, f, "k"), "Reset refilled the bucket")
	assert.Equal(t, 4, f.Calls())
}

func TestFlakyFailKeepsTheBuckets(t *testing.T) {
	ctx := context.Background()
	errDown := errors.New("connection refused")
	f := storetest.NewFlaky()
	require.True(t, take(t, f, "k"))

	f.Fail(errDown)
	_, err := f.Take(ctx, "k", 1, gold)
	assert.ErrorIs(t, err, errDown)
	assert.ErrorIs(t, f.Reset(ctx, "k", gold), errDown)

	f.Fail(nil)
	assert.True(t, take(t, f, "k"))
	assert.False(t, take(t, f, "k"), "the bucket is as Fail found it: one token left")
	assert.Equal(t, 4, f.Calls(), "failed calls count")
}

func TestDown(t *testing.T) {
	errDown := errors.New("down")
	f := storetest.Down(errDown)
	_, err := f.Take(context.Background(), "k", 1, gold)
	assert.ErrorIs(t, err, errDown)
	f.Fail(nil)
	assert.True(t, take(t, f, "k"))
}

func TestFlakySlow(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		f := storetest.NewFlaky()
		f.Slow(30 * time.Millisecond)
		began := time.Now()
		take(t, f, "k")
		assert.Equal(t, 30*time.Millisecond, time.Since(began))

		f.Fail(errors.New("down"))
		began = time.Now()
		_, err := f.Take(context.Background(), "k", 1, gold)
		assert.Error(t, err)
		assert.Equal(t, 30*time.Millisecond, time.Since(began), "a failure is slow too")

		f.Fail(nil)
		f.Slow(0)
		began = time.Now()
		take(t, f, "k")
		assert.Zero(t, time.Since(began))
	})
}

// TestFlakyOnTake cancels the caller's context in the middle of a call, as
// the metrics adapters' tests do, and calls back into the Flaky from the
// hook.
func TestFlakyOnTake(t *testing.T) {
	f := storetest.NewFlaky()
	ctx, cancel := context.WithCancel(context.Background())
	var seen []int
	f.OnTake(func() {
		seen = append(seen, f.Calls())
		cancel()
	})
	_, _ = f.Take(ctx, "k", 1, gold)
	assert.Error(t, ctx.Err(), "the hook ran during the call")
	f.Fail(errors.New("down"))
	_, _ = f.Take(context.Background(), "k", 1, gold)
	assert.Equal(t, []int{1, 2}, seen, "on every Take, failed ones too, after it is counted")

	f.OnTake(nil)
	_, _ = f.Take(context.Background(), "k", 1, gold)
	assert.Len(t, seen, 2)
}

// TestFlakyIsNotAMemoryStore: a Limiter treats a Flaky as a remote store,
// with a fallback, which is what the tests that use it rely on.
func TestFlakyIsNotAMemoryStore(t *testing.T) {
	f := storetest.NewFlaky()
	lim, err := tollgate.New(f, gold, tollgate.WithLogger(nil))
	require.NoError(t, err)
	ctx := context.Background()
	r, err := lim.Allow(ctx, "alice")
	require.NoError(t, err)
	assert.Equal(t, tollgate.SourceStore, r.Source)

	f.Fail(storetest.TimeoutError{})
	r, err = lim.Allow(ctx, "alice")
	require.NoError(t, err)
	assert.Equal(t, tollgate.SourceFallback, r.Source)
	assert.Equal(t, map[string]uint64{"timeout": 1}, nonZero(lim.Stats().StoreErrors))
	assert.Equal(t, 2, f.Calls())
}

func nonZero(m map[string]uint64) map[string]uint64 {
	got := map[string]uint64{}
	for k, v := range m {
		if v != 0 {
			got[k] = v
		}
	}
	return got
}

func TestFlakyConcurrentCalls(t *testing.T) {
	f := storetest.NewFlaky()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 100 {
				_, _ = f.Take(context.Background(), "k", 1, gold)
			}
		})
	}
	wg.Go(func() {
		for i := range 100 {
			f.Fail([]error{nil, errors.New("down")}[i%2])
			f.Slow(0)
			f.OnTake(nil)
		}
	})
	wg.Wait()
	assert.Equal(t, 800, f.Calls())
}

func TestTimeoutError(t *testing.T) {
	var nerr net.Error
	require.ErrorAs(t, error(storetest.TimeoutError{}), &nerr)
	assert.True(t, nerr.Timeout())
	assert.Equal(t, "i/o timeout", nerr.Error())
}
