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
