package tollgate

import (
	"context"
	"strconv"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// daylong is a plan of 1,000 tokens a day: on real Redis, whose clock
// runs, a test refills nothing that matters.
var daylong = Plan{Name: "tpd", Capacity: 1000, Rate: Per(1000, 24*time.Hour)}

func TestRedisStoreReset(t *testing.T) {
	ctx := context.Background()
	s, mr, setTime := newMiniredisStore(t)
	daily := Plan{Name: "daily", Capacity: 10, Rate: 0.01}
	_, err := s.Take(ctx, "k", 4, []Plan{gold, daily})
	require.NoError(t, err)
	require.NoError(t, s.Reset(ctx, "k", []Plan{gold, daily}))
	mark := s.Key("k", resetMarkName)
	assert.Equal(t, []string{mark}, mr.Keys(), "the buckets are gone, the reset mark is there")
	assert.Equal(t, strconv.FormatInt(t0, 10), mustGet(t, mr, mark), "Redis TIME at the Reset, µs")
	assert.Equal(t, minResetKeep, mr.TTL(mark))
	r, err := s.Take(ctx, "k", 0, []Plan{gold, daily})
	require.NoError(t, err)
	assert.Equal(t, []int64{4, 10}, []int64{r.PlanResults()[0].Remaining, r.PlanResults()[1].Remaining})

	require.NoError(t, s.resetHolds(ctx, "k", []Plan{gold}, time.Hour))
	assert.Equal(t, time.Hour, mr.TTL(mark), "a Limiter's longer hold TTL")
	setTime(t0 - time.Second.Microseconds()) // Redis TIME steps back
	require.NoError(t, s.Reset(ctx, "k", []Plan{gold}))
	assert.Equal(t, time.Hour, mr.TTL(mark), "never shortened by a Reset with a shorter one")
	assert.Equal(t, strconv.FormatInt(t0, 10), mustGet(t, mr, mark), "never moved back")
}

// mustGet returns the string at key in mr.
func mustGet(t *testing.T, mr *miniredis.Miniredis, key string) string {
	t.Helper()
	v, err := mr.Get(key)
	require.NoError(t, err)
	return v
}

// sharedRedis is one Redis that two instances share, each with a store
// and a client of its own.
type sharedRedis struct {
	a, b *RedisStore
	mr   *miniredis.Miniredis // nil on real Redis
	// tick returns once Redis TIME has moved on: on miniredis it moves the
	// clock by a millisecond, on real Redis it waits for the next µs.
	tick func()
}

// eachSharedRedis runs f on miniredis, with its clock at t0, and on a real
// Redis if there is one.
func eachSharedRedis(t *testing.T, f func(t *testing.T, r sharedRedis)) {
	t.Run("miniredis", func(t *testing.T) {
		mr := miniredis.RunT(t)
		now := t0
		mr.SetTime(time.UnixMicro(now))
		store := func() *RedisStore {
			c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
			t.Cleanup(func() { _ = c.Close() })
			return NewRedisStore(c)
		}
		f(t, sharedRedis{a: store(), b: store(), mr: mr, tick: func() {
			now += time.Millisecond.Microseconds()
			mr.SetTime(time.UnixMicro(now))
		}})
	})
	t.Run("redis", func(t *testing.T) {
		addr, prefix := redistest.Addr(t), redistest.KeyPrefix()
		store := func() *RedisStore {
			return NewRedisStore(redistest.NewClient(t, &redis.Options{Addr: addr}), WithKeyPrefix(prefix))
		}
		a := store()
		f(t, sharedRedis{a: a, b: store(), tick: func() {
			for was := redistest.Time(t, a.client); redistest.Time(t, a.client) == was; {
			}
		}})
	})
}

// instances returns a Limiter of plans on each of r's stores, with
// opts, remembering no denial.
func (r sharedRedis) instances(t *testing.T, plans []Plan, opts ...Option) (a, b *Limiter) {
	t.Helper()
	opts = append([]Option{WithLogger(nil), WithDenialCache(0)}, opts...)
	a, err := New(r.a, plans, opts...)
	require.NoError(t, err)
	b, err = New(r.b, plans, opts...)
	require.NoError(t, err)
	return a, b
}

// TestResetByAnotherInstanceVoidsTheRefund: of a plan of 1,000, instance
// A reserves 1,000, instance B resets the key and admits 1,000, then A
// cancels. A's refund would fill the bucket B's Reset filled a second
// time: before, A's Limiter knew of no Reset, the Cancel refunded 1,000,
// and 2,000 passed at one instant.
func TestResetByAnotherInstanceVoidsTheRefund(t *testing.T) {
	eachSharedRedis(t, func(t *testing.T, r sharedRedis) {
		a, b := r.instances(t, []Plan{daylong})
		resetByAnotherVoidsTheRefund(t, a, b, r.tick)
	})
}

// resetByAnotherVoidsTheRefund is the scenario of TestResetByAnotherInstanceVoidsTheRefund
// and TestResetByAnotherLimiterOnOneMemoryStoreVoidsTheRefund, on
// Limiters a and b that share a store of plan daylong, whose clock tick
// moves on.
func resetByAnotherVoidsTheRefund(t *testing.T, a, b *Limiter, tick func()) {
	ctx := context.Background()
	rv, err := a.Reserve(ctx, "k", 1000)
	require.NoError(t, err)
	require.True(t, rv.OK())
	tick()
	require.NoError(t, b.Reset(ctx, "k"))
	tick()
	var admitted int64
	admit := func(l *Limiter, n int64) {
		res, err := l.AllowN(ctx, "k", n)
		require.NoError(t, err)
		if res.Allowed {
			admitted += n
		}
	}
	admit(b, 1000)
	require.Equal(t, int64(1000), admitted, "Reset filled the bucket")

	st, err := rv.Cancel(ctx)
	require.NoError(t, err, "settled, not expired: the hold was there")
	assert.Zero(t, st.Refunded, "the bucket B's Reset filled held these tokens already")
	admit(a, 1000)
	admit(b, 1)
	admit(a, 1)
	assert.Equal(t, int64(1000), admitted, "1,000 admitted since the Reset, of a capacity of 1,000")
	s := a.Stats().Reservations
	assert.Equal(t, [3]uint64{1, 0, 0}, [3]uint64{s.Settled, s.Expired, s.Refunded})
}

// TestReservationAfterAnotherInstancesResetIsRefunded: a reservation
// taken after another instance's Reset of its key, or before the Reset of
// another key, is refunded as usual.
func TestReservationAfterAnotherInstancesResetIsRefunded(t *testing.T) {
	ctx := context.Background()
	eachSharedRedis(t, func(t *testing.T, r sharedRedis) {
		a, b := r.instances(t, []Plan{daylong})
		other, err := a.Reserve(ctx, "other", 1000)
		require.NoError(t, err)
		require.NoError(t, b.Reset(ctx, "k"))
		r.tick()
		rv, err := a.Reserve(ctx, "k", 1000)
		require.NoError(t, err)
		require.True(t, rv.OK())
		for _, rv := range []*Reservation{rv, other} {
			st, err := rv.Cancel(ctx)
			require.NoError(t, err)
			assert.Equal(t, int64(1000), st.Refunded)
		}
		res, err := b.AllowN(ctx, "k", 1000)
		require.NoError(t, err)
		assert.True(t, res.Allowed, "the refund came back")
	})
}

// TestResetMarkOutlivesTheResettersHoldTTL: instance B, whose holds live
// a millisecond, resets the key of a reservation of instance A, whose
// hold lives 15 minutes, and a minute passes before A cancels. Were the
// mark kept for B's hold TTL, it would be gone, and the refund would
// land on the bucket B filled.
func TestResetMarkOutlivesTheResettersHoldTTL(t *testing.T) {
	ctx := context.Background()
	rs, mr, setTime := newMiniredisStore(t)
	a, err := New(rs, []Plan{llm}, WithLogger(nil), WithDenialCache(0))
	require.NoError(t, err)
	b, err := New(NewRedisStore(rs.client), []Plan{llm}, WithLogger(nil), WithDenialCache(0), WithHoldTTL(time.Millisecond))
	require.NoError(t, err)
	rv, err := a.Reserve(ctx, "k", 1000)
	require.NoError(t, err)
	setTime(t0 + 1)
	require.NoError(t, b.Reset(ctx, "k"))
	mr.FastForward(time.Minute)
	st, err := rv.Cancel(ctx)
	require.NoError(t, err)
	assert.Zero(t, st.Refunded)
}

// TestResetByAnotherInstanceVoidsALeasesRest: instance A leases 10 of a
// key's 100 tokens and serves one; instance B resets the key and admits
// 100. A's Close gives back the lease's rest of 9 by a settlement, which
// would fill B's bucket again: before, 9 were left in it.
func TestResetByAnotherInstanceVoidsALeasesRest(t *testing.T) {
	ctx := context.Background()
	leased := Plan{Name: "hot", Capacity: 100, Rate: Per(100, 24*time.Hour), Lease: 10}
	plain := leased
	plain.Lease = 0
	eachSharedRedis(t, func(t *testing.T, r sharedRedis) {
		a, err := New(r.a, []Plan{leased}, WithLogger(nil), WithDenialCache(0))
		require.NoError(t, err)
		b, err := New(r.b, []Plan{plain}, WithLogger(nil), WithDenialCache(0))
		require.NoError(t, err)
		res, err := a.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, SourceStore, res.Source, "a lease of 10 taken")
		r.tick()
		require.NoError(t, b.Reset(ctx, "k"))
		res, err = b.AllowN(ctx, "k", 100)
		require.NoError(t, err)
		require.True(t, res.Allowed, "Reset filled the bucket")
		require.NoError(t, a.Close())
		res, err = b.Peek(ctx, "k")
		require.NoError(t, err)
		assert.Zero(t, res.Remaining, "the lease's rest was not given back to the bucket B filled")
	})
}

// TestRedisStoreResetLeavesPermits: RedisStore.Reset called with a
// concurrency plan's name but not its kind, as the CLI does, leaves its
// permits to their holders, as Limiter.Reset does (it refuses the name).
func TestRedisStoreResetLeavesPermits(t *testing.T) {
	ctx := context.Background()
	s, mr, _ := newMiniredisStore(t)
	permits := s.Key("k", "inflight")
	_, err := mr.ZAdd(permits, float64(t0+time.Minute.Microseconds()), "holder")
	require.NoError(t, err)
	require.NoError(t, s.Reset(ctx, "k", []Plan{{Name: "inflight", Capacity: 10, Rate: 1}}))
	members, err := mr.ZMembers(permits)
	require.NoError(t, err)
	assert.Equal(t, []string{"holder"}, members)
}
