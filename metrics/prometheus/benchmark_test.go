package tgprom_test

import (
	"context"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/tollgate-go/tollgate"
	tgprom "github.com/tollgate-go/tollgate/metrics/prometheus"
)

// BenchmarkObserver measures what the adapter adds to a decision: Allow on
// a MemoryStore with no Observer, with tollgate.NopObserver (what the
// Limiter itself spends, timing the store call) and with this adapter.
func BenchmarkObserver(b *testing.B) {
	ctx := context.Background()
	plan := []tollgate.Plan{{Name: "p", Capacity: 1 << 30, Rate: 1}} // never runs dry
	newLimiter := func(b *testing.B, mode string) *tollgate.Limiter {
		opts := []tollgate.Option{tollgate.WithLogger(nil)}
		switch mode {
		case "nop":
			opts = append(opts, tollgate.WithObserver(tollgate.NopObserver{}))
		case "prometheus":
			obs, err := tgprom.New(prometheus.NewRegistry())
			if err != nil {
				b.Fatal(err)
			}
			opts = append(opts, tollgate.WithObserver(obs))
		}
		l, err := tollgate.New(tollgate.NewMemoryStore(), plan, opts...)
		if err != nil {
			b.Fatal(err)
		}
		return l
	}
	for _, mode := range []string{"none", "nop", "prometheus"} {
		b.Run("serial/"+mode, func(b *testing.B) {
			l := newLimiter(b, mode)
			b.ReportAllocs()
			for b.Loop() {
				_, _ = l.Allow(ctx, "user-1")
			}
		})
		b.Run("parallel/"+mode, func(b *testing.B) {
			l := newLimiter(b, mode)
			keys := []string{"user-1", "user-2", "user-3", "user-4", "user-5", "user-6", "user-7", "user-8"}
			b.ReportAllocs()
			b.RunParallel(func(pb *testing.PB) {
				for i := 0; pb.Next(); i++ {
					_, _ = l.Allow(ctx, keys[i%len(keys)])
				}
			})
		})
	}
}
