package bench

import (
	"context"
	"slices"
	"sync"
	"testing"
	"time"

	"golang.org/x/time/rate"

	"github.com/tollgate-go/tollgate"
)

// roundDecisions is how many decisions each goroutine makes in one round
// of BenchmarkMemoryRatio: about a millisecond, against some microseconds
// to start and end a round.
const roundDecisions = 10_000

// BenchmarkMemoryRatio decides in short rounds that alternate between
// tollgate's MemoryStore and x/time/rate limiters in a sync.Map, ABBA, so
// that both see the same machine: on a shared machine, whose other load
// comes and goes within a second, separate benchmarks of a second each
// do not. It reports tollgate's ns/op and x/time/rate's (xrate-ns/op),
// each the total over its rounds, and the median of the per-round ratios
// of tollgate's time to x/time/rate's, with the 10th and 90th
// percentiles. The cases are BenchmarkMemoryOneKey's, against one
// x/time/rate limiter, and BenchmarkMemoryManyKeysParallel's, from 2
// goroutines.
func BenchmarkMemoryRatio(b *testing.B) {
	ctx := context.Background()
	for _, c := range []struct {
		name       string
		goroutines int
		capacity   int64
		rate       float64
		keys       []string
	}{
		{"one-key", 1, burst, perSec, keys[1:2]},
		{"draining", 2, burst, perSec, keys},
		{"refilling", 2, 10, 1e6, keys},
	} {
		b.Run(c.name, func(b *testing.B) {
			l, err := tollgate.New(tollgate.NewMemoryStore(tollgate.WithMaxKeys(2*numKeys)),
				[]tollgate.Plan{{Name: "p", Capacity: c.capacity, Rate: c.rate}})
			if err != nil {
				b.Fatal(err)
			}
			s := syncMapRate{limit: rate.Limit(c.rate), burst: int(c.capacity)}
			sides := [2]func(string){
				func(k string) { _, _ = l.Allow(ctx, k) },
				func(k string) { _ = s.allow(k) },
			}
			if len(c.keys) == 1 {
				one := rate.NewLimiter(rate.Limit(c.rate), int(c.capacity))
				sides[1] = func(string) { _ = one.Allow() }
			}
			for _, k := range c.keys { // warm: every key exists
				sides[0](k)
				sides[1](k)
			}
			alternate(b, c.goroutines, c.keys, sides)
		})
	}
}

// alternate runs rounds of decisions by sides[0] and sides[1] on keys
// from n goroutines at once, until each side has made b.N, and reports
// them as BenchmarkMemoryRatio says.
func alternate(b *testing.B, n int, keys []string, sides [2]func(string)) {
	start := make([]chan int, n)
	var done sync.WaitGroup
	for g := range start {
		start[g] = make(chan int)
		go func() {
			i := (g + 1) * 7919
			for side := range start[g] {
				for range roundDecisions {
					i++
					sides[side](keys[i%len(keys)])
				}
				done.Done()
			}
		}()
	}
	round := func(side int) time.Duration {
		t := time.Now()
		done.Add(n)
		for _, s := range start {
			s <- side
		}
		done.Wait()
		return time.Since(t)
	}
	var total [2]time.Duration
	var ratios []float64
	b.ResetTimer()
	for r := 0; r*roundDecisions*n < b.N; r++ {
		var d [2]time.Duration
		first := r % 2 // ABBA: which side goes first alternates
		d[first] = round(first)
		d[1-first] = round(1 - first)
		total[0], total[1] = total[0]+d[0], total[1]+d[1]
		ratios = append(ratios, float64(d[0])/float64(d[1]))
	}
	b.StopTimer()
	for _, s := range start {
		close(s)
	}
	ops := float64(len(ratios) * roundDecisions * n)
	slices.Sort(ratios)
	b.ReportMetric(float64(total[0])/ops, "ns/op")
	b.ReportMetric(float64(total[1])/ops, "xrate-ns/op")
	b.ReportMetric(ratios[len(ratios)/2], "ratio")
	b.ReportMetric(ratios[len(ratios)/10], "ratio-p10")
	b.ReportMetric(ratios[len(ratios)*9/10], "ratio-p90")
}
