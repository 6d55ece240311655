-- circuit_breaker.lua: one atomic step of a distributed circuit breaker.
--
-- It repeats circuit.step in breaker/circuit.go; a test feeds both the same
-- steps and demands the same answers. Times are whole microseconds of Redis
-- TIME, rates are parts per million, so every number is a whole number
-- below 2^53 and Lua's doubles hold it exactly.
--
-- KEYS[1]   the breaker's hash; one key, so one Cluster slot
-- ARGV[1]   op: 1 acquire, 2 record, 3 read, 4 force open, 5 force closed,
--           6 reset
-- ARGV[2]   token of the caller's probe lease ("0": none). Acquire grants a
--           lease to this token; record with it reports the probe.
-- ARGV[3]   generation the outcomes belong to; -1: whatever the current
--           one is, counted only while closed (the unfenced seed form)
-- ARGV[4-8] outcomes to record before the op (acquire may carry them too):
--           calls, failures, slow calls, trailing run of failures, and 1 if
--           any of the calls succeeded (so the run restarts). Record with
--           calls 0 and a token releases that token's lease unused.
-- ARGV[9-17] settings: window (µs), min calls, failure rate (ppm), slow
--           rate (ppm, 0 off), consecutive failures (0 off), open for (µs),
--           max open for (µs), probes, probe timeout (µs)
--
-- Reply: {state (0 closed, 1 open, 2 half-open), generation, wait (µs until
-- an open breaker lets a probe through, or a half-open one frees a lease),
-- grant (0 no, 1 closed call, 2 probe), from (state before + 1 if the
-- generation changed, else 0), trips, calls, failures, slow calls (in the
-- window), foreign (1 if the key held data not ours, now replaced unless the
-- op is read), held (1 if forced open), ignored (1 if outcomes were fenced
-- off: another generation, or a lease not held)}
--
-- Hash (schema v = 1): s state, g generation, ou open until (µs), k failed
-- probes in a row (the open time doubles with each), fx forced open, hs
-- probe successes, cf consecutive failures, tr trips, l<i>/e<i> lease i's
-- token ("-" once reported) and expiry (µs), b<i>/n<i>/f<i>/w<i> window step
-- i's slot number, calls, failures and slow calls. A missing key is a closed
-- breaker of generation 0. A closed breaker expires 2 windows after its last
-- write; an open one a day after its lease or open time ends; a forced one
-- never.

local MAX = 9007199254740992
local key = KEYS[1]
local op = tonumber(ARGV[1])
local token = ARGV[2]
local rg = tonumber(ARGV[3])
local bn, bf, bw = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local brun, bsucc = tonumber(ARGV[7]), tonumber(ARGV[8])
local window, mincalls = tonumber(ARGV[9]), tonumber(ARGV[10])
local rate, slowrate, consec = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local openus, maxopen = tonumber(ARGV[14]), tonumber(ARGV[15])
local probes, ptimeout = tonumber(ARGV[16]), tonumber(ARGV[17])

local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000000 + tonumber(time[2])

-- Read, and judge what we read: anything but our schema with whole numbers
-- in range is foreign, and read as a fresh breaker, never misread.
local h = {}
local foreign = 0
local raw = redis.pcall('HGETALL', key)
if raw.err ~= nil then
  foreign = 1
else
  for i = 1, #raw, 2 do h[raw[i]] = raw[i + 1] end
  if #raw > 0 then
    if h.v ~= '1' then foreign = 1 end
    for name, val in pairs(h) do
      local c = string.sub(name, 1, 1)
      if name ~= 'v' and c ~= 'l' then
        local x = tonumber(val)
        if x == nil or x < 0 or x > MAX or x ~= math.floor(x) then foreign = 1 end
      end
    end
    local s = tonumber(h.s)
    if s ~= 0 and s ~= 1 and s ~= 2 then foreign = 1 end
  end
end
if foreign == 1 then h = {} end
local function int(name) return tonumber(h[name] or 0) end

local s, g, ou, k = int('s'), int('g'), int('ou'), int('k')
local fx, hs, cf, tr = int('fx'), int('hs'), int('cf'), int('tr')
local s0, g0 = s, g
local lt, le = {}, {}
for i = 1, probes do lt[i] = h['l' .. i] or ''; le[i] = int('e' .. i) end
local width = math.max(math.floor(window / 10), 1)
local slot = math.floor(now / width)
local step = slot % 10
local full = foreign == 1 -- write every field, not just the step's
-- The window counts the ten steps up to now, or, after a clock step back,
-- the ten up to the newest step that holds counts, while that one is at
-- most a window ahead; none if it is further. A step that holds counts and
-- no longer counts is written back empty, so that it never counts again
-- when the clock catches up.
local wb, wn, wf, ww = {}, {}, {}, {}
local newest = slot
for i = 0, 9 do
  wb[i], wn[i], wf[i], ww[i] = int('b' .. i), int('n' .. i), int('f' .. i), int('w' .. i)
  if h['b' .. i] ~= nil and wn[i] + wf[i] + ww[i] > 0 then newest = math.max(newest, wb[i]) end
end
local first, last = newest - 9, newest
if newest > slot + 9 then first, last = 1, 0 end
for i = 0, 9 do
  if h['b' .. i] == nil or wb[i] < first or wb[i] > last then
    if wn[i] + wf[i] + ww[i] > 0 then full = true end
    wb[i], wn[i], wf[i], ww[i] = slot, 0, 0, 0 -- out of the window
  end
end
local dirty = false
local ignored = 0

-- An open time or a lease further ahead than the settings allow (Redis's
-- clock stepped back, or a planted value) is brought back to the longest
-- they allow, and written back, so that it holds the breaker no longer.
if s == 1 and fx == 0 and ou > now + math.max(maxopen, openus) then
  ou, full = now + math.max(maxopen, openus), true
end
for i = 1, probes do
  if le[i] > now + ptimeout then le[i], full = now + ptimeout, true end
end

local function clear()
  for i = 0, 9 do wb[i], wn[i], wf[i], ww[i] = slot, 0, 0, 0 end
  for i = 1, probes do lt[i], le[i] = '', 0 end
  cf, hs = 0, 0
end
local function open()
  local d = openus
  for _ = 1, k do
    if d >= maxopen then break end
    d = d * 2
  end
  d = math.min(d, math.max(maxopen, openus))
  s, g, ou, fx = 1, g + 1, now + d, 0
  clear()
  full = true
end
local function close()
  s, g, ou, k, fx = 0, g + 1, 0, 0, 0
  clear()
  full = true
end
local function sums()
  local n, f, w = 0, 0, 0
  for i = 0, 9 do n, f, w = n + wn[i], f + wf[i], w + ww[i] end
  return n, f, w
end

-- Outcomes first: the acquire that carries them then sees their effect.
local probe = op == 2 and token ~= '0'
if op == 1 or op == 2 then
  if bn > 0 and not probe then
    if s ~= 0 or (rg ~= -1 and rg ~= g) then
      ignored = 1
    else
      wb[step] = slot
      wn[step], wf[step], ww[step] = wn[step] + bn, wf[step] + bf, ww[step] + bw
      if bsucc == 1 then cf = brun else cf = cf + brun end
      dirty = true
      if bf > 0 or bw > 0 then
        local n, f, w = sums()
        if (n >= mincalls and (f * 1000000 >= rate * n or (slowrate > 0 and w * 1000000 >= slowrate * n)))
            or (consec > 0 and cf >= consec) then
          tr, k = tr + 1, 0
          open()
        end
      end
    end
  elseif probe then
    local held = 0
    if s == 2 and rg == g then
      for i = 1, probes do
        if lt[i] == token and le[i] > now then held = i end
      end
    end
    if held == 0 then
      ignored = 1
    elseif bn == 0 then
      lt[held], le[held] = '', 0 -- released unused: the next caller probes
      full = true
    elseif bf > 0 then
      k = k + 1
      open()
    else
      lt[held], hs = '-', hs + 1
      full = true
      if hs >= probes then close() end
    end
  end
end

local grant, wait = 0, 0
if op == 1 then
  if s == 1 and fx == 0 and now >= ou then
    s, g, hs = 2, g + 1, 0
    for i = 1, probes do lt[i], le[i] = '', 0 end
    full = true
  end
  if s == 0 then
    grant = 1
  elseif s == 2 then
    -- A lease is free once it expires, used or not: a used lease whose
    -- success was not counted (Probes lowered while probing) holds its
    -- slot for at most ProbeTimeout.
    local free = 0
    for i = probes, 1, -1 do
      if lt[i] == '' or le[i] <= now then free = i end
    end
    if free > 0 then
      lt[free], le[free] = token, now + ptimeout
      grant = 2
      full = true
    else
      wait = MAX
      for i = 1, probes do wait = math.min(wait, le[i] - now) end
      if wait == MAX then wait = ptimeout end
    end
  end
elseif op == 4 then
  open()
  fx, ou = 1, 0
elseif op == 5 then
  close()
elseif op == 6 then
  close()
  tr, k = 0, 0
end

if op ~= 3 and (full or dirty) then
  if full then
    redis.call('DEL', key)
    local f = {'v', 1, 's', s, 'g', g, 'ou', ou, 'k', k, 'fx', fx, 'hs', hs, 'cf', cf, 'tr', tr}
    for i = 1, probes do
      if lt[i] ~= '' then
        f[#f + 1], f[#f + 2], f[#f + 3], f[#f + 4] = 'l' .. i, lt[i], 'e' .. i, le[i]
      end
    end
    for i = 0, 9 do
      if wn[i] > 0 then
        local n = #f
        f[n + 1], f[n + 2], f[n + 3], f[n + 4] = 'b' .. i, wb[i], 'n' .. i, wn[i]
        f[n + 5], f[n + 6], f[n + 7], f[n + 8] = 'f' .. i, wf[i], 'w' .. i, ww[i]
      end
    end
    redis.call('HSET', key, unpack(f))
  else
    redis.call('HSET', key, 'v', 1, 's', s, 'g', g, 'cf', cf, 'b' .. step, slot, 'n' .. step, wn[step],
      'f' .. step, wf[step], 'w' .. step, ww[step])
  end
  if s == 0 then
    redis.call('PEXPIRE', key, math.max(math.floor(2 * window / 1000), 1))
  elseif fx == 1 then
    redis.call('PERSIST', key)
  else
    local last = ou
    for i = 1, probes do last = math.max(last, le[i]) end
    redis.call('PEXPIRE', key, math.floor(math.max(last - now, 0) / 1000) + 86400000)
  end
end

-- An open breaker's wait, whatever the op: a forced one is asked again
-- after an open time.
if s == 1 and fx == 1 then
  wait = openus
elseif s == 1 then
  wait = math.max(ou - now, 0)
end

local n, f, w = sums()
local from = 0
if g ~= g0 then from = s0 + 1 end
return {s, g, wait, grant, from, tr, n, f, w, foreign, fx, ignored}
