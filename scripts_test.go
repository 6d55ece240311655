package tollgate

import (
	"math"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	lua "github.com/yuin/gopher-lua"

	"github.com/tollgate-go/tollgate/internal/redisscript"
)

// limitScript is the general decision's script as a store sends it alone:
// the bucket's functions, then scripts/limit.lua.
var limitScript = luaBucket + luaSemaphore + luaLimit

// redis72Number is how Redis 7.2.0 to 7.2.4 pass a Lua number to a
// command (fpconv_dtoa, before redis/redis#13115 in 7.2.5): a whole number
// with 8 or more trailing zeros in scientific notation, 100,000,000 as
// "1e+8". Redis 7.0 (%.17g), 7.2.5 and later, and miniredis write it digit
// for digit, which is why no test on them sees it.
func redis72Number(x float64) string {
	s := strconv.FormatFloat(x, 'f', -1, 64)
	if x != math.Trunc(x) || strings.HasPrefix(s, "-") {
		return s
	}
	digits := strings.TrimRight(s, "0")
	if k := len(s) - len(digits); k < 8 || digits == "" {
		return s
	}
	out := digits[:1]
	if len(digits) > 1 {
		out += "." + digits[1:]
	}
	return out + "e+" + strconv.Itoa(len(s)-1)
}

func TestRedis72Number(t *testing.T) {
	for x, want := range map[float64]string{1: "1", 12_000_000: "12000000", 100_000_000: "1e+8", 300_000_000: "3e+8", 123_456_789: "123456789", 1_200_000_000: "1.2e+9"} {
		require.Equal(t, want, redis72Number(x))
	}
}

// runScriptAs72 runs a script on a minimal fake Redis (TIME, GET, SET,
// over data) that converts Lua numbers as Redis 7.2.0 to 7.2.4 do, and
// returns its reply.
func runScriptAs72(t *testing.T, data map[string]string, src string, keys, argv []string) *lua.LTable {
	t.Helper()
	L := lua.NewState()
	defer L.Close()
	call := func(L *lua.LState) int {
		args := make([]string, L.GetTop())
		for i := range args {
			switch v := L.Get(i + 1).(type) {
			case lua.LNumber:
				args[i] = redis72Number(float64(v))
			case lua.LString:
				args[i] = string(v)
			default:
				L.RaiseError("bad argument %d", i+1)
			}
		}
		switch strings.ToUpper(args[0]) {
		case "TIME":
			tb := L.NewTable()
			tb.Append(lua.LString(strconv.FormatInt(t0/1_000_000, 10)))
			tb.Append(lua.LString(strconv.FormatInt(t0%1_000_000, 10)))
			L.Push(tb)
		case "GET":
			if v, ok := data[args[1]]; ok {
				L.Push(lua.LString(v))
			} else {
				L.Push(lua.LFalse)
			}
		case "SET":
			if len(args) == 5 && !isInteger(args[4]) { // SET key value PX ms
				L.RaiseError("ERR value is not an integer or out of range")
			}
			data[args[1]] = args[2]
			L.Push(lua.LString("OK"))
		default:
			L.RaiseError("unexpected command %s", args[0])
		}
		return 1
	}
	r := L.NewTable()
	L.SetField(r, "call", L.NewFunction(call))
	L.SetField(r, "pcall", L.NewFunction(call))
	L.SetGlobal("redis", r)
	for name, vals := range map[string][]string{"KEYS": keys, "ARGV": argv} {
		tb := L.NewTable()
		for _, v := range vals {
			tb.Append(lua.LString(v))
		}
		L.SetGlobal(name, tb)
	}
	require.NoError(t, L.DoString(src))
	reply, ok := L.Get(-1).(*lua.LTable)
	require.True(t, ok, "the script replies with an array")
	return reply
}

// TestHoldOfALargeRoundCostSettlesOnRedis72: a hold set to the cost as a
// Lua number, which Redis 7.2.0 to 7.2.4 (inside README's "Redis 5.0 or later") write
// as "1e+8" for a reservation of 100,000,000 (a download of 100 MB
// reserved in bytes, say). settle.lua reads only digits as a hold of
// ours, so it settles that reservation as a bad hold: the refund is
// dropped and Settle returns ErrHoldExpired, the hold unreadable. Setting the hold to ARGV[1], the
// digits the store sent, does not depend on the server's conversion.
func TestHoldOfALargeRoundCostSettlesOnRedis72(t *testing.T) {
	data := map[string]string{}
	keys := []string{"tg:{k}:2:p", "tg:{k}:2:~h"}
	reply := runScriptAs72(t, data, limitScript, keys, []string{"100000000", "1000000000", "1000000", "900000"})
	require.Equal(t, lua.LNumber(1), reply.RawGetInt(1), "allowed")
	require.Contains(t, data, keys[1], "the hold is set")
	hold := data[keys[1]]

	keys = append(keys, "tg:{k}:2:~") // the reset mark, absent
	reply = runScriptAs72(t, data, settleScript, keys, []string{"100000000", "0", "900000", "0", "0", "1000000000", "1000000", "0"})
	require.Equal(t, lua.LNumber(0), reply.RawGetInt(1), "status 0: settled as a live hold, not as data not ours (hold %q)", hold)
	require.Equal(t, "s", data[keys[1]], "the tombstone")
}

// isInteger reports whether s is what Redis reads as an integer argument.
func isInteger(s string) bool {
	_, err := strconv.ParseInt(s, 10, 64)
	return err == nil
}

// TestBucketExpiryOfARoundNumberOnRedis72 writes a bucket whose expiry
// is 100,000,000 ms: on Redis 7.2.0 to 7.2.4 a Lua number would reach SET
// as 'PX 1e+8', which Redis refuses, and the decision would fail.
func TestBucketExpiryOfARoundNumberOnRedis72(t *testing.T) {
	lean := redisscript.ReplyLua + luaBucket + luaTake + "\nreturn takeOne(KEYS, ARGV)"
	for name, script := range map[string]string{"general": limitScript, "lean": lean} {
		data := map[string]string{}
		// 99,999,998 tokens refill at 1,000 a second in 99,999,998 ms, and
		// the expiry adds 2 ms.
		reply := runScriptAs72(t, data, script, []string{"tg:{k}:2:p"}, []string{"99999998", "99999998", "1000"})
		require.Equal(t, lua.LNumber(1), reply.RawGetInt(1), "%s: allowed", name)
		require.Contains(t, data, "tg:{k}:2:p", "%s: the bucket is written", name)
	}
}

// TestBucketLuaKnowsTheLongestRefill: bucket.lua bounds a version's fence
// by plan.go's maxRefillPeriod, which it spells as a number.
func TestBucketLuaKnowsTheLongestRefill(t *testing.T) {
	require.Contains(t, luaBucket, "local maxRefill = "+strconv.FormatInt(maxRefillPeriod.Microseconds(), 10)+" ")
}
