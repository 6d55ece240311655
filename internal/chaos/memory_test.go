//go:build chaos

package chaos

import (
	"context"
	"errors"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
	"github.com/tollgate-go/tollgate/internal/storetest"
)

// heapInuse returns the heap in use after a full collection.
func heapInuse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse
}

// TestChaosKeyFlood sends a flood of distinct keys through a Limiter whose
// store is down, so that its fallback MemoryStore (WithMaxKeys 100,000)
// takes them all: the case README promises cannot exhaust memory. The
// store never holds more than the bound, and the heap stays near what it
// was when the store first filled, however many keys follow.
func TestChaosKeyFlood(t *testing.T) {
	chaosPrologue(t, false)
	const maxKeys = 100_000
	keys := pick(1_000_000, 10_000_000)
	fallback := tollgate.NewMemoryStore(tollgate.WithMaxKeys(maxKeys))
	// A bucket of 10 that refills in an hour: no bucket is full again during
	// the flood, so eviction, not the sweep of full buckets, keeps the bound.
	lim, err := tollgate.New(storetest.Down(errors.New("down")), []tollgate.Plan{{Name: "flood", Capacity: 10, Rate: tollgate.Per(10, time.Hour)}},
		tollgate.WithFallback(fallback), tollgate.WithLogger(nil), tollgate.WithBreaker(breaker.Settings{Cooldown: time.Hour}))
	require.NoError(t, err)

	base := heapInuse()
	ctx := context.Background()
	buf := make([]byte, 0, 32)
	var filled, peak uint64 // heap when the store had just filled, and the most after that
	var series []float64    // heap in MiB after each tenth of the flood
	maxLen := 0
	began := time.Now()
	for i := 0; i < keys; i++ {
		buf = strconv.AppendInt(append(buf[:0], "flood-"...), int64(i), 10)
		r, err := lim.Allow(ctx, string(buf))
		if err != nil || r.Source != tollgate.SourceFallback {
			t.Fatalf("key %d: %v from %s; want the fallback to decide", i, err, r.Source)
		}
		if n := i + 1; n%(keys/20) == 0 || n == 2*maxKeys {
			// Not a measure of speed: 1 ms a key catches work per key
			// that grows with the keys (a scan of the store per new key),
			// where a key takes about 8 µs, 110 µs under the race detector.
			require.Less(t, time.Since(began), time.Duration(n)*time.Millisecond, "no key costs more as the flood goes on")
			maxLen = max(maxLen, fallback.Len())
			h := heapInuse()
			if n == 2*maxKeys {
				filled = h
			}
			peak = max(peak, h)
			if n%(keys/10) == 0 {
				series = append(series, float64(int(mib(h)*10))/10)
			}
		}
	}
	took := time.Since(began)
	final := heapInuse()
	kept := fallback.Len()
	perKey := float64(final-min(base, final)) / float64(kept)
	chaosLine(t, "key-flood", "keys", keys, "max_keys", maxKeys, "kept", kept, "max_kept", maxLen,
		"heap_base_mib", mib(base), "heap_filled_mib", mib(filled), "heap_peak_mib", mib(peak), "heap_final_mib", mib(final),
		"heap_mib_by_tenth", series, "bytes_per_kept_key", perKey, "took", took)
	assert.LessOrEqual(t, maxLen, maxKeys, "the store must never hold more than its bound")
	assert.Greater(t, kept, maxKeys*9/10, "the bound is used, not undershot")
	// After the store filled, evicted keys' memory is reused. What still
	// grows is Go's map itself: deleting leaves tombstones that its tables
	// reclaim only by growing (golang/go#70886), so a map of constant size
	// under churn creeps up (here +40% over 10 M keys, and far more slowly
	// after). Twice the heap at fill covers that; keeping even 5% of a 10 M
	// key flood (≈ 200 bytes a key) would not fit.
	assert.LessOrEqual(t, float64(peak), 2*float64(filled), "the heap must stay near its size at fill, whatever the flood")
	// Absolute: 512 bytes a kept key covers the key, its entry, its bucket
	// and the map's slot with room to spare.
	assert.Less(t, perKey, 512.0)
}

func mib(b uint64) float64 { return float64(b) / (1 << 20) }

// TestChaosGoroutineLeaks uses every client kind tollgate supports, through
// an outage and a recovery, then closes the clients: no goroutine may be
// left. The library starts none that outlives a call; go-redis starts some (pools,
// the Sentinel subscription, Cluster state reloads) and must stop them on
// Close. chaosPrologue checks every other chaos test the same way.
func TestChaosGoroutineLeaks(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	ctx := context.Background()
	// Servers first: their cleanups must run after the check below, which
	// is about clients and Limiters, not about the harness.
	srv := redistest.StartServer(t)
	sen := redistest.StartSentinel(t)
	cl := redistest.StartCluster(t, 3, 0)
	ignore := goleak.IgnoreCurrent()
	// The goroutine that waits for a restarted server's process belongs to
	// the harness, and ends with the server at the test's cleanup.
	harness := goleak.IgnoreAnyFunction("github.com/tollgate-go/tollgate/internal/redistest.(*Server).launchLocked.func1")

	before := runtime.NumGoroutine()
	clients := []redis.UniversalClient{
		redis.NewClient(pooled(redistest.FailFast(srv.Addr()))),
		redis.NewFailoverClient(&redis.FailoverOptions{MasterName: sen.MasterName(), SentinelAddrs: sen.SentinelAddrs()}),
		redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs(), ClusterStateReloadInterval: 100 * time.Millisecond}),
		redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": srv.Addr()}}),
	}
	// The test closes the clients itself, before its check. If it stops
	// first, this closes them, so that their redials do not outlive it
	// and fail the next test's check.
	closed := false
	t.Cleanup(func() {
		if closed {
			return
		}
		for _, c := range clients {
			_ = c.Close()
		}
	})
	decisions := 0
	for i, c := range clients {
		// No denial cache: every decision goes through the client.
		l, err := tollgate.New(tollgate.NewRedisStore(c, storeOptions(redistest.KeyPrefix())...), []tollgate.Plan{chaosPlan},
			tollgate.WithLogger(nil), tollgate.WithBreaker(breaker.Settings{Failures: 1, Cooldown: 10 * time.Millisecond}),
			tollgate.WithDenialCache(0))
		require.NoError(t, err)
		for n := 0; n < 200; n++ {
			r, err := l.Allow(ctx, strconv.Itoa(n%7))
			require.NoError(t, err, "client %d", i)
			require.Equal(t, tollgate.SourceStore, r.Source, "client %d", i)
			decisions++
		}
		short, cancel := context.WithTimeout(ctx, time.Millisecond)
		_, _ = l.Wait(short, "0", 1) // a Wait that gives up
		cancel()
	}
	// An outage and a recovery on the plain client: dials that fail, the
	// breaker, probes, the fallback.
	l, err := tollgate.New(tollgate.NewRedisStore(clients[0], storeOptions(redistest.KeyPrefix())...), []tollgate.Plan{chaosPlan},
		tollgate.WithLogger(nil), tollgate.WithBreaker(breaker.Settings{Failures: 1, Cooldown: 10 * time.Millisecond}))
	require.NoError(t, err)
	srv.Kill()
	for n := 0; n < 100; n++ {
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, tollgate.SourceFallback, r.Source)
		time.Sleep(time.Millisecond)
	}
	srv.Restart()
	back := eventually(5*time.Second, 5*time.Millisecond, func() bool {
		r, err := l.Allow(ctx, "k")
		return err == nil && r.Source == tollgate.SourceStore
	})
	require.True(t, back, "back to Redis after the restart")
	during := runtime.NumGoroutine()
	assert.Empty(t, libraryGoroutines(), "the library starts no goroutine of its own")
	closed = true
	for _, c := range clients {
		require.NoError(t, c.Close())
	}
	err = settledLeaks(ignore, harness)
	after := runtime.NumGoroutine()
	chaosLine(t, "goroutine-leaks", "clients", len(clients), "decisions", decisions,
		"goroutines_before", before, "goroutines_in_use", during, "goroutines_after_close", after, "leaked", err != nil)
	assert.NoError(t, err)
}

// libraryGoroutines returns the stacks of running goroutines started by the
// library's own code: any package of the module (the root, breaker,
// internal/...), but not its tests nor internal/redistest.
func libraryGoroutines() []string {
	const module = "github.com/tollgate-go/tollgate"
	buf := make([]byte, 1<<22)
	buf = buf[:runtime.Stack(buf, true)]
	var found []string
	for _, g := range strings.Split(string(buf), "\n\n") {
		lines := strings.Split(g, "\n")
		for i, line := range lines {
			fn, ok := strings.CutPrefix(line, "created by ")
			if !ok || i+1 == len(lines) {
				continue
			}
			library := strings.HasPrefix(fn, module+".") ||
				strings.HasPrefix(fn, module+"/") && !strings.HasPrefix(fn, module+"/internal/redistest.")
			if library && !strings.Contains(strings.Fields(lines[i+1])[0], "_test.go:") {
				found = append(found, g)
			}
		}
	}
	return found
}
