package redisscript

import (
	"context"
	"fmt"

	"github.com/redis/go-redis/v9"
)

// Batch runs many calls of one script in one script call: the script's
// source becomes a Lua function, and a loop gives each call its own KEYS
// and ARGV (tables the script must read, not write), runs it under pcall
// and packs its reply. The calls run one after the other, each atomic as
// a call of its own would be, and one call's error is its own: the
// others' writes stand and their replies come back. It suits scripts that reply with an array of integers. It is
// safe for concurrent use.
type Batch struct {
	script *Script
}

// ReplyLua defines, in Lua, how a batch replies for each of its calls,
// for a script or a library that comes after it. packInts(intsFormat(n),
// x1, ..., xn) packs a call's n integers, each 0 to 2^56 - 1, in 7
// big-endian bytes each (packedInts reads them): Redis's struct library
// packs them in C, where string.format was a twelfth of a batch's work
// in Redis, and is packInts itself, which spares a call of a function of
// ours; miniredis, which has none, gets the same bytes from plain Lua.
// callError(err) returns the reply of a call that failed with err, as
// pcall caught it: an error of its class alone, the first capital word of
// the message as Redis 7 words it, or the one after ': ' as earlier
// versions and miniredis word it (Sanitize keeps only known classes).
// errorRecord(err) returns the same class as a Grouped's record: a byte
// n, then n bytes, '-' and the class.
const ReplyLua = `local packInts, intsFormat
local struct = rawget(_G, 'struct')
if struct then
  packInts = struct.pack
  intsFormat = function(n) return '>' .. string.rep('I7', n) end
else
  local char, floor = string.char, math.floor
  intsFormat = function(n) return n end
  packInts = function(_, ...)
    local out = {...}
    for i = 1, #out do
      local x = out[i]
      out[i] = char(floor(x / 281474976710656) % 256, floor(x / 1099511627776) % 256,
        floor(x / 4294967296) % 256, floor(x / 16777216) % 256, floor(x / 65536) % 256,
        floor(x / 256) % 256, x % 256)
    end
    return table.concat(out)
  end
end
local function errorClass(err)
  if type(err) == 'table' then err = err.err end
  err = tostring(err)
  local class = string.match(err, '^%-?(%u+) ') or string.match(err, ': %-?(%u+) ') or 'ERR'
  if #class > 32 then return 'ERR' end
  return class
end
local function callError(err)
  return {err = errorClass(err) .. ' in a batched call'}
end
local function errorRecord(err)
  local class = errorClass(err)
  return string.char(1 + #class) .. '-' .. class
end
`

// batchFrame wraps a script's source: the first %s is ReplyLua, the
// second the script's prelude, which only defines functions, run once per
// batch, and the third its body, run once per call. ARGV[1] is the number of calls n,
// ARGV[2..n+1] the number of keys of each call, ARGV[n+2..2n+1] the
// number of its args, and the args follow, call after call, as the keys
// do in KEYS. Each call's reply is its integers, packed by packInts; a
// call that fails replies callError's error.
const batchFrame = `%s
%s
local function decide(KEYS, ARGV)
%s
end
local formats = {} -- packInts's formats, by number of integers
local function packed(ks, as)
  local reply = decide(ks, as)
  local n = #reply
  local f = formats[n]
  if not f then
    f = intsFormat(n)
    formats[n] = f
  end
  return packInts(f, unpack(reply))
end
local n = tonumber(ARGV[1])
local out, ks, as, ki, ai = {}, {}, {}, 0, 1 + 2 * n
for r = 1, n do
  -- One KEYS and one ARGV table serve every call; the script reads them
  -- and never writes them.
  local nk, na = ARGV[1 + r] + 0, ARGV[1 + n + r] + 0 -- converted once; tonumber converts twice
  for j = 1, nk do ks[j] = KEYS[ki + j] end
  for j = nk + 1, #ks do ks[j] = nil end
  for j = 1, na do as[j] = ARGV[ai + j] end
  for j = na + 1, #as do as[j] = nil end
  ki, ai = ki + nk, ai + na
  local ok, res = pcall(packed, ks, as)
  if ok then
    out[r] = res
  else
    out[r] = callError(res)
  end
end
return out
`

// NewBatch returns the Batch of the Lua source prelude + body. The
// prelude must only define what body uses, such as functions: it runs
// once per batch, not once per call, which spares each call the cost of
// making its closures. The body must end with its return statement, as a
// function body does.
func NewBatch(prelude, body string) *Batch {
	return &Batch{script: New(fmt.Sprintf(batchFrame, ReplyLua, prelude, body))}
}

// Loads returns how many times Run has sent the batch script's source
// after Redis answered NOSCRIPT.
func (b *Batch) Loads() int64 { return b.script.Loads() }

// Call is one call of a batch: its keys and args, and, once Run returns,
// its reply or its error.
type Call struct {
	Keys []string
	Args []any
	// Reply is the call's integers, packed in a string that Ints reads.
	Reply any
	// Err is the call's error, with only its class if Redis answered it:
	// the batch's own when the whole script call failed.
	Err error
}

// Run runs calls in one script call on c, and sets each call's Reply or
// Err. NOSCRIPT is healed as Script.Run heals it.
func (b *Batch) Run(ctx context.Context, c redis.Scripter, calls []*Call) {
	nk, na := 0, 1+2*len(calls)
	for _, call := range calls {
		nk += len(call.Keys)
		na += len(call.Args)
	}
	keys, args := make([]string, 0, nk), make([]any, 1+2*len(calls), na)
	args[0] = len(calls)
	for i, call := range calls {
		keys = append(keys, call.Keys...)
		args[1+i], args[1+len(calls)+i] = len(call.Keys), len(call.Args)
	}
	for _, call := range calls {
		args = append(args, call.Args...)
	}
	reply, err := b.script.Run(ctx, c, keys, args...)
	deliver(calls, reply, err)
}

// deliver hands each of calls its element of a batch's reply, or err,
// the batch's own, if the batch failed.
func deliver(calls []*Call, reply any, err error) {
	vals, ok := reply.([]any)
	if err == nil && (!ok || len(vals) != len(calls)) {
		err = fmt.Errorf("%w: want an array of %d replies, got %T", ErrBadReply, len(calls), reply)
	}
	for i, call := range calls {
		switch {
		case err != nil:
			call.Reply, call.Err = nil, err
		default:
			call.Reply, call.Err = element(vals[i])
		}
	}
}

// element returns one call's reply from a batch's reply.
func element(v any) (any, error) {
	switch e := v.(type) {
	case string:
		return v, nil // as it came: a string put in an interface again would be copied to the heap
	case error:
		return nil, Sanitize(e)
	}
	return nil, fmt.Errorf("%w: a batched reply is %T, not a string", ErrBadReply, v)
}

// packedInts appends to dst the integers of a batched reply, s, which
// holds n integers of 7 big-endian bytes each. Like Ints, it checks that
// each is 0 to MaxExact and names the shape but never a value.
func packedInts(dst []int64, s string, n int) ([]int64, error) {
	if len(s) != 7*n {
		return dst, fmt.Errorf("%w: want %d packed integers", ErrBadReply, n)
	}
	for i := range n {
		var x int64
		for _, c := range []byte(s[7*i : 7*i+7]) {
			x = x<<8 | int64(c)
		}
		if x > MaxExact {
			return dst, fmt.Errorf("%w: packed integer %d out of range", ErrBadReply, i)
		}
		dst = append(dst, x)
	}
	return dst, nil
}
