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

// newFleetLimiter returns a Limiter with a fleet on the miniredis mr,
// its heartbeat stopped at once: the tests beat by hand.
func newFleetLimiter(t *testing.T, mr *miniredis.Miniredis, plans []Plan, opts ...Option) *Limiter {
	t.Helper()
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	l, err := New(NewRedisStore(c), plans, append([]Option{WithLogger(nil), WithFleet(time.Hour)}, opts...)...)
	require.NoError(t, err)
	require.NoError(t, l.Close())
	l.fleet.size.Store(0)
	return l
}

// The heartbeat runs from New until Close, and Close waits for it.
func TestFleetHeartbeatRunsUntilClose(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	defer func() { _ = c.Close() }()
	l, err := New(NewRedisStore(c), testPlans, WithLogger(nil), WithFleet(10*time.Millisecond))
	require.NoError(t, err)
	for l.Stats().FleetSize == 0 { // the first heartbeat; the test's timeout bounds the wait
		time.Sleep(time.Millisecond)
	}
	assert.Equal(t, int64(1), l.Stats().FleetSize)
	require.NoError(t, l.Close())
	select {
	case <-l.fleet.done:
	default:
		t.Fatal("Close returned with the heartbeat still running")
	}
}

func TestFleetNeedsARedisStoreAndSaneSettings(t *testing.T) {
	_, err := New(NewMemoryStore(), testPlans, WithFleet(0))
	assert.ErrorIs(t, err, ErrInvalidOption)
	c := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
	defer func() { _ = c.Close() }()
	for _, interval := range []time.Duration{time.Millisecond, -time.Second} {
		_, err := New(NewRedisStore(c), testPlans, WithFleet(interval))
		assert.ErrorIs(t, err, ErrInvalidOption, "%v", interval)
	}
}

// Each heartbeat counts the instances alive; an instance stops counting
// TTL after its last heartbeat, and leaves the size once three
// heartbeats have not counted it. The heartbeats here are called
// directly, so the test waits for no goroutine.
func TestFleetCountsInstancesAlive(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	now := time.Unix(1_700_000_000, 0)
	mr.SetTime(now)
	var fleet []*Limiter
	for range 3 {
		fleet = append(fleet, newFleetLimiter(t, mr, testPlans))
	}
	for _, l := range fleet {
		require.NoError(t, l.fleet.beat(ctx))
	}
	for _, l := range fleet {
		require.NoError(t, l.fleet.beat(ctx))
		assert.Equal(t, int64(3), l.Stats().FleetSize)
	}
	// The third stops; after TTL (3 hours here) it no longer counts.
	require.NoError(t, fleet[2].Close())
	require.NoError(t, fleet[2].Close(), "Close is idempotent")
	now = now.Add(3*time.Hour + time.Second)
	mr.SetTime(now)
	for i := range fleetTTLBeats {
		require.NoError(t, fleet[0].fleet.beat(ctx))
		require.NoError(t, fleet[1].fleet.beat(ctx))
		assert.Equal(t, 2, len(mustMembers(t, mr, fleet[0].store.(*RedisStore).fleetKey())))
		want := map[bool]int64{true: 2, false: 3}[i == fleetTTLBeats-1]
		assert.Equal(t, want, fleet[1].Stats().FleetSize, "heartbeat %d after the third stopped", i+1)
	}
}

// Instances of one fleet at different intervals count each other while
// alive: one that beats every second and three every 5 s each count 4 at
// every heartbeat, so that each fallback takes a quarter of a plan.
func TestFleetCountsInstancesOfOtherIntervals(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	now := time.Unix(1_700_000_000, 0)
	mr.SetTime(now)
	fleet := []*Limiter{newFleetLimiter(t, mr, testPlans, WithFleet(time.Second))}
	for range 3 {
		fleet = append(fleet, newFleetLimiter(t, mr, testPlans, WithFleet(5*time.Second)))
	}
	for _, l := range fleet { // all start at once
		require.NoError(t, l.fleet.beat(ctx))
	}
	lowest := []int64{4, 4, 4, 4}
	for s := 1; s <= 30; s++ {
		now = now.Add(time.Second)
		mr.SetTime(now)
		mr.FastForward(time.Second)
		for i, l := range fleet {
			if i == 0 || s%5 == i {
				require.NoError(t, l.fleet.beat(ctx))
				lowest[i] = min(lowest[i], l.fleet.counts[0])
			}
		}
	}
	var sizes []int64
	for _, l := range fleet {
		sizes = append(sizes, l.Stats().FleetSize)
	}
	assert.Equal(t, []int64{4, 4, 4, 4}, lowest, "the fewest instances each heartbeat counted")
	assert.Equal(t, []int64{4, 4, 4, 4}, sizes)
}

// A Redis restarted empty counts, at first, only the instances that beat
// since: each instance keeps the size its heartbeats before counted
// until the others have beaten again, so that no fallback takes the
// share of a smaller fleet.
func TestFleetSizeOutlivesALostSet(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	mr.SetTime(time.Unix(1_700_000_000, 0))
	var fleet []*Limiter
	for range 4 {
		fleet = append(fleet, newFleetLimiter(t, mr, testPlans))
	}
	for range 2 {
		for _, l := range fleet {
			require.NoError(t, l.fleet.beat(ctx))
		}
	}
	require.Equal(t, int64(4), fleet[0].fleetSize())
	mr.FlushAll() // a restart without persistence
	for i, l := range fleet {
		require.NoError(t, l.fleet.beat(ctx))
		assert.Equal(t, int64(4), l.fleetSize(), "instance %d of 4 to beat again", i+1)
	}
	assert.Equal(t, 4, len(mustMembers(t, mr, fleet[0].store.(*RedisStore).fleetKey())))
}

func mustMembers(t *testing.T, mr *miniredis.Miniredis, key string) []string {
	m, err := mr.ZMembers(key)
	require.NoError(t, err)
	return m
}

// A fleet's fallback enforces this instance's share: with 4 instances
// alive, a quarter of the plan.
func TestFallbackEnforcesTheInstancesShare(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	l := newFleetLimiter(t, mr, []Plan{{Name: "p", Capacity: 100, Rate: 0.001}})
	l.fleet.size.Store(4)
	mr.SetError("LOADING Redis is loading the dataset in memory") // every call fails
	admitted := 0
	for range 200 {
		r, err := l.Allow(ctx, "k")
		require.NoError(t, err)
		require.Equal(t, SourceFallback, r.Source)
		if r.Allowed {
			admitted++
		}
		assert.Equal(t, int64(25), r.Limit, "the share applied is what the Result tells")
	}
	assert.Equal(t, 25, admitted)
}

func TestShare(t *testing.T) {
	bucket := Plan{Name: "b", Capacity: 100, Rate: 40}
	win := Plan{Name: "w", Capacity: 100, Window: time.Minute}
	plans := []Plan{bucket, win}
	assert.Same(t, &plans[0], &shareOf(plans, 1, 1)[0], "alone: the plans themselves")
	assert.Equal(t, []Plan{{Name: "b", Capacity: 25, Rate: 10}, {Name: "w", Capacity: 25, Window: time.Minute}}, shareOf(plans, 4, 1))
	assert.Equal(t, int64(7), shareOf(plans, 1000, 7)[0].Capacity, "never below one decision's cost")
	slow := Plan{Name: "s", Capacity: 1000, Rate: 1000 / maxRefillPeriod.Seconds()}
	got := shareOf([]Plan{slow}, maxFleetSize, 20)[0]
	assert.NoError(t, got.validate(), "the share is a valid plan")
}

// A heartbeat that gets a reply it cannot use keeps the size it had;
// counts beyond the largest fleet are taken as the largest.
func TestFleetBadReplies(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	l := newFleetLimiter(t, mr, testPlans)
	l.fleet.size.Store(3)
	mr.SetError("ERR broken")
	assert.Error(t, l.fleet.beat(ctx))
	assert.Equal(t, int64(3), l.fleetSize(), "the size last seen")
	mr.SetError("")
	for i := range maxFleetSize + 10 {
		_, err := mr.ZAdd(l.store.(*RedisStore).fleetKey(), float64(time.Now().UnixMicro()), strconv.Itoa(i))
		require.NoError(t, err)
	}
	require.NoError(t, l.fleet.beat(ctx))
	assert.Equal(t, int64(maxFleetSize), l.fleetSize())

	alone := newFleetLimiter(t, miniredis.RunT(t), testPlans)
	assert.Equal(t, int64(1), alone.fleetSize(), "before any heartbeat: alone")
}

// BenchmarkFleet shows that the heartbeat adds nothing to a decision: the
// client's work alone (a hook answers every command, so no byte reaches a
// network), with and without WithFleet; and the cost of one heartbeat on a
// real Redis, paid once per Interval.
func BenchmarkFleet(b *testing.B) {
	for _, withFleet := range []bool{false, true} {
		b.Run(map[bool]string{false: "decision/no-fleet", true: "decision/fleet"}[withFleet], func(b *testing.B) {
			c := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
			defer func() { _ = c.Close() }()
			c.AddHook(cannedReply{[]any{int64(1), int64(1 << 50), int64(1 << 40), int64(1 << 50)}})
			var opts []Option
			if withFleet {
				opts = append(opts, WithFleet(0))
			}
			l, err := New(NewRedisStore(c), benchPlan, opts...)
			require.NoError(b, err)
			defer func() { _ = l.Close() }()
			allowParallel(b, l)
		})
	}
	b.Run("heartbeat/redis", func(b *testing.B) {
		c := redis.NewClient(&redis.Options{Addr: redistest.Addr(b)})
		defer func() { _ = c.Close() }()
		l, err := New(NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix())), benchPlan, WithFleet(0))
		require.NoError(b, err)
		require.NoError(b, l.Close())
		ctx := context.Background()
		b.ReportAllocs()
		for b.Loop() {
			if err := l.fleet.beat(ctx); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestPeekNOnTheFleetShareAgreesWithAllowN: during an outage with
// WithFleet, AllowN(n) is decided on a share of each plan of at least n
// tokens, and PeekN(n), which sends a cost of -n, reads the same share: it
// does not say "wait 100 s" to a request that AllowN admits at once.
func TestPeekNOnTheFleetShareAgreesWithAllowN(t *testing.T) {
	ctx := context.Background()
	mr := miniredis.RunT(t)
	now := t0
	l := newFleetLimiter(t, mr, []Plan{{Name: "p", Capacity: 100, Rate: 1}}, WithFallback(newClockedMemoryStore(&now)), WithDenialCache(0))
	l.fleet.size.Store(4) // a share of 25 tokens, lifted to a cost above it
	mr.SetError("LOADING Redis is loading the dataset in memory")
	peek, err := l.PeekN(ctx, "k", 50)
	require.NoError(t, err)
	require.Equal(t, SourceFallback, peek.Source)
	r, err := l.AllowN(ctx, "k", 50)
	require.NoError(t, err)
	require.True(t, r.Allowed, "the fallback admits 50 on a share lifted to 50")
	assert.True(t, peek.Allowed, "PeekN said to wait %v", peek.RetryAfter)
	assert.Zero(t, peek.RetryAfter)
}

// During an outage the fallback decides the plans a decision would have
// had in Redis, each at this instance's share (WithFleet, 4 instances):
// a shadowed plan stays shadowed, never denies and reports its would-be
// denials; a resolver's tier is the tier shared; a new Version applies
// its inheritance once on the fallback's buckets, as in Redis.
func TestFallbackSharesThePlansInForce(t *testing.T) {
	ctx := context.Background()
	plan := Plan{Name: "p", Capacity: 100, Rate: 0.001}
	outage := func(t *testing.T, opts ...Option) *Limiter {
		mr := miniredis.RunT(t)
		l := newFleetLimiter(t, mr, []Plan{plan}, append([]Option{WithDenialCache(0)}, opts...)...)
		l.fleet.size.Store(4)
		mr.SetError("LOADING Redis is loading the dataset in memory")
		return l
	}
	// admit asks n times for a token of key, and counts the tokens
	// admitted and the would-be denials, each decided by the fallback
	// with the Limit limit.
	admit := func(t *testing.T, l *Limiter, key string, n int, limit int64) (admitted, wouldDeny int) {
		t.Helper()
		for range n {
			r, err := l.Allow(ctx, key)
			require.NoError(t, err)
			require.Equal(t, SourceFallback, r.Source)
			require.Equal(t, limit, r.Limit)
			if r.Allowed {
				admitted++
			}
			if r.ShadowDenied {
				wouldDeny++
			}
		}
		return admitted, wouldDeny
	}
	t.Run("shadow", func(t *testing.T) {
		l := outage(t, WithShadow())
		admitted, wouldDeny := admit(t, l, "k", 40, 25)
		assert.Equal(t, 40, admitted, "a shadowed plan never denies")
		assert.Equal(t, 15, wouldDeny, "past the share of 25")
		assert.Equal(t, uint64(15), l.Stats().Plans[0].ShadowDenied)
	})
	t.Run("resolver", func(t *testing.T) {
		gold := Plan{Name: "p", Capacity: 400, Rate: 0.001}
		l := outage(t, WithPlanResolver(func(_ context.Context, key string, p Plan) (Plan, error) {
			if key == "gold" {
				return gold, nil
			}
			return p, nil
		}))
		admitted, _ := admit(t, l, "gold", 200, 100)
		assert.Equal(t, 100, admitted, "the gold tier's share")
		admitted, _ = admit(t, l, "free", 200, 25)
		assert.Equal(t, 25, admitted, "the default plan's share")
	})
	t.Run("version", func(t *testing.T) {
		next := plan
		next.Version, next.Inherit = 2, InheritReset
		l := outage(t)
		total := 0
		for i := range 10 {
			require.NoError(t, l.SetPlans([]Plan{[]Plan{plan, next}[i%2]}))
			admitted, _ := admit(t, l, "k", 30, 25)
			total += admitted
		}
		assert.Equal(t, 50, total, "the share, and the share again once, when version 2 resets it")
	})
}

// hungFleetStore is a store whose heartbeats hang until their context
// ends, as on a Redis that answers nothing to a client without a read
// timeout shorter than the fleet's interval.
type hungFleetStore struct {
	mem   *MemoryStore
	beats chan struct{}
}

func (s *hungFleetStore) Take(ctx context.Context, key string, cost int64, plans []Plan) (Result, error) {
	return s.mem.Take(ctx, key, cost, plans)
}

func (s *hungFleetStore) Reset(ctx context.Context, key string, plans []Plan) error {
	return s.mem.Reset(ctx, key, plans)
}

func (s *hungFleetStore) heartbeat(ctx context.Context, _ string, _ time.Duration) (int64, error) {
	s.beats <- struct{}{}
	<-ctx.Done()
	return 0, ctx.Err()
}

// TestCloseDoesNotWaitForAHungHeartbeat: Close stops the heartbeat, and a
// heartbeat under way on a hung Redis is called off, not waited for until
// the fleet's interval (a minute here) ends it.
func TestCloseDoesNotWaitForAHungHeartbeat(t *testing.T) {
	s := &hungFleetStore{mem: NewMemoryStore(), beats: make(chan struct{}, 1)}
	l, err := New(s, testPlans, WithLogger(nil), WithFleet(time.Minute))
	require.NoError(t, err)
	<-s.beats
	closed := make(chan struct{})
	go func() {
		_ = l.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("Close waits for a hung heartbeat")
	}
}
