-- bucket.lua: the token bucket in Redis, put before limit.lua and
-- settle.lua (see scripts.go), so that both read, refill and write a
-- bucket the same way. It repeats TokenBucket from bucket.go; a test feeds
-- both the same steps and demands the same answers.
--
-- A bucket is a hash {t = micro-tokens, ts = stamp in µs, v = 1}, written
-- only when it changes, expiring when it would be full again. Numbers are
-- whole micro-tokens and microseconds below 2^53, exact in Lua's doubles.
-- A bucket in debt (a charge settled beyond what it held) holds 0 and has
-- its stamp ahead of now, by the time the debt takes to accrue.

local floor, tonumber = math.floor, tonumber
local max53 = 9007199254740992

-- readBucket returns the bucket at key as stored, whether the key holds
-- data not ours, which is replaced on write, and, if versioned, the
-- bucket's plan version pv (0 if none) and capacity c at its last
-- versioned write (nil if none). A missing, expired or foreign bucket
-- reads as full at now, of version 0.
local function readBucket(key, full, now, versioned)
  local h
  if versioned then
    h = redis.pcall('HMGET', key, 't', 'ts', 'v', 'pv', 'c')
  else
    h = redis.pcall('HMGET', key, 't', 'ts', 'v')
  end
  local t, ts
  if h.err == nil and h[3] == '1' then
    t, ts = tonumber(h[1]), tonumber(h[2])
  end
  if t == nil or ts == nil or t ~= floor(t) or ts ~= floor(ts)
      or t < 0 or t > max53 or ts < 0 or ts > max53 then
    return full, now, h.err ~= nil or h[1] ~= false or h[2] ~= false or h[3] ~= false, 0
  end
  if versioned then
    return t, ts, false, tonumber(h[4]) or 0, tonumber(h[5])
  end
  return t, ts, false
end

-- inherit is bucketVersion.inherit: a plan of a version above the
-- bucket's, pv, takes the bucket over once, by its inheritance (vs is
-- version × 4 + inheritance: 1 proportional, 2 reset, 3 additive, 0
-- as-is) from the capacity oc of the bucket's last versioned write, or
-- its own if none is known.
local function inherit(t, ts, full, now, vs, pv, oc)
  if floor(vs / 4) <= pv then return t, ts end
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

-- refill is TokenBucket.Refill: the bucket as of now.
local function refill(t, ts, full, rate, now)
  if now <= ts then
    if ts - now > full / rate then
      return full, now -- a stamp more than a full refill ahead: garbage
    end
    return math.min(t, full), ts
  elseif t >= full then
    return full, now
  end
  local gain = (now - ts) * rate
  local whole = floor(gain)
  if t + whole >= full then
    return full, now
  end
  return t + whole, now - floor((gain - whole) / rate)
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
-- micro-tokens added, debt as a stamp ahead, at most a full refill ahead;
-- and the micro-tokens of a charge that did not fit.
local function adjust(t, ts, full, rate, now, delta)
  t, ts = refill(t, ts, full, rate, now)
  local balance = t
  if ts > now then balance = -math.ceil((ts - now) * rate) end
  balance = balance + delta
  if balance >= full then
    return full, now, 0
  elseif balance >= 0 then
    return balance, math.min(ts, now), 0
  end
  local ahead = floor(full / rate)
  local w = accrual(-balance, rate)
  if w <= ahead then return 0, now + w, 0 end
  return 0, now + ahead, -balance - floor(ahead * rate)
end

-- writeBucket stores a bucket, replacing foreign data, with its plan
-- version pv and its capacity if pv is not nil, until it is full again,
-- rounded up, plus a millisecond for the expiry clock. A bucket fills from
-- its stamp, which is ahead of now after TIME stepped back or while it is
-- in debt: counted from now, the key would expire, and read as full, that
-- much early.
local function writeBucket(key, t, ts, full, rate, now, foreign, pv)
  if foreign then redis.call('DEL', key) end
  if pv then
    redis.call('HSET', key, 't', t, 'ts', ts, 'v', 1, 'pv', pv, 'c', full / 1000000)
  else
    redis.call('HSET', key, 't', t, 'ts', ts, 'v', 1)
  end
  redis.call('PEXPIRE', key, floor(((full - t) / rate + math.max(0, ts - now)) / 1000) + 2)
end
