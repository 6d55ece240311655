package tollgate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/bucketvalue"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// llm is a plan of 1,000 tokens a minute, like an LLM's tokens per
// minute; slow enough that a test's own run time refills nothing that
// matters.
var llm = Plan{Name: "tpm", Capacity: 1000, Rate: Per(1000, time.Minute)}

// clockedLimiter is a Limiter on a store whose clock the test moves.
type clockedLimiter struct {
	*Limiter
	advance func(time.Duration)   // moves the store's clock, and Redis's TTLs
	mr      *miniredis.Miniredis  // nil for the MemoryStore
	rs      *RedisStore           // nil for the MemoryStore
	client  redis.UniversalClient // nil for the MemoryStore
}

// eachStore runs f on a Limiter over a MemoryStore and over a RedisStore on
// miniredis, both on a clock the test moves, from t0.
func eachStore(t *testing.T, plans []Plan, f func(t *testing.T, l clockedLimiter), opts ...Option) {
	t.Run("memory", func(t *testing.T) {
		now := t0
		l, err := New(newClockedMemoryStore(&now), plans, opts...)
		require.NoError(t, err)
		f(t, clockedLimiter{Limiter: l, advance: func(d time.Duration) { now += d.Microseconds() }})
	})
	t.Run("redis", func(t *testing.T) {
		rs, mr, setTime := newMiniredisStore(t)
		now := t0
		l, err := New(rs, plans, append([]Option{WithLogger(nil)}, opts...)...)
		require.NoError(t, err)
		f(t, clockedLimiter{Limiter: l, mr: mr, rs: rs, client: rs.client, advance: func(d time.Duration) {
			now += d.Microseconds()
			setTime(now)
			mr.FastForward(d)
		}})
	})
}

func TestReserveSettle(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{llm}, func(t *testing.T, l clockedLimiter) {
		r, err := l.Reserve(ctx, "k", 800)
		require.NoError(t, err)
		require.True(t, r.OK())
		assert.Equal(t, int64(200), r.Result().Remaining, "Reserve takes n now, as AllowN does")

		st, err := r.Settle(ctx, 300)
		require.NoError(t, err)
		assert.Equal(t, int64(500), st.Refunded)
		assert.Equal(t, int64(700), st.Remaining, "the unused 500 came back")
		assert.True(t, st.Allowed)

		again, err := r.Settle(ctx, 0)
		require.ErrorIs(t, err, ErrNotHeld)
		assert.Zero(t, again.Refunded)
		peek, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, int64(700), peek.Remaining, "a second Settle refunds nothing")
	})
}

func TestSettleRefundCapsAtCapacity(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{llm}, func(t *testing.T, l clockedLimiter) {
		r, err := l.Reserve(ctx, "k", 600)
		require.NoError(t, err)
		l.advance(30 * time.Second) // 500 tokens refill
		st, err := r.Cancel(ctx)
		require.NoError(t, err)
		assert.Equal(t, int64(600), st.Refunded)
		assert.Equal(t, int64(1000), st.Remaining, "full, not 1,500: a refund never mints")
	})
}

func TestSettleOverchargeIsDebt(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{llm}, func(t *testing.T, l clockedLimiter) {
		r, err := l.Reserve(ctx, "k", 400)
		require.NoError(t, err)
		st, err := r.Settle(ctx, 1300) // 900 beyond the reservation, 600 there
		require.NoError(t, err)
		assert.Equal(t, int64(900), st.Charged)
		assert.Zero(t, st.Uncharged)
		assert.Equal(t, int64(0), st.Remaining)
		assert.False(t, st.Allowed)
		// 300 tokens of debt, then 1 token: 301 tokens at 1,000 a minute.
		assert.Equal(t, 18_060*time.Millisecond, st.RetryAfter)

		l.advance(18_059 * time.Millisecond)
		res, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.False(t, res.Allowed, "still in debt")
		l.advance(time.Millisecond)
		res, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.True(t, res.Allowed, "the same request passes at RetryAfter")
	}, WithDenialCache(0)) // its clock is the Limiter's, which the test does not move
}

func TestSettleDebtIsCapped(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{llm}, func(t *testing.T, l clockedLimiter) {
		r, err := l.Reserve(ctx, "k", 1000)
		require.NoError(t, err)
		st, err := r.Settle(ctx, 2500) // 1,500 of debt: one capacity fits
		require.NoError(t, err)
		assert.Equal(t, int64(1500), st.Charged)
		assert.Equal(t, int64(500), st.Uncharged)
		assert.Equal(t, uint64(500), l.Stats().Reservations.Uncharged)
		// One capacity of debt, then a token; the debt's stamp is rounded
		// down to whole µs.
		assert.InDelta(t, time.Minute+60*time.Millisecond, st.RetryAfter, float64(time.Microsecond))
	})
}

// TestDebtOutlivesItsTTL checks that a bucket in debt never reads as full
// by expiring early: its TTL counts the debt too.
func TestDebtOutlivesItsTTL(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{llm}, func(t *testing.T, l clockedLimiter) {
		r, err := l.Reserve(ctx, "k", 1000)
		require.NoError(t, err)
		_, err = r.Settle(ctx, 2000) // a minute of debt, then a minute to fill
		require.NoError(t, err)
		for _, step := range []time.Duration{59 * time.Second, time.Second, 59 * time.Second} {
			l.advance(step)
			p, err := l.Peek(ctx, "k")
			require.NoError(t, err)
			assert.Less(t, p.Remaining, int64(1000), "read as full %v early", 2*time.Minute-step)
		}
		l.advance(time.Second)
		p, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, int64(1000), p.Remaining)
	})
}

func TestSettleAfterTheHoldExpired(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{llm}, func(t *testing.T, l clockedLimiter) {
		refund, err := l.Reserve(ctx, "a", 600)
		require.NoError(t, err)
		over, err := l.Reserve(ctx, "b", 600)
		require.NoError(t, err)
		l.advance(time.Minute + time.Millisecond) // past the hold's TTL, set below
		st, err := refund.Settle(ctx, 100)
		require.ErrorIs(t, err, ErrHoldExpired)
		assert.Zero(t, st.Refunded, "an expired hold refunds nothing")
		st, err = over.Settle(ctx, 700)
		require.ErrorIs(t, err, ErrHoldExpired)
		assert.Equal(t, int64(100), st.Charged, "the excess is still charged")
		_, err = over.Settle(ctx, 700)
		require.ErrorIs(t, err, ErrNotHeld, "and only once")
		stats := l.Stats().Reservations
		assert.Equal(t, [...]uint64{2, 2, 2, 0, 100, 0}, [...]uint64{stats.Held, stats.Settled, stats.Expired,
			stats.Refunded, stats.Charged, stats.Uncharged}, "held, settled, expired, refunded, charged, uncharged")
	}, WithHoldTTL(time.Minute))
}

func TestSettleBadInput(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{llm, {Name: "w", Capacity: 5, Window: time.Second}}, func(t *testing.T, l clockedLimiter) {
		_, err := l.Reserve(ctx, "k", 1001)
		assert.ErrorIs(t, err, ErrInvalidCost, "more than the capacity never passes")
		_, err = l.Reserve(ctx, "k", 0)
		assert.ErrorIs(t, err, ErrInvalidCost)
		_, err = l.Reserve(ctx, "k", 1, "w")
		assert.ErrorIs(t, err, ErrInvalidPlan, "windows take no reservations")

		r, err := l.Reserve(ctx, "k", 600)
		require.NoError(t, err)
		_, err = r.Settle(ctx, -1)
		assert.ErrorIs(t, err, ErrInvalidCost)
		_, err = r.Settle(ctx, maxCapacity+1)
		assert.ErrorIs(t, err, ErrInvalidCost)

		denied, err := l.Reserve(ctx, "k", 600)
		require.NoError(t, err)
		require.False(t, denied.OK())
		_, err = denied.Settle(ctx, 0)
		assert.ErrorIs(t, err, ErrNotHeld)
		_, err = r.Cancel(ctx)
		assert.NoError(t, err, "the bad calls settled nothing")

		cancelled, cancel := context.WithCancel(ctx)
		cancel()
		_, err = l.Reserve(cancelled, "k", 1)
		assert.ErrorIs(t, err, context.Canceled)
	})
}

func TestReserveNeedsAStoreThatHolds(t *testing.T) {
	ctx := context.Background()
	l, err := New(foreignStore{NewMemoryStore()}, []Plan{llm})
	require.NoError(t, err)
	_, err = l.Reserve(ctx, "k", 1)
	assert.ErrorIs(t, err, errors.ErrUnsupported)
	_, err = l.PeekN(ctx, "k", 2)
	assert.ErrorIs(t, err, errors.ErrUnsupported)
	p, err := l.PeekN(ctx, "k", 1)
	require.NoError(t, err, "a read for one token is the Store interface's")
	assert.True(t, p.Allowed)

	rs, _, _ := newMiniredisStore(t)
	l, err = New(rs, []Plan{llm}, WithFallback(foreignStore{NewMemoryStore()}))
	require.NoError(t, err)
	_, err = l.Reserve(ctx, "k", 1)
	assert.ErrorIs(t, err, errors.ErrUnsupported, "the fallback could not settle")
}

// foreignStore is a Store of another package's kind: the Limiter knows
// nothing of it but the interface.
type foreignStore struct{ Store }

func TestSettleConcurrentlyRefundsOnce(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{llm}, func(t *testing.T, l clockedLimiter) {
		r, err := l.Reserve(ctx, "k", 500)
		require.NoError(t, err)
		var wg sync.WaitGroup
		var ok, again atomic.Int32
		for range 8 {
			wg.Go(func() {
				_, err := r.Cancel(ctx)
				switch {
				case err == nil:
					ok.Add(1)
				case errors.Is(err, ErrNotHeld):
					again.Add(1)
				}
			})
		}
		wg.Wait()
		assert.Equal(t, int32(1), ok.Load())
		assert.Equal(t, int32(7), again.Load())
		p, err := l.Peek(ctx, "k")
		require.NoError(t, err)
		assert.Equal(t, int64(1000), p.Remaining)
	})
}

// TestSettleRetryAfterALostReply settles a hold in Redis twice, as a retry
// after a reply lost on the way back would: the second changes nothing.
func TestSettleRetryAfterALostReply(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	h := hold{ttl: time.Minute}
	_, err := rs.hold(ctx, "k", 500, []Plan{llm}, &h)
	require.NoError(t, err)
	st, status, err := rs.settle(ctx, settleOp{key: "k", plans: []Plan{llm}, hold: &h, n: 500, used: 0})
	require.NoError(t, err)
	assert.Equal(t, holdLive, status)
	assert.Equal(t, int64(1000), st.Remaining)
	_, err = rs.Take(ctx, "k", 300, []Plan{llm})
	require.NoError(t, err)
	st, status, err = rs.settle(ctx, settleOp{key: "k", plans: []Plan{llm}, hold: &h, n: 500, used: 0})
	require.NoError(t, err)
	assert.Equal(t, holdSettled, status)
	assert.Zero(t, st.Refunded)
	assert.Equal(t, int64(700), st.Remaining, "refunded once")
}

// TestSettleUnreadableHolds settles holds that hold data tollgate did not
// write: each is settled as gone, conservatively, and replaced.
func TestSettleUnreadableHolds(t *testing.T) {
	ctx := context.Background()
	for name, spoil := range map[string]func(c redis.Cmdable, key string) error{
		"another n":  func(c redis.Cmdable, key string) error { return c.Set(ctx, key, "499", 0).Err() },
		"text":       func(c redis.Cmdable, key string) error { return c.Set(ctx, key, "5e2", 0).Err() },
		"a hash":     func(c redis.Cmdable, key string) error { c.Del(ctx, key); return c.HSet(ctx, key, "n", 500).Err() },
		"a negative": func(c redis.Cmdable, key string) error { return c.Set(ctx, key, "-500", 0).Err() },
	} {
		t.Run(name, func(t *testing.T) {
			rs, _, _ := newMiniredisStore(t)
			l, err := New(rs, []Plan{llm}, WithLogger(nil))
			require.NoError(t, err)
			r, err := l.Reserve(ctx, "k", 500)
			require.NoError(t, err)
			hk := rs.Key("k", "~"+r.hold.id)
			require.NoError(t, spoil(rs.client, hk))
			st, err := r.Settle(ctx, 600)
			require.ErrorIs(t, err, ErrHoldExpired)
			assert.ErrorContains(t, err, "did not write")
			assert.Zero(t, st.Refunded)
			assert.Equal(t, int64(100), st.Charged)
			assert.Equal(t, int64(400), st.Remaining)
			v, err := rs.client.Get(ctx, hk).Result()
			require.NoError(t, err)
			assert.Equal(t, "s", v, "replaced by a tombstone")
		})
	}
}

func TestReserveChainsAllOrNothing(t *testing.T) {
	ctx := context.Background()
	small := Plan{Name: "small", Capacity: 10, Rate: 1}
	eachStore(t, []Plan{llm, small}, func(t *testing.T, l clockedLimiter) {
		r, err := l.Reserve(ctx, "k", 8, "tpm", "small")
		require.NoError(t, err)
		require.True(t, r.OK())
		denied, err := l.Reserve(ctx, "k", 5, "tpm", "small")
		require.NoError(t, err)
		assert.False(t, denied.OK())
		st, err := r.Settle(ctx, 3)
		require.NoError(t, err)
		require.Len(t, st.PlanResults(), 2)
		assert.Equal(t, int64(997), st.PlanResults()[0].Remaining)
		assert.Equal(t, int64(7), st.PlanResults()[1].Remaining)
	})
}

// TestConcurrentReservationsOfTheMaximum is LiteLLM's #18730: concurrent
// requests each reserve the most they may cost against one cap; exactly
// floor(cap / max) are granted, whatever they turn out to use.
func TestConcurrentReservationsOfTheMaximum(t *testing.T) {
	ctx := context.Background()
	check := func(t *testing.T, s Store) {
		l, err := New(s, []Plan{{Name: "tpm", Capacity: 1000, Rate: Per(1, time.Hour)}}, WithLogger(nil))
		require.NoError(t, err)
		var granted atomic.Int64
		var wg sync.WaitGroup
		for range 40 {
			wg.Go(func() {
				r, err := l.Reserve(ctx, "k", 300)
				if !assert.NoError(t, err) || !r.OK() {
					return
				}
				granted.Add(1)
				_, err = r.Settle(ctx, 300)
				assert.NoError(t, err)
			})
		}
		wg.Wait()
		assert.Equal(t, int64(3), granted.Load())
	}
	t.Run("memory", func(t *testing.T) { check(t, NewMemoryStore()) })
	t.Run("redis", func(t *testing.T) {
		redistest.SkipIfUnavailable(t)
		c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
		check(t, NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()), WithoutBatching()))
	})
	t.Run("redis-batched", func(t *testing.T) { // holds ride in batches too
		redistest.SkipIfUnavailable(t)
		c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
		check(t, NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix())))
	})
}

func TestPeekN(t *testing.T) {
	ctx := context.Background()
	win := Plan{Name: "w", Capacity: 10, Window: time.Second, Slots: 10}
	eachStore(t, []Plan{llm, win}, func(t *testing.T, l clockedLimiter) {
		_, err := l.AllowN(ctx, "k", 900)
		require.NoError(t, err)
		p, err := l.PeekN(ctx, "k", 300)
		require.NoError(t, err)
		assert.False(t, p.Allowed)
		assert.Equal(t, int64(100), p.Remaining)
		assert.Equal(t, 12*time.Second, p.RetryAfter, "200 tokens at 1,000 a minute")
		p, err = l.PeekN(ctx, "k", 100)
		require.NoError(t, err)
		assert.True(t, p.Allowed)
		again, err := l.PeekN(ctx, "k", 100)
		require.NoError(t, err)
		assert.Equal(t, p, again, "a peek takes nothing")

		_, err = l.AllowN(ctx, "k", 8, "w")
		require.NoError(t, err)
		l.advance(500 * time.Millisecond)
		_, err = l.AllowN(ctx, "k", 1, "w")
		require.NoError(t, err)
		p, err = l.PeekN(ctx, "k", 4, "w")
		require.NoError(t, err)
		assert.False(t, p.Allowed)
		assert.Equal(t, int64(1), p.Remaining)
		assert.Equal(t, 600*time.Millisecond, p.RetryAfter, "once the 8 have left: sub-window 0 leaves at 1.1s")

		_, err = l.PeekN(ctx, "k", 1001)
		assert.ErrorIs(t, err, ErrInvalidCost)
		_, err = l.PeekN(ctx, "k", 0)
		assert.ErrorIs(t, err, ErrInvalidCost)
	})
}

func TestRefundForgetsRememberedDenials(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	l, err := New(rs, []Plan{llm}, WithLogger(nil))
	require.NoError(t, err)
	r := reserveAllAndRemember(t, l, "k")
	_, err = r.Settle(ctx, 500)
	require.NoError(t, err)
	a, err := l.AllowN(ctx, "k", 10)
	require.NoError(t, err)
	assert.True(t, a.Allowed, "the refund is seen at once")
}

// TestSettleDuringAnOutage settles reservations while Redis answers only
// errors: the fallback charges the excess and drops the refund, FailOpen
// settles nothing, and FailClosed fails and may be retried.
func TestSettleDuringAnOutage(t *testing.T) {
	ctx := context.Background()
	outage := func(t *testing.T, opts ...Option) (*Limiter, *miniredis.Miniredis) {
		rs, mr, _ := newMiniredisStore(t)
		l, err := New(rs, []Plan{llm}, append([]Option{WithLogger(nil), WithDenialCache(0)}, opts...)...)
		require.NoError(t, err)
		return l, mr
	}
	t.Run("fallback", func(t *testing.T) {
		l, mr := outage(t)
		onRedis, err := l.Reserve(ctx, "k", 600)
		require.NoError(t, err)
		over, err := l.Reserve(ctx, "o", 600)
		require.NoError(t, err)
		mr.SetError("LOADING Redis is loading the dataset in memory")

		st, err := onRedis.Settle(ctx, 100)
		require.NoError(t, err)
		assert.Equal(t, SourceFallback, st.Source)
		assert.Zero(t, st.Refunded, "the refund is dropped")
		st, err = over.Settle(ctx, 900)
		require.NoError(t, err)
		assert.Equal(t, int64(300), st.Charged, "the excess is charged to the fallback")
		assert.Equal(t, int64(700), st.Remaining, "the fallback's bucket, which knew nothing of the 600")

		inOutage, err := l.Reserve(ctx, "f", 600)
		require.NoError(t, err)
		require.Equal(t, SourceFallback, inOutage.Result().Source)
		mr.SetError("")
		st, err = inOutage.Settle(ctx, 100)
		require.NoError(t, err, "settled where it was held")
		assert.Equal(t, int64(500), st.Refunded)
		assert.Equal(t, int64(900), st.Remaining)
	})
	t.Run("fail-open", func(t *testing.T) {
		l, mr := outage(t, WithFailurePolicy(breaker.FailOpen))
		r, err := l.Reserve(ctx, "k", 600)
		require.NoError(t, err)
		mr.SetError("LOADING Redis is loading the dataset in memory")
		st, err := r.Settle(ctx, 100)
		require.NoError(t, err)
		assert.Equal(t, SourceFailOpen, st.Source)
		open, err := l.Reserve(ctx, "k", 600)
		require.NoError(t, err)
		require.Equal(t, SourceFailOpen, open.Result().Source)
		st, err = open.Settle(ctx, 900)
		require.NoError(t, err, "a reservation breaker.FailOpen granted held nothing")
		assert.Equal(t, SourceFailOpen, st.Source)
	})
	t.Run("fail-closed", func(t *testing.T) {
		l, mr := outage(t, WithFailurePolicy(breaker.FailClosed))
		r, err := l.Reserve(ctx, "k", 600)
		require.NoError(t, err)
		mr.SetError("LOADING Redis is loading the dataset in memory")
		_, err = r.Settle(ctx, 100)
		require.ErrorIs(t, err, ErrStoreUnavailable)
		mr.SetError("")
		st, err := r.Settle(ctx, 100)
		require.NoError(t, err, "a Settle that failed may be called again")
		assert.Equal(t, int64(500), st.Refunded)
		assert.Equal(t, int64(900), st.Remaining)
	})
}

const holdChildEnv = "TOLLGATE_HOLD_CHILD"

// holdPlan is the plan of the charge-bound proof: 100 tokens, 200 a second.
var holdPlan = Plan{Name: "tpm", Capacity: 100, Rate: 200}

// holdTotals is what one child process reports: the tokens settled (less
// any not charged), and those reserved and left unsettled.
type holdTotals struct {
	Settled, Unsettled, Granted, Denied int64
}

// TestSettleHonoursAnOpenBreaker: a settlement is a store call behind the
// breaker of its key, as a decision is. While the breaker is open it does
// not reach Redis, healthy again or not: the failure policy settles it,
// here the fallback, which drops the refund.
func TestSettleHonoursAnOpenBreaker(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	c, calls := countedClient(t, &redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	l, err := New(NewRedisStore(c), []Plan{llm}, WithLogger(nil), WithDenialCache(0),
		WithBreaker(breaker.Settings{Failures: 1, Cooldown: time.Hour}))
	require.NoError(t, err)
	r, err := l.Reserve(ctx, "k", 600)
	require.NoError(t, err)
	require.Equal(t, SourceStore, r.Result().Source)
	mr.SetError("LOADING Redis is loading the dataset in memory")
	_, err = l.Allow(ctx, "other") // fails, and opens the breaker
	require.NoError(t, err)
	require.Equal(t, breaker.Open, l.health.one.State())
	mr.SetError("")
	sent := calls.alone.Load()
	st, err := r.Settle(ctx, 100)
	require.NoError(t, err)
	assert.Equal(t, SourceFallback, st.Source)
	assert.Zero(t, st.Refunded, "the refund is dropped")
	assert.Equal(t, sent, calls.alone.Load(), "the settlement did not reach Redis")
}

// TestHoldChildProcess is not a test of its own: the parent test runs the
// test binary again with this test selected and a job in its environment.
// Its workers reserve 1 to 20 tokens, then settle with 0 to twice that, or
// leave one reservation in ten unsettled, and it prints its totals as JSON.
func TestHoldChildProcess(t *testing.T) {
	spec := os.Getenv(holdChildEnv)
	if spec == "" {
		t.Skip("runs only as a child of TestChargeBoundAcrossProcessesOnRealRedis")
	}
	var job windowJob
	require.NoError(t, json.Unmarshal([]byte(spec), &job))
	c := redis.NewClient(&redis.Options{Addr: job.Addr})
	defer c.Close()
	l, err := New(NewRedisStore(c, WithKeyPrefix(job.Prefix)), []Plan{holdPlan}, WithFailurePolicy(breaker.FailClosed), WithLogger(nil))
	require.NoError(t, err)
	ctx := context.Background()
	var mu sync.Mutex
	var total holdTotals
	var wg sync.WaitGroup
	deadline := time.Now().Add(job.Run)
	for w := range job.Workers {
		wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(w), uint64(os.Getpid())))
			for time.Now().Before(deadline) {
				n := 1 + rng.Int64N(20)
				r, err := l.Reserve(ctx, "shared", n)
				require.NoError(t, err)
				var settled, unsettled int64
				switch {
				case !r.OK():
				case rng.IntN(10) == 0:
					unsettled = n
				default:
					actual := rng.Int64N(2*n + 1)
					st, err := r.Settle(ctx, actual)
					require.NoError(t, err)
					settled = actual - st.Uncharged
				}
				mu.Lock()
				total.Settled += settled
				total.Unsettled += unsettled
				if r.OK() {
					total.Granted++
				} else {
					total.Denied++
				}
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	out, err := json.Marshal(total)
	require.NoError(t, err)
	fmt.Printf("%s\n", out)
}

// TestChargeBoundAcrossProcessesOnRealRedis runs 4 processes of 8
// reserving and settling goroutines on one key: what they settled, plus
// what they reserved and never settled, is at most capacity + rate ×
// elapsed + the debt left at the end, and that debt is at most one
// capacity.
func TestChargeBoundAcrossProcessesOnRealRedis(t *testing.T) {
	if os.Getenv(holdChildEnv) != "" {
		t.Skip("a child runs only TestHoldChildProcess")
	}
	addr := redistest.Addr(t)
	c := redistest.NewClient(t, &redis.Options{Addr: addr})
	prefix := redistest.KeyPrefix()
	start := redistest.Time(t, c)
	var total holdTotals
	for _, line := range runChildren(t, 4, "TestHoldChildProcess", holdChildEnv,
		windowJob{Addr: addr, Prefix: prefix, Workers: 8, Run: time.Second}) {
		var part holdTotals
		require.NoError(t, json.Unmarshal([]byte(line), &part))
		total.Settled += part.Settled
		total.Unsettled += part.Unsettled
		total.Granted += part.Granted
		total.Denied += part.Denied
	}
	end := redistest.Time(t, c)
	var debt float64
	if v, err := c.Get(context.Background(), NewRedisStore(c, WithKeyPrefix(prefix)).Key("shared", holdPlan.Name)).Result(); !errors.Is(err, redis.Nil) {
		require.NoError(t, err)
		b, ok := bucketvalue.Decode(v)
		require.True(t, ok, "not a bucket: %q", v)
		debt = max(0, float64(b.Stamp-end)*holdPlan.Rate/microTokens)
	}
	elapsed := float64(end-start) / 1e6
	bound := float64(holdPlan.Capacity) + holdPlan.Rate*elapsed + debt
	t.Logf("%d granted, %d denied; %d settled + %d unsettled = %d tokens, bound %.1f (capacity %d + %.0f/s × %.3fs + debt %.1f)",
		total.Granted, total.Denied, total.Settled, total.Unsettled, total.Settled+total.Unsettled,
		bound, holdPlan.Capacity, holdPlan.Rate, elapsed, debt)
	assert.LessOrEqual(t, float64(total.Settled+total.Unsettled), bound+1, "charged more than the bucket allows")
	assert.LessOrEqual(t, debt, float64(holdPlan.Capacity), "debt beyond one capacity")
	assert.Positive(t, total.Denied, "the load must push past the limit")
}

// BenchmarkReservation compares a reservation and its settlement with two
// plain decisions: in Redis's time (server-µs and cpu-µs per pair, as
// BenchmarkServerTime measures them) and, on the MemoryStore, in
// allocations per pair, of which the Reservation itself is one.
func BenchmarkReservation(b *testing.B) {
	ctx := context.Background()
	plans := []Plan{{Name: "b", Capacity: 1 << 30, Rate: 1}}
	b.Run("memory/reserve-settle", func(b *testing.B) {
		l, err := New(NewMemoryStore(), plans)
		require.NoError(b, err)
		b.ReportAllocs()
		for b.Loop() {
			r, err := l.Reserve(ctx, "k", 10)
			if err != nil {
				b.Fatal(err)
			}
			if _, err := r.Settle(ctx, 3); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("memory/allow-twice", func(b *testing.B) {
		l, err := New(NewMemoryStore(), plans)
		require.NoError(b, err)
		b.ReportAllocs()
		for b.Loop() {
			for range 2 {
				if _, err := l.AllowN(ctx, "k", 3); err != nil {
					b.Fatal(err)
				}
			}
		}
	})
	redistest.SkipIfUnavailable(b)
	srv := redistest.StartServer(b)
	c := redis.NewClient(&redis.Options{Addr: srv.Addr(), PoolSize: 16})
	b.Cleanup(func() { _ = c.Close() })
	for _, tc := range []struct {
		name string
		pair func(s *RedisStore, key string) error
	}{
		{"allow-twice", func(s *RedisStore, key string) error {
			for range 2 {
				if _, err := s.Take(ctx, key, 3, plans); err != nil {
					return err
				}
			}
			return nil
		}},
		{"reserve-settle", func(s *RedisStore, key string) error {
			h := hold{ttl: time.Minute}
			if _, err := s.hold(ctx, key, 10, plans, &h); err != nil {
				return err
			}
			_, _, err := s.settle(ctx, settleOp{key: key, plans: plans, hold: &h, n: 10, used: 3})
			return err
		}},
	} {
		b.Run("redis/"+tc.name, func(b *testing.B) {
			s := NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))
			names := benchKeys(10_000)
			for _, k := range names[:100] {
				require.NoError(b, tc.pair(s, k)) // the scripts are loaded
			}
			calls, usec := scriptStats(b, c)
			cpu := serverCPU(b, c)
			var next atomic.Int64
			b.SetParallelism(8)
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := int(next.Add(1)) * 7919
				for pb.Next() {
					i++
					if err := tc.pair(s, names[i%len(names)]); err != nil {
						b.Error(err)
						return
					}
				}
			})
			b.StopTimer()
			calls2, usec2 := scriptStats(b, c)
			pairs := float64(calls2-calls) / 2
			b.ReportMetric(float64(usec2-usec)/pairs, "server-µs/op")
			b.ReportMetric((serverCPU(b, c)-cpu)*1e6/pairs, "cpu-µs/op")
		})
	}
}

// TestReserveWithShadowedAndVersionedPlans reserves on a chain with a
// shadowed plan that would deny and a plan with a version: settling
// leaves the shadowed plan's bucket as enforcement would have (it took
// nothing), and the versioned bucket keeps its version, so its
// inheritance is not applied again.
func TestReserveWithShadowedAndVersionedPlans(t *testing.T) {
	ctx := context.Background()
	plans := []Plan{
		{Name: "tpm", Capacity: 1000, Rate: Per(1000, time.Minute), Version: 2, Inherit: InheritReset},
		{Name: "next", Capacity: 800, Rate: Per(800, time.Hour), Shadow: true},
	}
	eachStore(t, plans, func(t *testing.T, l clockedLimiter) {
		_, err := l.AllowN(ctx, "k", 500, "next")
		require.NoError(t, err)
		r, err := l.Reserve(ctx, "k", 600, "tpm", "next")
		require.NoError(t, err)
		require.True(t, r.OK(), "a shadowed plan never denies")
		require.True(t, r.Result().PlanResults()[1].WouldDeny)
		st, err := r.Settle(ctx, 700)
		require.NoError(t, err)
		assert.Equal(t, int64(300), st.PlanResults()[0].Remaining, "the versioned plan, charged 100 more, not reset")
		assert.Equal(t, int64(300), st.PlanResults()[1].Remaining, "the shadowed plan took nothing and is charged nothing")
		p, err := l.Peek(ctx, "k", "tpm")
		require.NoError(t, err)
		assert.Equal(t, int64(300), p.Remaining, "the version was kept: no second reset")
	})
}

// TestFallbackSettlementKeepsTheFleetShare settles holds during an outage
// with WithFleet, where the fallback decides on this instance's share of
// each plan (capacity and rate ÷ the instances alive). A settlement on the
// fallback adjusts that share, not the plans in full: a refund refills at
// the share's rate, a charge is taken from the share's bucket, and a debt
// accrues at the share's rate, also for a hold larger than the share and
// for one that Redis granted before the outage.
func TestFallbackSettlementKeepsTheFleetShare(t *testing.T) {
	ctx := context.Background()
	plan := Plan{Name: "p", Capacity: 100, Rate: 1} // a share of 4: 25 tokens, 0.25 a second
	setup := func(t *testing.T) (*Limiter, *miniredis.Miniredis, *int64) {
		mr := miniredis.RunT(t)
		now := t0
		l := newFleetLimiter(t, mr, []Plan{plan}, WithFallback(newClockedMemoryStore(&now)), WithDenialCache(0))
		l.fleet.size.Store(4)
		return l, mr, &now
	}
	admitted := func(t *testing.T, l *Limiter) int {
		n := 0
		for range 100 {
			r, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			require.Equal(t, SourceFallback, r.Source)
			if r.Allowed {
				n++
			}
		}
		return n
	}

	t.Run("refund of a hold the fallback granted", func(t *testing.T) {
		l, mr, now := setup(t)
		mr.SetError("LOADING Redis is loading the dataset in memory")
		r, err := l.Reserve(ctx, "k", 25)
		require.NoError(t, err)
		require.True(t, r.OK())
		require.Equal(t, SourceFallback, r.Result().Source)
		*now += (20 * time.Second).Microseconds() // the share refills 5 tokens
		_, err = r.Settle(ctx, 20)                // refunds 5
		require.NoError(t, err)
		assert.Equal(t, 10, admitted(t, l), "5 refilled at the share's rate + 5 refunded")
	})
	t.Run("charge of a hold the fallback granted", func(t *testing.T) {
		l, mr, _ := setup(t)
		mr.SetError("LOADING Redis is loading the dataset in memory")
		r, err := l.Reserve(ctx, "k", 10)
		require.NoError(t, err)
		require.Equal(t, SourceFallback, r.Result().Source)
		_, err = r.Settle(ctx, 30) // 15 left, 20 charged: 5 tokens of debt
		require.NoError(t, err)
		res, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.False(t, res.Allowed)
		assert.GreaterOrEqual(t, res.RetryAfter, 24*time.Second, "5 tokens of debt and 1 token, at 0.25 a second")
	})
	t.Run("charge of a hold larger than the share", func(t *testing.T) {
		l, mr, _ := setup(t)
		mr.SetError("LOADING Redis is loading the dataset in memory")
		r, err := l.Reserve(ctx, "k", 50) // decided on a share lifted to 50
		require.NoError(t, err)
		require.True(t, r.OK())
		_, err = r.Settle(ctx, 100) // 50 more, as debt
		require.NoError(t, err)
		res, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.False(t, res.Allowed, "a bucket in debt is not read as full by a decision on the share (Remaining %d)", res.Remaining)
	})
	t.Run("charge of a hold Redis granted", func(t *testing.T) {
		l, mr, _ := setup(t)
		r, err := l.Reserve(ctx, "k", 10)
		require.NoError(t, err)
		require.Equal(t, SourceStore, r.Result().Source)
		mr.SetError("LOADING Redis is loading the dataset in memory")
		_, err = r.Settle(ctx, 30) // the fallback is charged the excess, 20, of its 25
		require.NoError(t, err)
		assert.Equal(t, 5, admitted(t, l))
	})
}

// TestDebtSurvivesAFasterPlan runs up 100 tokens of debt, then doubles the
// plan's rate (SetPlans; a tier or a Version does the same): the stamp is
// now more than the new plan's full refill ahead, and is brought back to
// one (ADR 29). It reads as the most debt the new plan allows, never as
// the full bucket it read as before, which handed out 100 tokens at once.
func TestDebtSurvivesAFasterPlan(t *testing.T) {
	ctx := context.Background()
	plan := Plan{Name: "p", Capacity: 100, Rate: 1}
	eachStore(t, []Plan{plan}, func(t *testing.T, l clockedLimiter) {
		r, err := l.Reserve(ctx, "k", 100)
		require.NoError(t, err)
		st, err := r.Settle(ctx, 200) // 100 tokens of debt: the stamp 100 s ahead
		require.NoError(t, err)
		require.Zero(t, st.Uncharged)
		faster := plan
		faster.Rate = 2 // a full refill in 50 s
		require.NoError(t, l.SetPlans([]Plan{faster}))
		res, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.False(t, res.Allowed, "a bucket in debt admits nothing (Remaining %d)", res.Remaining)
		assert.Equal(t, 50500*time.Millisecond, res.RetryAfter, "50 s of debt at the new rate, then half a second for the token")
		l.advance(50500 * time.Millisecond)
		res, err = l.Allow(ctx, "k")
		require.NoError(t, err)
		assert.True(t, res.Allowed)
	}, WithDenialCache(0))
}

// TestSettleUsesThePlanInForce reserves, lowers the plan's rate from 10/s
// to 1/s, and settles 10 s later with a refund of 1: the bucket refills at
// the rate in force, 10 tokens, not at the reservation's, which left 100
// where the plan allows 11. The same holds when a plan resolver (WithPlanResolver) moves the
// key to a slower tier.
func TestSettleUsesThePlanInForce(t *testing.T) {
	ctx := context.Background()
	plan := Plan{Name: "p", Capacity: 100, Rate: 10}
	slower := plan
	slower.Rate = 1
	t.Run("SetPlans", func(t *testing.T) {
		eachStore(t, []Plan{plan}, func(t *testing.T, l clockedLimiter) {
			r, err := l.Reserve(ctx, "k", 100)
			require.NoError(t, err)
			require.True(t, r.OK())
			require.NoError(t, l.SetPlans([]Plan{slower}))
			l.advance(10 * time.Second)
			st, err := r.Settle(ctx, 99) // a refund of 1
			require.NoError(t, err)
			assert.Equal(t, int64(11), st.Remaining, "10 refilled at 1/s, and 1 refunded")
		}, WithDenialCache(0))
	})
	t.Run("resolver", func(t *testing.T) {
		var tier atomic.Pointer[Plan]
		tier.Store(&plan)
		resolver := WithPlanResolver(func(_ context.Context, _ string, _ Plan) (Plan, error) { return *tier.Load(), nil })
		eachStore(t, []Plan{plan}, func(t *testing.T, l clockedLimiter) {
			tier.Store(&plan)
			r, err := l.Reserve(ctx, "k", 100)
			require.NoError(t, err)
			require.True(t, r.OK())
			tier.Store(&slower)
			l.advance(10 * time.Second)
			st, err := r.Settle(ctx, 99)
			require.NoError(t, err)
			assert.Equal(t, int64(11), st.Remaining)
		}, WithDenialCache(0), resolver)
	})
	t.Run("a plan that left the table", func(t *testing.T) {
		eachStore(t, []Plan{plan, {Name: "other", Capacity: 5, Rate: 1}}, func(t *testing.T, l clockedLimiter) {
			r, err := l.Reserve(ctx, "k", 100, "p")
			require.NoError(t, err)
			require.NoError(t, l.SetPlans([]Plan{{Name: "other", Capacity: 5, Rate: 1}}))
			l.advance(time.Second)
			st, err := r.Settle(ctx, 99)
			require.NoError(t, err)
			assert.Equal(t, int64(11), st.Remaining, "settled on the reservation's plan: 10 refilled at 10/s, and 1 refunded")
		}, WithDenialCache(0))
	})
}

// TestSettleLeavesAWindowOfTheNameAlone: a reservation of 5 on bucket
// plan "x", then SetPlans makes "x" a window of 10 a minute, which counts
// what the bucket had used and admits the 5 it had left. Settling the
// reservation must not replace the window's counts with a bucket: the
// window would then count nothing and admit more within its minute.
func TestSettleLeavesAWindowOfTheNameAlone(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{{Name: "x", Capacity: 10, Rate: 1}}, func(t *testing.T, l clockedLimiter) {
		rv, err := l.Reserve(ctx, "k", 5)
		require.NoError(t, err)
		require.True(t, rv.OK())
		require.NoError(t, l.SetPlans([]Plan{{Name: "x", Capacity: 10, Window: time.Minute}}))
		admitted := 0
		for range 10 {
			r, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			if r.Allowed {
				admitted++
			}
		}
		require.Equal(t, 5, admitted, "the window carries what the bucket had used")
		_, _ = rv.Settle(ctx, 0) // a refund of 5
		for range 10 {
			r, err := l.Allow(ctx, "k")
			require.NoError(t, err)
			if r.Allowed {
				admitted++
			}
		}
		assert.Equal(t, 5, admitted, "the window of 10 a minute admitted more within its minute")
	}, WithDenialCache(0))
}

// TestSettleLeavesPermitsOfTheNameAlone: a bucket's name removed by
// SetPlans and given back as a concurrency plan, once the Limiter forgot
// its kind (past maxHistoryNames other names), holds permits, not tokens: a
// reservation taken from the bucket settles nothing onto them (before:
// the refund wrote a bucket over the permits, and 4 were held at once of
// a concurrency plan of 2).
func TestSettleLeavesPermitsOfTheNameAlone(t *testing.T) {
	ctx := context.Background()
	other := Plan{Name: "other", Capacity: 10, Rate: 1}
	eachStore(t, []Plan{other, {Name: "x", Capacity: 10, Rate: 1}}, func(t *testing.T, l clockedLimiter) {
		rv, err := l.Reserve(ctx, "k", 5, "x")
		require.NoError(t, err)
		require.True(t, rv.OK())
		require.NoError(t, l.SetPlans([]Plan{other}))
		delete(l.table.Load().history.byName, "x") // as historyAfter forgets it past maxHistoryNames names
		require.NoError(t, l.SetPlans([]Plan{other, {Name: "x", Capacity: 2, Concurrency: true}}))
		held := 0
		for range 2 {
			p, err := l.Acquire(ctx, "k", 1, "x")
			require.NoError(t, err)
			if p.OK() {
				held++
			}
		}
		require.Equal(t, 2, held)
		_, _ = rv.Cancel(ctx)
		for range 2 {
			p, err := l.Acquire(ctx, "k", 1, "x")
			require.NoError(t, err)
			if p.OK() {
				held++
			}
		}
		assert.Equal(t, 2, held, "permits held at once of a concurrency plan of 2")
	})
}

// TestResetVoidsTheRefundsOfEarlierReservations: Reset fills the bucket
// without a reservation's tokens, so its refund would fill it a second
// time. Of a plan of 1,000, a reservation of 1,000, a Reset, 1,000
// admitted, then a Cancel: before, the Cancel refunded 1,000 and 1,000
// more passed at the same instant, 2,000 in all; a refund onto another
// key is kept.
func TestResetVoidsTheRefundsOfEarlierReservations(t *testing.T) {
	ctx := context.Background()
	eachStore(t, []Plan{llm}, func(t *testing.T, l clockedLimiter) {
		r, err := l.Reserve(ctx, "k", 1000)
		require.NoError(t, err)
		require.True(t, r.OK())
		other, err := l.Reserve(ctx, "other", 1000)
		require.NoError(t, err)
		require.NoError(t, l.Reset(ctx, "k"))
		a, err := l.AllowN(ctx, "k", 1000)
		require.NoError(t, err)
		require.True(t, a.Allowed, "Reset filled the bucket")

		st, err := r.Cancel(ctx)
		require.NoError(t, err)
		assert.Zero(t, st.Refunded, "the bucket Reset filled held these tokens already")
		b, err := l.AllowN(ctx, "k", 1)
		require.NoError(t, err)
		assert.False(t, b.Allowed, "1,000 admitted since the Reset, of a capacity of 1,000")

		st, err = other.Cancel(ctx)
		require.NoError(t, err)
		assert.Equal(t, int64(1000), st.Refunded, "another key's reservation is refunded")
	})
}

// TestResetDuringSettleVoidsItsRefund: a Reset of the key that comes while
// a reservation settles, after the resolver Settle consults, is counted
// before Settle looks for Resets; the refund would fill the bucket Reset
// filled, once 1,000 tokens were taken from it.
func TestResetDuringSettleVoidsItsRefund(t *testing.T) {
	ctx := context.Background()
	var armed atomic.Bool
	var l *Limiter
	resolve := func(ctx context.Context, key string, p Plan) (Plan, error) {
		if armed.CompareAndSwap(true, false) {
			assert.NoError(t, l.Reset(ctx, "k"))
			a, err := l.AllowN(ctx, "k", 1000)
			assert.NoError(t, err)
			assert.True(t, a.Allowed, "Reset filled the bucket")
		}
		return p, nil
	}
	eachStore(t, []Plan{llm}, func(t *testing.T, cl clockedLimiter) {
		l = cl.Limiter
		r, err := l.Reserve(ctx, "k", 1000)
		require.NoError(t, err)
		require.True(t, r.OK())
		armed.Store(true)
		st, err := r.Cancel(ctx)
		require.NoError(t, err)
		assert.Zero(t, st.Refunded)
		b, err := l.AllowN(ctx, "k", 1)
		require.NoError(t, err)
		assert.False(t, b.Allowed, "1,000 admitted since the Reset, of a capacity of 1,000")
	}, WithPlanResolver(resolve))
}

// settleRacer is a go-redis hook that, at the first script call once
// armed, runs race on a goroutine and lets the call go once race returned
// or a moment passed, whichever is first.
type settleRacer struct {
	armed atomic.Bool
	race  func()
}

func (h *settleRacer) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *settleRacer) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		if isScriptCmd(cmd) && h.armed.CompareAndSwap(true, false) {
			done := make(chan struct{})
			go func() { defer close(done); h.race() }()
			select {
			case <-done:
			case <-time.After(100 * time.Millisecond):
			}
		}
		return next(ctx, cmd)
	}
}

func (h *settleRacer) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestResetWhileSettleIsUnderWayWaits: a Reset of the key asked for while
// a settlement's refund is on its way to Redis waits for it, so that the
// refund lands before the Reset, never on the bucket Reset filled.
func TestResetWhileSettleIsUnderWayWaits(t *testing.T) {
	ctx := context.Background()
	rs, _, _ := newMiniredisStore(t)
	l, err := New(rs, []Plan{llm}, WithLogger(nil))
	require.NoError(t, err)
	r, err := l.Reserve(ctx, "k", 1000)
	require.NoError(t, err)
	require.True(t, r.OK())
	reset := make(chan struct{})
	h := &settleRacer{race: func() {
		defer close(reset)
		assert.NoError(t, l.Reset(ctx, "k"))
		a, err := l.AllowN(ctx, "k", 1000)
		assert.NoError(t, err)
		assert.True(t, a.Allowed, "Reset filled the bucket")
	}}
	rs.client.(*redis.Client).AddHook(h)
	h.armed.Store(true)
	_, err = r.Cancel(ctx)
	require.NoError(t, err)
	<-reset
	b, err := l.AllowN(ctx, "k", 1)
	require.NoError(t, err)
	assert.False(t, b.Allowed, "1,000 admitted since the Reset, of a capacity of 1,000")
}

// TestSettleOfACallerWhoLeftStillSettles settles reservations with a
// context that ended, as a handler's does once its client hangs up after
// the work: the refund and the charge reach the store all the same, as
// a Release does, or the hold is never settled (before: nothing refunded
// of 5 reserved, 1 used, and 3 used beyond the reservation never
// charged), on every store.
func TestSettleOfACallerWhoLeftStillSettles(t *testing.T) {
	ctx := context.Background()
	gone, cancel := context.WithCancel(ctx)
	cancel()
	for name, l := range permitStores(t, false) {
		t.Run(name, func(t *testing.T) {
			r, err := l.Reserve(ctx, "refund", 5, "daily")
			require.NoError(t, err)
			require.True(t, r.OK())
			st, err := r.Settle(gone, 1)
			require.NoError(t, err)
			assert.EqualValues(t, 4, st.Refunded)
			p, err := l.Peek(ctx, "refund", "daily")
			require.NoError(t, err)
			assert.EqualValues(t, 4, p.Remaining, "the unused 4 refunded")

			r, err = l.Reserve(ctx, "charge", 2, "daily")
			require.NoError(t, err)
			require.True(t, r.OK())
			st, err = r.Settle(gone, 5)
			require.NoError(t, err)
			assert.EqualValues(t, 3, st.Charged)
			p, err = l.Peek(ctx, "charge", "daily")
			require.NoError(t, err)
			assert.Zero(t, p.Remaining, "5 used of 5")
			_, err = r.Settle(ctx, 5)
			assert.ErrorIs(t, err, ErrNotHeld, "settled once")
		})
	}
}

// TestSettleOfARedisFallbacksHold: a hold that a RedisStore given as the
// fallback (WithFallback) granted during an outage is settled there, as a
// MemoryStore fallback's is, whatever the store's breaker says: while the
// store is still down its refund is not dropped, and once the store is
// back, a failure of the fallback does not count against the store's
// breaker, nor would a success of the fallback close it.
func TestSettleOfARedisFallbacksHold(t *testing.T) {
	ctx := context.Background()
	setup := func(t *testing.T, cooldown time.Duration) (*Limiter, *miniredis.Miniredis, *miniredis.Miniredis) {
		rs, mr, _ := newMiniredisStore(t)
		fallback, fmr, _ := newMiniredisStore(t)
		l, err := New(rs, []Plan{llm}, WithLogger(nil), WithDenialCache(0), WithFallback(fallback),
			WithBreaker(breaker.Settings{Failures: 1, Cooldown: cooldown}))
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.Close() })
		mr.SetError("LOADING Redis is loading the dataset in memory")
		return l, mr, fmr
	}
	t.Run("refunded while the store is down", func(t *testing.T) {
		l, _, _ := setup(t, time.Hour)
		r, err := l.Reserve(ctx, "k", 600)
		require.NoError(t, err)
		require.Equal(t, SourceFallback, r.Result().Source)
		require.Equal(t, breaker.Open, l.health.one.State())
		st, err := r.Settle(ctx, 100)
		require.NoError(t, err)
		assert.Equal(t, int64(500), st.Refunded, "settled where it was held")
		assert.Equal(t, int64(900), st.Remaining)
	})
	t.Run("the fallback's failure is not the store's", func(t *testing.T) {
		l, mr, fmr := setup(t, 10*time.Millisecond)
		r, err := l.Reserve(ctx, "k", 600)
		require.NoError(t, err)
		require.Equal(t, SourceFallback, r.Result().Source)
		mr.SetError("")
		require.Eventually(t, func() bool {
			p, err := l.Peek(ctx, "other") // the probe that closes the breaker
			return err == nil && p.Source == SourceStore
		}, 5*time.Second, 5*time.Millisecond)
		opened := l.Stats().BreakerOpened
		fmr.SetError("LOADING Redis is loading the dataset in memory")
		_, err = r.Settle(ctx, 100)
		require.ErrorIs(t, err, ErrStoreUnavailable)
		assert.Equal(t, breaker.Closed, l.health.one.State(), "the store answers")
		assert.Equal(t, opened, l.Stats().BreakerOpened)
		fmr.SetError("")
		st, err := r.Settle(ctx, 100)
		require.NoError(t, err, "settled once the fallback answers")
		assert.Equal(t, int64(500), st.Refunded)
	})
}

// TestSettleDuringAnOutageOnARedisFallback: while the store is down, the
// Fallback policy settles a hold the store granted on a RedisStore given
// as the fallback as on a MemoryStore: the excess is charged there, every
// time, and the refund dropped; no settlement fails.
func TestSettleDuringAnOutageOnARedisFallback(t *testing.T) {
	ctx := context.Background()
	rs, mr, _ := newMiniredisStore(t)
	fallback, _, _ := newMiniredisStore(t)
	l, err := New(rs, []Plan{llm}, WithLogger(nil), WithDenialCache(0), WithFallback(fallback))
	require.NoError(t, err)
	t.Cleanup(func() { _ = l.Close() })
	var held []*Reservation
	for range 3 {
		r, err := l.Reserve(ctx, "k", 100)
		require.NoError(t, err)
		require.Equal(t, SourceStore, r.Result().Source)
		held = append(held, r)
	}
	mr.SetError("LOADING Redis is loading the dataset in memory")
	for i, r := range held {
		st, err := r.Settle(ctx, 300)
		require.NoError(t, err, "settlement %d", i+1)
		assert.Equal(t, SourceFallback, st.Source)
		assert.Equal(t, int64(200), st.Charged)
		assert.Equal(t, int64(1000-200*int64(i+1)), st.Remaining, "settlement %d: each excess charged to the fallback", i+1)
	}
}

// reserveAllAndRemember reserves the 1,000 tokens of llm on key, and asks
// for 10 more until the Limiter answers the denial from its cache.
func reserveAllAndRemember(t *testing.T, l *Limiter, key string) *Reservation {
	t.Helper()
	ctx := context.Background()
	r, err := l.Reserve(ctx, key, 1000)
	require.NoError(t, err)
	for range 2 {
		d, err := l.AllowN(ctx, key, 10)
		require.NoError(t, err)
		require.False(t, d.Allowed)
	}
	d, err := l.AllowN(ctx, key, 10)
	require.NoError(t, err)
	require.Equal(t, SourceCache, d.Source, "the denial is remembered")
	return r
}
