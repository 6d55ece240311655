// Command service shows tollgate in service code: two API keys share the
// chained plans "burst" and "daily", and one of them runs out.
//
// It uses the Redis at REDIS_URL (for example redis://localhost:6379/0) and,
// when none is given, an embedded miniredis, so it runs anywhere:
//
//	go run ./examples/service
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate"
)

func main() {
	client, cleanup, err := redisClient()
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()

	lim, err := tollgate.New(tollgate.NewRedisStore(client, tollgate.WithKeyPrefix("example")), []tollgate.Plan{
		{Name: "burst", Capacity: 5, Rate: 2},                             // 5 at once, then 2 a second
		{Name: "daily", Capacity: 7, Rate: tollgate.Per(7, 24*time.Hour)}, // 7 a day
	})
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	// One real decision at startup: a wrong password or an ACL without
	// EVALSHA fails here, not as a silent fallback for ever.
	checkCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := lim.Check(checkCtx); err != nil {
		log.Fatal(err)
	}
	for _, key := range []string{"api-key-alice", "api-key-bob"} {
		if err := lim.Reset(ctx, key); err != nil { // start each run with full buckets
			log.Fatal(err)
		}
	}

	// Alice sends a burst of 7, waits 1.5 s for the burst plan to refill,
	// then tries 3 more: the daily plan stops her. Bob is not affected.
	handle := func(key string) {
		res, err := lim.Allow(ctx, key, "burst", "daily")
		if err != nil {
			log.Fatal(err)
		}
		if res.Allowed {
			fmt.Printf("%-14s allowed  %d left in %q\n", key, res.Remaining, res.Plan)
			return
		}
		fmt.Printf("%-14s DENIED   by %q, retry in %s\n", key, res.Plan, res.RetryAfter.Round(time.Millisecond))
	}
	for i := 0; i < 7; i++ {
		handle("api-key-alice")
	}
	handle("api-key-bob")
	time.Sleep(1500 * time.Millisecond)
	for i := 0; i < 3; i++ {
		handle("api-key-alice")
	}
}

// redisClient connects to REDIS_URL, or starts an embedded miniredis.
func redisClient() (redis.UniversalClient, func(), error) {
	if url := os.Getenv("REDIS_URL"); url != "" {
		opt, err := redis.ParseURL(url)
		if err != nil {
			return nil, nil, err
		}
		c := redis.NewClient(opt)
		fmt.Println("using Redis at", opt.Addr)
		return c, func() { _ = c.Close() }, nil
	}
	mr, err := miniredis.Run()
	if err != nil {
		return nil, nil, err
	}
	fmt.Println("REDIS_URL not set: using an embedded miniredis")
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	return c, func() { _ = c.Close(); mr.Close() }, nil
}
