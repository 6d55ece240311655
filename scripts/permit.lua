-- permit.lua: release, renew or adopt the permits of holders on the
-- concurrency plans of one key (see semaphore.lua), in one atomic step.
--
-- KEYS[i]          the set of concurrency plan i; every key shares one
--                  hash slot
-- ARGV[1]          the lease in µs to renew or adopt for, or 0 to release
-- ARGV[2]          1 to adopt: to add the holders' permits, held
--                  elsewhere (a fallback during an outage), whether the
--                  sets hold them or not and whatever their count; else 0
-- ARGV[3h..3h+2]   holder h: its id, its n permits of each plan, and the
--                  sum of 2^(i-1) over the plans i it holds permits of
--
-- Reply: {now, the permits whose lease had ended, which it removed
-- first, as limit.lua does, then per holder 1 if it held all its
-- permits, alive, or was adopted, else 0}. A holder that did not hold all
-- its permits (its lease ended, or they were released before) gets none
-- renewed: what it has left is removed, and nothing is added back. A key
-- of another type holds no permit: it is left alone, or replaced to
-- adopt. Each set then expires 2 ms after its latest score, as
-- semaphore.lua says: after a release as after a renewal.
local now = clock()
local lease, adopt = ARGV[1] + 0, ARGV[2] == '1'
local sets = {}
local out = {now, 0}
for i = 1, #KEYS do
  local t = redisCall('TYPE', KEYS[i]).ok
  sets[i] = t == 'zset'
  if sets[i] then
    out[2] = out[2] + redisCall('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
  elseif adopt then
    if t ~= 'none' then redisCall('DEL', KEYS[i]) end
    sets[i] = true
  end
end
for h = 3, #ARGV, 3 do
  local id, n, mask = ARGV[h], ARGV[h + 1] + 0, ARGV[h + 2] + 0
  local live = true
  for i = 1, #KEYS do
    -- An if, not live = live and sets[i] and ...: gopher-lua, which
    -- miniredis runs, leaves a local as it was when it assigns it an and
    -- whose left side is a false table field.
    if not adopt and live and floor(mask / 2 ^ (i - 1)) % 2 == 1 and not (sets[i] and holds(KEYS[i], id, n, now)) then
      live = false
    end
  end
  for i = 1, #KEYS do
    if sets[i] and floor(mask / 2 ^ (i - 1)) % 2 == 1 then
      if live and lease > 0 then
        addPermits(KEYS[i], id, n, now + lease)
      else
        removePermits(KEYS[i], id, n)
      end
    end
  end
  out[#out + 1] = live and 1 or 0
end
-- A release too: the permits it removed may have had the latest score,
-- and the set must not outlive the permits left.
for i = 1, #KEYS do
  if sets[i] then expireAfterLast(KEYS[i], now) end
end
return out
