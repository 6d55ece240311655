//go:build chaos

package chaos

import (
	"context"
	"fmt"
	"math"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// chaosFull selects the long version of every scenario.
var chaosFull = os.Getenv("TOLLGATE_CHAOS_FULL") == "1"

// chaosUnbatched gives every RedisStore of the suite WithoutBatching,
// child processes included (they inherit the environment).
var chaosUnbatched = os.Getenv("TOLLGATE_CHAOS_UNBATCHED") == "1"

// pooled gives a store's client, unless the run is unbatched, a pool of 2
// connections, fewer than an instance's workers, so that decisions wait
// and ride in batches, as they do once callers outnumber the pool; the
// unbatched run keeps go-redis's default pool.
func pooled(o *redis.Options) *redis.Options {
	if !chaosUnbatched {
		o.PoolSize = 2
	}
	return o
}

// chaosLease gives the plan of TestChaosProcesses's children a lease
// (Plan.Lease, ADR 27) under TOLLGATE_CHAOS_LEASE=1. Only that scenario
// takes it: the others' Limiters are not closed, and a lease's sweeper
// would fail their goroutine check.
var chaosLease = os.Getenv("TOLLGATE_CHAOS_LEASE") == "1"

// storeOptions returns the options of every RedisStore of the suite: the
// key prefix, and WithoutBatching under TOLLGATE_CHAOS_UNBATCHED=1.
func storeOptions(prefix string) []tollgate.Option {
	if chaosUnbatched {
		return []tollgate.Option{tollgate.WithKeyPrefix(prefix), tollgate.WithoutBatching()}
	}
	return []tollgate.Option{tollgate.WithKeyPrefix(prefix)}
}

// pick returns short in the CI run and full under TOLLGATE_CHAOS_FULL=1.
func pick[T any](short, full T) T {
	if chaosFull {
		return full
	}
	return short
}

// chaosPlan is the plan every Redis scenario uses: small enough that the
// load drains it at once, so every admission beyond the burst is a refill
// and the bound is tight.
var chaosPlan = tollgate.Plan{Name: "chaos", Capacity: 10, Rate: 20}

// chaosPrologue skips the test without redis-server (when it needs one) and
// registers the goroutine leak check. Cleanups run last-in first-out, so the
// check, registered first, runs after every server, client and load the test
// set up has been stopped.
func chaosPrologue(t *testing.T, needsRedis bool) {
	t.Helper()
	if needsRedis {
		redistest.SkipIfUnavailable(t)
	}
	ignore := goleak.IgnoreCurrent()
	t.Cleanup(func() { assert.NoError(t, settledLeaks(ignore)) })
}

// leakGrace is how long goroutines may take to end after their owner has
// been closed. go-redis probes a dead server from a goroutine that sleeps a
// second between dials and sees that its pool was closed only when it wakes
// up (pool.(*ConnPool).tryDial), so a client closed while a server is down
// leaves it for up to a second and a dial timeout. That is not a leak; a
// goroutine still there after leakGrace is.
const leakGrace = 5 * time.Second

// settledLeaks returns goleak's report of the goroutines, not ignored,
// that are still running leakGrace from now, or nil once there are none.
func settledLeaks(ignore ...goleak.Option) error {
	var err error
	eventually(leakGrace, 100*time.Millisecond, func() bool {
		err = goleak.Find(ignore...)
		return err == nil
	})
	return err
}

// eventually calls cond, then again after each pause of every, until it
// returns true, and reports whether it did before within passed. Like every loop of the suite, it is
// bounded in count as well as in time, so that a clock that misbehaves
// cannot hang it.
func eventually(within, every time.Duration, cond func() bool) bool {
	deadline := time.Now().Add(within)
	for i := int64(0); i <= int64(within/every); i++ {
		if cond() {
			return true
		}
		if time.Now().After(deadline) {
			break
		}
		time.Sleep(every)
	}
	return false
}

// chaosLine logs the scenario's figures on one greppable line.
func chaosLine(t *testing.T, scenario string, kv ...any) {
	t.Helper()
	var b strings.Builder
	fmt.Fprintf(&b, "CHAOS scenario=%s", scenario)
	for i := 0; i+1 < len(kv); i += 2 {
		v := kv[i+1]
		switch x := v.(type) {
		case time.Duration:
			v = roundDuration(x)
		case []time.Duration:
			ds := make([]time.Duration, len(x))
			for j, d := range x {
				ds[j] = roundDuration(d)
			}
			v = ds
		case float64:
			v = fmt.Sprintf("%.1f", x)
		}
		fmt.Fprintf(&b, " %s=%v", kv[i], v)
	}
	t.Log(b.String())
}

// roundDuration keeps three or four significant digits: 2.659s, 700.6µs.
func roundDuration(d time.Duration) time.Duration {
	r := time.Duration(1)
	for d/r >= 10_000 {
		r *= 10
	}
	return d.Round(r)
}

// failFast is the README's client advice (redistest.FailFast) for a client
// of any kind: its Cluster and Failover methods copy these fields into the
// options of each. The addresses are left to the harness's Client methods.
func failFast() *redis.UniversalOptions {
	o := pooled(redistest.FailFast(""))
	return &redis.UniversalOptions{
		PoolSize:              o.PoolSize,
		DialTimeout:           o.DialTimeout,
		ReadTimeout:           o.ReadTimeout,
		WriteTimeout:          o.WriteTimeout,
		PoolTimeout:           o.PoolTimeout,
		MaxRetries:            o.MaxRetries,
		DialerRetries:         o.DialerRetries,
		ContextTimeoutEnabled: o.ContextTimeoutEnabled,
	}
}

// fastCluster is the README's client advice for Cluster: fail fast, and
// reload the slot map often enough to notice a failover.
func fastCluster() *redis.ClusterOptions {
	o := failFast().Cluster()
	o.ClusterStateReloadInterval = 500 * time.Millisecond
	return o
}

// fastFailover is the README's client advice for Sentinel.
func fastFailover() *redis.FailoverOptions { return failFast().Failover() }

// instance is one service instance: a Limiter with its own client, its own
// fallback MemoryStore, and the RedisStore under it.
type instance struct {
	lim   *tollgate.Limiter
	store *tollgate.RedisStore
}

// newInstances builds n instances over clients made by newClient, sharing one
// key prefix, under the Fallback policy with the default breaker.
func newInstances(t *testing.T, n int, newClient func() redis.UniversalClient, opts ...tollgate.Option) []instance {
	t.Helper()
	prefix := redistest.KeyPrefix()
	insts := make([]instance, n)
	for i := range insts {
		s := tollgate.NewRedisStore(newClient(), storeOptions(prefix)...)
		l, err := tollgate.New(s, []tollgate.Plan{chaosPlan}, append([]tollgate.Option{tollgate.WithLogger(nil)}, opts...)...)
		require.NoError(t, err)
		insts[i] = instance{lim: l, store: s}
	}
	return insts
}

func scriptLoads(insts []instance) int64 {
	n := int64(0)
	for _, in := range insts {
		n += in.store.ScriptLoads()
	}
	return n
}

// redisClock reads Redis TIME at addr, in µs: the clock the script decides
// by. Its client lives for this one call, so that it has no pool left to
// redial the server when a scenario kills it.
func redisClock(t *testing.T, addr string) int64 {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: addr})
	defer c.Close()
	return redistest.Time(t, c)
}

// byStore reports whether Redis made a decision that came from src: itself,
// or through the Limiter's denial cache, which only repeats a denial Redis
// gave (and never admits). Either way the decision is charged to Redis.
func byStore(src tollgate.Source) bool {
	return src == tollgate.SourceStore || src == tollgate.SourceCache
}

// decision is one call as the caller saw it.
type decision struct {
	at, took int64 // ns: when the call began, since the load began; how long it took
	key      uint16
	inst     uint8
	src      tollgate.Source
	allowed  bool
	err      bool
}

// load drives instances with workers that each decide in a loop, bounded by
// a count and a time, and records every decision.
type load struct {
	t     *testing.T
	insts []instance
	keys  []string
	began time.Time

	stop     chan struct{}
	stopOnce sync.Once
	finished atomic.Bool
	wg       sync.WaitGroup
	logs     [][]decision // one per worker, written only by it until wg.Wait
	firstErr atomic.Value

	// For waiting while the load runs: per key, the end of the latest
	// decision by the store and by anything else, in ns since began.
	lastStore, lastOther []atomic.Int64
}

type loadSpec struct {
	workers int           // per instance
	pace    time.Duration // sleep between one worker's decisions
	maxOps  int           // per worker
	maxTime time.Duration // for the whole load
}

// startLoad starts the workers; the load stops at finish (also registered
// as a cleanup, so a failed test stops it before its servers go).
func startLoad(t *testing.T, insts []instance, keys []string, spec loadSpec) *load {
	t.Helper()
	require.Less(t, len(keys), 1<<16)
	require.Less(t, len(insts), 1<<8)
	l := &load{
		t: t, insts: insts, keys: keys, began: time.Now(),
		stop:      make(chan struct{}),
		logs:      make([][]decision, len(insts)*spec.workers),
		lastStore: make([]atomic.Int64, len(keys)),
		lastOther: make([]atomic.Int64, len(keys)),
	}
	t.Cleanup(l.finish)
	for w := range l.logs {
		inst := w % len(insts)
		l.wg.Go(func() { l.work(w, inst, spec) })
	}
	return l
}

func (l *load) work(w, inst int, spec loadSpec) {
	lim := l.insts[inst].lim
	log := make([]decision, 0, min(spec.maxOps, 1<<16))
	defer func() { l.logs[w] = log }()
	deadline := l.began.Add(spec.maxTime)
	for n := 0; n < spec.maxOps; n++ {
		select {
		case <-l.stop:
			return
		default:
		}
		began := time.Now()
		if began.After(deadline) {
			return
		}
		k := (n*len(l.logs) + w) % len(l.keys) // every worker visits every key
		r, err := lim.Allow(context.Background(), l.keys[k])
		end := time.Now()
		d := decision{at: int64(began.Sub(l.began)), took: int64(end.Sub(began)), key: uint16(k), inst: uint8(inst),
			src: r.Source, allowed: r.Allowed, err: err != nil}
		if err != nil {
			l.firstErr.CompareAndSwap(nil, err.Error())
		}
		log = append(log, d)
		last := &l.lastOther[k]
		if err == nil && byStore(r.Source) {
			last = &l.lastStore[k]
		}
		storeMax(last, d.at+d.took)
		if spec.pace > 0 {
			time.Sleep(spec.pace)
		}
	}
}

func storeMax(a *atomic.Int64, v int64) {
	for old := a.Load(); v > old && !a.CompareAndSwap(old, v); old = a.Load() {
	}
}

// since returns the time since the load began, in ns: the time base of
// every decision.
func (l *load) since() int64 { return int64(time.Since(l.began)) }

// finish stops the workers and waits for them. It is idempotent.
func (l *load) finish() {
	l.stopOnce.Do(func() { close(l.stop) })
	l.wg.Wait()
	l.finished.Store(true)
}

// all returns every decision. The workers hand their logs over when they
// stop, so it must be called after finish.
func (l *load) all() []decision {
	if !l.finished.Load() {
		panic("load.all before load.finish")
	}
	var all []decision
	for _, lg := range l.logs {
		all = append(all, lg...)
	}
	return all
}

// waitStore waits, at most within, until the decisions on keys have come
// from the store alone for quiet, and returns false if they did not.
func (l *load) waitStore(keys []int, quiet, within time.Duration) bool {
	return eventually(within, 20*time.Millisecond, func() bool {
		ok, now := true, l.since()
		for _, k := range keys {
			other, store := l.lastOther[k].Load(), l.lastStore[k].Load()
			ok = ok && store > other && now-other >= int64(quiet)
		}
		return ok
	})
}

// waitOther waits, at most within, until a decision on one of keys after
// from came from elsewhere than the store.
func (l *load) waitOther(keys []int, from int64, within time.Duration) bool {
	return eventually(within, 5*time.Millisecond, func() bool {
		for _, k := range keys {
			if l.lastOther[k].Load() > from {
				return true
			}
		}
		return false
	})
}

// figures summarises decisions, after finish.
type figures struct {
	decisions, errors      int
	storeAllowed, fallback int
}

func (l *load) figures() figures {
	var f figures
	for _, d := range l.all() {
		f.decisions++
		switch {
		case d.err:
			f.errors++
		case !byStore(d.src):
			f.fallback++
		case d.allowed:
			f.storeAllowed++
		}
	}
	return f
}

// outage returns how long after from (ns since the load began) the callers
// deciding on keys last saw a decision not made by the store, among the
// decisions that began before to: the outage as they saw it, from the fault
// to the end of the last degraded decision. ok is false if every decision
// came from the store.
func (l *load) outage(keys []int, from, to int64) (d time.Duration, ok bool) {
	in := keySet(keys)
	last := int64(-1)
	for _, x := range l.all() {
		if in[x.key] && x.at+x.took >= from && x.at < to && (x.err || !byStore(x.src)) {
			last = max(last, x.at+x.took)
		}
	}
	if last < 0 {
		return 0, false
	}
	return time.Duration(last - from), true
}

// latency returns the 99th percentile and the maximum of the time decisions
// took among those that began in [from, to), and how many there were.
func (l *load) latency(from, to int64) (p99, worst time.Duration, n int) {
	var took []int64
	for _, d := range l.all() {
		if d.at >= from && d.at < to {
			took = append(took, d.took)
		}
	}
	if len(took) == 0 {
		return 0, 0, 0
	}
	slices.Sort(took)
	return time.Duration(took[(len(took)*99)/100]), time.Duration(took[len(took)-1]), len(took)
}

func keySet(keys []int) map[uint16]bool {
	in := make(map[uint16]bool, len(keys))
	for _, k := range keys {
		in[uint16(k)] = true
	}
	return in
}

// checkAdmitted asserts the bound, key by key: the store's admissions within
// capacity × (1 + lost(k)) + rate × elapsed, and each instance's fallback
// within capacity + rate × its own fallback window on the key. It returns
// the total admitted, by everyone, and the sum of the bounds.
func (l *load) checkAdmitted(elapsedMicros int64, lost func(key int) int) (admitted int, bound float64) {
	t := l.t
	t.Helper()
	p := chaosPlan
	elapsed := float64(elapsedMicros) / 1e6
	type fb struct {
		admitted      int
		first, last   int64
		seen          bool
		storeAdmitted int
	}
	per := make([][]fb, len(l.keys)) // [key][inst]; storeAdmitted in [key][0]
	for k := range per {
		per[k] = make([]fb, len(l.insts))
	}
	for _, d := range l.all() {
		if d.err || d.src == tollgate.SourceFailOpen {
			continue
		}
		e := &per[d.key][d.inst]
		if byStore(d.src) {
			if d.allowed {
				per[d.key][0].storeAdmitted++
			}
			continue
		}
		if !e.seen || d.at < e.first { // the workers' logs are not in time order
			e.first, e.seen = d.at, true
		}
		e.last = max(e.last, d.at+d.took)
		if d.allowed {
			e.admitted++
		}
	}
	for k, insts := range per {
		storeBound := float64(p.Capacity*int64(1+lost(k))) + p.Rate*elapsed
		assert.LessOrEqual(t, float64(insts[0].storeAdmitted), storeBound, "key %s: Redis over-admitted", l.keys[k])
		admitted += insts[0].storeAdmitted
		bound += storeBound
		for i, e := range insts {
			if !e.seen {
				continue
			}
			fbBound := float64(p.Capacity) + p.Rate*float64(e.last-e.first)/1e9
			assert.LessOrEqual(t, float64(e.admitted), fbBound, "key %s instance %d: fallback over-admitted", l.keys[k], i)
			admitted += e.admitted
			bound += fbBound
		}
	}
	return admitted, bound
}

// until returns when round i of faults at marks ends: when the next fault
// began, or never.
func until(marks []int64, i int) int64 {
	if i+1 < len(marks) {
		return marks[i+1]
	}
	return math.MaxInt64
}

// indexes returns 0, 1, …, n-1.
func indexes(n int) []int {
	ix := make([]int, n)
	for i := range ix {
		ix[i] = i
	}
	return ix
}
