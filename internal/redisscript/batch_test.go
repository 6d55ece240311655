package redisscript

import (
	"context"
	"testing"

	"github.com/alicebob/miniredis/v2"
	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tollgate-go/tollgate/internal/redistest"
)

// counter adds ARGV[1] to the integer at KEYS[1] and replies with the
// sum, a number past Lua's own formatting (10^15), and the number of keys
// and args it was given.
const counter = `local v = redis.call('INCRBY', KEYS[1], ARGV[1])
return {v, 1000000000000000 + v, #KEYS, #ARGV}`

// batchClients returns a miniredis client and, when a real Redis is
// reachable, a real one, with a key prefix of this test's own.
func batchClients(t *testing.T) map[string]redis.UniversalClient {
	mr := miniredis.RunT(t)
	clients := map[string]redis.UniversalClient{"miniredis": redis.NewClient(&redis.Options{Addr: mr.Addr()})}
	if redistest.Available() {
		clients["redis"] = redistest.NewClient(t, &redis.Options{Addr: redistest.Addr(t)})
	}
	return clients
}

func ints(t *testing.T, reply any, n int) []int64 {
	t.Helper()
	v, err := Ints(nil, reply, n)
	require.NoError(t, err)
	return v
}

// TestBatchRunsEachCallAsItsOwn runs three calls of one script in a batch,
// one of them on a key of the wrong type: each call sees only its own keys
// and args, gets the reply a call of its own gets, and the failing call's
// error is its own, reduced to its class, while the others' writes stand.
func TestBatchRunsEachCallAsItsOwn(t *testing.T) {
	for name, c := range batchClients(t) {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			p := redistest.KeyPrefix()
			require.NoError(t, c.HSet(ctx, p+"hash", "f", "secret").Err())
			calls := []*Call{
				{Keys: []string{p + "a"}, Args: []any{5}},
				{Keys: []string{p + "hash"}, Args: []any{1}},
				{Keys: []string{p + "b", p + "unused"}, Args: []any{7, "x", "y"}},
			}
			b := NewBatch("", counter)
			b.Run(ctx, c, calls)
			require.NoError(t, calls[0].Err)
			assert.Equal(t, []int64{5, 1e15 + 5, 1, 1}, ints(t, calls[0].Reply, 4))
			var rerr *Error
			require.ErrorAs(t, calls[1].Err, &rerr)
			assert.Equal(t, "WRONGTYPE", rerr.Class)
			assert.NotContains(t, calls[1].Err.Error(), p)
			require.NoError(t, calls[2].Err)
			assert.Equal(t, []int64{7, 1e15 + 7, 2, 3}, ints(t, calls[2].Reply, 4))

			single, err := New(counter).Run(ctx, c, []string{p + "a"}, 1)
			require.NoError(t, err)
			assert.Equal(t, []int64{6, 1e15 + 6, 1, 1}, ints(t, single, 4), "the batch's write stood")
		})
	}
}

// TestBatchRunsThePreludeOnce: the prelude's functions are made once per
// batch and serve every call in it.
func TestBatchRunsThePreludeOnce(t *testing.T) {
	for name, c := range batchClients(t) {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			p := redistest.KeyPrefix()
			prelude := `redis.call('INCR', '` + p + `preludes')
local function double(x) return 2 * x end`
			b := NewBatch(prelude, `return {double(tonumber(ARGV[1]))}`)
			calls := []*Call{{Keys: []string{p + "a"}, Args: []any{1}}, {Keys: []string{p + "b"}, Args: []any{2}}, {Keys: []string{p + "c"}, Args: []any{3}}}
			b.Run(ctx, c, calls)
			for i, call := range calls {
				require.NoError(t, call.Err)
				assert.Equal(t, []int64{2 * int64(i+1)}, ints(t, call.Reply, 1))
			}
			assert.Equal(t, "1", c.Get(ctx, p+"preludes").Val(), "once for three calls")
		})
	}
}

func TestBatchHealsNoscript(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	ctx := context.Background()
	b := NewBatch("", counter)
	for i := 0; i < 3; i++ {
		calls := []*Call{{Keys: []string{"a"}, Args: []any{1}}, {Keys: []string{"b"}, Args: []any{1}}}
		b.Run(ctx, c, calls)
		require.NoError(t, calls[0].Err)
		require.NoError(t, calls[1].Err)
	}
	assert.Equal(t, int64(1), b.Loads())
	require.NoError(t, c.ScriptFlush(ctx).Err())
	calls := []*Call{{Keys: []string{"a"}, Args: []any{1}}}
	b.Run(ctx, c, calls)
	require.NoError(t, calls[0].Err)
	assert.Equal(t, []int64{4, 1e15 + 4, 1, 1}, ints(t, calls[0].Reply, 4))
	assert.Equal(t, int64(2), b.Loads())
}

// TestBatchFailureReachesEveryCall makes the whole script call fail: every
// call gets the error, with only its class.
func TestBatchFailureReachesEveryCall(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr(), MaxRetries: -1})
	mr.SetError("READONLY You can't write against a read only replica; key 'secret'")
	calls := []*Call{{Keys: []string{"secret"}, Args: []any{1}}, {Keys: []string{"b"}, Args: []any{1}}}
	NewBatch("", counter).Run(context.Background(), c, calls)
	for _, call := range calls {
		var rerr *Error
		require.ErrorAs(t, call.Err, &rerr)
		assert.Equal(t, "READONLY", rerr.Class)
		assert.Nil(t, call.Reply)
	}
}

// TestBatchChecksTheReply feeds the batch script's replies of the wrong
// shape, through a script that ignores its calls and replies as told.
func TestBatchChecksTheReply(t *testing.T) {
	mr := miniredis.RunT(t)
	c := redis.NewClient(&redis.Options{Addr: mr.Addr()})
	for _, tc := range []struct {
		name, script string
	}{
		{"not an array", "return 1"},
		{"too few replies", "return {'1,2'}"},
		{"an element not a string", "return {'1,2', 3}"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := &Batch{script: New(tc.script)}
			calls := []*Call{{Keys: []string{"a"}}, {Keys: []string{"b"}}}
			b.Run(context.Background(), c, calls)
			assert.ErrorIs(t, calls[1].Err, ErrBadReply)
		})
	}
}

func TestPackedInts(t *testing.T) {
	seven := func(xs ...int64) string { // 7 big-endian bytes each
		var b []byte
		for _, x := range xs {
			for i := 6; i >= 0; i-- {
				b = append(b, byte(x>>(8*i)))
			}
		}
		return string(b)
	}
	got, err := Ints(nil, seven(0, MaxExact, 17), 3)
	require.NoError(t, err)
	assert.Equal(t, []int64{0, MaxExact, 17}, got)
	for _, bad := range []string{"", seven(1, 2), seven(1, 2, 3, 4), seven(1, 2, 3)[1:], seven(1, 2, 3) + "x", seven(1, MaxExact+1, 3), seven(1<<56-1, 2, 3)} {
		_, err := Ints(nil, bad, 3)
		assert.ErrorIs(t, err, ErrBadReply, "%q", bad)
	}
}
