-- settle.lua: settles a reservation's hold on the buckets of one key, once
-- (Reservation.Settle). limit.lua took n tokens from every bucket and set
-- the hold to n; settling with the tokens actually used refunds n - actual
-- when fewer were used, capped at a full bucket, or charges actual - n
-- when more were, as debt. A hold that is gone (it expired, or Redis lost
-- it) refunds nothing and charges only actual - n; so does a hold that
-- holds anything else, which is never trusted. Every settlement leaves a
-- tombstone, so that a second one, such as a retry after a lost reply,
-- changes nothing.
--
-- KEYS[i]          the bucket of plan i, for i < #KEYS; every key shares
--                  one hash slot
-- KEYS[#KEYS]      the hold
-- ARGV[1]          n, the tokens the reservation took
-- ARGV[2]          actual, the tokens used
-- ARGV[3]          the tombstone's time to live in ms
-- ARGV[2i+2..2i+3] plan i: capacity in tokens, rate in tokens per second
--
-- Reply: {status, now (µs, from TIME), then per plan tokens, stamp (the
-- bucket as stored after settling), then the largest charge, in
-- micro-tokens, that a bucket could not take because its debt would have
-- passed one capacity}. Status: 0 settled a live hold; 1 already settled:
-- nothing changed; 2 the hold was gone; 3 the hold held data not ours.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local hold = KEYS[#KEYS]
local n, actual = tonumber(ARGV[1]), tonumber(ARGV[2])

local status
local h = redis.pcall('GET', hold)
if type(h) == 'table' then
  status = 3 -- another type
elseif h == false then
  status = 2
elseif h == 's' then
  status = 1
elseif string.find(h, '^%d+$') and tonumber(h) == n then
  status = 0
else
  status = 3
end

local delta = 0
if status == 0 then
  delta = (n - actual) * 1000000
elseif status ~= 1 and actual > n then
  delta = (n - actual) * 1000000
end

local reply = {status, now}
local lost = 0
for i = 1, #KEYS - 1 do
  local full, rate = tonumber(ARGV[2 * i + 2]) * 1000000, tonumber(ARGV[2 * i + 3])
  local t, ts, foreign = readBucket(KEYS[i], full, now)
  if delta ~= 0 then
    local u
    t, ts, u = adjust(t, ts, full, rate, now, delta)
    writeBucket(KEYS[i], t, ts, full, rate, now, foreign)
    lost = math.max(lost, u)
  end
  reply[2 * i + 1], reply[2 * i + 2] = t, ts
end
if status ~= 1 then
  redis.call('SET', hold, 's', 'PX', ARGV[3])
end
reply[#reply + 1] = lost
return reply
