package main

import (
	"bytes"
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate"
	"github.com/tollgate-go/tollgate/breaker"
)

func TestMain(m *testing.M) {
	redis.SetLogger(quietLogger{}) // as main does
	os.Exit(m.Run())
}

// cli runs the command line args with REDIS_URL pointing at addr, and
// returns its exit status and output.
func cli(t *testing.T, ctx context.Context, addr string, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errOut bytes.Buffer
	getenv := func(k string) string {
		if k == "REDIS_URL" && addr != "" {
			return "redis://" + addr + "/0"
		}
		return ""
	}
	code = run(ctx, args, &out, &errOut, getenv)
	return code, out.String(), errOut.String()
}

// deadAddr returns the address of a Redis that has gone away.
func deadAddr(t *testing.T) string {
	mr := miniredis.NewMiniRedis()
	require.NoError(t, mr.Start())
	addr := mr.Addr()
	mr.Close()
	return addr
}

func TestUsageAndExitCodes(t *testing.T) {
	dead := deadAddr(t)
	tests := []struct {
		name       string
		args       []string
		code       int
		stdout     string
		stderr     string
		notInPrint string
	}{
		{name: "no args", args: nil, code: exitUsage, stderr: "Usage:\n  tollgate inspect"},
		{name: "help", args: []string{"help"}, code: exitOK, stdout: "Exit status: 0 ok, 1 runtime error, 2 usage error."},
		{name: "-h", args: []string{"-h"}, code: exitOK, stdout: "Usage:"},
		{name: "unknown command", args: []string{"frob"}, code: exitUsage, stderr: `tollgate: unknown command "frob"` + "\nRun 'tollgate help' for usage.\n"},
		{name: "inspect without args", args: []string{"inspect"}, code: exitUsage, stderr: "inspect needs KEY and at least one PLAN"},
		{name: "reset without plan", args: []string{"reset", "alice"}, code: exitUsage, stderr: "reset needs KEY and at least one PLAN"},
		{name: "subcommand -h", args: []string{"inspect", "-h"}, code: exitOK, stderr: "Usage: tollgate inspect [-redis URL] [-prefix P] KEY PLAN..."},
		{name: "unknown flag", args: []string{"inspect", "-nope", "alice", "gold"}, code: exitUsage, stderr: "flag provided but not defined: -nope"},
		{name: "brace in prefix", args: []string{"inspect", "-prefix", "a{b", "alice", "gold"}, code: exitUsage, stderr: "-prefix must be non-empty, without '{' or '}'"},
		{name: "empty key", args: []string{"reset", "", "gold"}, code: exitUsage, stderr: "KEY is empty"},
		{name: "long key", args: []string{"inspect", strings.Repeat("k", tollgate.MaxKeyLen+1), "gold"}, code: exitUsage, stderr: "KEY is 1025 bytes, longer than 1024", notInPrint: "kkkk"},
		{name: "bad plan name", args: []string{"inspect", "alice", "bad plan"}, code: exitUsage, stderr: `tollgate: invalid plan: name "bad plan"`},
		{name: "plan twice", args: []string{"reset", "alice", "gold", "gold"}, code: exitUsage, stderr: `plan name "gold" is given twice`},
		{name: "flag after KEY", args: []string{"reset", "alice", "-prefix", "staging", "gold"}, code: exitUsage, stderr: `flag-like argument "-prefix" after KEY: flags go before KEY`},
		{name: "bad URL hides password", args: []string{"inspect", "-redis", "redis://u:secret@[::1", "alice", "gold"}, code: exitUsage, stderr: "bad Redis URL: missing ']' in host", notInPrint: "secret"},
		// A password holding '/', '?' or '#' ends the authority early, and
		// net/url's error quotes what it took for the port: the password.
		{name: "bad URL hides a password with a slash", args: []string{"inspect", "-redis", "redis://u:pa55/word@localhost:6379/0", "alice", "gold"}, code: exitUsage, stderr: "bad Redis URL: the user name or password does not parse: percent-encode", notInPrint: "pa55"},
		{name: "bad URL hides a password with a hash", args: []string{"inspect", "-redis", "redis://u:pa55#word@localhost:6379/0", "alice", "gold"}, code: exitUsage, stderr: "bad Redis URL: the user name or password does not parse: percent-encode", notInPrint: "pa55"},
		{name: "bad scheme", args: []string{"inspect", "-redis", "http://localhost", "alice", "gold"}, code: exitUsage, stderr: "bad Redis URL"},
		{name: "Redis down", args: []string{"inspect", "-redis", "redis://u:secret@" + dead, "alice", "gold"}, code: exitError, stderr: "connection refused", notInPrint: "secret"},
		{name: "bench: bad plans", args: []string{"bench", "-plans", "x:1"}, code: exitUsage, stderr: `-plans: "x:1" is not NAME:CAPACITY:RATE or NAME:CAPACITY:WINDOW`},
		{name: "bench: zero capacity", args: []string{"bench", "-plans", "x:0:1"}, code: exitUsage, stderr: "-plans: invalid plan: capacity must be 1"},
		{name: "bench: neither rate nor window", args: []string{"bench", "-plans", "x:1:soon"}, code: exitUsage, stderr: `-plans: "soon" is neither a rate (tokens/s) nor a window (such as 1m)`},
		{name: "bench: window too short", args: []string{"bench", "-plans", "x:1:1us"}, code: exitUsage, stderr: "-plans: invalid plan: window must be 1ms to 100 years"},
		{name: "bench: zero duration", args: []string{"bench", "-duration", "0s"}, code: exitUsage, stderr: "-duration and -progress must be positive"},
		{name: "bench: argument", args: []string{"bench", "extra"}, code: exitUsage, stderr: `bench takes no arguments, got "extra"`},
		{name: "bench: Redis down", args: []string{"bench", "-redis", "redis://" + dead}, code: exitError, stderr: "tollgate: ping " + dead},
		{name: "breaker: Redis down", args: []string{"breaker", "show", "-redis", "redis://" + dead, "x"}, code: exitError, stderr: "tollgate: store unavailable", notInPrint: "tollgate: tollgate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := cli(t, context.Background(), "", tt.args...)
			assert.Equal(t, tt.code, code, "stderr: %s", stderr)
			assert.Contains(t, stdout, tt.stdout)
			assert.Contains(t, stderr, tt.stderr)
			if tt.code != exitOK {
				assert.Empty(t, stdout, "errors go to stderr")
			}
			if tt.notInPrint != "" {
				assert.NotContains(t, stdout+stderr, tt.notInPrint)
			}
		})
	}
}

var t0 = time.Date(2026, 11, 22, 10, 0, 0, 123456000, time.UTC)

// newLimiter returns a Limiter on mr, as a service would use it.
func newLimiter(t *testing.T, mr *miniredis.Miniredis, opts ...tollgate.Option) *tollgate.Limiter {
	client := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = client.Close() })
	lim, err := tollgate.New(tollgate.NewRedisStore(client, opts...), []tollgate.Plan{
		{Name: "gold", Capacity: 4, Rate: 2},
		{Name: "daily", Capacity: 100, Rate: tollgate.Per(100, 24*time.Hour)},
	}, tollgate.WithFailurePolicy(breaker.FailClosed), tollgate.WithLogger(nil))
	require.NoError(t, err)
	return lim
}
