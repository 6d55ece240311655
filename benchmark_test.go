package tollgate

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// benchPlan never runs dry, so every decision does the full work of an
// admission.
var benchPlan = []Plan{{Name: "p", Capacity: 1 << 30, Rate: 1}}

func benchKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = "user-" + strconv.Itoa(i)
	}
	return keys
}

func BenchmarkLimiterAllow(b *testing.B) {
	ctx := context.Background()
	b.Run("memory/one-key", func(b *testing.B) {
		l, _ := New(NewMemoryStore(), benchPlan)
		b.ReportAllocs()
		for b.Loop() {
			_, _ = l.Allow(ctx, "user-1")
		}
	})
	b.Run("memory/many-keys-parallel", func(b *testing.B) {
		l, _ := New(NewMemoryStore(), benchPlan)
		allowParallel(b, l)
	})
	b.Run("memory/chained", func(b *testing.B) {
		l, _ := New(NewMemoryStore(), []Plan{benchPlan[0], {Name: "q", Capacity: 1 << 30, Rate: 1}})
		b.ReportAllocs()
		for b.Loop() {
			_, _ = l.Allow(ctx, "user-1", "p", "q")
		}
	})
	b.Run("fallback-breaker-open", func(b *testing.B) {
		f := newFlakyStore()
		f.fail(context.DeadlineExceeded)
		l, _ := New(f, benchPlan, WithLogger(nil))
		for i := 0; i < 3; i++ {
			_, _ = l.Allow(ctx, "user-1")
		}
		b.ReportAllocs()
		for b.Loop() {
			_, _ = l.Allow(ctx, "user-1")
		}
	})
	b.Run("redis/client-only", func(b *testing.B) {
		// The client's work alone: a hook answers every command with a
		// canned reply, so no byte reaches a network.
		c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
		defer c.Close()
		c.AddHook(cannedReply{[]any{int64(1), int64(1 << 50), int64(1 << 40), int64(1 << 50)}})
		l, _ := New(NewRedisStore(c), benchPlan)
		allowParallel(b, l)
	})
	b.Run("redis/parallel", func(b *testing.B) {
		c := redis.NewClient(&redis.Options{Addr: redistest.Addr(b), PoolSize: 64})
		defer c.Close()
		l, _ := New(NewRedisStore(c, WithKeyPrefix(testPrefix(b))), benchPlan)
		b.SetParallelism(32)
		allowParallel(b, l)
	})
}

// allowParallel runs Allow from parallel goroutines over 10,000 keys, each
// goroutine starting at a key of its own, and fails on any error.
func allowParallel(b *testing.B, l *Limiter) {
	ctx := context.Background()
	keys := benchKeys(10_000)
	var next atomic.Int64
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		i := int(next.Add(1)) * 7919
		for pb.Next() {
			i++
			if _, err := l.Allow(ctx, keys[i%len(keys)]); err != nil {
				b.Error(err)
				return
			}
		}
	})
}

// cannedReply is a go-redis hook that answers every command with reply.
type cannedReply struct{ reply []any }

func (h cannedReply) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h cannedReply) ProcessHook(redis.ProcessHook) redis.ProcessHook {
	return func(_ context.Context, cmd redis.Cmder) error {
		cmd.(*redis.Cmd).SetVal(h.reply)
		return nil
	}
}

func (h cannedReply) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}
