package redisscript

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestRunHealsNoscript(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	s := New("return {1, tonumber(ARGV[1]), KEYS[1]}")
	ctx := context.Background()
	for i := 0; i < 3; i++ {
		reply, err := s.Run(ctx, c, []string{"k"}, 42)
		require.NoError(t, err)
		assert.Equal(t, []any{int64(1), int64(42), "k"}, reply)
	}
	assert.Equal(t, int64(1), s.Loads(), "loaded once, then EVALSHA finds it")
	require.NoError(t, c.ScriptFlush(ctx).Err())
	_, err := s.Run(ctx, c, []string{"k"}, 1)
	require.NoError(t, err)
	assert.Equal(t, int64(2), s.Loads())
	assert.Len(t, s.SHA(), 40)
}

func TestRunKeepsOnlyTheClass(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	s := New("return redis.call('GET', KEYS[1])")
	mr.SetError("OOM command not allowed; key 'secret-key'")
	_, err := s.Run(context.Background(), c, []string{"secret-key"})
	var rerr *Error
	require.ErrorAs(t, err, &rerr)
	assert.Equal(t, "OOM", rerr.Class)
	assert.Equal(t, "redis answered OOM", err.Error())
}

// fakeRedisError is an error Redis answered, as go-redis types them.
type fakeRedisError string

func (e fakeRedisError) Error() string { return string(e) }
func (fakeRedisError) RedisError()     {}

func TestSanitize(t *testing.T) {
	timeout := &net.OpError{Op: "read", Err: os.ErrDeadlineExceeded}
	for _, tc := range []struct {
		in   error
		want string
	}{
		{fakeRedisError("ERR unknown command 'evalsha', with args beginning with: 'abc' '1' 'tollgate:{alice}:gold'"), "redis answered ERR"},
		{fakeRedisError("READONLY You can't write against a read only replica."), "redis answered READONLY"},
		{fakeRedisError("NOPERM this user has no permissions to run the 'evalsha' command"), "redis answered NOPERM"},
		{fakeRedisError("alice@example.com is not a class"), "redis answered ERR"},
		{fmt.Errorf("wrapped: %w", fakeRedisError("BUSY Redis is busy running a script")), "redis answered BUSY"},
		{fakeRedisError("ERR Error running script (call to f_0a1b): @user_script:63: @user_script: 63: -OOM command not allowed when used memory > 'maxmemory'."), "redis answered OOM"},
		{fakeRedisError("ERR Error running script (call to f_0a1b): @user_script:1: -alice@example.com"), "redis answered ERR"},
		{fakeRedisError("ERR unknown command 'evalsha', with args beginning with: 'tollgate:{x: -ALICE y}:gold'"), "redis answered ERR"},
		{fakeRedisError("ALICE is no class Redis answers"), "redis answered ERR"},
		{timeout, timeout.Error()},
		{context.Canceled, "context canceled"},
		{redis.Nil, "redis: nil"},
	} {
		got := Sanitize(tc.in)
		assert.Equal(t, tc.want, got.Error(), "%v", tc.in)
		assert.NotContains(t, got.Error(), "alice")
		assert.NotContains(t, got.Error(), "ALICE")
	}
	assert.NoError(t, Sanitize(nil))
	assert.True(t, errors.Is(Sanitize(context.Canceled), context.Canceled))
}

func TestInts(t *testing.T) {
	got, err := Ints(nil, []any{int64(0), int64(MaxExact)}, 2)
	require.NoError(t, err)
	assert.Equal(t, []int64{0, MaxExact}, got)
	for _, bad := range []any{
		nil, "x", []any{int64(1)}, []any{int64(1), "2"}, []any{int64(-1), int64(0)}, []any{int64(MaxExact + 1), int64(0)},
	} {
		_, err := Ints(nil, bad, 2)
		assert.ErrorIs(t, err, ErrBadReply, "%v", bad)
	}
}

// TestRunNilReplyIsBadReply: a script that replies nil (Lua's nil or
// false) gave no reply of the expected shape: go-redis hands that over as
// redis.Nil, which is ErrBadReply, not an error Redis answered.
func TestRunNilReplyIsBadReply(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	for _, src := range []string{"return nil", "return false"} {
		_, err := New(src).Run(context.Background(), c, []string{"k"})
		assert.ErrorIs(t, err, ErrBadReply, "%s: got %v", src, err)
		var rerr *Error
		assert.False(t, errors.As(err, &rerr), "%s: %v is no error Redis answered", src, err)
	}
}
