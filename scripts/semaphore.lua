-- semaphore.lua: the permits of a concurrency plan in Redis, put after
-- bucket.lua and before limit.lua and permit.lua (see scripts.go), which
-- share them. semaphore.go holds the same rules for the MemoryStore; a
-- test feeds both the same steps and demands the same answers.
--
-- A concurrency plan's state is a sorted set: n permits held by one
-- holder are n members '<holder id>.<j>', j = 1..n, scored by when their
-- lease ends, in µs of Redis TIME. A permit whose score is at or before
-- now has expired, and the next call on the set removes it. The key
-- expires 2 ms after its latest score, so that a set whose holders died
-- leaves nothing; Redis deletes a set whose last member goes.

-- addPermits adds n members of holder id to the set at key, their lease
-- ending at ends (µs), in commands of at most 500 members.
local function addPermits(key, id, n, ends)
  local score = whole(ends)
  local m = {}
  for j = 1, n do
    m[#m + 1], m[#m + 2] = score, id .. '.' .. j
    if #m == 1000 or j == n then
      redisCall('ZADD', key, unpack(m))
      m = {}
    end
  end
end

-- expireAfterLast sets the set at key to expire 2 ms after its latest
-- score: the expiry clock counts in ms, and a set must outlive its
-- permits.
local function expireAfterLast(key, now)
  local last = redisCall('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] then
    redisCall('PEXPIRE', key, format('%d', (last[2] - now) / 1000 + 2))
  end
end

-- removePermits removes the n members of holder id from the set at key.
local function removePermits(key, id, n)
  for j = 1, n do redisCall('ZREM', key, id .. '.' .. j) end
end

-- holds reports whether all n members of holder id are in the set at
-- key, and alive at now.
local function holds(key, id, n, now)
  for j = 1, n do
    local s = redisCall('ZSCORE', key, id .. '.' .. j)
    if not s or s + 0 <= now then return false end
  end
  return true
end
