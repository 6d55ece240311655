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
-- takeMany is many decisions, all made at one reading of TIME, as a
-- Grouped sends them (redisscript.Grouped, whose calls' own arg is the
-- cost):
-- KEYS[i]          decision i's bucket, decisions grouped by their plan
-- ARGV[1]          g, the number of groups
-- ARGV[4j-2..4j+1] group j: how many decisions it holds, their cost if
--                  they all have the same, else '', then its capacity
--                  and rate, as above
-- ARGV[4g+2..]     the costs of each group whose decisions differ in
--                  cost, decision after decision
-- Reply: a string of Grouped's records: TIME in µs in 7 bytes (packInts),
-- then one per decision: allowed (a byte, 1 or 0), then the bucket's
-- tokens and stamp as limit.lua replies them, as a bucket's bytes
-- (bucket.lua): those it wrote or read where it has them, whose
-- stamp and tokens Go's bucketvalue reads, so that a decision packs
-- nothing of its own; or an errorRecord.

-- take decides cost tokens of the bucket at key, of capacity cap and
-- rate rate, at now (numbers all), as limit.lua does; it returns allowed
-- (1 or 0) and the bucket's tokens and stamp as limit.lua replies them:
-- after the decision if it took tokens, else as read; and then the
-- bucket's bytes that hold them, if it wrote or read such bytes.
local function take(key, cost, cap, rate, now)
  local full, need = cap * 1000000, cost * 1000000
  local t, ts, pv, c, s, ahead = readBucket(key, full, now)
  local rt, rts = refill(t, ts, full, rate, now)
  if need > 0 and rt >= need then
    rt = rt - need
    return 1, rt, rts, writeBucket(key, rt, rts, full, rate, now, pv, c)
  end
  -- A stamp too far ahead is brought back by a decision that asks for
  -- tokens, allowed or not, and a window ahead of now that it read as a
  -- bucket is written as that bucket (ADR 29).
  if cost > 0 and (ahead or tooFarAhead(ts, full, rate, now)) then
    writeBucket(key, rt, rts, full, rate, now, pv, c)
  end
  return rt >= need and 1 or 0, t, ts, s
end

local function takeOne(KEYS, ARGV)
  local now = readClock()
  local allowed, t, ts = take(KEYS[1], ARGV[1] + 0, ARGV[2] + 0, ARGV[3] + 0, now)
  return {allowed, now, t, ts}
end

-- heads[64 * allowed + n] is the start of a record of takeMany's: its
-- length, then allowed, before a bucket of n bytes.
local heads = {}
for _, n in ipairs({8, 9, 10, 11, 12, 13, 14, 28}) do
  heads[n], heads[64 + n] = string.char(1 + n, 0), string.char(1 + n, 1)
end
local nowFormat = intsFormat(1) -- packInts's, for TIME's record
local clockHead = string.char(7)

-- out holds the pieces of takeMany's reply: made once for all the calls
-- of a library, whose function takes only its first k.
local out = {}

local function takeMany(KEYS, ARGV)
  local now = readClock()
  local groups = ARGV[1] + 0
  local i, k, owns = 0, 2, 1 + 4 * groups -- ARGV[owns + 1] is the next cost of a group whose costs differ
  out[1], out[2] = clockHead, packInts(nowFormat, now)
  for j = 1, groups do
    local a = 4 * j - 2
    local cost, cap, rate = ARGV[a + 1], ARGV[a + 2] + 0, ARGV[a + 3] + 0
    local each = cost == ''
    if not each then cost = cost + 0 end
    for _ = 1, ARGV[a] + 0 do
      i = i + 1
      if each then
        owns = owns + 1
        cost = ARGV[owns] + 0
      end
      local ok, allowed, t, ts, b = pcall(take, KEYS[i], cost, cap, rate, now)
      if ok then
        if not b then b = packBucket(layouts[14], ts, t, 0, 0) end
        out[k + 1], out[k + 2] = heads[64 * allowed + #b], b
        k = k + 2
      else
        k = k + 1
        out[k] = errorRecord(allowed)
      end
    end
  end
  return table.concat(out, '', 1, k)
end
