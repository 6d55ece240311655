//go:build chaos

package chaos

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redisscript"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// Failover scenarios: a Cluster master and a Sentinel master killed under
// load. The promoted replica has never run the script (Redis 7 replicates a
// script's effects, not the script), so the first decision there meets
// NOSCRIPT, which must heal unseen. A library of functions is replicated
// with the data: on Redis 7 the lean decision's functions are on the
// replica before it is promoted, and need no load.

// failoverLoad is the load of the failover scenarios; see serverLoad.
var failoverLoad = loadSpec{workers: 4, pace: time.Millisecond, maxOps: 1_000_000, maxTime: 5 * time.Minute}

// failoverBound bounds the outage callers see after a master dies, from the
// kill to their last decision not made by Redis. The servers are configured
// to act within seconds (redistest: cluster-node-timeout and Sentinel
// down-after-milliseconds 1 s), and the README's client settings notice the
// new master within 500 ms (Cluster state reload; Sentinel's switch-master
// message is immediate); the breaker then probes within its 500 ms cooldown.
// Cluster, worst case: 1 s until the master is suspected, about 1 s for the
// other masters to agree and the replica to win the vote (500 ms fixed delay
// plus up to 500 ms random), 0.5 s for the client, 0.5 s for the breaker:
// about 3.5 s. The bound doubles that, for a 2-core machine that also runs
// six servers, the load and the race detector.
const failoverBound = 8 * time.Second

// failoverWait bounds how long the test waits for a failover to happen at
// all, before it gives up: longer than failoverBound, so that a slow
// failover fails the bound with its figure rather than a timeout.
const failoverWait = 30 * time.Second

// scriptCached reports whether the server at addr has the script cached.
func scriptCached(t *testing.T, addr string) bool {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	ok, err := c.ScriptExists(context.Background(), redisscript.New(limitScript(t)).SHA()).Result()
	require.NoError(t, err)
	return ok[0]
}

// functionsLoaded reports whether the server at addr has a library of
// tollgate's functions.
func functionsLoaded(t *testing.T, addr string) bool {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	libs, err := c.FunctionList(context.Background(), redis.FunctionListQuery{LibraryNamePattern: "tollgate_*"}).Result()
	if err != nil && strings.HasPrefix(err.Error(), "ERR unknown command") {
		return false // before Redis 7
	}
	require.NoError(t, err)
	return len(libs) > 0
}

// checkReloads checks that a store healed what the promoted replica
// lacked: the script, or, if the functions had not reached it, those.
func checkReloads(t *testing.T, round int, r failoverRound, functions bool) {
	t.Helper()
	if functions {
		t.Logf("round %d: the promoted replica had the functions, replicated; %d reloads", round, r.reloads)
		return
	}
	assert.Positive(t, r.reloads, "round %d: the promoted replica answered NOSCRIPT, and the store reloaded", round)
}

// limitScript returns the text of the script a decision runs, as the
// RedisStore builds it: scripts/bucket.lua, then scripts/limit.lua.
func limitScript(t *testing.T) string {
	t.Helper()
	var text string
	for _, name := range []string{"bucket.lua", "limit.lua"} {
		b, err := os.ReadFile(filepath.Join("..", "..", "scripts", name))
		require.NoError(t, err)
		text += string(b)
	}
	return text
}

// waitReplicaSynced waits until the server at addr is a replica whose link
// to its master is up and whose first sync is done.
func waitReplicaSynced(t *testing.T, addr string, within time.Duration) {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	var info string
	synced := eventually(within, 50*time.Millisecond, func() bool {
		info, _ = c.Info(context.Background(), "replication").Result()
		return strings.Contains(info, "role:slave") && strings.Contains(info, "master_link_status:up") &&
			strings.Contains(info, "master_sync_in_progress:0")
	})
	require.True(t, synced, "%s did not become a replica in sync within %s:\n%s", addr, within, info)
}

// failoverRound is one killed master.
type failoverRound struct {
	kill     int64         // ns since the load began
	promoted time.Duration // from the kill until the servers named a new master, polled every 50 ms
	reloads  int64         // NOSCRIPT reloads during the round
}

// killMaster kills victim under the running load l, waits until
// newMaster reports a server other than victim, then until decisions on
// keys come from Redis again.
func killMaster(t *testing.T, l *load, victim *redistest.Server, keys []int, newMaster func() *redistest.Server) failoverRound {
	t.Helper()
	reloads := scriptLoads(l.insts)
	r := failoverRound{kill: l.since()}
	victim.Kill()
	promoted := eventually(failoverWait, 50*time.Millisecond, func() bool { return newMaster() != victim })
	require.True(t, promoted, "no failover within %s", failoverWait)
	r.promoted = time.Duration(l.since() - r.kill)
	require.True(t, l.waitStore(keys, time.Second, failoverWait), "decisions did not return to Redis")
	r.reloads = scriptLoads(l.insts) - reloads
	return r
}

func killTimes(rs []failoverRound) []int64 {
	kills := make([]int64, len(rs))
	for i, r := range rs {
		kills[i] = r.kill
	}
	return kills
}

// failoverFigures measures, after the load finished, each round's outage on
// keys as callers saw it, and the latency of the decisions during it.
func failoverFigures(t *testing.T, l *load, keys []int, rs []failoverRound) (outages, promoted, p99s, worsts []time.Duration) {
	t.Helper()
	kills := killTimes(rs)
	for i, kill := range kills {
		outage, ok := l.outage(keys, kill, until(kills, i))
		assert.True(t, ok, "round %d: a dead master must be noticed", i)
		p99, worst, _ := l.latency(kill, kill+int64(outage))
		outages, p99s, worsts = append(outages, outage), append(p99s, p99), append(worsts, worst)
		promoted = append(promoted, rs[i].promoted)
	}
	return outages, promoted, p99s, worsts
}

// TestChaosClusterFailover kills the master of a third of the keys in a
// Cluster of 3 masters with one replica each, under load, with the README's
// client settings. In the full run the killed node comes back as a replica
// and the new master is killed in turn.
func TestChaosClusterFailover(t *testing.T) {
	chaosPrologue(t, true)
	cl := redistest.StartCluster(t, 3, 1)
	insts := newInstances(t, 2, func() redis.UniversalClient { return cl.Client(t, fastCluster()) })
	nodes := cl.Servers()
	// Keys until every master serves 4; victims are the keys of the first
	// master, whose slot range (and its replica, nodes[3]) the test fails
	// over. nodes[1] serves other slots and is never killed: the clock.
	var keys []string
	var victims, others []int
	perMaster := map[*redistest.Server]int{}
	for i := 0; len(keys) < 12 && i < 1000; i++ {
		k := fmt.Sprint("user-", i)
		m := cl.MasterFor(k)
		if perMaster[m] == 4 {
			continue
		}
		perMaster[m]++
		if m == nodes[0] {
			victims = append(victims, len(keys))
		} else {
			others = append(others, len(keys))
		}
		keys = append(keys, k)
	}
	require.Len(t, keys, 12)
	clock := nodes[1].Addr()
	rounds := pick(1, 2)

	start := redisClock(t, clock)
	l := startLoad(t, insts, keys, failoverLoad)
	var results []failoverRound
	for round := 0; round < rounds; round++ {
		time.Sleep(pick(time.Second, 3*time.Second))
		victim := cl.MasterFor(keys[victims[0]])
		replica := nodes[0]
		if victim == nodes[0] {
			replica = nodes[3]
		}
		require.False(t, scriptCached(t, replica.Addr()), "the replica must start without the script, or NOSCRIPT goes untested")
		functions := functionsLoaded(t, replica.Addr())
		r := killMaster(t, l, victim, victims, func() *redistest.Server { return cl.MasterFor(keys[victims[0]]) })
		checkReloads(t, round, r, functions)
		results = append(results, r)
		if round+1 < rounds {
			victim.Restart() // it rejoins as a replica of the new master
			waitReplicaSynced(t, victim.Addr(), failoverWait)
		}
	}
	time.Sleep(pick(500*time.Millisecond, 3*time.Second))
	l.finish()
	end := redisClock(t, clock)

	f := l.figures()
	isVictim := keySet(victims)
	admitted, bound := l.checkAdmitted(end-start, func(k int) int {
		if isVictim[uint16(k)] {
			return rounds // each failover may lose the replica's lag
		}
		return 0
	})
	outages, promoted, p99s, worsts := failoverFigures(t, l, victims, results)
	// The Limiter keeps a breaker per master (ADR 20), but under Redis's
	// default cluster-require-full-coverage every node answers CLUSTERDOWN
	// once the master is marked failed: the healthy masters' keys go to
	// the fallback too, until the replica takes over.
	var collateral []time.Duration
	kills := killTimes(results)
	for i, kill := range kills {
		o, _ := l.outage(others, kill, until(kills, i))
		collateral = append(collateral, o)
	}
	chaosLine(t, "cluster-failover", "rounds", rounds, "admitted", admitted, "bound", bound, "decisions", f.decisions,
		"fallback", f.fallback, "outage", outages, "promoted_after", promoted, "p99", p99s, "max", worsts,
		"healthy_masters_outage", collateral, "reloads", scriptLoads(insts), "errors", f.errors)
	checkFailover(t, f, l, outages)
}

// TestChaosSentinelFailover kills the master of a Sentinel setup (master,
// replica, sentinel) under load, with the README's client settings. In the
// full run the killed server comes back, the sentinel makes it a replica,
// and the new master is killed in turn.
func TestChaosSentinelFailover(t *testing.T) {
	chaosPrologue(t, true)
	sen := redistest.StartSentinel(t)
	insts := newInstances(t, 2, func() redis.UniversalClient { return sen.Client(t, fastFailover()) })
	keys := chaosKeys(8)
	rounds := pick(1, 2)

	start := redisClock(t, sen.Master().Addr())
	l := startLoad(t, insts, keys, failoverLoad)
	var results []failoverRound
	for round := 0; round < rounds; round++ {
		time.Sleep(pick(time.Second, 3*time.Second))
		victim := sen.Master()
		replica := sentinelReplica(t, sen)
		if round > 0 {
			waitReplicaSynced(t, replica, failoverWait)
		}
		require.False(t, scriptCached(t, replica), "the replica must start without the script, or NOSCRIPT goes untested")
		functions := functionsLoaded(t, replica)
		r := killMaster(t, l, victim, indexes(len(keys)), sen.Master)
		checkReloads(t, round, r, functions)
		results = append(results, r)
		if round+1 < rounds {
			victim.Restart() // the sentinel makes it a replica of the new master
		}
	}
	time.Sleep(pick(500*time.Millisecond, 3*time.Second))
	l.finish()
	end := redisClock(t, sen.Master().Addr())

	f := l.figures()
	admitted, bound := l.checkAdmitted(end-start, func(int) int { return rounds })
	outages, promoted, p99s, worsts := failoverFigures(t, l, indexes(len(keys)), results)
	chaosLine(t, "sentinel-failover", "rounds", rounds, "admitted", admitted, "bound", bound, "decisions", f.decisions,
		"fallback", f.fallback, "outage", outages, "promoted_after", promoted, "p99", p99s, "max", worsts,
		"reloads", scriptLoads(insts), "errors", f.errors)
	checkFailover(t, f, l, outages)
}

// sentinelReplica returns the address of the replica the sentinel knows.
func sentinelReplica(t *testing.T, sen *redistest.Sentinel) string {
	t.Helper()
	c := redis.NewSentinelClient(&redis.Options{Addr: sen.SentinelAddrs()[0]})
	defer c.Close()
	var replicas []map[string]string
	var addr string
	found := eventually(failoverWait, 100*time.Millisecond, func() bool {
		replicas, _ = c.Replicas(context.Background(), sen.MasterName()).Result()
		for _, r := range replicas {
			if !strings.Contains(r["flags"], "down") && r["master-link-status"] == "ok" {
				addr = r["ip"] + ":" + r["port"]
				return true
			}
		}
		return false
	})
	require.True(t, found, "the sentinel knows no live replica: %v", replicas)
	return addr
}

// checkFailover asserts what every failover scenario promises.
func checkFailover(t *testing.T, f figures, l *load, outages []time.Duration) {
	t.Helper()
	assert.Zero(t, f.errors, "no error may reach a caller under Fallback; first: %v", l.firstErr.Load())
	assert.Positive(t, f.fallback, "the fallback decided during the outage")
	for i, o := range outages {
		assert.Less(t, o, failoverBound, "round %d: outage as callers saw it", i)
	}
}
