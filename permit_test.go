package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// permitPlans are a concurrency plan of 3 permits and a bucket of 5
// tokens that refills slowly, to chain with it.
var permitPlans = []Plan{
	{Name: "inflight", Capacity: 3, Concurrency: true},
	{Name: "daily", Capacity: 5, Rate: Per(5, time.Hour)},
}

// permitStores returns a Limiter on permitPlans for each store kind: a
// MemoryStore, miniredis, and real Redis when there is one; not
// miniredis for a test that waits for leases to end (timed), since its
// clock stands still.
func permitStores(t *testing.T, timed bool, opts ...Option) map[string]*Limiter {
	t.Helper()
	opts = append([]Option{WithLogger(nil), WithFailurePolicy(breaker.FailClosed)}, opts...)
	out := map[string]*Limiter{}
	add := func(name string, s Store) {
		l, err := New(s, permitPlans, opts...)
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.Close() })
		out[name] = l
	}
	add("memory", NewMemoryStore())
	if !timed {
		rs, _, _ := newMiniredisStore(t)
		add("miniredis", rs)
	}
	if redistest.Available() {
		c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
		add("redis", NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix())))
	}
	return out
}

// TestAcquireHoldsAtMostCapacity acquires, is refused, releases twice
// and acquires again, on every store.
func TestAcquireHoldsAtMostCapacity(t *testing.T) {
	ctx := context.Background()
	for name, l := range permitStores(t, false) {
		t.Run(name, func(t *testing.T) {
			a, err := l.Acquire(ctx, "k", 2, "inflight")
			require.NoError(t, err)
			require.True(t, a.OK())
			require.EqualValues(t, 1, a.Result().Remaining)
			b, err := l.Acquire(ctx, "k", 2, "inflight")
			require.NoError(t, err)
			require.False(t, b.OK(), "3 permits, 2 held: 2 more do not fit")
			require.Zero(t, b.Result().RetryAfter, "a permit has no schedule")
			require.ErrorIs(t, b.Release(ctx), ErrNotHeld)
			require.NoError(t, a.Release(ctx))
			require.ErrorIs(t, a.Release(ctx), ErrNotHeld, "a second release")
			c, err := l.Acquire(ctx, "k", 3, "inflight")
			require.NoError(t, err)
			require.True(t, c.OK(), "released permits come back")
			require.NoError(t, c.Release(ctx))
			st := l.Stats().Permits
			require.EqualValues(t, 2, st.Granted)
			require.EqualValues(t, 1, st.Refused)
			require.EqualValues(t, 2, st.Released)
		})
	}
}

// TestAcquireChainTakesBothOrNeither chains permits with a bucket: a
// refusal by either takes nothing from the other.
func TestAcquireChainTakesBothOrNeither(t *testing.T) {
	ctx := context.Background()
	for name, l := range permitStores(t, false) {
		t.Run(name, func(t *testing.T) {
			var held []*Permit
			for i := 0; i < 3; i++ {
				p, err := l.Acquire(ctx, "k", 1, "inflight", "daily")
				require.NoError(t, err)
				require.True(t, p.OK())
				held = append(held, p)
			}
			p, err := l.Acquire(ctx, "k", 1, "inflight", "daily")
			require.NoError(t, err)
			require.False(t, p.OK())
			require.Equal(t, "inflight", p.Result().Plan, "the full concurrency plan binds")
			r, err := l.Peek(ctx, "k", "daily")
			require.NoError(t, err)
			require.EqualValues(t, 2, r.Remaining, "a refused acquire took no token")
			for _, p := range held {
				require.NoError(t, p.Release(ctx))
			}
			for i := 0; i < 2; i++ {
				p, err := l.Acquire(ctx, "k", 1, "inflight", "daily")
				require.NoError(t, err)
				require.True(t, p.OK())
				require.NoError(t, p.Release(ctx))
			}
			p, err = l.Acquire(ctx, "k", 1, "inflight", "daily")
			require.NoError(t, err)
			require.False(t, p.OK(), "no token left")
			require.Equal(t, "daily", p.Result().Plan)
			require.Positive(t, p.Result().RetryAfter)
			q, err := l.Acquire(ctx, "k", 3, "inflight")
			require.NoError(t, err)
			require.True(t, q.OK(), "a refusal for tokens held no permit")
			require.NoError(t, q.Release(ctx))
		})
	}
}

// TestAcquireBadInput gives each kind of bad input its error.
func TestAcquireBadInput(t *testing.T) {
	ctx := context.Background()
	for name, l := range permitStores(t, false) {
		t.Run(name, func(t *testing.T) {
			_, err := l.Allow(ctx, "k", "inflight")
			require.ErrorIs(t, err, ErrInvalidPlan)
			_, err = l.Reserve(ctx, "k", 1, "inflight")
			require.ErrorIs(t, err, ErrInvalidPlan)
			_, err = l.Peek(ctx, "k", "inflight")
			require.ErrorIs(t, err, ErrInvalidPlan)
			_, err = l.Acquire(ctx, "k", 1, "daily")
			require.ErrorIs(t, err, ErrInvalidPlan)
			_, err = l.Acquire(ctx, "k", 4, "inflight")
			require.ErrorIs(t, err, ErrInvalidCost)
			_, err = l.Acquire(ctx, "k", 0, "inflight")
			require.ErrorIs(t, err, ErrInvalidCost)
			_, err = l.Acquire(ctx, "", 1, "inflight")
			require.ErrorIs(t, err, ErrInvalidKey)
		})
	}
	for _, p := range []Plan{
		{Name: "c", Concurrency: true},
		{Name: "c", Capacity: maxPermits + 1, Concurrency: true},
		{Name: "c", Capacity: 1, Rate: 1, Concurrency: true},
		{Name: "c", Capacity: 1, Window: time.Second, Concurrency: true},
		{Name: "c", Capacity: 1, Shadow: true, Concurrency: true},
		{Name: "c", Capacity: 1, Lease: 1, Concurrency: true},
		{Name: "c", Capacity: 1, Version: 1, Concurrency: true},
	} {
		_, err := New(NewMemoryStore(), []Plan{p})
		require.ErrorIs(t, err, ErrInvalidPlan, "%+v", p)
	}
	_, err := New(NewMemoryStore(), permitPlans, WithShadow())
	require.ErrorIs(t, err, ErrInvalidPlan)
	_, err = New(NewMemoryStore(), permitPlans, WithPermitLease(time.Millisecond))
	require.ErrorIs(t, err, ErrInvalidOption)
	_, err = NewMemoryStore().Take(ctx, "k", 1, permitPlans[:1])
	require.ErrorIs(t, err, ErrInvalidPlan)
}

// TestPermitLeaseEndsWithoutRenewal stops renewing one of two holders'
// permits: once its lease has ended, they come back, and its Release
// says they were lost. Leases are long enough that a starved test process
// still renews the other holder's in time.
func TestPermitLeaseEndsWithoutRenewal(t *testing.T) {
	ctx := context.Background()
	for name, l := range permitStores(t, true, WithPermitLease(600*time.Millisecond)) {
		t.Run(name, func(t *testing.T) {
			kept, err := l.Acquire(ctx, "k", 1, "inflight")
			require.NoError(t, err)
			p, err := l.Acquire(ctx, "k", 2, "inflight")
			require.NoError(t, err)
			require.True(t, p.OK())
			l.book.remove(p) // its holder stops renewing it
			time.Sleep(time.Second)
			q, err := l.Acquire(ctx, "k", 2, "inflight")
			require.NoError(t, err)
			require.True(t, q.OK(), "the lease ended: its permits came back")
			require.EqualValues(t, 2, l.Stats().Permits.Reclaimed)
			require.ErrorIs(t, p.Release(ctx), ErrPermitLost)
			require.ErrorIs(t, p.Release(ctx), ErrNotHeld)
			require.NoError(t, q.Release(ctx))
			require.NoError(t, kept.Release(ctx))
		})
	}
}

// TestPermitRenewedOutlivesItsLease holds permits for more than two
// leases: the Limiter's renewals keep them.
func TestPermitRenewedOutlivesItsLease(t *testing.T) {
	ctx := context.Background()
	for name, l := range permitStores(t, true, WithPermitLease(600*time.Millisecond)) {
		t.Run(name, func(t *testing.T) {
			p, err := l.Acquire(ctx, "k", 3, "inflight")
			require.NoError(t, err)
			time.Sleep(1500 * time.Millisecond)
			q, err := l.Acquire(ctx, "k", 1, "inflight")
			require.NoError(t, err)
			require.False(t, q.OK(), "renewed: still held")
			require.EqualValues(t, 3, l.Stats().Plans[0].PermitsHeld)
			require.NoError(t, p.Release(ctx))
			require.Zero(t, l.Stats().Permits.Lost)
		})
	}
}

// TestAcquireDuringAnOutage has Redis answer errors while permits are
// held: the fallback grants from the instance's share less the permits
// it still holds from Redis, and releases its own; FailOpen grants a
// Permit that holds nothing; FailClosed refuses with the error.
func TestAcquireDuringAnOutage(t *testing.T) {
	ctx := context.Background()
	outage := func(t *testing.T, opts ...Option) (*Limiter, func(string)) {
		rs, mr, _ := newMiniredisStore(t)
		l, err := New(rs, permitPlans, append([]Option{WithLogger(nil)}, opts...)...)
		require.NoError(t, err)
		t.Cleanup(func() { _ = l.Close() })
		return l, func(msg string) { mr.SetError(msg) }
	}
	t.Run("fallback", func(t *testing.T) {
		l, fail := outage(t)
		onRedis, err := l.Acquire(ctx, "k", 2, "inflight")
		require.NoError(t, err)
		require.True(t, onRedis.OK())
		fail("LOADING Redis is loading the dataset in memory")
		p, err := l.Acquire(ctx, "k", 2, "inflight")
		require.NoError(t, err)
		require.Equal(t, SourceFallback, p.Result().Source)
		require.False(t, p.OK(), "3 permits, 2 of them still held from Redis")
		p, err = l.Acquire(ctx, "k", 1, "inflight")
		require.NoError(t, err)
		require.True(t, p.OK())
		require.Equal(t, SourceFallback, p.Result().Source)
		require.ErrorIs(t, onRedis.Release(ctx), ErrStoreUnavailable)
		require.EqualValues(t, 1, l.Stats().Permits.Unreleased)
		require.NoError(t, p.Release(ctx), "released in the fallback, which granted it")
		q, err := l.Acquire(ctx, "k", 3, "inflight")
		require.NoError(t, err)
		require.True(t, q.OK(), "the Redis permits no longer count once released")
		require.NoError(t, q.Release(ctx))
	})
	t.Run("fail-open", func(t *testing.T) {
		l, fail := outage(t, WithFailurePolicy(breaker.FailOpen))
		fail("LOADING Redis is loading the dataset in memory")
		p, err := l.Acquire(ctx, "k", 3, "inflight")
		require.NoError(t, err)
		require.True(t, p.OK())
		require.Equal(t, SourceFailOpen, p.Result().Source)
		require.NoError(t, p.Release(ctx), "a permit FailOpen granted holds nothing")
		require.ErrorIs(t, p.Release(ctx), ErrNotHeld)
	})
	t.Run("fail-closed", func(t *testing.T) {
		l, fail := outage(t, WithFailurePolicy(breaker.FailClosed))
		fail("LOADING Redis is loading the dataset in memory")
		_, err := l.Acquire(ctx, "k", 1, "inflight")
		require.ErrorIs(t, err, ErrStoreUnavailable)
	})
}

// TestPlanCannotChangeKindOfPermits refuses a plan that becomes, or stops
// being, a concurrency plan under its name: through SetPlans, a
// resolver, or AllowPlans.
func TestPlanCannotChangeKindOfPermits(t *testing.T) {
	ctx := context.Background()
	l, err := New(NewMemoryStore(), permitPlans, WithLogger(nil))
	require.NoError(t, err)
	rate := Plan{Name: "inflight", Capacity: 3, Rate: 1}
	require.ErrorIs(t, l.SetPlans([]Plan{rate, permitPlans[1]}), ErrInvalidPlan)
	permits := Plan{Name: "daily", Capacity: 3, Concurrency: true}
	require.ErrorIs(t, l.SetPlans([]Plan{permitPlans[0], permits}), ErrInvalidPlan)
	_, err = l.AllowPlans(ctx, "k", 1, rate)
	require.ErrorIs(t, err, ErrInvalidPlan)
	flip, err := New(NewMemoryStore(), permitPlans, WithLogger(nil),
		WithPlanResolver(func(_ context.Context, _ string, p Plan) (Plan, error) {
			if p.Concurrency {
				return rate, nil
			}
			return p, nil
		}))
	require.NoError(t, err)
	_, err = flip.Acquire(ctx, "k", 1, "inflight")
	require.ErrorIs(t, err, ErrInvalidPlan)
	_, err = flip.Allow(ctx, "k", "inflight")
	require.ErrorIs(t, err, ErrInvalidPlan)
}

// TestResetLeavesPermitsToTheirHolders: Reset refills the key's rate
// plans, and frees no permit whose holder still works. Before, a Reset
// of every plan deleted the permits: 3 held, then 3 more granted, 6 at
// once of 3.
func TestResetLeavesPermitsToTheirHolders(t *testing.T) {
	ctx := context.Background()
	for name, l := range permitStores(t, false) {
		t.Run(name, func(t *testing.T) {
			a, err := l.Acquire(ctx, "k", 3, "inflight", "daily")
			require.NoError(t, err)
			require.True(t, a.OK())
			require.NoError(t, l.Reset(ctx, "k"))
			b, err := l.Acquire(ctx, "k", 1, "inflight")
			require.NoError(t, err)
			require.False(t, b.OK(), "the 3 permits are still held")
			r, err := l.AllowN(ctx, "k", 5, "daily")
			require.NoError(t, err)
			require.True(t, r.Allowed, "the bucket was reset")
			require.ErrorIs(t, l.Reset(ctx, "k", "inflight"), ErrInvalidPlan)
			require.NoError(t, a.Release(ctx), "the permits were never lost")
		})
	}
}

// TestNilPermitIsNotHeld: Acquire returns a nil Permit with its error, and
// a Release deferred before the error check, or OK and Result on it, must
// not panic.
func TestNilPermitIsNotHeld(t *testing.T) {
	var p *Permit
	require.False(t, p.OK())
	require.Equal(t, Result{}, p.Result())
	require.ErrorIs(t, p.Release(context.Background()), ErrNotHeld)
}
