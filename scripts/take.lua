-- take.lua: the lean decision, on one token bucket plan that has no
-- version and is not shadowed, without a hold: what most decisions are.
-- It gives the answers and writes the bytes limit.lua does for such a
-- decision (a test feeds both the same steps and demands both), with the
-- fewest redis.calls (GET, and SET when the bucket changes) and no
-- table or closure of its own per decision. It comes after bucket.lua and
-- the batch reply's functions (redisscript.ReplyLua), and only defines
-- functions, so that Redis Functions can load it as a library, whose
-- functions are made once, not once per call as a script's are.
--
-- takeOne is one decision, with KEYS and ARGV as limit.lua takes them for
-- one bucket:
-- KEYS[1]  the bucket
-- ARGV[1]  cost in tokens; 0 reads without taking or writing, and -n reads
--          as if asked for n tokens
-- ARGV[2]  capacity in tokens
-- ARGV[3]  rate in tokens per second (= micro-tokens per µs)
-- Reply: {allowed (1 or 0), now (µs, from TIME), tokens, stamp}, as
-- limit.lua replies.
--
-- takeMany is many decisions, each one's reply packed as a batch packs it
-- (redisscript.Grouped), all made at one reading of TIME:
-- KEYS[i]         decision i's bucket, decisions grouped by their plan
-- ARGV[1]         g, the number of groups
-- ARGV[3j-1..3j+1] group j: how many decisions it holds, then its
--                 capacity and rate, as above
-- ARGV[3g+1+i]    decision i's cost, as above

-- take decides cost tokens (a string or a number) of the bucket at key,
-- of capacity cap and rate rate (numbers), at now, as limit.lua does; it
-- returns allowed (1 or 0) and the bucket's tokens and stamp as limit.lua
-- replies them: after the decision if it took tokens, else as read.
local function take(key, cost, cap, rate, now)
  cost = cost + 0
  local full, need = cap * 1000000, cost * 1000000
  local t, ts, pv, c = readBucket(key, full, now)
  local rt, rts = refill(t, ts, full, rate, now)
  if need > 0 and rt >= need then
    rt = rt - need
    writeBucket(key, rt, rts, full, rate, now, pv, c)
    return 1, rt, rts
  end
  -- A stamp too far ahead is brought back by a decision that asks for
  -- tokens, allowed or not (ADR 29).
  if cost > 0 and tooFarAhead(ts, full, rate, now) then
    writeBucket(key, rt, rts, full, rate, now, pv, c)
  end
  return rt >= need and 1 or 0, t, ts
end

local function takeOne(KEYS, ARGV)
  local now = readClock()
  local allowed, t, ts = take(KEYS[1], ARGV[1], ARGV[2] + 0, ARGV[3] + 0, now)
  return {allowed, now, t, ts}
end

local replyFormat = intsFormat(4) -- packInts's, for takeOne's reply

local function takeMany(KEYS, ARGV)
  local now = readClock()
  local out, groups, i = {}, ARGV[1] + 0, 0
  local costs = 1 + 3 * groups -- ARGV[costs + i] is decision i's cost
  for j = 1, groups do
    local a = 3 * j - 1
    local cap, rate = ARGV[a + 1] + 0, ARGV[a + 2] + 0
    for _ = 1, ARGV[a] + 0 do
      i = i + 1
      local ok, allowed, t, ts = pcall(take, KEYS[i], ARGV[costs + i], cap, rate, now)
      if ok then
        out[i] = packInts(replyFormat, allowed, now, t, ts)
      else
        out[i] = callError(allowed)
      end
    end
  end
  return out
end
