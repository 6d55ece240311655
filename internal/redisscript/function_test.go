package redisscript

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// counterLib is a library of two functions: incr adds ARGV[1] to the
// integer at KEYS[1], with a number its prelude computed once per Lua
// state; get reads it and writes nothing.
func counterLib() (incr, get *Function) {
	fns := NewLibrary("test_counter", `local base = 1000000000000000
local function add(key, n) return redis.call('INCRBY', key, n) end`,
		Entry{Name: "incr", Body: "local v = add(KEYS[1], ARGV[1])\nreturn {v, base + v}"},
		Entry{Name: "get", Body: "return {tonumber(redis.call('GET', KEYS[1]) or '0')}"})
	return fns[0], fns[1]
}

// cmdLog is a go-redis hook that counts the commands sent, by name, and
// answers every FCALL with a chosen error, if one is set.
type cmdLog struct {
	mu     sync.Mutex
	names  map[string]int
	refuse atomic.Pointer[string]
}

func newCmdLog() *cmdLog { return &cmdLog{names: map[string]int{}} }

func (h *cmdLog) count(name string) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.names[name]
}

func (h *cmdLog) DialHook(next redis.DialHook) redis.DialHook { return next }

func (h *cmdLog) ProcessHook(next redis.ProcessHook) redis.ProcessHook {
	return func(ctx context.Context, cmd redis.Cmder) error {
		h.mu.Lock()
		h.names[cmd.Name()]++
		h.mu.Unlock()
		if msg := h.refuse.Load(); msg != nil && cmd.Name() == "fcall" {
			return fakeRedisError(*msg) // go-redis sets it as the command's error
		}
		return next(ctx, cmd)
	}
}

func (h *cmdLog) ProcessPipelineHook(next redis.ProcessPipelineHook) redis.ProcessPipelineHook {
	return next
}

// TestFunctionLoadsAndHealsOnRealRedis: the first call finds no function,
// loads the library and calls it; later calls need no load; after FUNCTION
// FLUSH (or a restart without persistence) one call loads it again. The
// prelude's state lives on between calls, as a library's does.
func TestFunctionLoadsAndHealsOnRealRedis(t *testing.T) {
	addr := redistest.Addr(t)
	c := redistest.NewClient(t, &redis.Options{Addr: addr})
	ctx := context.Background()
	key := redistest.KeyPrefix() + "n"
	incr, get := counterLib()
	// A shared server may hold this test's library from an earlier run:
	// start without it, leaving every other library alone.
	lib := strings.TrimSuffix(incr.Name(), "_incr")
	if err := c.FunctionDelete(ctx, lib).Err(); err != nil {
		require.ErrorContains(t, err, "not found")
	}
	for i := int64(1); i <= 3; i++ {
		reply, err := incr.Run(ctx, c, []string{key}, 2)
		require.NoError(t, err)
		assert.Equal(t, []any{2 * i, 1e15 + 2*i}, reply)
	}
	assert.Equal(t, int64(1), incr.Loads(), "loaded once")
	reply, err := get.Run(ctx, c, []string{key})
	require.NoError(t, err)
	assert.Equal(t, []any{int64(6)}, reply)
	assert.Zero(t, get.Loads(), "the library came with incr")

	require.NoError(t, c.FunctionFlush(ctx).Err())
	reply, err = get.Run(ctx, c, []string{key})
	require.NoError(t, err)
	assert.Equal(t, []any{int64(6)}, reply)
	assert.Equal(t, int64(1), get.Loads(), "healed once")
	assert.Zero(t, incr.script.Loads(), "never run as a script")
	libs, err := c.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: "test_counter_*"}).Result()
	require.NoError(t, err)
	require.Len(t, libs, 1)
	assert.ElementsMatch(t, []string{incr.Name(), get.Name()}, []string{libs[0].Functions[0].Name, libs[0].Functions[1].Name})
}

// TestFunctionRunsAsScriptWithoutFunctions: miniredis has no FCALL. The
// first call learns it and runs the script; every later call is EVALSHA
// alone, and NOSCRIPT heals as Script's does.
func TestFunctionRunsAsScriptWithoutFunctions(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	t.Cleanup(func() { _ = c.Close() })
	h := newCmdLog()
	c.AddHook(h)
	ctx := context.Background()
	incr, get := counterLib()
	for i := int64(1); i <= 3; i++ {
		reply, err := incr.Run(ctx, c, []string{"n"}, 1)
		require.NoError(t, err)
		assert.Equal(t, []any{i, 1e15 + i}, reply)
	}
	reply, err := get.Run(ctx, c, []string{"n"})
	require.NoError(t, err)
	assert.Equal(t, []any{int64(3)}, reply)
	assert.Equal(t, 1, h.count("fcall"), "learned once, for the library")
	assert.Zero(t, h.count("function"), "no FUNCTION LOAD")
	assert.Equal(t, 4, h.count("evalsha"))
	assert.Equal(t, int64(1), incr.Loads(), "its script, after NOSCRIPT")
	require.NoError(t, c.ScriptFlush(ctx).Err())
	_, err = incr.Run(ctx, c, []string{"n"}, 1)
	require.NoError(t, err)
	assert.Equal(t, int64(2), incr.Loads())
}

// TestFunctionRunsAsScriptWhenRedisRefusesToStartIt: Redis refuses to
// start a function that may write at maxmemory, on a read-only replica or
// short of replicas, where a script runs until it writes. Such a call
// runs as a script, and the store keeps using functions.
func TestFunctionRunsAsScriptWhenRedisRefusesToStartIt(t *testing.T) {
	mr := miniredis.RunT(t)
	for _, msg := range []string{
		"OOM command not allowed when used memory > 'maxmemory'.",
		"READONLY You can't write against a read only replica.",
		"NOREPLICAS Not enough good replicas to write.",
	} {
		c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
		h := newCmdLog()
		h.refuse.Store(&msg)
		c.AddHook(h)
		incr, _ := counterLib()
		for range 2 {
			_, err := incr.Run(context.Background(), c, []string{"refused"}, 1)
			require.NoError(t, err, msg)
		}
		assert.Equal(t, 2, h.count("fcall"), "%s: still a function's server", msg)
		assert.Equal(t, 2, h.count("evalsha"), "%s: each call ran as a script", msg)
		assert.False(t, incr.lib.scripts.Load(), msg)
		_ = c.Close()
	}
	other := "BUSY Redis is busy running a script."
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	h := newCmdLog()
	h.refuse.Store(&other)
	c.AddHook(h)
	incr, _ := counterLib()
	_, err := incr.Run(context.Background(), c, []string{"refused"}, 1)
	var rerr *Error
	require.ErrorAs(t, err, &rerr, "any other error is the call's")
	assert.Equal(t, "BUSY", rerr.Class)
	assert.Zero(t, h.count("evalsha"))
}

// TestFunctionOnReadOnlyReplicaOnRealRedis: a function that writes
// nothing answers on a replica, as a script does, and one that writes
// fails with READONLY, as a script's write does.
func TestFunctionOnReadOnlyReplicaOnRealRedis(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	master := redistest.StartServer(t)
	replica := redistest.StartServer(t, "--replicaof", "127.0.0.1", fmt.Sprint(master.Port()))
	c := replica.Client(t)
	incr, get := counterLib()
	ctx := context.Background()
	reply, err := get.Run(ctx, c, []string{"n"})
	require.NoError(t, err)
	assert.Equal(t, []any{int64(0)}, reply)
	_, err = incr.Run(ctx, c, []string{"n"}, 1)
	var rerr *Error
	require.ErrorAs(t, err, &rerr)
	assert.Equal(t, "READONLY", rerr.Class)
}

// TestFunctionFallsBackWhenTheACLForbidsIt: a user who may run scripts but
// not FCALL, or not FUNCTION LOAD, runs scripts.
func TestFunctionFallsBackWhenTheACLForbidsIt(t *testing.T) {
	redistest.SkipIfUnavailable(t)
	for _, forbid := range []string{"-fcall", "-function"} {
		srv := redistest.StartServer(t)
		require.NoError(t, srv.Client(t).Do(context.Background(), "ACL", "SETUSER", "default", "on", "nopass", "~*", "+@all", forbid).Err())
		c := redistest.NewClient(t, &redis.Options{Addr: srv.Addr()})
		incr, _ := counterLib()
		for i := int64(1); i <= 2; i++ {
			reply, err := incr.Run(context.Background(), c, []string{"n"}, 1)
			require.NoError(t, err, forbid)
			assert.Equal(t, []any{i, 1e15 + i}, reply, forbid)
		}
		assert.True(t, incr.lib.scripts.Load(), forbid)
	}
}

// TestFunctionLoadsOnEveryClusterMaster: a Cluster's masters each need the
// library. The first call loads it on all of them, so that calls on keys
// of every master find it; after FUNCTION FLUSH on every master, one call
// per master's keys heals.
func TestFunctionLoadsOnEveryClusterMaster(t *testing.T) {
	cl := redistest.StartCluster(t, 3, 0)
	c := cl.Client(t, nil)
	ctx := context.Background()
	incr, _ := counterLib()
	keys := []string{"{a}n", "{b}n", "{c}n", "{d}n", "{e}n"}
	for _, k := range keys {
		_, err := incr.Run(ctx, c, []string{k}, 1)
		require.NoError(t, err)
	}
	assert.Equal(t, int64(1), incr.Loads(), "one load reached every master")
	require.NoError(t, c.ForEachMaster(ctx, func(ctx context.Context, m *redis.Client) error {
		libs, err := m.FunctionList(ctx, redis.FunctionListQuery{LibraryNamePattern: "test_counter_*"}).Result()
		if err == nil && len(libs) != 1 {
			err = fmt.Errorf("%s has %d libraries", m.Options().Addr, len(libs))
		}
		if err != nil {
			return err
		}
		return m.FunctionFlush(ctx).Err()
	}))
	for _, k := range keys {
		reply, err := incr.Run(ctx, c, []string{k}, 1)
		require.NoError(t, err)
		assert.Equal(t, int64(2), reply.([]any)[0], k)
	}
	assert.Equal(t, int64(2), incr.Loads(), "healed once, on every master")
	assert.Zero(t, incr.script.Loads())
}

// TestLibraryNamesFollowTheCode: the library's and functions' names end
// with a hash of the code, so that two versions of a library never
// replace each other's functions in one Redis.
func TestLibraryNamesFollowTheCode(t *testing.T) {
	a, _ := counterLib()
	b, _ := counterLib()
	other := NewLibrary("test_counter", "local base = 2", Entry{Name: "incr", Body: "return {base}"})[0]
	assert.Equal(t, a.Name(), b.Name())
	assert.NotEqual(t, a.Name(), other.Name())
	assert.True(t, strings.HasPrefix(a.Name(), "test_counter_"), a.Name())
	assert.True(t, strings.HasSuffix(a.Name(), "_incr"), a.Name())
	assert.True(t, strings.HasPrefix(a.lib.code, "#!lua name=test_counter_"))
}

func TestErrorKinds(t *testing.T) {
	for _, tc := range []struct {
		msg                       string
		missing, none, refusedRun bool
	}{
		{msg: "ERR Function not found", missing: true},
		{msg: "ERR unknown command 'fcall', with args beginning with: 'f' '1' 'ERR Function not found'", none: true},
		{msg: "NOPERM this user has no permissions to run the 'fcall' command", none: true},
		{msg: "NOPERM this user has no permissions to run the 'function|load' command", none: true},
		{msg: "NOPERM this user has no permissions to access one of the keys used as arguments"},
		{msg: "OOM command not allowed when used memory > 'maxmemory'.", refusedRun: true},
		{msg: "READONLY You can't write against a read only replica.", refusedRun: true},
		{msg: "NOREPLICAS Not enough good replicas to write.", refusedRun: true},
		{msg: "ERR Error running script: Function not found"},
		{msg: "WRONGTYPE Operation against a key holding the wrong kind of value"},
	} {
		err := fakeRedisError(tc.msg)
		assert.Equal(t, tc.missing, notLoaded(err), tc.msg)
		assert.Equal(t, tc.none, noFunctions(err), tc.msg)
		assert.Equal(t, tc.refusedRun, refusedBeforeRunning(err), tc.msg)
	}
	assert.False(t, notLoaded(context.Canceled))
	assert.False(t, noFunctions(fmt.Errorf("dial: unknown command")))
}

// TestFunctionNilReplyIsBadReply: a function or its script that replies
// nil is ErrBadReply, as a script's nil reply is.
func TestFunctionNilReplyIsBadReply(t *testing.T) {
	mr := miniredis.RunT(t) // no functions: its script runs
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	t.Cleanup(func() { _ = c.Close() })
	f := NewLibrary("test_nil", "", Entry{Name: "nil", Body: "return nil"})[0]
	for range 2 {
		_, err := f.Run(context.Background(), c, []string{"k"})
		assert.ErrorIs(t, err, ErrBadReply, "got %v", err)
	}
	if redistest.Available() {
		rc := redistest.NewClient(t, &redis.Options{Addr: redistest.StartServer(t).Addr(), MaxRetries: -1})
		f := NewLibrary("test_nil", "", Entry{Name: "nil", Body: "return nil"})[0]
		for range 2 {
			_, err := f.Run(context.Background(), rc, []string{"k"})
			assert.ErrorIs(t, err, ErrBadReply, "FCALL: got %v", err)
		}
	}
}
