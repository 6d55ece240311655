-- fleet.lua: one heartbeat of one instance of a fleet of Limiters that
-- share a Redis, and the count of the instances alive (ADR 24).
--
-- KEYS[1]  the fleet's sorted set: member -> the instance's last
--          heartbeat, in µs of Redis TIME
-- ARGV[1]  this instance's id (no '/')
-- ARGV[2]  how long this instance counts as alive after its last
--          heartbeat, in µs: its TTL, decimal digits
--
-- Reply: the number of instances alive, this one included.
--
-- This instance's member is '<ARGV[2]>/<ARGV[1]>': each member carries
-- its own TTL, so that instances at different intervals drop each other
-- only once each one's own TTL has passed. A member without '/' is an
-- instance of a release before, which wrote its id alone: it counts for
-- the caller's TTL, as those releases counted every member. The members
-- older than the caller's TTL are the only ones read: a member is dropped
-- once its own TTL and the caller's have passed. The set expires with its
-- longest-lived member: the expiry is set to the caller's TTL only when
-- the set would expire sooner. Numbers sent to Redis are formatted with
-- %d: Lua's own number-to-string conversion writes 1.7e15 with 14 digits.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], string.format('%d', now), ARGV[2] .. '/' .. ARGV[1])
local old = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now - ttl), 'WITHSCORES')
for i = 1, #old, 2 do
  local declared = string.match(old[i], '^(%d+)/')
  local own = declared and tonumber(declared) or ttl
  if tonumber(old[i + 1]) < now - own then
    redis.call('ZREM', KEYS[1], old[i])
  end
end
local life = math.floor(ttl / 1000) + 1
if redis.call('PTTL', KEYS[1]) < life then
  redis.call('PEXPIRE', KEYS[1], string.format('%d', life))
end
return redis.call('ZCARD', KEYS[1])
