// Command load is a closed-loop load generator: N callers each make one
// decision at a time against one Redis, as fast as it answers, for a fixed
// time. It reports decisions per second and latency percentiles for
// tollgate (its default, batched, and WithoutBatching, on the plain
// go-redis client and on its auto-pipeliner in full duplex; and unbatched
// on the default auto-pipeliner),
// go-redis/redis_rate (plain and on the same full-duplex auto-pipeliner)
// and ulule/limiter, side by side in one run, and Redis memory per bucket
// (on fresh redis-server processes it starts). A PING loop shows the round
// trips the machine allows.
//
// Each concurrency runs for several rounds, the contenders in a rotated
// order each round; it prints the median of the rounds and the median of
// each round's ratio to redis_rate (or -base), since machines drift
// between runs.
//
//	go run ./cmd/load -redis redis://127.0.0.1:6379/0 -duration 5s -callers 1,8,64 -rounds 3
//
// With -instr N, it also counts redis-server's instructions per decision
// in callgrind (valgrind must be on PATH), which timing noise cannot move:
//
//	go run ./cmd/load -callers '' -memkeys 0 -instr 20000 -only tollgate,tollgate-unbatched,redis_rate
//
// The memory measure gives every contender the prefix "m:" in front of
// 16-byte keys; -memdefaults writes each library's own default key scheme
// instead, and -memkeylen picks other key lengths, since Redis allocates
// a key in size classes 16 bytes apart:
//
//	go run ./cmd/load -callers '' -memdefaults -memkeylen 10,16,26,32
//
// With -floor N, it measures the same for scripts that do per key only
// what any decision must (floor.go), in N calls of 32 keys:
//
//	go run ./cmd/load -callers '' -memkeys 0 -floor 2000 -instr 20000 -only tollgate
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"os"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
	ulule "github.com/ulule/limiter/v3"
	ululeredis "github.com/ulule/limiter/v3/drivers/store/redis"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
)

// decider makes one rate-limit decision for key.
type decider func(ctx context.Context, key string) error

type contender struct {
	name string
	// setup returns the decider and a cleanup.
	setup func(opt *redis.Options, prefix string) (decider, func())
}

// A limit no contender reaches during a run, so every decision does the
// full work of an admission: read, refill, write. The refill is slow, one
// token a second, so that a bucket is never full again between visits: a
// fast one would be full, and expired, before the key's next visit, and
// tollgate would create a key where redis_rate updates one (its expiry
// is rounded up to whole seconds). ulule counts a fixed window instead.
const (
	burst  = 1 << 30
	perSec = 1
)

var contenders = []contender{
	{"ping", func(opt *redis.Options, _ string) (decider, func()) {
		c := redis.NewClient(opt)
		return func(ctx context.Context, _ string) error { return c.Ping(ctx).Err() }, func() { _ = c.Close() }
	}},
	{"tollgate", func(opt *redis.Options, prefix string) (decider, func()) {
		c := redis.NewClient(opt)
		return tollgateDecider(c, prefix), func() { _ = c.Close() }
	}},
	{"tollgate-unbatched", func(opt *redis.Options, prefix string) (decider, func()) {
		c := redis.NewClient(opt)
		return tollgateDecider(c, prefix, tollgate.WithoutBatching()), func() { _ = c.Close() }
	}},
	{"tollgate-autopipeline", func(opt *redis.Options, prefix string) (decider, func()) {
		c := redis.NewClient(opt)
		ap, err := c.AutoPipeline()
		if err != nil {
			log.Fatal(err)
		}
		return tollgateDecider(ap, prefix, tollgate.WithoutBatching()), func() { _ = c.Close() }
	}},
	{"tollgate-fullduplex", func(opt *redis.Options, prefix string) (decider, func()) { // never batches: a store cannot tell what an auto-pipeliner sits on
		c := redis.NewClient(opt)
		return tollgateDecider(fullDuplex(c), prefix), func() { _ = c.Close() }
	}},
	{"redis_rate", func(opt *redis.Options, prefix string) (decider, func()) {
		c := redis.NewClient(opt)
		return redisRateDecider(c, prefix), func() { _ = c.Close() }
	}},
	{"redis_rate-fullduplex", func(opt *redis.Options, prefix string) (decider, func()) {
		c := redis.NewClient(opt)
		return redisRateDecider(fullDuplex(c), prefix), func() { _ = c.Close() }
	}},
	{"ulule", func(opt *redis.Options, prefix string) (decider, func()) {
		c := redis.NewClient(opt)
		store, err := ululeredis.NewStoreWithOptions(c, ulule.StoreOptions{Prefix: prefix})
		if err != nil {
			log.Fatal(err)
		}
		l := ulule.New(store, ulule.Rate{Period: time.Second, Limit: burst})
		return func(ctx context.Context, key string) error {
			_, err := l.Get(ctx, key)
			return err
		}, func() { _ = c.Close() }
	}},
}

// fullDuplex returns go-redis's auto-pipeliner on c in full duplex: one
// connection writes while another reads.
func fullDuplex(c *redis.Client) redis.UniversalClient {
	ap, err := c.AutoPipelineWithOptions(&redis.AutoPipelineOptions{FullDuplex: true})
	if err != nil {
		log.Fatal(err)
	}
	return ap
}

func tollgateDecider(c redis.UniversalClient, prefix string, opts ...tollgate.Option) decider {
	l, err := tollgate.New(tollgate.NewRedisStore(c, append([]tollgate.Option{tollgate.WithKeyPrefix(prefix)}, opts...)...),
		[]tollgate.Plan{{Name: "p", Capacity: burst, Rate: perSec}}, tollgate.WithFailurePolicy(breaker.FailClosed))
	if err != nil {
		log.Fatal(err)
	}
	return func(ctx context.Context, key string) error {
		_, err := l.Allow(ctx, key)
		return err
	}
}

// redisRateDecider is go-redis/redis_rate on c, which may be an
// auto-pipeliner: what redis_rate gets from the same transport.
func redisRateDecider(c redis.UniversalClient, prefix string) decider {
	l := redis_rate.NewLimiter(c)
	lim := redis_rate.Limit{Rate: perSec, Burst: burst, Period: time.Second}
	return func(ctx context.Context, key string) error {
		_, err := l.Allow(ctx, prefix+key, lim)
		return err
	}
}

func main() {
	url := flag.String("redis", envOr("REDIS_URL", "redis://127.0.0.1:6379/0"), "Redis URL")
	duration := flag.Duration("duration", 5*time.Second, "how long each contender runs at each concurrency")
	callersFlag := flag.String("callers", "1,8,64", "comma-separated concurrent callers")
	nkeys := flag.Int("keys", 10_000, "distinct keys")
	only := flag.String("only", "", "comma-separated contenders to run (default all)")
	memKeys := flag.Int("memkeys", 100_000, "keys for the memory-per-bucket measure; 0 skips it")
	memKeyLens := flag.String("memkeylen", "16", "comma-separated lengths in bytes of the memory measure's keys")
	memDefaults := flag.Bool("memdefaults", false, "the memory measure writes each contender's default key scheme, not the prefix m:")
	instr := flag.Int("instr", 0, "decisions per contender for the redis-server instructions measure, which needs valgrind; 0 skips it")
	rounds := flag.Int("rounds", 3, "rounds per concurrency; medians are reported")
	pool := flag.Int("pool", 0, "every client's PoolSize; 0 is go-redis's default, 10 per GOMAXPROCS, as README's client has")
	baseName := flag.String("base", "redis_rate", "the contender each round's ratio is to")
	floorN := flag.Int("floor", 0, "calls of the floor scripts (floor.go), 32 keys each, from one serial client, for their Redis CPU per key (and, with -instr, instructions); 0 skips them")
	cpuProfile := flag.String("cpuprofile", "", "write this process's CPU profile (load generator, client and library together) to this file")
	flag.Parse()
	if *cpuProfile != "" {
		stop := startProfile(*cpuProfile)
		defer stop()
	}

	opt, err := redis.ParseURL(*url)
	if err != nil {
		log.Fatal(err)
	}
	opt.PoolSize = *pool
	keys := make([]string, *nkeys)
	for i := range keys {
		keys[i] = "user-" + strconv.Itoa(i)
	}
	info := redis.NewClient(opt) // reads Redis's CPU around each run
	defer info.Close()
	fmt.Printf("%-22s %7s %12s %10s %10s %10s %7s %11s %s\n", "contender", "callers", "decisions/s", "p50", "p99", "p99.9", "errors", "redis-cpu", "× "+*baseName+" (range)")
	var active []contender
	for _, c := range contenders {
		if *only == "" || slices.Contains(strings.Split(*only, ","), c.name) {
			active = append(active, c)
		}
	}
	for _, callers := range intList(*callersFlag) { // -callers '': the measures alone
		results := make([][]result, len(active)) // by contender, then round
		for round := range *rounds {
			for k := range active {
				i := (k + round) % len(active) // rotated, so drift spreads evenly
				c := active[i]
				prefix := fmt.Sprintf("bench-%s-%d-%d:", c.name, callers, time.Now().UnixNano())
				decide, cleanup := c.setup(opt, prefix)
				before := redisCPU(info)
				r := run(decide, keys, callers, *duration)
				r.cpu = (redisCPU(info) - before) / float64(len(r.latencies))
				results[i] = append(results[i], r)
				cleanup()
			}
		}
		base := slices.IndexFunc(active, func(c contender) bool { return c.name == *baseName })
		for i, c := range active {
			r := median(results[i], func(r result) float64 { return r.rate })
			vs := ""
			if base >= 0 {
				ratios := make([]float64, *rounds)
				for k := range ratios {
					ratios[k] = results[i][k].rate / results[base][k].rate
				}
				slices.Sort(ratios)
				vs = fmt.Sprintf("%.2f (%.2f–%.2f)", ratios[len(ratios)/2], ratios[0], ratios[len(ratios)-1])
			}
			q := func(p float64) time.Duration {
				return time.Duration(median(results[i], func(r result) float64 { return float64(r.p(p)) }))
			}
			errs := int64(0)
			for _, r := range results[i] {
				errs += r.errs
			}
			cpu := time.Duration(median(results[i], func(r result) float64 { return r.cpu }) * 1e9).Round(10 * time.Nanosecond)
			fmt.Printf("%-22s %7d %12.0f %10s %10s %10s %7d %11s %s\n", c.name, callers, r, q(0.50), q(0.99), q(0.999), errs, cpu, vs)
		}
	}
	if *floorN > 0 {
		floorCPU(opt, keys, *floorN)
	}
	if *memKeys > 0 {
		memory(*memKeys, intList(*memKeyLens), *memDefaults)
	}
	if *instr > 0 {
		instructions(active, keys, *instr, *pool)
		if *floorN > 0 {
			floorInstructions(keys, *instr)
		}
	}
}

type result struct {
	rate      float64
	latencies []time.Duration
	errs      int64
	cpu       float64 // Redis's CPU (user + system) per decision, in seconds
}

// median returns the median of f over rs.
func median(rs []result, f func(result) float64) float64 {
	v := make([]float64, len(rs))
	for i, r := range rs {
		v[i] = f(r)
	}
	slices.Sort(v)
	return v[len(v)/2]
}

func (r result) p(q float64) time.Duration {
	if len(r.latencies) == 0 {
		return 0
	}
	return r.latencies[int(q*float64(len(r.latencies)-1))].Round(time.Microsecond)
}

// run drives callers goroutines, each one decision at a time, for d.
func run(decide decider, keys []string, callers int, d time.Duration) result {
	ctx := context.Background()
	var (
		mu   sync.Mutex
		all  []time.Duration
		errs atomic.Int64
		seq  atomic.Int64
		wg   sync.WaitGroup
	)
	deadline := time.Now().Add(d)
	start := time.Now()
	for g := 0; g < callers; g++ {
		wg.Go(func() {
			lat := make([]time.Duration, 0, 1<<16)
			i := int(seq.Add(1)) * 7919
			for time.Now().Before(deadline) {
				i++
				t := time.Now()
				if err := decide(ctx, keys[i%len(keys)]); err != nil {
					errs.Add(1)
				}
				lat = append(lat, time.Since(t))
			}
			mu.Lock()
			all = append(all, lat...)
			mu.Unlock()
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	slices.Sort(all)
	return result{rate: float64(len(all)) / elapsed.Seconds(), latencies: all, errs: errs.Load()}
}

// intList parses comma-separated whole numbers; empty fields are skipped.
func intList(s string) []int {
	var out []int
	for _, f := range strings.Split(s, ",") {
		if f == "" {
			continue
		}
		n, err := strconv.Atoi(f)
		if err != nil {
			log.Fatal(err)
		}
		out = append(out, n)
	}
	return out
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}

// startProfile starts a CPU profile written to path and returns what
// stops it.
func startProfile(path string) func() {
	f, err := os.Create(path)
	if err != nil {
		log.Fatal(err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		log.Fatal(err)
	}
	return func() {
		pprof.StopCPUProfile()
		_ = f.Close()
	}
}
