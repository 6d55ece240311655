package tollgate

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

func checkOf(t *testing.T, store Store) error {
	t.Helper()
	l, err := New(store, testPlans, WithLogger(nil))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return l.Check(ctx)
}

func TestCheckPasses(t *testing.T) {
	assert.NoError(t, checkOf(t, NewMemoryStore()))
	assert.NoError(t, checkOf(t, newCountingStore()))
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	assert.NoError(t, checkOf(t, NewRedisStore(c)))
	assert.NoError(t, checkOf(t, NewRedisStore(c, WithKeyPrefix("other"))))
	assert.ElementsMatch(t, []string{"tollgate:{=}:check", "other:{=}:check"}, mr.Keys(),
		"one reserved key per prefix, which no caller's key maps to")
}

func TestCheckNamesTheCause(t *testing.T) {
	pw := miniredis.RunT(t)
	pw.RequireAuth("secret")
	listener, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	closed := listener.Addr().String()
	require.NoError(t, listener.Close())

	cases := []struct {
		name, addr, cause string
	}{
		{"wrong password", pw.Addr(), "credentials"},
		{"nothing listening", closed, "cannot reach Redis"},
	}
	if redistest.Available() {
		renamed := redistest.StartServer(t, "--rename-command", "EVALSHA", `""`)
		cases = append(cases, struct{ name, addr, cause string }{"EVALSHA renamed", renamed.Addr(), "rejected the script"})
		acl := redistest.StartServer(t)
		require.NoError(t, acl.Client(t).Do(context.Background(),
			"ACL", "SETUSER", "default", "on", "nopass", "~*", "+@all", "-evalsha", "-eval").Err())
		cases = append(cases, struct{ name, addr, cause string }{"ACL without EVALSHA", acl.Addr(), "ACL"})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := checkOf(t, NewRedisStore(redistest.NewClient(t, redistest.FailFast(tc.addr))))
			require.ErrorIs(t, err, ErrStoreUnavailable)
			assert.Contains(t, err.Error(), tc.cause)
			assert.NotContains(t, err.Error(), "tollgate:{", "no key in the error")
		})
	}
}

func TestCheckReturnsTheCallersContextError(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
	t.Cleanup(func() { _ = c.Close() })
	l, err := New(NewRedisStore(c), testPlans)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	assert.ErrorIs(t, l.Check(ctx), context.Canceled)
}

// TestCheckTriesEveryKindThePlansUse: an ACL that forbids the commands of
// a kind of plan (a window's hashes, a concurrency plan's sorted sets) or
// of the fleet's heartbeat (sorted sets) fails Check on a Limiter that
// uses it, rather than sending every such decision to the fallback for
// ever, or leaving the fleet uncounted; a Limiter that uses none of them
// passes Check on the same server. Checks in a row are not denied, which
// would try no command that writes.
func TestCheckTriesEveryKindThePlansUse(t *testing.T) {
	ctx := context.Background()
	bucket := Plan{Name: "b", Capacity: 10, Rate: 1}
	window := Plan{Name: "w", Capacity: 10, Window: time.Minute}
	permits := Plan{Name: "c", Capacity: 10, Concurrency: true}
	for _, tc := range []struct {
		name, forbid string
		plans        []Plan
		opts         []Option
	}{
		{"a window", "-@hash", []Plan{bucket, window}, nil},
		{"a concurrency plan", "-@sortedset", []Plan{permits, bucket}, nil},
		{"the fleet", "-@sortedset", []Plan{bucket}, []Option{WithFleet(time.Hour)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := redistest.StartServer(t)
			require.NoError(t, srv.Client(t).Do(ctx, "ACL", "SETUSER", "default", "on", "nopass", "~*", "+@all", tc.forbid).Err())
			store := NewRedisStore(redistest.NewClient(t, redistest.FailFast(srv.Addr())))
			assert.NoError(t, checkOf(t, store), "a Limiter of buckets alone needs none of it")
			l, err := New(store, tc.plans, append([]Option{WithLogger(nil)}, tc.opts...)...)
			require.NoError(t, err)
			t.Cleanup(func() { _ = l.Close() })
			cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
			defer cancel()
			for i := range 2 { // the second right after the first, which must not deny it
				err = l.Check(cctx)
				require.ErrorIs(t, err, ErrStoreUnavailable, "Check %d", i+1)
				assert.NotContains(t, err.Error(), "{=}", "no key in the error")
			}
		})
	}
}

// TestCheckTriesTheFallbackStore gives a Limiter a fallback RedisStore
// whose Redis wants a password: Check says so at startup, rather than the
// first outage finding a fallback that fails too.
func TestCheckTriesTheFallbackStore(t *testing.T) {
	main, fb := miniredis.RunT(t), miniredis.RunT(t)
	fb.RequireAuth("secret")
	store := func(mr *miniredis.Miniredis) *RedisStore {
		c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
		t.Cleanup(func() { _ = c.Close() })
		return NewRedisStore(c)
	}
	l, err := New(store(main), testPlans, WithLogger(nil), WithFallback(store(fb)))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	err = l.Check(ctx)
	require.ErrorIs(t, err, ErrStoreUnavailable)
	assert.ErrorContains(t, err, "fallback")
	assert.ErrorContains(t, err, "credentials")

	fb.RequireAuth("")
	assert.NoError(t, l.Check(ctx))
}
