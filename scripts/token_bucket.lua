-- token_bucket.lua: one atomic decision on every chained plan of one key.
--
-- It repeats TokenBucket.Refill and TakeAll from bucket.go; a test feeds both
-- the same steps and demands the same answers. Numbers are whole micro-tokens
-- and microseconds, below 2^53, so Lua's doubles hold them exactly, and both
-- Redis and miniredis pass whole numbers to commands digit for digit.
--
-- KEYS[i]      the bucket of plan i; every key shares one hash slot
-- ARGV[1]      cost in tokens; 0 reads without taking or writing
-- ARGV[2i]     capacity of plan i, in tokens
-- ARGV[2i+1]   rate of plan i, in tokens per second (= micro-tokens per µs)
--
-- Reply: {allowed (1 or 0), now (µs, from TIME), tokens_1, stamp_1, ...}:
-- each plan's bucket as stored after the decision: drained if allowed,
-- as read if not (a missing or foreign bucket reads as full at now). Go
-- measures waits from it, as the next decision will refill it.
--
-- Bucket: a hash {t = micro-tokens, ts = stamp in µs, v = 1}, written only
-- when tokens are taken, expiring when it would be full again: a missing
-- bucket reads as full. A bucket of another schema or type is replaced.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local need = tonumber(ARGV[1]) * 1000000
local reply = {1, now}
local after = {} -- the buckets refilled to now, to drain if allowed
local foreign -- plans whose key holds data not ours, replaced on write

for i = 1, #KEYS do
  local full = tonumber(ARGV[2 * i]) * 1000000
  local rate = tonumber(ARGV[2 * i + 1])
  local h = redis.pcall('HMGET', KEYS[i], 't', 'ts', 'v')
  local t, ts
  if h.err == nil and h[3] == '1' then
    t, ts = tonumber(h[1]), tonumber(h[2])
  end
  if t == nil or ts == nil or t ~= math.floor(t) or ts ~= math.floor(ts)
      or t < 0 or t > 9007199254740992 or ts < 0 or ts > 9007199254740992 then
    if h.err ~= nil or h[1] or h[2] or h[3] then
      foreign = foreign or {}
      foreign[i] = true
    end
    t, ts = full, now -- missing or expired: a full bucket
  end
  reply[2 * i + 1], reply[2 * i + 2] = t, ts
  -- Refill, exactly as bucket.go does it.
  if now <= ts then
    if ts - now > full / rate then
      t, ts = full, now -- a stamp more than a full refill ahead: garbage
    elseif t > full then
      t = full
    end
  elseif t >= full then
    t, ts = full, now
  else
    local gain = (now - ts) * rate
    local whole = math.floor(gain)
    if t + whole >= full then
      t, ts = full, now
    else
      t, ts = t + whole, now - math.floor((gain - whole) / rate)
    end
  end
  if t < need then reply[1] = 0 end
  after[2 * i - 1], after[2 * i] = t, ts
end

if reply[1] == 1 and need > 0 then
  for i = 1, #KEYS do
    local t, ts = after[2 * i - 1] - need, after[2 * i]
    reply[2 * i + 1], reply[2 * i + 2] = t, ts
    if foreign and foreign[i] then redis.call('DEL', KEYS[i]) end
    redis.call('HSET', KEYS[i], 't', t, 'ts', ts, 'v', 1)
    -- Until full again, rounded up, plus a millisecond for the expiry
    -- clock. The bucket fills from its stamp, which is ahead of now after
    -- TIME stepped back: counted from now, the key would expire, and read
    -- as full, that much early.
    redis.call('PEXPIRE', KEYS[i],
      math.floor(((tonumber(ARGV[2 * i]) * 1000000 - t) / tonumber(ARGV[2 * i + 1])
        + math.max(0, ts - now)) / 1000) + 2)
  end
end
return reply
