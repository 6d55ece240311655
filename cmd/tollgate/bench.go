package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"math"
	"math/bits"
	"math/rand/v2"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
)

// benchConfig is what bench runs.
type benchConfig struct {
	duration    time.Duration // how long to run
	concurrency int           // goroutines, each deciding in a closed loop
	keys        int           // distinct keys, picked at random
	plans       []tollgate.Plan
	progress    time.Duration // interval of progress lines
}

// maxBenchWorkers and maxBenchKeys bound bench's -concurrency and -keys:
// each worker holds a connection and a histogram, and each key a string,
// for the whole run.
const (
	maxBenchWorkers = 10_000
	maxBenchKeys    = 10_000_000
)

func runBench(ctx context.Context, args []string, stdout, stderr io.Writer, getenv func(string) string) error {
	fs := newFlagSet("bench", "tollgate bench [-redis URL] [-duration 10s] [-concurrency 8] [-keys 10000] [-plans NAME:CAPACITY:RATE|WINDOW,...] [-progress 1s]", stderr)
	redisURL := fs.String("redis", "", "Redis `URL` (default $REDIS_URL, else "+defaultRedisURL+")")
	var cfg benchConfig
	fs.DurationVar(&cfg.duration, "duration", 10*time.Second, "how long to run")
	fs.IntVar(&cfg.concurrency, "concurrency", 8, "goroutines deciding in a closed loop")
	fs.IntVar(&cfg.keys, "keys", 10_000, "distinct keys, picked at random for each decision")
	plans := fs.String("plans", "bench:10:1", "chained plans as NAME:CAPACITY:RATE (tokens, tokens/s) or NAME:CAPACITY:WINDOW (tokens, a duration such as 1m), comma-separated")
	fs.DurationVar(&cfg.progress, "progress", time.Second, "interval of progress lines")
	if err := parseFlags(fs, args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return usagef("bench takes no arguments, got %q", fs.Arg(0))
	}
	if cfg.duration <= 0 || cfg.concurrency < 1 || cfg.keys < 1 || cfg.progress <= 0 {
		return usagef("-duration and -progress must be positive, -concurrency and -keys at least 1")
	}
	if cfg.concurrency > maxBenchWorkers || cfg.keys > maxBenchKeys {
		return usagef("-concurrency may be at most %d, and -keys at most %d", maxBenchWorkers, maxBenchKeys)
	}
	var err error
	if cfg.plans, err = parsePlans(*plans); err != nil {
		return err
	}
	opts, err := redisOptions(*redisURL, getenv)
	if err != nil {
		return err
	}
	// Every worker holds a connection; more would make them wait in the pool.
	opts.PoolSize = max(opts.PoolSize, cfg.concurrency)
	client := redis.NewClient(opts)
	defer client.Close()
	return bench(ctx, stdout, stderr, client, cfg)
}

// parsePlans parses "NAME:CAPACITY:RATE,..." and checks the plans as New
// does. A RATE with a unit, such as 1m, is a WINDOW: the plan is then a
// sliding window of CAPACITY tokens in any WINDOW.
func parsePlans(s string) ([]tollgate.Plan, error) {
	var plans []tollgate.Plan
	for _, f := range strings.Split(s, ",") {
		parts := strings.Split(f, ":")
		if len(parts) != 3 {
			return nil, usagef("-plans: %q is not NAME:CAPACITY:RATE or NAME:CAPACITY:WINDOW", f)
		}
		capacity, err := strconv.ParseInt(parts[1], 10, 64)
		if err != nil {
			return nil, usagef("-plans: capacity %q is not a whole number", parts[1])
		}
		p := tollgate.Plan{Name: parts[0], Capacity: capacity}
		if p.Rate, err = strconv.ParseFloat(parts[2], 64); err != nil {
			if p.Window, err = time.ParseDuration(parts[2]); err != nil {
				return nil, usagef("-plans: %q is neither a rate (tokens/s) nor a window (such as 1m)", parts[2])
			}
		}
		plans = append(plans, p)
	}
	if _, err := tollgate.New(tollgate.NewMemoryStore(), plans); err != nil {
		return nil, usagef("-plans: %v", libUsageError(err))
	}
	return plans, nil
}

// planSpec writes a plan as parsePlans reads it.
func planSpec(p tollgate.Plan) string {
	if p.Window > 0 {
		return fmt.Sprintf("%s:%d:%v", p.Name, p.Capacity, p.Window)
	}
	return fmt.Sprintf("%s:%d:%g", p.Name, p.Capacity, p.Rate)
}

// benchCounts are the totals shared by the workers and the progress lines.
type benchCounts struct {
	allowed, denied, errors atomic.Int64
	firstErr                atomic.Pointer[string]
}

func (c *benchCounts) decisions() int64 { return c.allowed.Load() + c.denied.Load() }

// bench decides in a closed loop on client for cfg.duration, or until ctx
// ends, printing progress and then a summary to w. Its buckets live under
// a random key prefix, so it touches nothing it did not create, and it
// deletes them at the end.
func bench(ctx context.Context, w, stderr io.Writer, client *redis.Client, cfg benchConfig) error {
	if err := client.Ping(ctx).Err(); err != nil {
		return fmt.Errorf("ping %s: %w", client.Options().Addr, err)
	}
	prefix := fmt.Sprintf("tollgate-bench-%016x", rand.Uint64())
	store := tollgate.NewRedisStore(client, tollgate.WithKeyPrefix(prefix))
	// No denial cache: every decision goes to Redis, which is what the
	// bench measures.
	lim, err := tollgate.New(store, cfg.plans, tollgate.WithFailurePolicy(breaker.FailClosed),
		tollgate.WithDenialCache(0), tollgate.WithLogger(slog.New(slog.NewTextHandler(stderr, nil))))
	if err != nil {
		return err
	}
	names := make([]string, len(cfg.plans))
	specs := make([]string, len(cfg.plans))
	for i, p := range cfg.plans {
		names[i] = p.Name
		specs[i] = planSpec(p)
	}
	keys := make([]string, cfg.keys)
	for i := range keys {
		keys[i] = "key-" + strconv.Itoa(i)
	}
	fmt.Fprintf(w, "bench: %s against %s, %d workers, %d keys, plans %s, FailClosed, key prefix %s\n",
		cfg.duration, client.Options().Addr, cfg.concurrency, cfg.keys, strings.Join(specs, ","), prefix)

	runCtx, cancel := context.WithTimeout(ctx, cfg.duration)
	defer cancel()
	var (
		counts benchCounts
		wg     sync.WaitGroup
		hists  = make([]latencies, cfg.concurrency)
	)
	start := time.Now()
	for i := range cfg.concurrency {
		h := &hists[i]
		wg.Go(func() {
			for runCtx.Err() == nil {
				began := time.Now()
				r, err := lim.Allow(runCtx, keys[rand.IntN(len(keys))], names...)
				took := time.Since(began)
				switch {
				case err != nil && runCtx.Err() != nil:
					return // the run ended during the call
				case err != nil:
					counts.errors.Add(1)
					msg := err.Error() // the library never puts keys in errors
					counts.firstErr.CompareAndSwap(nil, &msg)
					time.Sleep(time.Millisecond) // a dead Redis must not spin the CPU
				case r.Allowed:
					counts.allowed.Add(1)
					h.record(took)
				default:
					counts.denied.Add(1)
					h.record(took)
				}
			}
		})
	}
	progressDone := make(chan struct{})
	go func() {
		defer close(progressDone)
		progress(runCtx, w, &counts, start, cfg.progress)
	}()
	wg.Wait()
	elapsed := time.Since(start)
	cancel()
	<-progressDone

	var all latencies
	for i := range hists {
		all.merge(&hists[i])
	}
	total := counts.decisions()
	fmt.Fprintf(w, "total     %d decisions in %s: %.0f decisions/s\n", total, elapsed.Round(time.Millisecond), float64(total)/elapsed.Seconds())
	fmt.Fprintf(w, "allowed   %d (%s)\n", counts.allowed.Load(), percent(counts.allowed.Load(), total))
	fmt.Fprintf(w, "denied    %d (%s)\n", counts.denied.Load(), percent(counts.denied.Load(), total))
	fmt.Fprintf(w, "errors    %d\n", counts.errors.Load())
	if first := counts.firstErr.Load(); first != nil {
		fmt.Fprintf(w, "first error: %s\n", *first)
	}
	if all.n > 0 {
		fmt.Fprintf(w, "latency   p50 %s  p99 %s  p99.9 %s  max %s (decisions without error, within 3%%)\n",
			all.quantile(0.5), all.quantile(0.99), all.quantile(0.999), all.max.Round(time.Microsecond))
	}

	// Delete the buckets, even after Ctrl-C: only keys under the random
	// prefix, which nothing else uses. They would expire by TTL anyway.
	cleanCtx, cancelClean := context.WithTimeout(context.WithoutCancel(ctx), 30*time.Second)
	defer cancelClean()
	deleted, err := deleteBuckets(cleanCtx, client, store, keys, names)
	if err != nil {
		fmt.Fprintf(stderr, "tollgate: cleanup: %v; the bench's buckets expire by TTL within %s\n", err, maxRefill(cfg.plans))
	} else {
		fmt.Fprintf(w, "cleanup   deleted %d buckets under prefix %s\n", deleted, prefix)
	}
	if n := counts.errors.Load(); n > 0 {
		return fmt.Errorf("%d decisions failed (the first error is above)", n)
	}
	return nil
}

// progress prints one line every interval until ctx ends.
func progress(ctx context.Context, w io.Writer, counts *benchCounts, start time.Time, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	var lastN, lastErrs int64
	last := start
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			n, errs := counts.decisions(), counts.errors.Load()
			fmt.Fprintf(w, "%7s  %8.0f decisions/s  %6d errors\n",
				now.Sub(start).Round(100*time.Millisecond), float64(n-lastN)/now.Sub(last).Seconds(), errs-lastErrs)
			lastN, lastErrs, last = n, errs, now
		}
	}
}

func percent(n, total int64) string {
	if total == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(n)/float64(total))
}

// maxRefill returns the longest time a bucket of plans takes to refill,
// or a window to empty, which bounds its TTL.
func maxRefill(plans []tollgate.Plan) time.Duration {
	var d time.Duration
	for _, p := range plans {
		if p.Window > 0 { // and up to one sub-window more
			d = max(d, 2*p.Window)
			continue
		}
		d = max(d, time.Duration(float64(p.Capacity)/p.Rate*float64(time.Second)))
	}
	return d.Round(time.Second)
}

// deleteBuckets deletes every bucket the bench may have written, in
// batches, and returns how many existed.
func deleteBuckets(ctx context.Context, c *redis.Client, store *tollgate.RedisStore, keys, plans []string) (int64, error) {
	const batch = 1000
	var deleted int64
	rks := make([]string, 0, batch)
	flush := func() error {
		if len(rks) == 0 {
			return nil
		}
		n, err := c.Del(ctx, rks...).Result()
		deleted += n
		rks = rks[:0]
		return err
	}
	for _, k := range keys {
		for _, p := range plans {
			rks = append(rks, store.Key(k, p))
			if len(rks) == batch {
				if err := flush(); err != nil {
					return deleted, err
				}
			}
		}
	}
	return deleted, flush()
}

// latencies counts durations in buckets 1/32 of a power of two wide, so a
// quantile is within about 3% and a run of any length needs 16 KiB per
// worker. The zero value is empty. It is not safe for concurrent use.
type latencies struct {
	counts [64 * subBuckets]int64
	n      int64
	max    time.Duration
}

const (
	subBits    = 5
	subBuckets = 1 << subBits // buckets per power of two
)

// bucketOf returns the bucket of ns nanoseconds: below 2·subBuckets one per
// nanosecond, then subBuckets per power of two.
func bucketOf(ns int64) int {
	v := uint64(max(ns, 0))
	if v < 2*subBuckets {
		return int(v)
	}
	e := bits.Len64(v) - subBits - 1 // v>>e is in [subBuckets, 2·subBuckets)
	return e*subBuckets + int(v>>e)
}

// upperOf returns the largest duration in bucket i, in nanoseconds.
func upperOf(i int) int64 {
	e := max(i/subBuckets-1, 0)
	m := int64(i - e*subBuckets)
	return (m+1)<<e - 1
}

func (l *latencies) record(d time.Duration) {
	l.counts[bucketOf(int64(d))]++
	l.n++
	l.max = max(l.max, d)
}

func (l *latencies) merge(o *latencies) {
	for i, c := range o.counts {
		l.counts[i] += c
	}
	l.n += o.n
	l.max = max(l.max, o.max)
}

// quantile returns the q-quantile (0 < q ≤ 1) as the upper end of its
// bucket, and never more than the largest duration recorded; 0 if empty.
func (l *latencies) quantile(q float64) time.Duration {
	rank := max(int64(math.Ceil(q*float64(l.n))), 1)
	var seen int64
	for i, c := range l.counts {
		seen += c
		if seen >= rank {
			return min(time.Duration(upperOf(i)), l.max).Round(time.Microsecond)
		}
	}
	return 0
}
