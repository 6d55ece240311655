package tollgate

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// leasedPlan leases 10 tokens at a time from a bucket of 100 that refills
// one token a second: on miniredis, whose clock stands still, nothing
// refills.
var leasedPlan = Plan{Name: "hot", Capacity: 100, Rate: 1, Lease: 10}

// remaining reads the bucket of key in rs with a Limiter that takes no
// lease and remembers no denial: in Redis, never on a fallback, again
// until a read succeeds, as one may time out in a starved process.
func remaining(t *testing.T, rs *RedisStore, key string) int64 {
	t.Helper()
	plain := leasedPlan
	plain.Lease = 0
	l, err := New(rs, []Plan{plain}, WithDenialCache(0), WithLogger(nil), WithFailurePolicy(breaker.FailClosed))
	require.NoError(t, err)
	var r Result
	require.Eventually(t, func() bool {
		r, err = l.Peek(context.Background(), key)
		return err == nil
	}, 10*time.Second, time.Millisecond, "a read of Redis")
	return r.Remaining
}

// TestLeaseServesDecisionsLocally: one script call takes 10 tokens, and
// the next 9 decisions cost Redis nothing. Close gives the unused rest
// back, so the bucket then holds exactly what was not admitted.
func TestLeaseServesDecisionsLocally(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	var calls scriptCounter
	rs.client.AddHook(&calls)
	l, err := New(rs, []Plan{leasedPlan}, WithLogger(nil))
	require.NoError(t, err)
	var sources [numSources]int
	for i := range 25 {
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.Allowed, "decision %d", i)
		sources[r.Source]++
		if i == 0 {
			assert.Equal(t, int64(99), r.Remaining, "90 in Redis and 9 in the lease")
			assert.Equal(t, "hot", r.Plan)
			assert.Equal(t, int64(100), r.Limit)
		}
	}
	// A lease is taken in Redis when the last one ran out, or ahead, by a
	// goroutine, once a quarter of it is left: how many of each depends on
	// how fast that goroutine is.
	assert.Equal(t, 25, sources[SourceStore]+sources[SourceLease])
	assert.LessOrEqual(t, sources[SourceStore], 3, "at most one decision in 10 waits for a lease")
	require.NoError(t, l.Close())
	// Close returns once every lease goroutine called Done, which each
	// does on its way out: the last may still be on the stack a moment.
	// The wait is for that exit, not a measure of speed.
	assert.Eventually(t, func() bool {
		stacks := make([]byte, 1<<20)
		return !strings.Contains(string(stacks[:runtime.Stack(stacks, true)]), "(*leases)")
	}, 5*time.Second, time.Millisecond, "Close stopped the sweeper and waited for every give-back")
	st := l.Stats()
	assert.Equal(t, uint64(sources[SourceStore]), st.Plans[0].Allowed[SourceStore])
	assert.Equal(t, uint64(sources[SourceLease]), st.Plans[0].Allowed[SourceLease])
	held := st.Reservations.Held
	assert.Equal(t, held, st.Reservations.Settled, "every lease was given back")
	assert.GreaterOrEqual(t, held, uint64(3), "25 decisions take 3 leases of at most 10")
	// Each lease taken and each given back is a script call; the first
	// calls of each script, some at once, meet NOSCRIPT and send EVAL.
	n := uint64(calls.alone.Load() + calls.piped.Load())
	assert.GreaterOrEqual(t, n, 2*held)
	assert.LessOrEqual(t, n, 2*held+6)
	assert.Equal(t, int64(75), remaining(t, rs, "k"), "the unused tokens came back")
}

// TestLeaseNearTheLimitDecidesEachRequest: when Redis has fewer tokens
// than a lease, each request is decided in Redis as usual, so the key
// admits exactly its capacity.
func TestLeaseNearTheLimitDecidesEachRequest(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	plan := Plan{Name: "hot", Capacity: 10, Rate: 1, Lease: 8}
	l, err := New(rs, []Plan{plan}, WithLogger(nil))
	require.NoError(t, err)
	allowed := 0
	for range 30 {
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		if r.Allowed {
			allowed++
		}
	}
	assert.Equal(t, 10, allowed, "the lease of 8, then the 2 left one at a time")
	require.NoError(t, l.Close())
	assert.Equal(t, int64(0), remaining(t, rs, "k"))
}

// TestLeaseBackoffDoesNotQueue: while a key takes no lease (Redis had too
// few tokens), its requests go to Redis at once, even while another
// caller holds the key's renewal.
func TestLeaseBackoffDoesNotQueue(t *testing.T) {
	rs, _, _ := newMiniredisStore(t)
	plan := Plan{Name: "hot", Capacity: 10, Rate: 1, Lease: 8}
	l, err := New(rs, []Plan{plan}, WithLogger(nil))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	for range 9 { // the lease of 8, then a lease refused: the key backs off
		r, err := l.Allow(context.Background(), "k")
		require.NoError(t, err)
		require.True(t, r.Allowed)
	}
	e := l.leases.get("k", "hot")
	e.renew <- struct{}{} // another caller holds the renewal
	defer func() { <-e.renew }()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err, "decided without waiting for the renewal")
	assert.True(t, r.Allowed, "the last token")
	assert.Equal(t, SourceStore, r.Source)
}

// TestLeaseSweeperGivesBack: a lease no decision comes back for is given
// back once its TTL has passed, without Close.
func TestLeaseSweeperGivesBack(t *testing.T) {
	rs, _, _ := newMiniredisStore(t)
	l, err := New(rs, []Plan{leasedPlan}, WithLeaseTTL(20*time.Millisecond), WithLogger(nil))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	r, err := l.Allow(context.Background(), "k")
	require.NoError(t, err)
	require.True(t, r.Allowed)
	require.Equal(t, int64(90), remaining(t, rs, "k"), "leased")
	require.Eventually(t, func() bool { return remaining(t, rs, "k") == 99 }, 10*time.Second, 5*time.Millisecond,
		"the 9 unused tokens come back")
	l.leases.mu.Lock()
	defer l.leases.mu.Unlock()
	assert.Empty(t, l.leases.m, "and the key is forgotten")
}

// TestLeaseOnlyForOnePlanAndItsSize: chains, costs above the lease and
// other stores decide as before.
func TestLeaseOnlyForOnePlanAndItsSize(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	other := Plan{Name: "daily", Capacity: 1000, Rate: 1}
	l, err := New(rs, []Plan{leasedPlan, other}, WithLogger(nil))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	r, err := l.Allow(ctx, "chain", "hot", "daily")
	require.NoError(t, err)
	assert.Equal(t, int64(99), remaining(t, rs, "chain"), "a chain takes no lease")
	r, err = l.AllowN(ctx, "big", 11, "hot")
	require.NoError(t, err)
	assert.True(t, r.Allowed)
	assert.Equal(t, int64(89), remaining(t, rs, "big"), "a cost above the lease takes no lease")

	m, err := New(NewMemoryStore(), []Plan{leasedPlan})
	require.NoError(t, err)
	assert.Nil(t, m.leases, "a MemoryStore needs none")
}

func TestLeaseValidation(t *testing.T) {
	for _, p := range []Plan{
		{Name: "p", Capacity: 10, Rate: 1, Lease: -1},
		{Name: "p", Capacity: 10, Rate: 1, Lease: 11},
		{Name: "p", Capacity: 10, Window: time.Second, Lease: 1},
		{Name: "p", Capacity: 10, Rate: 1, Lease: 1, Shadow: true},
	} {
		_, err := New(NewMemoryStore(), []Plan{p})
		assert.ErrorIs(t, err, ErrInvalidPlan, "%+v", p)
	}
	rs, _, _ := newMiniredisStore(t)
	for _, d := range []time.Duration{0, time.Microsecond, time.Minute + 1} {
		_, err := New(rs, []Plan{leasedPlan}, WithLeaseTTL(d))
		assert.ErrorIs(t, err, ErrInvalidOption, "%v", d)
	}
}

// TestLeaseCallerContext: a caller whose context ends while another
// takes the key's lease gets its context's error, not an outage.
func TestLeaseCallerContext(t *testing.T) {
	rs, _, _ := newMiniredisStore(t)
	l, err := New(rs, []Plan{leasedPlan}, WithLogger(nil))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	e := l.leases.get("k", "hot")
	e.renew <- struct{}{} // another caller is taking the lease
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	_, err = l.Allow(ctx, "k")
	assert.ErrorIs(t, err, context.Canceled)
	<-e.renew
}

// TestLeasesNeverOverAdmit runs 4 Limiters of 8 goroutines on one key on
// miniredis, whose clock stands still: together they admit at most the
// capacity, at least the capacity less a lease per Limiter, and after
// Close the bucket holds exactly what they did not admit.
func TestLeasesNeverOverAdmit(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	var allowed atomic.Int64
	var wg sync.WaitGroup
	limiters := make([]*Limiter, 4)
	for i := range limiters {
		l, err := New(rs, []Plan{leasedPlan}, WithLogger(nil))
		require.NoError(t, err)
		limiters[i] = l
		for range 8 {
			wg.Go(func() {
				for range 40 {
					r, err := l.Allow(ctx, "k")
					if err != nil {
						t.Error(err)
						return
					}
					if r.Allowed {
						allowed.Add(1)
					}
				}
			})
		}
	}
	wg.Wait()
	for _, l := range limiters {
		require.NoError(t, l.Close())
	}
	n := allowed.Load()
	assert.LessOrEqual(t, n, leasedPlan.Capacity)
	assert.GreaterOrEqual(t, n, leasedPlan.Capacity-4*leasedPlan.Lease)
	assert.Equal(t, leasedPlan.Capacity-n, remaining(t, rs, "k"), "every unused leased token came back")
}

// TestLeaseGiveBackForgetsRememberedDenials: a lease given back refunds
// its rest to Redis, and the Limiter forgets the key's remembered
// denials, as after any refund: a request the bucket now admits is not
// denied from the cache.
func TestLeaseGiveBackForgetsRememberedDenials(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	plan := Plan{Name: "hot", Capacity: 10, Rate: Per(10, time.Hour), Lease: 8}
	l, err := New(rs, []Plan{plan}, WithLogger(nil))
	require.NoError(t, err)
	time.Sleep(time.Millisecond) // off the instant of New: see testDenialCacheSparesTheStore
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, SourceStore, r.Source, "a lease of 8 taken: 2 left in Redis, 7 in the lease")
	for _, src := range []Source{SourceStore, SourceCache} {
		r, err = l.AllowN(ctx, "k", 9) // above the lease: decided in Redis
		require.NoError(t, err)
		require.False(t, r.Allowed)
		require.Equal(t, src, r.Source, "the denial is remembered")
	}
	require.NoError(t, l.Close()) // gives the lease's 7 back
	r, err = l.AllowN(ctx, "k", 9)
	require.NoError(t, err)
	assert.True(t, r.Allowed, "9 in Redis; denied by %v", r.Source)
	assert.Equal(t, SourceStore, r.Source)
}

// TestLeaseThroughAnOutage: a lease spends tokens taken in Redis without
// asking Redis or its breaker, so one taken before Redis failed serves its
// rest while the breaker is open. No lease is taken from the fallback:
// one it grants is given back at once, and each request is decided by
// the fallback, on this instance's share (WithFleet, 4 instances).
func TestLeaseThroughAnOutage(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	plan := Plan{Name: "hot", Capacity: 100, Rate: 0.001, Lease: 10}
	l, err := New(NewRedisStore(c), []Plan{plan}, WithLogger(nil), WithFleet(time.Hour), WithLeaseTTL(time.Minute),
		WithDenialCache(0), WithBreaker(breaker.Settings{Cooldown: time.Hour}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	l.fleet.close() // the test sets the fleet's size: a share of 25
	l.fleet.size.Store(4)
	r, err := l.Allow(ctx, "k")
	require.NoError(t, err)
	require.Equal(t, SourceStore, r.Source, "a lease of 10 taken")
	mr.SetError("LOADING Redis is loading the dataset in memory")
	for range 3 { // another key's decisions fail and trip the breaker
		_, err := l.Allow(ctx, "other")
		require.NoError(t, err)
	}
	require.Equal(t, breaker.Open, l.health.one.State())
	for i := range 9 {
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.True(t, r.Allowed)
		assert.Equal(t, SourceLease, r.Source, "decision %d: the lease's rest", i)
	}
	admitted := 0
	for i := range 100 {
		if i == 1 { // the holds the fallback granted are given back
			require.Eventually(t, func() bool {
				st := l.Stats().Reservations
				return st.Held == st.Settled
			}, 10*time.Second, time.Millisecond)
		}
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, SourceFallback, r.Source, "decision %d", i)
		if r.Allowed {
			admitted++
		}
	}
	assert.Equal(t, 25, admitted, "the share, one request at a time")
}

// leaseChildEnv carries a leaseJob to TestLeaseChildProcess.
const leaseChildEnv = "TOLLGATE_LEASE_CHILD"

// procPlan is the plan the processes of TestLeaseBoundAcrossProcesses
// share: a lease of 25 from a bucket of 100 refilling 1,000 a second.
var procPlan = Plan{Name: "hot", Capacity: 100, Rate: 1000, Lease: 25}

// leaseTotals is what one child process reports: its decisions, and the
// Redis TIME, in µs, when its goroutines started and stopped.
type leaseTotals struct {
	Allowed, Denied, Leased int64
	Start, End              int64
}

// TestLeaseBoundAcrossProcessesOnRealRedis runs 4 processes of 8
// goroutines deciding one key through leases for a second. They admit at
// most capacity + rate × elapsed, as without leases, and no fewer than
// rate × the time all four ran less a lease per process: the tokens a
// lease may hold back from the others (ADR 27).
func TestLeaseBoundAcrossProcessesOnRealRedis(t *testing.T) {
	if os.Getenv(leaseChildEnv) != "" {
		t.Skip("a child runs only TestLeaseChildProcess")
	}
	addr := redistest.Addr(t)
	c := redistest.NewClient(t, &redis.Options{Addr: addr})
	prefix := redistest.KeyPrefix()
	start := redistest.Time(t, c)
	var total leaseTotals
	var common [2]int64 // the span all four ran: the latest start, the earliest end
	for i, line := range runChildren(t, 4, "TestLeaseChildProcess", leaseChildEnv,
		windowJob{Addr: addr, Prefix: prefix, Workers: 8, Run: time.Second}) {
		var part leaseTotals
		require.NoError(t, json.Unmarshal([]byte(line), &part), line)
		total.Allowed += part.Allowed
		total.Denied += part.Denied
		total.Leased += part.Leased
		if i == 0 || part.Start > common[0] {
			common[0] = part.Start
		}
		if i == 0 || part.End < common[1] {
			common[1] = part.End
		}
	}
	end := redistest.Time(t, c)
	upper := float64(procPlan.Capacity) + procPlan.Rate*float64(end-start)/1e6
	lower := procPlan.Rate*float64(common[1]-common[0])/1e6 - float64(4*procPlan.Lease)
	t.Logf("%d allowed (%d from leases), %d denied; at most %.1f (capacity %d + %.0f/s × %.3f s), at least %.1f (%.0f/s × %.3f s all four ran − 4 × %d)",
		total.Allowed, total.Leased, total.Denied, upper, procPlan.Capacity, procPlan.Rate, float64(end-start)/1e6,
		lower, procPlan.Rate, float64(common[1]-common[0])/1e6, procPlan.Lease)
	assert.LessOrEqual(t, float64(total.Allowed), upper+1, "admitted more than the bucket allows")
	assert.GreaterOrEqual(t, float64(total.Allowed), lower, "leases held back more than a lease per process")
	assert.Positive(t, total.Denied, "the load must push past the limit")
	assert.Positive(t, total.Leased, "leases served decisions")
}

// TestLeaseChildProcess is one process of
// TestLeaseBoundAcrossProcessesOnRealRedis.
func TestLeaseChildProcess(t *testing.T) {
	spec := os.Getenv(leaseChildEnv)
	if spec == "" {
		t.Skip("runs only as a child of TestLeaseBoundAcrossProcessesOnRealRedis")
	}
	var job windowJob
	require.NoError(t, json.Unmarshal([]byte(spec), &job))
	c := redis.NewClient(&redis.Options{Addr: job.Addr})
	defer c.Close()
	l, err := New(NewRedisStore(c, WithKeyPrefix(job.Prefix)), []Plan{procPlan}, WithFailurePolicy(breaker.FailClosed),
		WithLeaseTTL(100*time.Millisecond), WithLogger(nil))
	require.NoError(t, err)
	ctx := context.Background()
	var allowed, denied, leased atomic.Int64
	var wg sync.WaitGroup
	startTime := redistest.Time(t, c)
	deadline := time.Now().Add(job.Run)
	for range job.Workers {
		wg.Go(func() {
			for time.Now().Before(deadline) {
				r, err := l.Allow(ctx, "shared")
				require.NoError(t, err)
				switch {
				case !r.Allowed:
					denied.Add(1)
				case r.Source == SourceLease:
					leased.Add(1)
					allowed.Add(1)
				default:
					allowed.Add(1)
				}
			}
		})
	}
	wg.Wait()
	endTime := redistest.Time(t, c)
	require.NoError(t, l.Close())
	out, err := json.Marshal(leaseTotals{Allowed: allowed.Load(), Denied: denied.Load(), Leased: leased.Load(), Start: startTime, End: endTime})
	require.NoError(t, err)
	fmt.Printf("%s\n", out)
}

// BenchmarkLease compares a hot key decided from a lease on real Redis
// with the same decision on a MemoryStore, serially and from parallel
// goroutines, and reports the script calls per decision.
func BenchmarkLease(b *testing.B) {
	redistest.SkipIfUnavailable(b)
	ctx := context.Background()
	hot := Plan{Name: "hot", Capacity: 1 << 30, Rate: 1 << 30, Lease: 10_000}
	stores := map[string]func(b *testing.B, calls *scriptCounter) Store{
		"memory": func(*testing.B, *scriptCounter) Store { return NewMemoryStore() },
		"lease": func(b *testing.B, calls *scriptCounter) Store {
			c := redistest.NewClient(b, &redis.Options{Addr: redistest.Addr(b)})
			c.AddHook(calls)
			return NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
		},
	}
	for _, mode := range []string{"serial", "parallel"} {
		for _, name := range []string{"memory", "lease"} {
			b.Run(mode+"/"+name, func(b *testing.B) {
				var calls scriptCounter
				l, err := New(stores[name](b, &calls), []Plan{hot}, WithLogger(nil))
				require.NoError(b, err)
				b.Cleanup(func() { _ = l.Close() })
				decide := func() {
					if r, err := l.Allow(ctx, "hot"); err != nil || !r.Allowed {
						b.Errorf("%v %+v", err, r)
					}
				}
				b.ReportAllocs()
				b.ResetTimer()
				if mode == "serial" {
					for b.Loop() {
						decide()
					}
				} else {
					b.RunParallel(func(pb *testing.PB) {
						for pb.Next() {
							decide()
						}
					})
				}
				b.StopTimer()
				b.ReportMetric(float64(calls.alone.Load()+calls.piped.Load())/float64(b.N), "calls/op")
			})
		}
	}
}

// TestLeaseOfAllowPlansSettlesWithTheCallersPlan: AllowPlans decides on
// the plan its caller holds, and a lease it takes (Plan.Lease) is a
// reservation of that plan. Giving the lease back must adjust the bucket
// with that plan, not with the table's plan of the same name, which
// AllowPlans never decided on: the table's faster rate would refill the
// bucket at the give-back, tokens the caller's plan never accrued.
func TestLeaseOfAllowPlansSettlesWithTheCallersPlan(t *testing.T) {
	ctx := context.Background()
	rs, _, setTime := newMiniredisStore(t)
	table := Plan{Name: "api", Capacity: 100, Rate: 100}
	tier := Plan{Name: "api", Capacity: 10, Rate: 1.0 / 3600, Lease: 5} // 10 an hour
	l, err := New(rs, []Plan{table}, WithLogger(nil), WithDenialCache(0))
	require.NoError(t, err)
	r, err := l.AllowPlans(ctx, "k", 1, tier)
	require.NoError(t, err)
	require.True(t, r.Allowed)
	require.Equal(t, SourceStore, r.Source, "the first decision takes a lease of 5")
	setTime(t0 + 10*time.Second.Microseconds())
	require.NoError(t, l.Close()) // gives back the 4 tokens not handed out

	plain := tier
	plain.Lease = 0
	l2, err := New(rs, []Plan{table}, WithLogger(nil), WithDenialCache(0))
	require.NoError(t, err)
	admitted := 1
	for range 20 {
		r, err := l2.AllowPlans(ctx, "k", 1, plain)
		require.NoError(t, err)
		if r.Allowed {
			admitted++
		}
	}
	// Capacity 10 plus 10 s at 10 an hour: 10 in all.
	assert.Equal(t, 10, admitted, "the give-back refilled the bucket at the table's rate")
}

// TestSweepPassesOverALeaseBeingTakenAhead: the sweeper passes over a key
// whose next lease is being taken, as its doc says. Dropped meanwhile,
// the key holds no lease when that take comes back, so its tokens go back
// on their own, after a new plan may have drained the bucket: a lease of
// 50 of 100 has handed out 25, the next 25 are being taken ahead, two
// sweeps end and drop the lease, and the plan becomes one of 10 (before:
// 20 admitted at one instant under it).
func TestSweepPassesOverALeaseBeingTakenAhead(t *testing.T) {
	small := Plan{Name: "hot", Capacity: 10, Rate: 1}
	l, rs, gate := leaseTakenAhead(t)
	far := l.now() + int64(time.Hour)
	l.leases.sweepOnce(far, false) // ends the lease
	l.leases.sweepOnce(far, false) // would drop it
	require.NoError(t, l.SetPlans([]Plan{small}))
	admitted := admittedReleasing(t, l, gate)
	require.NoError(t, l.Close())
	admitted += countAdmitted(t, plainLimiter(t, rs, small), "k", 30)
	assert.Equal(t, small.Capacity, admitted, "admitted under the plan of 10, at one instant")
}
