-- token_bucket.lua: one atomic decision on every chained plan of one key.
--
-- It repeats TokenBucket.Refill and TakeAll from bucket.go; a test feeds both
-- the same steps and demands the same answers. Numbers are whole micro-tokens
-- and microseconds, below 2^53, so Lua's doubles hold them exactly.
--
-- KEYS[i]      the bucket of plan i; every key shares one hash slot
-- ARGV[1]      cost in tokens; 0 reads without taking or writing
-- ARGV[2i]     capacity of plan i, in tokens
-- ARGV[2i+1]   rate of plan i, in tokens per second (= micro-tokens per µs)
--
-- Reply: {allowed (1 or 0), now (µs, from TIME), tokens_1, stamp_1, ...}:
-- each plan's bucket after the decision (refilled; drained if allowed).
--
-- Bucket: a hash {t = micro-tokens, ts = stamp in µs, v = 1}, written only
-- when tokens are taken, expiring when it would be full again: a missing
-- bucket reads as full. A bucket of another schema or type is replaced.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local need = tonumber(ARGV[1]) * 1000000
local n = #KEYS
local tokens, stamps, fulls, rates, foreign = {}, {}, {}, {}, {}
local allowed = 1

for i = 1, n do
  local full = tonumber(ARGV[2 * i]) * 1000000
  local rate = tonumber(ARGV[2 * i + 1])
  local h = redis.pcall('HMGET', KEYS[i], 't', 'ts', 'v')
  local t, ts
  if h.err == nil and h[3] == '1' then
    t, ts = tonumber(h[1]), tonumber(h[2])
  end
  if t == nil or ts == nil or t < 0 or t ~= math.floor(t) or ts ~= math.floor(ts) then
    -- missing, expired, or not ours: a full bucket
    foreign[i] = h.err ~= nil or h[1] or h[2] or h[3]
    t, ts = full, now
  end
  -- Refill, exactly as bucket.go does it.
  if now <= ts then
    if t > full then t = full end
  elseif t >= full or t + (now - ts) * rate >= full then
    t, ts = full, now
  else
    local gain = (now - ts) * rate
    local whole = math.floor(gain)
    t, ts = t + whole, now - math.floor((gain - whole) / rate)
  end
  if t < need then allowed = 0 end
  tokens[i], stamps[i], fulls[i], rates[i] = t, ts, full, rate
end

local reply = {allowed, now}
for i = 1, n do
  if allowed == 1 and need > 0 then
    local t = tokens[i] - need
    tokens[i] = t
    if foreign[i] then redis.call('DEL', KEYS[i]) end
    redis.call('HSET', KEYS[i], 't', string.format('%.0f', t),
      'ts', string.format('%.0f', stamps[i]), 'v', '1')
    -- Until full again, rounded up, plus a millisecond for the expiry clock.
    redis.call('PEXPIRE', KEYS[i], string.format('%.0f',
      math.floor((fulls[i] - t) / rates[i] / 1000) + 2))
  end
  reply[2 * i + 1] = tokens[i]
  reply[2 * i + 2] = stamps[i]
end
return reply
