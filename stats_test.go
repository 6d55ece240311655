package tollgate

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"testing/synctest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redisscript"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// TestStatsCountDecisionsOutagesAndBreaker runs in a bubble: the breaker's
// cooldown passes on synctest's fake clock.
func TestStatsCountDecisionsOutagesAndBreaker(t *testing.T) {
	synctest.Test(t, testStatsCountDecisionsOutagesAndBreaker)
}

func testStatsCountDecisionsOutagesAndBreaker(t *testing.T) {
	ctx := context.Background()
	f := newFlakyStore()
	l := newTestLimiter(t, f, WithBreaker(breaker.Settings{Failures: 2, Cooldown: time.Millisecond}), WithDenialCache(0))
	_, err := l.AllowN(ctx, "k", 4, "gold")
	require.NoError(t, err)
	_, err = l.Allow(ctx, "k", "gold", "daily") // denied, bound by gold
	require.NoError(t, err)
	f.fail(errors.New("down"))
	for i := 0; i < 3; i++ {
		_, err = l.Allow(ctx, "k2", "daily")
		require.NoError(t, err)
	}
	assert.True(t, l.Stats().Outage)
	assert.Equal(t, breaker.Open, l.Stats().Breaker)
	f.fail(nil)
	time.Sleep(2 * time.Millisecond)
	_, err = l.Peek(ctx, "k") // closes the breaker; peeks are not counted
	require.NoError(t, err)
	_, err = l.Allow(ctx, "") // errors are not decisions
	require.Error(t, err)

	s := l.Stats()
	require.Len(t, s.Plans, 2)
	gold, daily := s.Plans[0], s.Plans[1]
	assert.Equal(t, "gold", gold.Plan)
	assert.Equal(t, "daily", daily.Plan)
	assert.Equal(t, uint64(1), gold.Allowed[SourceStore])
	assert.Equal(t, uint64(1), gold.Denied[SourceStore])
	assert.Equal(t, uint64(3), daily.Allowed[SourceFallback])
	assert.Equal(t, [numSources]uint64{}, daily.Denied)
	assert.Equal(t, uint64(5), s.StoreCalls, "the open breaker skipped one call")
	assert.Equal(t, map[string]uint64{"other": 2}, s.StoreErrors)
	var inBuckets uint64
	for _, n := range s.StoreLatency {
		inBuckets += n
	}
	assert.Equal(t, s.StoreCalls, inBuckets)
	assert.Len(t, s.StoreLatency, len(s.LatencyBounds)+1)
	assert.False(t, s.Outage)
	assert.Equal(t, breaker.Closed, s.Breaker)
	assert.Equal(t, uint64(1), s.BreakerOpened)
	assert.Equal(t, uint64(1), s.BreakerHalfOpened)
	assert.Equal(t, uint64(1), s.BreakerClosed)
}

func TestStatsCountCacheHitsApart(t *testing.T) {
	ctx := context.Background()
	s := newCountingStore()
	l := newTestLimiter(t, s)
	_, err := l.AllowN(ctx, "k", 4, "gold")
	require.NoError(t, err)
	for i := 0; i < 3; i++ {
		r, err := l.Allow(ctx, "k", "gold")
		require.NoError(t, err)
		require.False(t, r.Allowed)
	}
	st := l.Stats()
	assert.Equal(t, uint64(1), st.Plans[0].Denied[SourceStore])
	assert.Equal(t, uint64(2), st.Plans[0].Denied[SourceCache], "answered without the store")
	assert.Equal(t, uint64(2), st.StoreCalls)
}

// TestStatsPlanByNameAndTotals reads a plan's figures by name, by Source
// and in total, for a plan of the table and one of AllowPlans.
func TestStatsPlanByNameAndTotals(t *testing.T) {
	ctx := context.Background()
	l := newTestLimiter(t, newCountingStore())
	_, err := l.AllowN(ctx, "k", 4, "gold")
	require.NoError(t, err)
	for i := 0; i < 3; i++ { // the store denies, then the cache twice
		_, err = l.Allow(ctx, "k", "gold")
		require.NoError(t, err)
	}
	_, err = l.AllowPlans(ctx, "k", 1, Plan{Name: "adhoc", Capacity: 1, Rate: 1})
	require.NoError(t, err)
	st := l.Stats()

	gold, ok := st.Plan("gold")
	require.True(t, ok)
	assert.Equal(t, "gold", gold.Plan)
	assert.Equal(t, uint64(1), gold.AllowedTotal())
	assert.Equal(t, uint64(3), gold.DeniedTotal())
	assert.Equal(t, uint64(1), gold.AllowedBy(SourceStore))
	assert.Equal(t, uint64(1), gold.DeniedBy(SourceStore))
	assert.Equal(t, uint64(2), gold.DeniedBy(SourceCache))
	assert.Zero(t, gold.AllowedBy(SourceFallback))
	assert.Zero(t, gold.AllowedBy(SourceExempt), "exempt decisions are not counted")
	assert.Zero(t, gold.DeniedBy(Source(255)), "out of range, no panic")

	adhoc, ok := st.Plan("adhoc")
	require.True(t, ok, "AllowPlans's plans are found by name too")
	assert.Equal(t, uint64(1), adhoc.AllowedTotal())
	assert.Zero(t, adhoc.DeniedTotal())

	daily, ok := st.Plan("daily")
	require.True(t, ok, "a plan of the table that has not decided")
	assert.Equal(t, PlanStats{Plan: "daily"}, daily)
	_, ok = st.Plan("nope")
	assert.False(t, ok)
	assert.Zero(t, PlanStats{}.AllowedTotal())
}

func TestStatsErrorClasses(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want string
	}{
		{&redisscript.Error{Class: "OOM"}, "OOM"},
		{fmt.Errorf("%w: shape", redisscript.ErrBadReply), "bad-reply"},
		{context.DeadlineExceeded, "timeout"},
		{context.Canceled, "canceled"},
		{errors.New("dial: refused"), "other"},
	} {
		assert.Equal(t, tc.want, errorClass(tc.err), "%v", tc.err)
	}
}

func TestStatsOfMemoryStore(t *testing.T) {
	l := newTestLimiter(t, NewMemoryStore())
	_, err := l.Allow(context.Background(), "k")
	require.NoError(t, err)
	s := l.Stats()
	assert.Equal(t, uint64(1), s.Plans[0].Allowed[SourceStore])
	assert.Zero(t, s.StoreCalls, "a MemoryStore cannot fail and is not timed")
	assert.Equal(t, breaker.Closed, s.Breaker)
	s.LatencyBounds[0] = time.Hour // the snapshot is the caller's
	assert.Equal(t, 50*time.Microsecond, l.Stats().LatencyBounds[0])
}

func TestStatsDoNotSlowDecisionsDown(t *testing.T) {
	l := newTestLimiter(t, NewMemoryStore())
	allocs := testing.AllocsPerRun(100, func() { _, _ = l.Allow(context.Background(), "k") })
	assert.Zero(t, allocs)
}

// TestStatsOnRealOutage kills and restarts a real redis-server under load
// and checks what Stats tells, which the metrics adapters map one to one
// onto metrics (their own tests drive them with fakes, as they cannot
// import internal/redistest from their modules).
func TestStatsOnRealOutage(t *testing.T) {
	srv := redistest.StartServer(t)
	l, err := New(NewRedisStore(redistest.NewClient(t, redistest.FailFast(srv.Addr()))), testPlans, WithLogger(nil),
		WithBreaker(breaker.Settings{Failures: 3, Cooldown: 100 * time.Millisecond}))
	require.NoError(t, err)

	stop := loadUntilStopped(4, func(g, i int) {
		_, err := l.Allow(context.Background(), fmt.Sprint("user-", g, "-", i%10), "gold")
		assert.NoError(t, err, "breaker.Fallback hides the outage from callers")
		time.Sleep(time.Millisecond)
	})
	count := func(s Source) uint64 {
		p := l.Stats().Plans[0]
		return p.Allowed[s] + p.Denied[s]
	}
	waitMore := func(s Source, within time.Duration) {
		t.Helper()
		n := count(s)
		require.Eventually(t, func() bool { return count(s) > n+20 }, within, 5*time.Millisecond, "decisions from %s", s)
	}
	waitMore(SourceStore, 2*time.Second)
	srv.Kill()
	waitMore(SourceFallback, 2*time.Second)
	assert.True(t, l.Stats().Outage)
	srv.Restart() // with an empty script cache
	waitMore(SourceStore, 3*time.Second)
	stop()

	s := l.Stats()
	t.Logf("%+v", s)
	var failed uint64
	for _, n := range s.StoreErrors {
		failed += n
	}
	assert.GreaterOrEqual(t, failed, uint64(3), "the failures that opened the breaker")
	assert.Less(t, failed, s.StoreCalls, "calls skipped by the open breaker are not calls")
	assert.GreaterOrEqual(t, s.BreakerOpened, uint64(1))
	assert.GreaterOrEqual(t, s.BreakerClosed, uint64(1))
	assert.Equal(t, breaker.Closed, s.Breaker)
	assert.GreaterOrEqual(t, s.ScriptLoads, int64(2), "loaded on the fresh server, and again after the restart")
	assert.Zero(t, s.Plans[0].Allowed[SourceFailOpen])
}
