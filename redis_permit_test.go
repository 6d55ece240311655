package tollgate

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
	"github.com/tollgate-go/tollgate/internal/redistest"
)

// permitRedis is a RedisStore under test, and how time passes for it.
type permitRedis struct {
	s *RedisStore
	// pass lets d go by on miniredis, TIME and TTLs alike; nil on real
	// Redis, whose clock runs by itself.
	pass func(d time.Duration)
}

// exists reports whether Redis holds key.
func (r permitRedis) exists(t *testing.T, key string) bool {
	n, err := r.s.client.Exists(context.Background(), key).Result()
	require.NoError(t, err)
	return n == 1
}

// permitRedises returns a RedisStore on miniredis, and on real Redis when
// there is one, by name.
func permitRedises(t *testing.T) map[string]permitRedis {
	t.Helper()
	mr := miniredis.RunT(t)
	now := t0
	mr.SetTime(time.UnixMicro(now))
	c := redistest.NewClient(t, &redis.Options{Addr: mr.Addr()})
	out := map[string]permitRedis{"miniredis": {s: NewRedisStore(c), pass: func(d time.Duration) {
		now += d.Microseconds()
		mr.SetTime(time.UnixMicro(now))
		mr.FastForward(d)
	}}}
	if redistest.Available() {
		c := redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
		out["redis"] = permitRedis{s: NewRedisStore(c, WithKeyPrefix(redistest.KeyPrefix()))}
	}
	return out
}

// acquireOn has s decide an Acquire of n permits of plans for holder id
// with a lease, and requires it granted.
func acquireOn(t *testing.T, s decider, id string, n int64, lease time.Duration, plans ...Plan) {
	t.Helper()
	g := &permit{id: id, lease: lease, backs: &giveBacks{}}
	r, err := s.decide(context.Background(), op{key: "k", n: n, mode: modeAcquire, plans: plans, grant: g})
	require.NoError(t, err)
	require.True(t, r.Allowed, "%s acquires %d", id, n)
}

// permitsOn has s renew holder id's n permits of plan p for lease, or
// release them for 0, and returns whether they were live.
func permitsOn(t *testing.T, s permitStore, id string, n int64, lease time.Duration, p Plan) bool {
	t.Helper()
	live, _, err := s.permits(context.Background(), permitOp{key: "k", plans: []Plan{p}, lease: lease,
		holders: []permitHolder{{id: id, n: n, mask: 1}}})
	require.NoError(t, err)
	return live[0]
}

// TestPermitSetGoneOnceAllReleased: permits acquired through a Limiter,
// chained with a bucket, leave their set in Redis until the last of them
// is released, and nothing once it is.
func TestPermitSetGoneOnceAllReleased(t *testing.T) {
	ctx := context.Background()
	for name, r := range permitRedises(t) {
		t.Run(name, func(t *testing.T) {
			l, err := New(r.s, permitPlans, WithLogger(nil), WithFailurePolicy(breaker.FailClosed))
			require.NoError(t, err)
			t.Cleanup(func() { _ = l.Close() })
			set := r.s.Key("k", "inflight")
			var held []*Permit
			for _, n := range []int64{1, 2} {
				p, err := l.Acquire(ctx, "k", n, "inflight", "daily")
				require.NoError(t, err)
				require.True(t, p.OK())
				held = append(held, p)
			}
			for _, p := range held {
				assert.True(t, r.exists(t, set), "permits are held: their set is there")
				require.NoError(t, p.Release(ctx))
			}
			assert.False(t, r.exists(t, set), "every permit released: nothing is left of the set")
			assert.True(t, r.exists(t, r.s.Key("k", "daily")), "the bucket stays until it is full again")
		})
	}
}

// TestPermitSetGoneOnceEveryLeaseEnded: permits never released leave
// their set in Redis until the last lease ends, and nothing once it
// ended: permits that were only acquired, and permits one of which was
// renewed for less than its lease had left. On miniredis the clock is
// exact: the set is there a µs before the last lease ends, and gone 2 ms
// after it.
func TestPermitSetGoneOnceEveryLeaseEnded(t *testing.T) {
	for name, r := range permitRedises(t) {
		t.Run(name, func(t *testing.T) {
			p := Plan{Name: "inflight", Capacity: 5, Concurrency: true}
			set := r.s.Key("k", p.Name)
			goneAfter := func(last time.Duration) {
				t.Helper()
				require.True(t, r.exists(t, set))
				if r.pass == nil {
					assert.Eventually(t, func() bool { return !r.exists(t, set) }, 5*time.Second, 10*time.Millisecond,
						"every lease ended: nothing is left of the set")
					return
				}
				r.pass(last - time.Microsecond)
				require.True(t, r.exists(t, set), "a lease still runs: the set is there")
				r.pass(time.Microsecond + 2*time.Millisecond)
				assert.False(t, r.exists(t, set), "every lease ended: nothing is left of the set")
			}
			acquireOn(t, r.s, "a", 2, 100*time.Millisecond, p)
			acquireOn(t, r.s, "b", 1, 300*time.Millisecond, p)
			goneAfter(300 * time.Millisecond)

			acquireOn(t, r.s, "c", 2, 100*time.Millisecond, p)
			acquireOn(t, r.s, "d", 1, 2*time.Second, p)
			require.True(t, permitsOn(t, r.s, "d", 1, 500*time.Millisecond, p), "renewed before its lease ended")
			goneAfter(500 * time.Millisecond)
		})
	}
}
