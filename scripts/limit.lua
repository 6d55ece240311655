-- limit.lua: one atomic decision on every chained plan of one key, token
-- buckets and sliding windows alike.
--
-- It repeats, for buckets, TokenBucket.Refill from bucket.go and, for
-- windows, the window type and suppression from window.go, and chain from
-- chain.go; a test feeds both the same steps and demands the same answers.
-- Numbers are whole micro-tokens, tokens and microseconds, below 2^53, so
-- Lua's doubles hold them exactly, and both Redis and miniredis pass whole
-- numbers to commands digit for digit.
--
-- KEYS[i]        the state of plan i; every key shares one hash slot
-- ARGV[1]        cost in tokens; 0 reads without taking or writing
-- ARGV[2]        a random whole number in [0, 2^53), drawn by the caller
--                for suppressed plans (Lua's math.random is reseeded on
--                every call before Redis 7)
-- ARGV[4i-1..4i] plan i: capacity in tokens, then
--   a bucket:    rate in tokens per second (= micro-tokens per µs), 0, 0
--   a window:    sub-window width g in µs, the number k of sub-windows,
--                and the hard limit in tokens if suppressed, else 0
--
-- Reply: {allowed (1 or 0), now (µs, from TIME), then per plan:
--   a bucket:  tokens, stamp: the bucket as stored after the decision,
--              drained if allowed, as read if not (a missing or foreign
--              bucket reads as full at now);
--   a window:  admitted, offered: the counts at now before the decision;
--              ready: when max(cost, 1) tokens fit, if not taken now;
--              reset: when nothing admitted counts any more, after the
--              decision (now if nothing does)}
--
-- Bucket: a hash {t = micro-tokens, ts = stamp in µs, v = 1}, written only
-- when tokens are taken, expiring when it would be full again.
--
-- Window: a hash {v = 'w' or 's' (suppressed) .. g .. '/' .. k,
-- <i> = tokens admitted in sub-window i = floor(µs / g),
-- o<i> = tokens offered (suppressed plans)}. At now, sub-windows from
-- floor(now / g) - k on count, and those after it: the oldest counts in
-- full until it lies wholly outside the window. A plain window is written
-- only when tokens are taken; a suppressed one whenever tokens are asked.
-- It expires when its newest sub-window stops counting.
--
-- Data of another schema, type or geometry is replaced, never misread.

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])
local cost = tonumber(ARGV[1])
local need = cost * 1000000
local u = tonumber(ARGV[2])
local allowed = true
local state = {} -- per plan: a bucket refilled to now, or a window as read
local foreign -- plans whose key holds data not ours, replaced on write

local function is_count(x)
  return x ~= nil and x == math.floor(x) and x >= 0 and x <= 9007199254740992
end

-- bucket reads and refills plan i's bucket, exactly as bucket.go does.
local function bucket(i, full, rate)
  local h = redis.pcall('HMGET', KEYS[i], 't', 'ts', 'v')
  local t, ts
  if h.err == nil and h[3] == '1' then
    t, ts = tonumber(h[1]), tonumber(h[2])
  end
  if not (is_count(t) and is_count(ts)) then
    if h.err ~= nil or h[1] or h[2] or h[3] then
      foreign = foreign or {}
      foreign[i] = true
    end
    t, ts = full, now -- missing or expired: a full bucket
  end
  local s = {stored_t = t, stored_ts = ts}
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
  s.t, s.ts = t, ts
  if t < need then allowed = false end
  return s
end

-- window reads plan i's window and decides on it, as window.go does.
local function window(i, cap, g, k, hard)
  local id = (hard > 0 and 's' or 'w') .. ARGV[4 * i] .. '/' .. ARGV[4 * i + 1]
  local s = {cap = cap, g = g, k = k, hard = hard, id = id,
    b = math.floor(now / g), adm = {}, off = {}, fields = {}}
  local h = redis.pcall('HGETALL', KEYS[i])
  local ok = h.err == nil
  local version
  if ok then
    for j = 1, #h, 2 do
      local f, c = h[j], tonumber(h[j + 1])
      if f == 'v' then
        version = h[j + 1]
      else
        local counts = s.adm
        if string.sub(f, 1, 1) == 'o' then
          counts, f = s.off, string.sub(f, 2)
        end
        local x = tonumber(f)
        if not (is_count(x) and is_count(c)) then ok = false break end
        counts[x] = c
        s.fields[#s.fields + 1] = h[j]
        if s.newest == nil or x > s.newest then s.newest = x end
      end
    end
  end
  -- A newest sub-window more than a window ahead is no clock step: the
  -- window reads as empty, as window.go's span says.
  if not ok or (#h > 0 and version ~= id) or (s.newest and s.newest > s.b + k) then
    if not ok or #h > 0 then
      foreign = foreign or {}
      foreign[i] = true
    end
    s.adm, s.off, s.fields, s.newest = {}, {}, {}, nil
  end
  local admitted, offered = 0, 0
  for x, c in pairs(s.adm) do
    if x >= s.b - k then admitted = admitted + c end
  end
  for x, c in pairs(s.off) do
    if x >= s.b - k then offered = offered + c end
  end
  s.admitted, s.offered = admitted, offered
  if cost > 0 then
    local f -- the probability of refusal, as suppression() computes it
    if admitted + cost <= cap then
      f = 0
    elseif hard == 0 or admitted + cost > hard then
      f = 1
    else
      f = 1 - cap / (offered + cost) * ((hard - admitted - cost + 1) / (hard - cap))
    end
    if u < f * 9007199254740992 then allowed = false end
  end
  return s
end

-- leaves returns when sub-window x stops counting.
local function leaves(s, x)
  return (x + 1 + s.k) * s.g
end

-- ready returns when n more tokens fit under the window's capacity, as
-- window.readyAt computes it: the oldest sub-windows leave first.
local function ready(s, n)
  local total = s.admitted
  if total + n <= s.cap then return now end
  local live = {}
  for x, c in pairs(s.adm) do
    if x >= s.b - s.k and c > 0 then live[#live + 1] = x end
  end
  table.sort(live)
  for _, x in ipairs(live) do
    total = total - s.adm[x]
    if total + n <= s.cap then return leaves(s, x) end
  end
  return now -- not reached: all gone, n fits
end

for i = 1, #KEYS do
  local cap, k = tonumber(ARGV[4 * i - 1]), tonumber(ARGV[4 * i + 1])
  if k == 0 then
    state[i] = bucket(i, cap * 1000000, tonumber(ARGV[4 * i]))
  else
    state[i] = window(i, cap, tonumber(ARGV[4 * i]), k, tonumber(ARGV[4 * i + 2]))
  end
end

local reply = {allowed and 1 or 0, now}
local function push(...)
  for _, x in ipairs({...}) do reply[#reply + 1] = x end
end
for i = 1, #KEYS do
  local s = state[i]
  if s.g == nil then -- a bucket
    if allowed and need > 0 then
      local t, ts = s.t - need, s.ts
      push(t, ts)
      if foreign and foreign[i] then redis.call('DEL', KEYS[i]) end
      redis.call('HSET', KEYS[i], 't', t, 'ts', ts, 'v', 1)
      -- Until full again, rounded up, plus a millisecond for the expiry
      -- clock. The bucket fills from its stamp, which is ahead of now after
      -- TIME stepped back: counted from now, the key would expire, and read
      -- as full, that much early.
      redis.call('PEXPIRE', KEYS[i],
        math.floor(((tonumber(ARGV[4 * i - 1]) * 1000000 - t) / tonumber(ARGV[4 * i])
          + math.max(0, ts - now)) / 1000) + 2)
    else
      push(s.stored_t, s.stored_ts)
    end
  else -- a window
    local take = allowed and cost > 0
    local ask = cost > 0 and s.hard > 0
    local at = now
    if not take then at = ready(s, math.max(cost, 1)) end
    push(s.admitted, s.offered, at)
    if take or ask then
      -- Field names are formatted here: Lua's own number-to-string
      -- conversion turns 10^14 into '1e+14'.
      local field = string.format('%d', s.b)
      if foreign and foreign[i] then redis.call('DEL', KEYS[i]) end
      if s.newest == nil then redis.call('HSET', KEYS[i], 'v', s.id) end
      if take then
        redis.call('HINCRBY', KEYS[i], field, cost)
        s.adm[s.b] = (s.adm[s.b] or 0) + cost
        s.admitted = s.admitted + cost
      end
      if ask then redis.call('HINCRBY', KEYS[i], 'o' .. field, cost) end
      -- Sub-windows before b - k count no more.
      local stale = {}
      for _, f in ipairs(s.fields) do
        local x = tonumber(string.sub(f, 1, 1) == 'o' and string.sub(f, 2) or f)
        if x < s.b - s.k then stale[#stale + 1] = f end
      end
      if #stale > 0 then redis.call('HDEL', KEYS[i], unpack(stale)) end
      -- The key expires once its newest sub-window stops counting, plus a
      -- millisecond for the expiry clock; until then it keeps its expiry.
      if s.newest == nil or s.b > s.newest then
        redis.call('PEXPIRE', KEYS[i], math.floor((leaves(s, s.b) - now) / 1000) + 2)
      end
    end
    push(ready(s, s.cap))
  end
end
return reply
