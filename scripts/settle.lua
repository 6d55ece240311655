-- settle.lua: settles a reservation's hold on the buckets of one key, once
-- (Reservation.Settle). limit.lua took n tokens from every bucket and set
-- the hold to n; settling with the tokens actually used refunds n - actual
-- when fewer were used, capped at a full bucket, or charges actual - n
-- when more were, as debt. A hold that is gone (it expired, or Redis lost
-- it) refunds nothing and charges only actual - n; so does a hold that
-- holds anything else, which is never trusted. Every settlement leaves a
-- tombstone, so that a second one, such as a retry after a lost reply,
-- changes nothing; a hold that was not there gets one too, so that the
-- hold's own call, if it reaches Redis later (its reply was lost, and the
-- caller gave it back by its id with actual 0), takes nothing (limit.lua).
--
-- A live hold taken before the key's latest Reset (RedisStore.Reset,
-- which sets the reset mark) refunds nothing either: the buckets the Reset
-- filled hold its tokens already. It still charges actual - n and leaves
-- the tombstone. So does one taken after, if Redis TIME now reads before
-- the hold's time (it stepped back since), or if the mark holds data not
-- ours: the doubt costs a refund, never a token minted.
--
-- KEYS[i]          the bucket of plan i, for i < #KEYS - 1; every key
--                  shares one hash slot
-- KEYS[#KEYS - 1]  the hold
-- KEYS[#KEYS]      the key's reset mark (reset.lua)
-- ARGV[1]          n, the tokens the reservation took
-- ARGV[2]          actual, the tokens used
-- ARGV[3]          the tombstone's time to live in ms
-- ARGV[4]          the sum of 2^(i-1) over the plans i the reservation
--                  did not take from: shadowed plans that would have
--                  denied, which settling leaves alone
-- ARGV[5]          the Redis TIME, in µs, of the hold's call (the now of
--                  its reply); 0 if unknown (a hold given back after a
--                  lost reply), which every reset mark is at or after
-- ARGV[3i+3..3i+5] plan i: capacity in tokens, rate in tokens per second,
--                  and 0 or, for a plan with a version, version × 4 +
--                  inheritance, as limit.lua takes them
--
-- Reply: {status, now (µs, from TIME), then per plan tokens, stamp (the
-- bucket as stored after settling), then the largest charge, in
-- micro-tokens, that a bucket could not take because its debt would have
-- passed one capacity}. Status: 0 settled a live hold; 1 already settled:
-- nothing changed; 2 the hold was gone; 3 the hold held data not ours; 4
-- the hold was live, and taken before the key's latest Reset.

local now = clock()
local hold = KEYS[#KEYS - 1]
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
if status == 0 then
  local mark, at = redis.pcall('GET', KEYS[#KEYS]), tonumber(ARGV[5])
  if mark ~= false and (type(mark) ~= 'string' or not string.find(mark, '^%d+$') or tonumber(mark) >= at or now < at) then
    status = 4
  end
end

local delta = 0
if status == 0 then
  delta = (n - actual) * 1000000
elseif status ~= 1 and actual > n then
  delta = (n - actual) * 1000000
end

local reply = {status, now}
local lost = 0
local skip = tonumber(ARGV[4])
for i = 1, #KEYS - 2 do
  local a = 3 * i + 3
  local full, rate, vs = tonumber(ARGV[a]) * 1000000, tonumber(ARGV[a + 1]), tonumber(ARGV[a + 2])
  local t, ts, pv, oc = readBucket(KEYS[i], full, now)
  if vs > 0 then
    t, ts = inherit(t, ts, full, now, vs, pv, oc)
    pv, oc = math.max(math.floor(vs / 4), pv), full / 1000000
  end
  if delta ~= 0 and math.floor(skip / 2 ^ (i - 1)) % 2 == 0 then
    local u
    t, ts, u = adjust(t, ts, full, rate, now, delta)
    writeBucket(KEYS[i], t, ts, full, rate, now, pv, oc)
    lost = math.max(lost, u)
  end
  reply[2 * i + 1], reply[2 * i + 2] = t, ts
end
if status ~= 1 then
  redis.call('SET', hold, 's', 'PX', ARGV[3])
end
reply[#reply + 1] = lost
return reply
