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

// echoGroups replies, in its shared record, the number of its ARGV, and
// for each call its group's number, the group's two shared args, its own
// arg and the number of keys it was given, from the layout Grouped sends;
// a call whose own arg is 0 fails with BUSY, and one whose key holds a
// hash with WRONGTYPE, each as its own error.
const echoGroups = `local function echo(key, j, a, b, own)
  if own == 0 then error('BUSY test') end
  redis.call('INCRBY', key, own)
  local r = packInts(intsFormat(4), j, a, b, own)
  return string.char(#r) .. r
end
local function run(KEYS, ARGV)
  local out, i, groups = {string.char(7), packInts(intsFormat(1), #ARGV)}, 0, ARGV[1] + 0
  local owns = 1 + 4 * groups
  for j = 1, groups do
    local n, own, a, b = ARGV[4 * j - 2] + 0, ARGV[4 * j - 1], ARGV[4 * j] + 0, ARGV[4 * j + 1] + 0
    for _ = 1, n do
      i = i + 1
      local o = own
      if o == '' then
        owns = owns + 1
        o = ARGV[owns]
      end
      local ok, r = pcall(echo, KEYS[i], j, a, b, o + 0)
      out[#out + 1] = ok and r or errorRecord(r)
    end
  end
  return table.concat(out)
end`

// TestGroupedSendsRunsOfSharedArgsOnce runs calls whose shared args come
// in runs, and a call that fails and one on a key of the wrong type: each
// run of equal shared args is one group, whose own args are sent once if
// its calls have the same, the calls keep their order, and each call gets
// its own reply or error, with only its class.
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
				call("b", 1, int64(7), "8"),
				call("c", 3, int64(9), "8"),
				call("d", 0, int64(9), "8"), // fails
				call("hash", 5, int64(7), "8"),
				call("a", 6, int64(7), "8"),
			}
			g.Run(ctx, c, calls)
			want := [][]int64{{1, 7, 8, 1}, {1, 7, 8, 1}, {2, 9, 8, 3}, nil, nil, {3, 7, 8, 6}}
			for i, w := range want {
				if w == nil {
					continue
				}
				require.NoError(t, calls[i].Err, "call %d", i)
				r, ok := calls[i].Reply.(Record)
				require.True(t, ok, "call %d: %T", i, calls[i].Reply)
				assert.Equal(t, w, ints(t, r.Own[:28], 4), "call %d", i)
				assert.Equal(t, []int64{1 + 3*4 + 2 + 2}, ints(t, r.Shared, 1), "ARGV: 3 groups, the own args of 2 of them")
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

// TestDeliverRecords hands each call its record, or its error's class,
// and every call ErrBadReply if the reply holds other than a shared
// record and one per call, whole.
func TestDeliverRecords(t *testing.T) {
	calls := []*Call{{}, {}}
	deliverRecords(calls, "\x01s\x02ab\x05-BUSY", nil)
	assert.Equal(t, Record{Shared: "s", Own: "ab"}, calls[0].Reply)
	assert.NoError(t, calls[0].Err)
	assert.Nil(t, calls[1].Reply)
	assert.Equal(t, &Error{Class: "BUSY"}, calls[1].Err)
	deliverRecords(calls, "\x01s\x02ab\x05-WHAT", nil)
	assert.Equal(t, &Error{Class: "ERR"}, calls[1].Err, "a class Redis has not")
	for _, bad := range []any{"\x01s\x02ab", "\x01s\x02ab\x01c\x01d", "\x01s\x02ab\x05-BU", "", []any{"\x01s"}, nil} {
		deliverRecords(calls, bad, nil)
		for i, call := range calls {
			assert.ErrorIs(t, call.Err, ErrBadReply, "%q: call %d", bad, i)
			assert.Nil(t, call.Reply)
		}
	}
}

// FuzzDeliverRecords: whatever string Redis replies, every call gets a
// Record or an error, and nothing panics.
func FuzzDeliverRecords(f *testing.F) {
	f.Add("\x01s\x02ab\x05-BUSY", 2)
	f.Add("\x01s\x00\x01-", 2)
	f.Add("\xffs", 1)
	f.Fuzz(func(t *testing.T, reply string, n int) {
		calls := make([]*Call, 1+uint(n)%4)
		for i := range calls {
			calls[i] = &Call{}
		}
		deliverRecords(calls, reply, nil)
		for _, call := range calls {
			_, isRecord := call.Reply.(Record)
			assert.True(t, isRecord != (call.Err != nil), "a Record or an error: %#v, %v", call.Reply, call.Err)
		}
	})
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
