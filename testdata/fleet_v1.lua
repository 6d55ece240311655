-- fleet.lua: one heartbeat of one instance of a fleet of Limiters that
-- share a Redis, and the count of the instances alive (ADR 24).
--
-- KEYS[1]  the fleet's sorted set: instance id -> its last heartbeat, in
--          µs of Redis TIME
-- ARGV[1]  this instance's id
-- ARGV[2]  how long an instance counts as alive after its last
--          heartbeat, in µs
--
-- Reply: the number of instances alive, this one included.
--
-- Instances whose heartbeat is older than ARGV[2] are dropped, and the set
-- expires when no instance has beaten for that long. Times are formatted
-- with %d: Lua's own number-to-string conversion writes 1.7e15 with 14
-- digits.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local ttl = tonumber(ARGV[2])
redis.call('ZADD', KEYS[1], string.format('%d', now), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. string.format('%d', now - ttl))
redis.call('PEXPIRE', KEYS[1], math.floor(ttl / 1000) + 1)
return redis.call('ZCARD', KEYS[1])
