package main

import (
	"context"
	"fmt"
	"log"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/go-redis/redis_rate/v10"
	"github.com/redis/go-redis/v9"
	ulule "github.com/ulule/limiter/v3"
	ululeredis "github.com/ulule/limiter/v3/drivers/store/redis"

	"github.com/tollgate-go/tollgate"
)

// memory measures the growth of Redis used_memory per bucket, over n
// distinct keys of each length in keyLens (bytes of the caller's key),
// each decided twice a little apart so that the stored state holds a
// fractional refill. The plan (a burst of 100, one token per 1000 s) keeps
// every bucket alive through the measure. Each contender gets a fresh
// redis-server of its own, so that no other data and no earlier resize of
// Redis's tables skews the growth. With defaults, each contender writes
// its own default key scheme (tollgate's prefix "tollgate", redis_rate's
// "rate:", ulule's "limiter"); otherwise each is given the prefix "m:".
func memory(n int, keyLens []int, defaults bool) {
	ctx := context.Background()
	prefix := "m:"
	if defaults {
		prefix = ""
	}
	fmt.Printf("\n%-22s %7s %s\n", "contender", "key len", "bytes of used_memory per bucket (prefix "+strconv.Quote(prefix)+")")
	for _, keyLen := range keyLens {
		for _, ct := range []struct {
			name  string
			setup func(c *redis.Client, prefix string) decider
		}{
			{"tollgate", func(c *redis.Client, prefix string) decider {
				var opts []tollgate.Option
				if prefix != "" {
					opts = append(opts, tollgate.WithKeyPrefix(prefix))
				}
				l, err := tollgate.New(tollgate.NewRedisStore(c, opts...),
					[]tollgate.Plan{{Name: "p", Capacity: 100, Rate: 0.001}})
				if err != nil {
					log.Fatal(err)
				}
				return func(ctx context.Context, key string) error { _, err := l.Allow(ctx, key); return err }
			}},
			{"redis_rate", func(c *redis.Client, prefix string) decider {
				l := redis_rate.NewLimiter(c)
				lim := redis_rate.Limit{Rate: 1, Burst: 100, Period: 1000 * time.Second}
				return func(ctx context.Context, key string) error { _, err := l.Allow(ctx, prefix+key, lim); return err }
			}},
			{"ulule", func(c *redis.Client, prefix string) decider {
				if prefix == "" {
					prefix = ulule.DefaultPrefix
				}
				store, err := ululeredis.NewStoreWithOptions(c, ulule.StoreOptions{Prefix: prefix})
				if err != nil {
					log.Fatal(err)
				}
				l := ulule.New(store, ulule.Rate{Period: 1000 * time.Second, Limit: 100})
				return func(ctx context.Context, key string) error { _, err := l.Get(ctx, key); return err }
			}},
		} {
			fmt.Printf("%-22s %7d %.1f\n", ct.name, keyLen, memoryPerBucket(ctx, n, keyLen, func(c *redis.Client) decider { return ct.setup(c, prefix) }))
		}
	}
}

// memoryPerBucket returns the growth of used_memory per bucket on a fresh
// redis-server when the decider setup makes decides twice on each of n
// keys of keyLen bytes ("user-" and a zero-padded number).
func memoryPerBucket(ctx context.Context, n, keyLen int, setup func(*redis.Client) decider) float64 {
	width := keyLen - len("user-")
	if len(strconv.Itoa(n-1)) > width {
		log.Fatalf("%d keys do not fit in %d bytes", n, keyLen)
	}
	c, _, stop := freshRedis()
	defer stop()
	decide := setup(c)
	before := usedMemory(ctx, c)
	for pass := 0; pass < 2; pass++ {
		var wg sync.WaitGroup
		var seq atomic.Int64
		for g := 0; g < 32; g++ {
			wg.Go(func() {
				for i := seq.Add(1) - 1; i < int64(n); i = seq.Add(1) - 1 {
					if err := decide(ctx, fmt.Sprintf("user-%0*d", width, i)); err != nil {
						log.Fatal(err)
					}
				}
			})
		}
		wg.Wait()
	}
	return float64(usedMemory(ctx, c)-before) / float64(n)
}
