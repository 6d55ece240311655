package tollgate_test

import (
	"context"
	"fmt"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"

	"github.com/tollgate-go/tollgate"
)

func ExampleLimiter_Allow() {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "api", Capacity: 3, Rate: 1}, // bursts of 3, then 1 a second
	})
	if err != nil {
		panic(err)
	}
	for i := 0; i < 4; i++ {
		res, err := lim.Allow(context.Background(), "user-42")
		if err != nil {
			panic(err)
		}
		fmt.Println(res.Allowed, res.Remaining, res.RetryAfter.Round(100*time.Millisecond))
	}
	// Output:
	// true 2 0s
	// true 1 0s
	// true 0 0s
	// false 0 1s
}

func ExampleLimiter_Allow_chained() {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "burst", Capacity: 10, Rate: 5},
		{Name: "daily", Capacity: 2, Rate: tollgate.Per(2, 24*time.Hour)},
	})
	if err != nil {
		panic(err)
	}
	for i := 0; i < 3; i++ {
		res, err := lim.Allow(context.Background(), "user-42", "burst", "daily")
		if err != nil {
			panic(err)
		}
		fmt.Printf("allowed=%v binding=%s burst=%d daily=%d\n",
			res.Allowed, res.Plan, res.PlanResults()[0].Remaining, res.PlanResults()[1].Remaining)
	}
	// Output:
	// allowed=true binding=daily burst=9 daily=1
	// allowed=true binding=daily burst=8 daily=0
	// allowed=false binding=daily burst=8 daily=0
}

func ExampleNewRedisStore() {
	mr, err := miniredis.Run() // in a service: your Redis
	if err != nil {
		panic(err)
	}
	defer mr.Close()
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer client.Close()

	store := tollgate.NewRedisStore(client)
	lim, err := tollgate.New(store, []tollgate.Plan{{Name: "gold", Capacity: 2, Rate: 1}})
	if err != nil {
		panic(err)
	}
	res, err := lim.Allow(context.Background(), "user:42", "gold")
	if err != nil {
		panic(err)
	}
	fmt.Println(res.Allowed, res.Remaining, res.Source)
	fmt.Println(store.Key("user:42", "gold"))
	// Output:
	// true 1 store
	// tollgate:{user:42}:2:gold
}

func ExampleLimiter_Wait() {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "jobs", Capacity: 1, Rate: 20}})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	start := time.Now()
	for i := 0; i < 3; i++ { // one now, then one every 50ms
		if _, err := lim.Wait(ctx, "worker", 1); err != nil {
			panic(err)
		}
	}
	fmt.Println("waited at least 100ms:", time.Since(start) >= 99*time.Millisecond)
	// Output: waited at least 100ms: true
}

// An LLM call whose cost, in tokens, is known only from the answer:
// reserve the most it may use (max_tokens), then settle what it used.
func ExampleLimiter_Reserve() {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "tpm", Capacity: 10_000, Rate: tollgate.Per(10_000, time.Minute)},
	})
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	const maxTokens = 4_000
	for _, used := range []int64{1_200, 3_900, 2_500, 700} {
		r, err := lim.Reserve(ctx, "team-7", maxTokens, "tpm")
		if err != nil {
			panic(err)
		}
		if !r.OK() {
			fmt.Println("denied; retry after", r.Result().RetryAfter.Round(time.Second))
			continue
		}
		// ... call the model with max_tokens = 4,000; it used `used` ...
		st, err := r.Settle(ctx, used)
		if err != nil {
			panic(err)
		}
		fmt.Println("used", used, "refunded", st.Refunded, "left", st.Remaining)
	}
	// Output:
	// used 1200 refunded 2800 left 8800
	// used 3900 refunded 100 left 4900
	// used 2500 refunded 1500 left 2400
	// denied; retry after 10s
}

func ExampleLimiter_Acquire() {
	// An LLM gateway: each tenant may have 10 requests in flight and
	// 10,000 tokens a minute. A request holds a permit while the model
	// answers, and reserves the most its answer may cost.
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "inflight", Capacity: 10, Concurrency: true},
		{Name: "tpm", Capacity: 10_000, Rate: tollgate.Per(10_000, time.Minute)},
	})
	if err != nil {
		panic(err)
	}
	defer lim.Close()
	ctx := context.Background()
	const maxTokens = 4_000

	// 11 requests arrive at once: 10 get a permit.
	var inFlight []*tollgate.Permit
	for range 11 {
		p, err := lim.Acquire(ctx, "tenant-7", 1, "inflight")
		if err != nil {
			panic(err)
		}
		if !p.OK() {
			fmt.Println("refused: 10 in flight; RetryAfter", p.Result().RetryAfter)
			continue
		}
		inFlight = append(inFlight, p)
	}
	// Each reserves 4,000 tokens: those that get none give their permit
	// back at once.
	type answer struct {
		permit *tollgate.Permit
		tokens *tollgate.Reservation
	}
	var answering []answer
	var wait time.Duration
	for _, p := range inFlight {
		r, err := lim.Reserve(ctx, "tenant-7", maxTokens, "tpm")
		if err != nil {
			panic(err)
		}
		if !r.OK() {
			wait = r.Result().RetryAfter
			if err := p.Release(ctx); err != nil {
				panic(err)
			}
			continue
		}
		answering = append(answering, answer{p, r})
	}
	fmt.Println("tokens for", len(answering), "of", len(inFlight), "- the others retry after", wait.Round(time.Second))
	// The model answers; each settles the tokens it used and releases.
	for i, used := range []int64{1_200, 900} {
		st, err := answering[i].tokens.Settle(ctx, used)
		if err != nil {
			panic(err)
		}
		if err := answering[i].permit.Release(ctx); err != nil {
			panic(err)
		}
		fmt.Println("used", used, "tokens left", st.Remaining)
	}
	inflight, _ := lim.Stats().Plan("inflight")
	fmt.Println("permits held:", inflight.PermitsHeld)
	// Output:
	// refused: 10 in flight; RetryAfter 0s
	// tokens for 2 of 10 - the others retry after 12s
	// used 1200 tokens left 4800
	// used 900 tokens left 7900
	// permits held: 0
}

func ExampleWithPlanResolver() {
	gold := tollgate.Plan{Name: "api", Capacity: 5, Rate: 1}
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "api", Capacity: 2, Rate: 1}},
		tollgate.WithPlanResolver(func(_ context.Context, key string, p tollgate.Plan) (tollgate.Plan, error) {
			switch key { // a real resolver reads the key's tier from a cache
			case "customer-gold":
				return gold, nil // the same name: the same bucket
			case "health-check":
				return tollgate.Plan{}, tollgate.ErrExempt
			}
			return p, nil
		}))
	if err != nil {
		panic(err)
	}
	for _, key := range []string{"customer-free", "customer-gold", "health-check"} {
		res, err := lim.Allow(context.Background(), key)
		if err != nil {
			panic(err)
		}
		fmt.Println(key, res.Allowed, res.Limit, res.Source)
	}
	// Output:
	// customer-free true 2 store
	// customer-gold true 5 store
	// health-check true 2 exempt
}

func ExampleWithShadow() {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{{Name: "api", Capacity: 2, Rate: 0.1}},
		tollgate.WithShadow()) // dry run: decide and drain, never deny
	if err != nil {
		panic(err)
	}
	for i := 0; i < 3; i++ {
		res, err := lim.Allow(context.Background(), "user-42")
		if err != nil {
			panic(err)
		}
		fmt.Println(res.Allowed, res.ShadowDenied)
	}
	fmt.Println("would have denied:", lim.Stats().Plans[0].ShadowDenied)
	// Output:
	// true false
	// true false
	// true true
	// would have denied: 1
}

func ExampleStats_Plan() {
	lim, err := tollgate.New(tollgate.NewMemoryStore(), []tollgate.Plan{
		{Name: "api", Capacity: 2, Rate: 1},
	})
	if err != nil {
		panic(err)
	}
	for i := 0; i < 3; i++ {
		if _, err := lim.Allow(context.Background(), "user-42"); err != nil {
			panic(err)
		}
	}
	api, _ := lim.Stats().Plan("api")
	fmt.Println(api.AllowedTotal(), api.DeniedTotal(), api.DeniedBy(tollgate.SourceStore))
	// Output:
	// 2 1 1
}
