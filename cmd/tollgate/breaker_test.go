package main

import (
	"context"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/breaker"
)

func TestBreakerCommand(t *testing.T) {
	mr := miniredis.RunT(t)
	ctx := context.Background()
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	b, err := breaker.NewShared(c, breaker.SharedSettings{MinCalls: 2, OpenFor: time.Minute}, breaker.WithLogger(nil))
	require.NoError(t, err)
	for range 2 {
		tk, err := b.Acquire(ctx, "hooks.example")
		require.NoError(t, err)
		require.NoError(t, tk.Done(ctx, breaker.Failure))
	}

	code, out, errOut := cli(t, ctx, mr.Addr(), "breaker", "show", "hooks.example")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, `"tollgate:{hooks.example}:cb"`)
	assert.Contains(t, out, "state       open (probes in ")
	assert.Contains(t, out, "trips       1")

	code, out, errOut = cli(t, ctx, mr.Addr(), "breaker", "reset", "hooks.example")
	require.Equal(t, exitOK, code, errOut)
	assert.Contains(t, out, "state       closed")
	assert.Contains(t, out, "trips       0")

	code, out, _ = cli(t, ctx, mr.Addr(), "breaker", "open", "hooks.example")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "forced")
	_, err = b.State(ctx, "hooks.example")
	require.NoError(t, err)
	code, out, _ = cli(t, ctx, mr.Addr(), "breaker", "close", "hooks.example")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "state       closed")

	require.NoError(t, mr.Set("tollgate:{junk}:cb", "x"))
	code, out, _ = cli(t, ctx, mr.Addr(), "breaker", "show", "junk")
	require.Equal(t, exitOK, code)
	assert.Contains(t, out, "foreign data")

	for _, args := range [][]string{
		{"breaker"}, {"breaker", "flip", "k"}, {"breaker", "show"}, {"breaker", "show", "a", "b"},
		{"breaker", "show", "-prefix", "a{", "k"}, {"breaker", "show", "-window", "-1s", "k"},
	} {
		code, _, _ := cli(t, ctx, mr.Addr(), args...)
		assert.Equal(t, exitUsage, code, "%q", args)
	}
	code, _, errOut = cli(t, ctx, deadAddr(t), "breaker", "show", "secret-key")
	assert.Equal(t, exitError, code)
	assert.NotContains(t, errOut, "secret-key")
}
