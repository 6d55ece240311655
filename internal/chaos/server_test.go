//go:build chaos

package chaos

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// Scenarios on one redis-server of the test's own: a restart, a SCRIPT
// FLUSH storm, and a server too slow to answer.

// chaosKeys returns n keys for a scenario.
func chaosKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprint("user-", i)
	}
	return keys
}

// serverLoad is the load of the single-server scenarios: 2 instances of 4
// workers, a decision every millisecond or so per worker, so that the
// workers, the server and the race detector share 2 cores without starving
// the server.
var serverLoad = loadSpec{workers: 4, pace: time.Millisecond, maxOps: 1_000_000, maxTime: 2 * time.Minute}

// recoveryBound is how soon after Redis answers again every decision must
// come from it: the breaker's cooldown (500 ms), one probe (at most one dial
// and one read, 100 ms each), then generous room for a loaded 2-core
// machine under the race detector. README promises "within about a second".
const recoveryBound = 3 * time.Second

// TestChaosRedisRestart kills the Redis under load, keeps it down, and
// starts it again on the same port, empty (no persistence): the fallback
// decides meanwhile, no error reaches a caller, and decisions return to
// Redis. Redis forgets every bucket, so each key may get one more burst
// (lost = 1 per restart).
func TestChaosRedisRestart(t *testing.T) {
	chaosPrologue(t, true)
	srv := redistest.StartServer(t)
	insts := newInstances(t, 2, func() redis.UniversalClient { return redistest.NewClient(t, pooled(redistest.FailFast(srv.Addr()))) })
	keys := chaosKeys(8)
	rounds, down := pick(1, 3), pick(700*time.Millisecond, 2*time.Second)

	start := redisClock(t, srv.Addr())
	l := startLoad(t, insts, keys, serverLoad)
	var kills, restarts []int64 // ns since the load began
	for round := 0; round < rounds; round++ {
		time.Sleep(500 * time.Millisecond)
		kills = append(kills, l.since())
		srv.Kill()
		require.True(t, l.waitOther(indexes(len(keys)), kills[round], 5*time.Second), "round %d: decisions never left Redis", round)
		time.Sleep(down)
		srv.Restart()
		restarts = append(restarts, l.since())
		require.True(t, l.waitStore(indexes(len(keys)), 500*time.Millisecond, recoveryBound+time.Second),
			"round %d: decisions did not return to Redis", round)
	}
	l.finish()
	end := redisClock(t, srv.Addr())

	var outages, backs, p99s, worsts []time.Duration
	for round, kill := range kills {
		outage, ok := l.outage(indexes(len(keys)), kill, until(kills, round))
		require.True(t, ok)
		p99, worst, _ := l.latency(kill, restarts[round])
		outages, backs = append(outages, outage), append(backs, outage-time.Duration(restarts[round]-kill))
		p99s, worsts = append(p99s, p99), append(worsts, worst)
	}

	f := l.figures()
	admitted, bound := l.checkAdmitted(end-start, func(int) int { return rounds })
	chaosLine(t, "redis-restart", "rounds", rounds, "admitted", admitted, "bound", bound, "decisions", f.decisions,
		"fallback", f.fallback, "outage", outages, "back_after_restart", backs, "p99", p99s, "max", worsts, "errors", f.errors)
	assert.Zero(t, f.errors, "no error may reach a caller under Fallback; first: %v", l.firstErr.Load())
	assert.Positive(t, f.fallback, "the fallback decided during the outage")
	for _, b := range backs {
		assert.Less(t, b, recoveryBound, "back on Redis soon after the restart")
	}
	assert.Greater(t, admitted, len(keys)*int(chaosPlan.Capacity), "the load must drain the buckets")
}

// TestChaosScriptFlushStorm flushes the script cache and the functions
// every few ms under load, so that calls meet NOSCRIPT and "function not
// found". Under FailClosed any failure would reach the caller as an error,
// so none may, no decision may leave Redis, and the bound is exact (lost =
// 0).
func TestChaosScriptFlushStorm(t *testing.T) {
	chaosPrologue(t, true)
	srv := redistest.StartServer(t)
	// go-redis's default timeouts: this scenario is about NOSCRIPT, and a
	// 100 ms read timeout could fail a decision on a loaded machine.
	insts := newInstances(t, 3, func() redis.UniversalClient { return redistest.NewClient(t, pooled(&redis.Options{Addr: srv.Addr()})) },
		tollgate.WithFailurePolicy(breaker.FailClosed))
	admin := redistest.NewClient(t, &redis.Options{Addr: srv.Addr()})
	functions := redistest.MajorVersion(t) >= 7
	keys := chaosKeys(8)
	storm, every := pick(2*time.Second, 20*time.Second), pick(5*time.Millisecond, 2*time.Millisecond)

	start := redisClock(t, srv.Addr())
	l := startLoad(t, insts, keys, serverLoad)
	flushes := 0
	for deadline := time.Now().Add(storm); time.Now().Before(deadline) && flushes < 100_000; flushes++ {
		require.NoError(t, admin.ScriptFlush(context.Background()).Err())
		if functions {
			require.NoError(t, admin.FunctionFlush(context.Background()).Err())
		}
		time.Sleep(every)
	}
	l.finish()
	end := redisClock(t, srv.Addr())

	f := l.figures()
	admitted, bound := l.checkAdmitted(end-start, func(int) int { return 0 })
	p99, worst, _ := l.latency(0, l.since())
	chaosLine(t, "script-flush-storm", "admitted", admitted, "bound", bound, "decisions", f.decisions,
		"flushes", flushes, "reloads", scriptLoads(insts), "fallback", f.fallback, "p99", p99, "max", worst, "errors", f.errors)
	assert.Zero(t, f.errors, "NOSCRIPT must never reach a caller; first: %v", l.firstErr.Load())
	assert.Zero(t, f.fallback)
	assert.GreaterOrEqual(t, scriptLoads(insts), int64(flushes/2), "the flushes must have bitten")
	assert.Greater(t, admitted, len(keys)*int(chaosPlan.Capacity), "the load must drain the buckets")
}

// TestChaosSlowRedis makes Redis answer nothing for longer than the client's
// 100 ms read timeout, two ways: CLIENT PAUSE (commands queue, connections
// are accepted) and DEBUG SLEEP (the server blocks entirely). The breaker
// must open, so that decisions stop waiting for Redis, and close again.
func TestChaosSlowRedis(t *testing.T) {
	for _, how := range []string{"client-pause", "debug-sleep"} {
		t.Run(how, func(t *testing.T) {
			chaosPrologue(t, true)
			var args []string
			if redistest.MajorVersion(t) >= 7 { // DEBUG is open by default before 7.0
				args = append(args, "--enable-debug-command", "yes")
			}
			srv := redistest.StartServer(t, args...)
			insts := newInstances(t, 2, func() redis.UniversalClient { return redistest.NewClient(t, pooled(redistest.FailFast(srv.Addr()))) })
			admin := redistest.NewClient(t, &redis.Options{Addr: srv.Addr(), ReadTimeout: time.Minute})
			keys := chaosKeys(8)
			rounds, pause := pick(1, 3), pick(1500*time.Millisecond, 5*time.Second)

			start := redisClock(t, srv.Addr())
			l := startLoad(t, insts, keys, serverLoad)
			var begins, ends []int64 // of the pauses, in ns since the load began
			for round := 0; round < rounds; round++ {
				time.Sleep(500 * time.Millisecond)
				begins = append(begins, l.since())
				if how == "client-pause" {
					ms := strconv.FormatInt(pause.Milliseconds(), 10)
					require.NoError(t, admin.Do(context.Background(), "CLIENT", "PAUSE", ms, "ALL").Err())
					time.Sleep(pause)
				} else {
					// DEBUG SLEEP answers when the server wakes up.
					secs := strconv.FormatFloat(pause.Seconds(), 'f', 3, 64)
					require.NoError(t, admin.Do(context.Background(), "DEBUG", "SLEEP", secs).Err())
				}
				ends = append(ends, l.since())
				require.True(t, l.waitStore(indexes(len(keys)), 500*time.Millisecond, recoveryBound+time.Second),
					"round %d: decisions did not return to Redis", round)
			}
			l.finish()
			end := redisClock(t, srv.Addr())

			var p99s, worsts, backs []time.Duration
			for round, began := range begins {
				outage, ok := l.outage(indexes(len(keys)), began, until(begins, round))
				require.True(t, ok, "round %d: a pause longer than the read timeout must be noticed", round)
				p99, worst, _ := l.latency(began, ends[round])
				p99s, worsts, backs = append(p99s, p99), append(worsts, worst), append(backs, outage-time.Duration(ends[round]-began))
			}

			f := l.figures()
			// Redis loses nothing; a command that ran after its caller gave
			// up only took tokens nobody got, which counts against no bound.
			admitted, bound := l.checkAdmitted(end-start, func(int) int { return 0 })
			chaosLine(t, "slow-redis-"+how, "rounds", rounds, "pause", pause, "admitted", admitted, "bound", bound,
				"decisions", f.decisions, "fallback", f.fallback, "p99", p99s, "max", worsts, "back_after_pause", backs, "errors", f.errors)
			assert.Zero(t, f.errors, "first: %v", l.firstErr.Load())
			assert.Positive(t, f.fallback, "the breaker must open during the pause")
			for i := range worsts {
				// The slowest decision is one that waited for Redis: a read
				// (100 ms), or a probe that dials (100 ms), says HELLO (100 ms)
				// and reads (100 ms). 1 s leaves room for a loaded machine;
				// without the breaker, decisions would wait the whole pause.
				assert.Less(t, worsts[i], time.Second, "round %d: latency during the pause", i)
				assert.Less(t, backs[i], recoveryBound, "round %d: back on Redis after the pause", i)
			}
		})
	}
}
