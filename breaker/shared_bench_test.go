package breaker

import (
	"context"
	"testing"
	"time"
)

// BenchmarkShared measures a call's breaker work on a real Redis: Acquire
// and Done on a closed breaker without and with the closed cache, Acquire
// on an open one, and the script's round trip alone. It reports round
// trips per call.
func BenchmarkShared(b *testing.B) {
	c, prefix := realRedis(b)
	addr := c.Options().Addr
	run := func(b *testing.B, set SharedSettings, key string, setup func(*Shared), op func(*Shared) error) {
		s := fleet(b, addr, prefix, 1, set)[0]
		if setup != nil {
			setup(s)
		}
		before := s.Stats().RoundTrips
		b.ReportAllocs()
		b.ResetTimer()
		for b.Loop() {
			if err := op(s); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(s.Stats().RoundTrips-before)/float64(b.N), "trips/op")
	}
	ctx := context.Background()
	acquireDone := func(key string) func(*Shared) error {
		return func(s *Shared) error {
			tk, err := s.Acquire(ctx, key)
			if err != nil {
				return err
			}
			return tk.Done(ctx, Success)
		}
	}
	b.Run("closed", func(b *testing.B) {
		run(b, SharedSettings{}, "closed", nil, acquireDone("closed"))
	})
	b.Run("closed-cached", func(b *testing.B) {
		run(b, SharedSettings{CacheClosedFor: 50 * time.Millisecond}, "cached", nil, acquireDone("cached"))
	})
	b.Run("open", func(b *testing.B) {
		run(b, SharedSettings{OpenFor: time.Hour}, "open", func(s *Shared) {
			if err := s.ForceOpen(ctx, "open"); err != nil {
				b.Fatal(err)
			}
			_, _ = s.Acquire(ctx, "open")
		}, func(s *Shared) error {
			if _, err := s.Acquire(ctx, "open"); err != ErrOpen {
				return err
			}
			return nil
		})
	})
	b.Run("script", func(b *testing.B) {
		s := fleet(b, addr, prefix, 1, SharedSettings{})[0]
		keys := []string{s.Key("script")}
		args := append([]any{opAcquire, 1, 0, 0, 0, 0, 0, 0}, s.p.args()...)
		b.ReportAllocs()
		for b.Loop() {
			if _, err := script.Run(ctx, c, keys, args...); err != nil {
				b.Fatal(err)
			}
		}
	})
}
