-- reset.lua: resets the buckets and windows of one key (RedisStore.Reset),
-- never a concurrency plan's permits: deletes them, so that they read as
-- full, and sets the key's reset mark to the instant of the Reset, in the
-- same call, so that a settlement of a hold taken before it refunds
-- nothing (settle.lua): the buckets this fills hold that hold's tokens
-- already. The mark never goes back: a mark that holds a later instant (a
-- Reset before Redis TIME stepped back) is kept.
-- It lives at least ARGV[1] ms, and a mark that would live longer keeps
-- its time to live, so that the longest a hold of any instance may still
-- be settled is not cut short by an instance with a shorter one.
--
-- KEYS[i]      the bucket of plan i, for i < #KEYS; every key shares one
--              hash slot
-- KEYS[#KEYS]  the key's reset mark: the Redis TIME of its latest Reset,
--              in µs
-- ARGV[1]      the mark's least time to live in ms
--
-- Reply: the mark as set, µs.

local mark = KEYS[#KEYS]
local at, keep = clock(), tonumber(ARGV[1])
local old = redis.pcall('GET', mark)
if type(old) == 'string' and string.find(old, '^%d+$') then
  at = math.max(at, tonumber(old))
  keep = math.max(keep, redis.call('PTTL', mark))
end
for i = 1, #KEYS - 1 do
  -- A concurrency plan's permits, a sorted set, are their holders' until
  -- released: a Reset that names one by name alone (the CLI) keeps them.
  if redis.call('TYPE', KEYS[i]).ok ~= 'zset' then
    redis.call('DEL', KEYS[i])
  end
end
redis.call('SET', mark, whole(at), 'PX', whole(keep))
return at
