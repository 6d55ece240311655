package breaker_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate/breaker"
)

// A webhook destination fails every call: the shared breaker trips after
// MinCalls calls, refuses without calling it, and lets one probe through
// once OpenFor has passed.
func ExampleShared() {
	mr := miniredis.NewMiniRedis()
	if err := mr.Start(); err != nil {
		panic(err)
	}
	defer mr.Close()
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer client.Close()

	cb, err := breaker.NewShared(client, breaker.SharedSettings{MinCalls: 3, OpenFor: time.Second},
		breaker.WithLogger(nil))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	for i := range 5 {
		ticket, err := cb.Acquire(ctx, "hooks.example.com")
		if errors.Is(err, breaker.ErrOpen) {
			fmt.Printf("call %d: refused, retry after %v\n", i, ticket.RetryAfter.Round(time.Second))
			continue
		}
		fmt.Printf("call %d: sent, failed\n", i)
		_ = ticket.Done(ctx, breaker.Failure)
	}
	snap, _ := cb.Inspect(ctx, "hooks.example.com")
	fmt.Println(snap.State, "after", snap.Trips, "trip")
	// Output:
	// call 0: sent, failed
	// call 1: sent, failed
	// call 2: sent, failed
	// call 3: refused, retry after 1s
	// call 4: refused, retry after 1s
	// open after 1 trip
}
