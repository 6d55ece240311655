-- bucket.lua: the token bucket in Redis, put before limit.lua and
-- settle.lua (see scripts.go), so that both read, refill and write a
-- bucket the same way. It repeats TokenBucket from bucket.go; a test feeds
-- both the same steps and demands the same answers.
--
-- A bucket is a string of big-endian whole numbers (ADR 28): its stamp
-- ts in µs (7 bytes), then its micro-tokens t in as few bytes as hold
-- them (1 to 7), so 8 to 14 bytes; or, once a plan with a version (ADR 22)
-- wrote it, 28 bytes: ts, t, the version pv and the capacity c in tokens
-- of that write, 7 bytes each. It is written with SET ... PX only when it
-- changes, expiring when it would be full again. Numbers are whole
-- micro-tokens and microseconds below 2^53, exact in Lua's doubles. A
-- bucket in debt (a charge settled beyond what it held) holds 0 and has
-- its stamp ahead of now, by the time the debt takes to accrue.

-- The functions the decisions call, read once: reading a global in Redis
-- costs more than a local.
local floor, tonumber, format = math.floor, tonumber, string.format
local redisCall, redisPcall = redis.call, redis.pcall
local max53 = 9007199254740992
local maxOffered = 70368744177664 -- window.go's maxOffered, 2^46
local maxRefill = 3153600000000000 -- plan.go's maxRefillPeriod, in µs

-- readClock returns Redis TIME in µs, read at each call. TIME's fields
-- are decimal strings that arithmetic converts once, where tonumber
-- converts twice.
local function readClock()
  local time = redis.call('TIME')
  return time[1] * 1000000 + time[2]
end

-- clock returns Redis TIME in µs, read once per script call: a batch
-- (redisscript.Batch) runs this prelude once, so every decision in it is
-- made at the instant the batch began (ADR 26). A library of Redis
-- Functions runs this prelude once for all its calls, so its functions
-- read readClock instead.
local clock_us
local function clock()
  if not clock_us then clock_us = readClock() end
  return clock_us
end

-- whole returns whole number x as a command argument. Redis 7.2.0 to
-- 7.2.4 pass a Lua number with 8 or more trailing zeros as '1e+8', which
-- no command reads as an integer (fixed by redis/redis#13115 in 7.2.5),
-- so a number that large goes as its digits; below, the compare costs less
-- than formatting.
local function whole(x)
  if x < 100000000 then return x end
  return string.format('%d', x)
end

-- A bucket's layout, by its length in bytes (8 to 14, or 28; nil for
-- any other): packBucket(layouts[n], ts, t, pv, c) returns the string of
-- n bytes of a bucket, and unpackBucket(layouts[n], s) the numbers of
-- one, ts and t, then pv and c if n is 28. Redis's struct library packs
-- and unpacks them in C at a third of plain Lua's cost, and is both
-- functions itself, which spares a call of a function of ours (a call
-- costs more in Redis than a few lines of arithmetic); its layouts are
-- its formats. miniredis, which the tests without Redis run on, has
-- none, and gets the same bytes from plain Lua, where a layout is the
-- length, so both paths are tested against Go's reader.
local layouts, packBucket, unpackBucket
local struct = rawget(_G, 'struct')
if struct then
  layouts = {[8] = '>I7I1', [9] = '>I7I2', [10] = '>I7I3', [11] = '>I7I4', [12] = '>I7I5', [13] = '>I7I6',
    [14] = '>I7I7', [28] = '>I7I7I7I7'}
  packBucket, unpackBucket = struct.pack, struct.unpack
else
  layouts = {[8] = 8, [9] = 9, [10] = 10, [11] = 11, [12] = 12, [13] = 13, [14] = 14, [28] = 28}
  local byte, char = string.byte, string.char
  local function bytes7(x)
    return char(floor(x / 281474976710656) % 256, floor(x / 1099511627776) % 256, floor(x / 4294967296) % 256,
      floor(x / 16777216) % 256, floor(x / 65536) % 256, floor(x / 256) % 256, x % 256)
  end
  local function number(s, i, j)
    local x = 0
    for k = i, j do x = x * 256 + byte(s, k) end
    return x
  end
  packBucket = function(n, ts, t, pv, c)
    if n == 28 then return bytes7(ts) .. bytes7(t) .. bytes7(pv) .. bytes7(c) end
    return bytes7(ts) .. string.sub(bytes7(t), 15 - n)
  end
  unpackBucket = function(n, s)
    if n == 28 then return number(s, 1, 7), number(s, 8, 14), number(s, 15, 21), number(s, 22, 28) end
    return number(s, 1, 7), number(s, 8, n)
  end
end

-- windowCounts returns what a window's hash h, as HGETALL lists it,
-- counts at now in its own shape: the tokens admitted and offered (its
-- admitted ones if it was not suppressed), its capacity in tokens, or
-- nil if it has none, whether it is ahead: its newest sub-window more
-- than k ahead of now's, when it counts all it holds (ADR 29), and its
-- sub-window width g in µs and k, and whether nothing it holds counts
-- any more, offered counts included: its newest sub-window has left, as
-- it has when its key expires; or nothing if h is not a window. It is
-- window.counts for a window that limit.lua carries into another shape
-- (ADR 16), another kind (ADR 31), or now's sub-window.
local function windowCounts(h, now)
  local v, c
  for j = 1, #h, 2 do
    if h[j] == 'v' then v = h[j + 1] elseif h[j] == 'c' then c = h[j + 1] end
  end
  local g, k = string.match(v or '', '^[ws](%d+)/(%d+)$')
  if not g or (c and not string.find(c, '^%d+$')) then return end
  g, k = tonumber(g), tonumber(k)
  local b, newest, admitted, offered = floor(now / g), nil, 0, 0
  for j = 1, #h, 2 do
    local f = h[j]
    if f ~= 'v' and f ~= 'c' then
      local x, n = tonumber(string.match(f, '^o?(%d+)$')), string.find(h[j + 1], '^%d+$') and tonumber(h[j + 1])
      if not x or not n or x > max53 or n > max53 then return end
      if newest == nil or x > newest then newest = x end
      if x >= b - k then
        if string.byte(f) == 111 then offered = offered + n else admitted = admitted + n end
      end
    end
  end
  if string.byte(v) == 119 then offered = admitted end -- 'w': no offered counts
  return admitted, offered, c and tonumber(c), newest ~= nil and newest > b + k, g, k,
    newest == nil or (newest + 1 + k) * g <= now
end

-- readBucket returns the bucket at key as stored, full at now if it is
-- missing, expired or not a bucket (data of another schema), and the
-- plan version pv (0 if none) and the capacity c of the last write by a
-- plan with a version (nil if none). A window of the name (its plan
-- changed kind) reads as a bucket at now holding what the window has
-- left, its capacity (full's, if it has none) less what it counts, at
-- most full, with pv -1: such a bucket inherits nothing (ADR 31); but a
-- window of which nothing counts any more reads as full, as it does once
-- its key has expired, a millisecond or two later. Last,
-- it returns the bytes it read if they hold the bucket it returns, a
-- bucket's bytes (nil if it returns a full bucket or one made from a
-- window), and whether it read a window ahead of now (windowCounts),
-- which a decision that asks for tokens writes back as the bucket read.
local function readBucket(key, full, now)
  -- GET answers a string, false if the key is missing, or an error
  -- (WRONGTYPE) as a table, whose length, 0, is no bucket's: a bucket
  -- is found without a call of type.
  local s = redisPcall('GET', key)
  if not s then return full, now, 0 end
  local layout = layouts[#s]
  if layout then
    local ts, t, pv, c = unpackBucket(layout, s)
    if t > max53 or ts > max53 then return full, now, 0 end
    if #s == 28 then return t, ts, pv, c, s end
    return t, ts, 0, nil, s
  end
  if type(s) == 'table' then
    local h = redis.pcall('HGETALL', key)
    local admitted, _, c, ahead, _, _, gone = windowCounts(h.err and {} or h, now)
    if not admitted or gone then return full, now, 0 end
    return math.min(full, math.max(0, (c or full / 1000000) - admitted) * 1000000), now, -1, nil, nil, ahead
  end
  return full, now, 0
end

-- inherit is bucketVersion.inherit: a plan of a version above the
-- bucket's, pv, takes the bucket over once, by its inheritance (vs is
-- version × 4 + inheritance: 1 proportional, 2 reset, 3 additive, 0
-- as-is) from the capacity oc of the bucket's last versioned write, or
-- its own if none is known. A pv below 0, a bucket just made from a
-- window, inherits nothing.
local function inherit(t, ts, full, now, vs, pv, oc)
  if pv < 0 or floor(vs / 4) <= pv then return t, ts end
  local how, old = vs % 4, full
  if oc and oc > 0 then old = oc * 1000000 end
  if how == 1 then
    t = floor(t / old * full)
  elseif how == 2 then
    t, ts = full, now
  elseif how == 3 then
    t = math.min(t, full) + math.max(0, full - old)
  end
  return t, ts
end

-- tooFarAhead is TokenBucket.tooFarAhead: whether stamp ts is more than a
-- full refill ahead of now.
local function tooFarAhead(ts, full, rate, now)
  return ts - now > full / rate
end

-- refill is TokenBucket.Refill: the bucket as of now.
local function refill(t, ts, full, rate, now)
  if now <= ts then
    if tooFarAhead(ts, full, rate, now) then
      return math.min(t, full), now + floor(full / rate) -- brought back (ADR 29)
    end
    return math.min(t, full), ts
  elseif t >= full then
    return full, now
  end
  -- x - x % 1 is floor(x) without a function call, which costs more in
  -- Redis than the arithmetic; but it is NaN for an x of +Inf, the gain of
  -- a rate near the largest double, which a gain of a full bucket or more
  -- returns before: floor(gain) is then full or more, as Go finds it.
  local gain = (now - ts) * rate
  if gain >= full then
    return full, now
  end
  local whole = gain - gain % 1
  if t + whole >= full then
    return full, now
  end
  local late = (gain - whole) / rate -- how long ago the last whole micro-token accrued
  return t + whole, now - (late - late % 1)
end

-- accrual is accrualMicros: the fewest whole µs in which deficit
-- micro-tokens accrue at rate.
local function accrual(deficit, rate)
  local w = math.ceil(deficit / rate)
  if w > 1 and floor((w - 1) * rate) >= deficit then
    w = w - 1
  elseif floor(w * rate) < deficit then
    w = w + 1
  end
  return w
end

-- adjust is TokenBucket.adjust: the bucket refilled to now with delta
-- micro-tokens added, debt as a stamp ahead, at most a full refill ahead
-- of now, a bucket that holds tokens with its stamp ahead (TIME stepped
-- back) adjusted at its stamp; and the micro-tokens of a charge that did
-- not fit.
local function adjust(t, ts, full, rate, now, delta)
  t, ts = refill(t, ts, full, rate, now)
  local at, held = now, t -- the bucket's time, and what it holds there
  if ts > now then
    if t == 0 then held = -math.ceil((ts - now) * rate) else at = ts end
  end
  local balance = held + delta
  if balance >= full then
    return full, at, 0
  elseif balance >= 0 then
    return balance, math.min(ts, at), 0
  end
  local ahead = floor(full / rate) - (at - now)
  local most = floor(ahead * rate) -- the debt that accrues in ahead
  if -balance <= most then return 0, at + accrual(-balance, rate), 0 end
  -- Not -balance - most: a charge onto a debt at its cap makes -balance
  -- pass 2^53, where a double rounds it. held plus the most debt is
  -- below -delta here, so below 2^53, and exact.
  return 0, at + ahead, -delta - (held + most)
end

-- writeBucket stores a bucket, with its plan version pv and capacity c
-- in tokens if pv is above 0, until it is full again, rounded up, plus a
-- millisecond for the expiry clock. A bucket fills from its stamp, which
-- is ahead of now after TIME stepped back or while it is in debt: counted
-- from now, the key would expire, and read as full, that much early. SET
-- replaces whatever the key held. A bucket with a version outlives its
-- refill by one more full refill of the larger of full and c at rate, at
-- most maxRefill, as bucketVersion.fence computes, so that its version
-- does not leave with it and a reset or an additive change apply again
-- (ADR 30). It returns the bytes it stored.
local function writeBucket(key, t, ts, full, rate, now, pv, c)
  local us = (full - t) / rate
  if ts > now then us = us + (ts - now) end
  if pv > 0 then us = us + math.min(floor(math.max(full, c * 1000000) / rate), maxRefill) end
  -- n is the bucket's length: 28 with a version, else the stamp's 7
  -- bytes and the fewest that hold t, 1 to 7, chosen here rather than in
  -- a function of their own, whose call would cost more than the compares.
  local n = 28
  if pv <= 0 then
    if t < 65536 then
      n = t < 256 and 8 or 9
    elseif t < 4294967296 then
      n = t < 16777216 and 10 or 11
    elseif t < 1099511627776 then
      n = 12
    else
      n = t < 281474976710656 and 13 or 14
    end
  end
  local b = packBucket(layouts[n], ts, t, pv, c)
  -- PX's digits, formatted here: Redis 7.0 formats a Lua number with
  -- printf's %.17g, at a larger cost, and 7.2.0 to 7.2.4 as '1e+8' (see
  -- whole). %d drops the fraction of a positive number, as floor does.
  redisCall('SET', key, b, 'PX', format('%d', us / 1000 + 2))
  return b
end
