// Command webhook is a webhook dispatcher: every destination has a
// rate limit and a circuit breaker shared by all instances through Redis,
// and deliveries are paced with Wait rather than dropped.
//
// Two destinations get 40 deliveries each. hooks.good.example answers;
// hooks.down.example fails every call, so its breaker trips after
// MinCalls calls and later deliveries are held back without calling it,
// until a probe is allowed after OpenFor.
//
// It uses the Redis at REDIS_URL (for example redis://localhost:6379/0) and,
// when none is given, an embedded miniredis, so it runs anywhere:
//
//	go run ./examples/webhook
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
)

func main() {
	client, cleanup, err := redisClient()
	if err != nil {
		log.Fatal(err)
	}
	defer cleanup()

	// 20 deliveries a second per destination, bursts of 5.
	lim, err := tollgate.New(tollgate.NewRedisStore(client, tollgate.WithKeyPrefix("webhook-example")),
		[]tollgate.Plan{{Name: "per-destination", Capacity: 5, Rate: 20}})
	if err != nil {
		log.Fatal(err)
	}
	// Trip when half of at least 10 calls in 10 s fail; probe after 1 s.
	cb, err := breaker.NewShared(client, breaker.SharedSettings{MinCalls: 10, FailureRate: 0.5, OpenFor: time.Second},
		breaker.WithPrefix("webhook-example"), breaker.WithLogKeys(true)) // host names are not personal data
	if err != nil {
		log.Fatal(err)
	}
	ctx := context.Background()
	for _, dest := range []string{"hooks.good.example", "hooks.down.example"} {
		if err := cb.Reset(ctx, dest); err != nil { // start each run closed
			log.Fatal(err)
		}
		if err := lim.Reset(ctx, dest); err != nil {
			log.Fatal(err)
		}
	}

	for _, dest := range []string{"hooks.good.example", "hooks.down.example"} {
		var sent, failed, held int
		for range 40 {
			switch err := deliver(ctx, lim, cb, dest); {
			case err == nil:
				sent++
			case errors.Is(err, breaker.ErrOpen):
				held++ // requeue it for later in a real dispatcher
			default:
				failed++
			}
		}
		st, err := cb.Inspect(ctx, dest)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Printf("%-19s sent %2d  failed %2d  held back %2d  breaker %s (trips %d)\n",
			dest, sent, failed, held, st.State, st.Trips)
	}
}

// deliver sends one webhook to dest: it waits for the rate limit, asks the
// breaker, calls the destination and reports the outcome.
func deliver(ctx context.Context, lim *tollgate.Limiter, cb *breaker.Shared, dest string) error {
	if _, err := lim.Wait(ctx, dest, 1); err != nil {
		return err
	}
	ticket, err := cb.Acquire(ctx, dest)
	if err != nil {
		return err // breaker.ErrOpen: ticket.RetryAfter says when to try again
	}
	callCtx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	err = post(callCtx, dest)
	outcome := breaker.Success
	switch {
	case errors.Is(err, context.Canceled):
		outcome = breaker.Ignore // our own doing: says nothing of dest
	case err != nil:
		outcome = breaker.Failure
	}
	if derr := ticket.Done(ctx, outcome); derr != nil && !errors.Is(derr, breaker.ErrStale) {
		return derr
	}
	return err
}

// post stands for the HTTP POST to the destination.
func post(ctx context.Context, dest string) error {
	if dest == "hooks.down.example" {
		return errors.New("503 Service Unavailable")
	}
	return ctx.Err()
}

// redisClient returns a client of REDIS_URL, or of an embedded miniredis.
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
