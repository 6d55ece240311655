package bench

import (
	"context"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sethvargo/go-limiter/memorystore"
	"golang.org/x/time/rate"

	"github.com/tollgate-go/tollgate"
)

// Every limiter gets a bucket that never runs dry during a run, so every
// decision does the full work of an admission.
const (
	burst   = 1 << 30
	perSec  = 1.0
	numKeys = 10_000
)

var keys = func() []string {
	k := make([]string, numKeys)
	for i := range k {
		k[i] = "user-" + strconv.Itoa(i)
	}
	return k
}()

func newTollgate(b *testing.B) *tollgate.Limiter {
	l, err := tollgate.New(tollgate.NewMemoryStore(tollgate.WithMaxKeys(2*numKeys)),
		[]tollgate.Plan{{Name: "p", Capacity: burst, Rate: perSec}})
	if err != nil {
		b.Fatal(err)
	}
	return l
}

// syncMapRate is what people write by hand: x/time/rate limiters per key
// in a sync.Map.
type syncMapRate struct {
	m     sync.Map
	limit rate.Limit
	burst int
}

func (s *syncMapRate) allow(key string) bool {
	v, ok := s.m.Load(key)
	if !ok {
		v, _ = s.m.LoadOrStore(key, rate.NewLimiter(s.limit, s.burst))
	}
	return v.(*rate.Limiter).Allow()
}

func BenchmarkMemoryOneKey(b *testing.B) {
	ctx := context.Background()
	b.Run("tollgate", func(b *testing.B) {
		l := newTollgate(b)
		b.ReportAllocs()
		for b.Loop() {
			_, _ = l.Allow(ctx, "user-1")
		}
	})
	b.Run("x-time-rate", func(b *testing.B) {
		l := rate.NewLimiter(perSec, burst)
		b.ReportAllocs()
		for b.Loop() {
			_ = l.Allow()
		}
	})
	b.Run("go-limiter", func(b *testing.B) {
		s, _ := memorystore.New(&memorystore.Config{Tokens: burst, Interval: time.Hour})
		defer s.Close(ctx)
		b.ReportAllocs()
		for b.Loop() {
			_, _, _, _, _ = s.Take(ctx, "user-1")
		}
	})
}

// BenchmarkMemoryManyKeysParallel decides on 10,000 keys from as many
// goroutines as -cpu gives. In draining, buckets never fill (a burst no
// run reaches, one token a second); in refilling, every key is full again
// by its next visit (10 tokens, 10⁶ a second), as for users under their
// limit.
func BenchmarkMemoryManyKeysParallel(b *testing.B) {
	ctx := context.Background()
	parallel := func(b *testing.B, allow func(key string)) {
		for _, k := range keys { // warm: every key exists
			allow(k)
		}
		var seq atomic.Int64
		b.ReportAllocs()
		b.ResetTimer()
		b.RunParallel(func(pb *testing.PB) {
			i := int(seq.Add(1)) * 7919
			for pb.Next() {
				i++
				allow(keys[i%numKeys])
			}
		})
	}
	for _, c := range []struct {
		name     string
		capacity int64
		rate     float64
		interval time.Duration // go-limiter's: one capacity per interval
	}{
		{"draining", burst, perSec, time.Hour},
		{"refilling", 10, 1e6, 10 * time.Microsecond},
	} {
		b.Run(c.name+"/tollgate", func(b *testing.B) {
			l, err := tollgate.New(tollgate.NewMemoryStore(tollgate.WithMaxKeys(2*numKeys)),
				[]tollgate.Plan{{Name: "p", Capacity: c.capacity, Rate: c.rate}})
			if err != nil {
				b.Fatal(err)
			}
			parallel(b, func(k string) { _, _ = l.Allow(ctx, k) })
		})
		b.Run(c.name+"/x-time-rate-sync-map", func(b *testing.B) {
			s := syncMapRate{limit: rate.Limit(c.rate), burst: int(c.capacity)}
			parallel(b, func(k string) { _ = s.allow(k) })
		})
		b.Run(c.name+"/go-limiter", func(b *testing.B) {
			s, _ := memorystore.New(&memorystore.Config{Tokens: uint64(c.capacity), Interval: c.interval})
			defer s.Close(ctx)
			parallel(b, func(k string) { _, _, _, _, _ = s.Take(ctx, k) })
		})
	}
}
