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

// echoGroups replies, for each call, its group's number, the group's two
// shared args, its own arg and the number of keys it was given, from the
// layout Grouped sends; a call whose own arg is 0 fails with BUSY, and
// one whose key holds a hash with WRONGTYPE, each as its own error.
const echoGroups = `local function echo(key, j, a, b, own)
  if own == 0 then error('BUSY test') end
  redis.call('INCRBY', key, own)
  return packInts(intsFormat(4), j, a, b, own)
end
local function run(KEYS, ARGV)
  local out, i, groups = {}, 0, ARGV[1] + 0
  local owns = 1 + 3 * groups
  for j = 1, groups do
    local n, a, b = ARGV[3 * j - 1] + 0, ARGV[3 * j] + 0, ARGV[3 * j + 1] + 0
    for _ = 1, n do
      i = i + 1
      local ok, r = pcall(echo, KEYS[i], j, a, b, ARGV[owns + i] + 0)
      out[i] = ok and r or callError(r)
    end
  end
  return out
end`

// TestGroupedSendsRunsOfSharedArgsOnce runs calls whose shared args come
// in runs, and a call that fails and one on a key of the wrong type: each
// run of equal shared args is one group, the calls keep their order, and
// each call gets its own reply or error, with only its class.
func TestGroupedSendsRunsOfSharedArgsOnce(t *testing.T) {
	for name, c := range batchClients(t) {
		t.Run(name, func(t *testing.T) {
			ctx := context.Background()
			p := redistest.KeyPrefix()
			require.NoError(t, c.HSet(ctx, p+"hash", "f", "secret").Err())
			g := NewGrouped(NewLibrary("test_echo", ReplyLua+echoGroups, Entry{Name: "run", Body: "return run(KEYS, ARGV)"})[0], 1)
			call := func(key string, own int64, shared ...any) *Call {
				return &Call{Keys: []string{p + key}, Args: append([]any{own}, shared...)}
			}
			calls := []*Call{
				call("a", 1, int64(7), "8"),
				call("b", 2, int64(7), "8"),
				call("c", 3, int64(9), "8"),
				call("d", 0, int64(9), "8"), // fails
				call("hash", 5, int64(7), "8"),
				call("a", 6, int64(7), "8"),
			}
			g.Run(ctx, c, calls)
			want := [][]int64{{1, 7, 8, 1}, {1, 7, 8, 2}, {2, 9, 8, 3}, nil, nil, {3, 7, 8, 6}}
			for i, w := range want {
				if w == nil {
					continue
				}
				require.NoError(t, calls[i].Err, "call %d", i)
				assert.Equal(t, w, ints(t, calls[i].Reply, 4), "call %d", i)
			}
			var rerr *Error
			require.ErrorAs(t, calls[3].Err, &rerr)
			assert.Equal(t, "BUSY", rerr.Class)
			require.ErrorAs(t, calls[4].Err, &rerr)
			assert.Equal(t, "WRONGTYPE", rerr.Class)
			assert.NotContains(t, calls[4].Err.Error(), p)
			assert.Equal(t, "7", c.Get(ctx, p+"a").Val(), "both calls on a ran, in order")
		})
	}
}

// TestGroupedFailureReachesEveryCall: when the call of the function
// itself fails, every call gets its error.
func TestGroupedFailureReachesEveryCall(t *testing.T) {
	c := redis.NewClient(&redis.Options{Addr: miniredis.RunT(t).Addr()})
	t.Cleanup(func() { _ = c.Close() })
	g := NewGrouped(NewLibrary("test_fail", "", Entry{Name: "run", Body: "return {1}"})[0], 1)
	calls := []*Call{{Keys: []string{"a"}, Args: []any{1, 2}}, {Keys: []string{"b"}, Args: []any{1, 2}}}
	g.Run(context.Background(), c, calls)
	for _, call := range calls {
		assert.ErrorIs(t, call.Err, ErrBadReply)
	}
}

func TestSameArgs(t *testing.T) {
	assert.True(t, sameArgs([]any{int64(1), "2", 3, 4.5}, []any{int64(1), "2", 3, 4.5}))
	for _, b := range [][]any{{int64(2), "2", 3, 4.5}, {1, "2", 3, 4.5}, {int64(1), "2"}, {int64(1), []byte("2"), 3, 4.5}} {
		assert.False(t, sameArgs([]any{int64(1), "2", 3, 4.5}, b), "%v", b)
	}
	assert.False(t, sameArgs([]any{[]byte("x")}, []any{[]byte("x")}), "no panic on a type == cannot compare")
}
