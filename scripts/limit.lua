-- limit.lua: one atomic decision on every chained plan of one key, token
-- buckets and sliding windows alike.
--
-- It repeats, for buckets, TokenBucket.Refill from bucket.go and, for
-- windows, the window type and suppression from window.go, and chain from
-- chain.go; a test feeds both the same steps and demands the same answers.
-- Numbers are whole micro-tokens, tokens and microseconds, below 2^53, so
-- Lua's doubles hold them exactly; numbers of 10^8 and more go to
-- commands as digits (whole, in bucket.lua), which Redis 7.2.0 to 7.2.4
-- would otherwise write as '1e+8'. It is written for speed: flat
-- arrays rather than a table per plan, and nothing for windows allocated
-- in a chain of buckets alone (ADR 16).
--
-- KEYS[i]        the state of plan i; every key shares one hash slot
-- ARGV[1]        cost in tokens; 0 reads without taking or writing, and
--                -n reads as if asked for n tokens (PeekN)
-- A capacity below 0 shadows its plan (ADR 23): the plan is decided with
-- capacity -c and drained if it fits, but never denies; a plan that lacks
-- the tokens is left as it was, but for a stamp brought back (ADR 29).
-- Then, for a chain of buckets alone (#ARGV = 1 + 2 #KEYS), which the
-- arguments of windows would slow by 13-23% (ADR 16):
-- ARGV[2i..2i+1] plan i: capacity in tokens, rate in tokens per second
--                (= micro-tokens per µs)
-- A reservation's hold (Limiter.Reserve), on buckets only, adds one key
-- and one argument to either layout (#ARGV = 2 #KEYS, or 4 #KEYS - 1 for
-- the wide one, which no layout without a hold has for two keys or more):
-- KEYS[#KEYS]    the hold, set to the cost taken if allowed (see
--                settle.lua)
-- ARGV[#ARGV]    the hold's time to live in ms
-- A hold whose key exists already takes nothing and writes nothing: it
-- is decided as a read. If the key holds the cost (this hold's own call,
-- run already, as a client's retry runs it again) it is allowed; if
-- anything else (the tombstone of a hold settled or given back before
-- its call ran, or data not ours), denied. So a hold's call that arrives
-- late, after its caller gave it back, cannot take its tokens again.
-- and for any other chain:
-- ARGV[2]        a random whole number in [0, 2^53), drawn by the caller
--                for suppressed plans (Lua's math.random is reseeded on
--                every call before Redis 7)
-- ARGV[4i-1..4i+2] plan i: capacity in tokens, then
--   a bucket:    rate in tokens per second, 0, and 0 or, for a plan with
--                a version (ADR 22), version × 4 + inheritance (1
--                proportional, 2 reset, 3 additive, 0 as-is)
--   a window:    sub-window width g in µs, the number k of sub-windows,
--                and the hard limit in tokens if suppressed, else 0
--   a concurrency plan: the lease in µs, -1, and the holder's id
--
-- Reply: {allowed (1 or 0) + 2 × (the sum of 2^(i-1) over the shadowed
-- plans i that would deny), now (µs, from TIME), then per plan:
--   a bucket:  tokens, stamp: the bucket as stored after the decision,
--              drained if allowed, as read if not, before a stamp too
--              far ahead is written back (a missing or foreign bucket
--              reads as full at now);
--   a window:  admitted, offered: the counts at now before the decision
--              (offered: what a suppressed one leaves, less its cost);
--              ready: when max(cost, 1) tokens fit, if not taken now;
--              reset: when nothing admitted counts any more, after the
--              decision (now if nothing does);
--   a concurrency plan: free, the permits not held at now before the
--              decision (0 when more are held than the capacity, which
--              was lowered), and reclaimed, the permits whose lease had
--              ended, which it removed}
--
-- Bucket: a string of tokens and stamp (see bucket.lua), written only
-- when tokens are taken, or, by a decision that asks for tokens, when its
-- stamp was more than a full refill ahead and is brought back (ADR 29),
-- expiring when it would be full again. Once a
-- plan with a version wrote it, it also keeps pv, the highest version
-- that wrote it, never lowered, and c, the capacity of the last such
-- write: a plan of a higher version than pv applies its inheritance
-- once, from capacity c (or its own, if none), as plan_version.go does.
--
-- Window: a hash {v = 'w' or 's' (suppressed) .. g .. '/' .. k,
-- c = the capacity in tokens of the last plan that wrote it,
-- <i> = tokens admitted in sub-window i = floor(µs / g),
-- o<i> = tokens offered (suppressed plans), at most 2^46}. At now, sub-windows from
-- floor(now / g) - k on count, and those after it: the oldest counts in
-- full until it lies wholly outside the window. A plain window is written
-- only when tokens are taken; a suppressed one whenever tokens are asked.
-- A window ahead, its newest sub-window more than k ahead of the current
-- one (the clock stepped back that far, or garbage), counts all it holds
-- in the current sub-window, where a decision that asks for tokens
-- writes it back, allowed or not (ADR 29). It expires when its newest
-- sub-window stops counting.
--
-- Concurrency plan: a sorted set of permits, members '<holder id>.<j>'
-- for j = 1..n, scored by when their lease ends, in µs. Every decision on
-- the plan, allowed or not, removes the permits whose lease ended (score
-- <= now); an allowed one adds n members and sets the key to expire just
-- after its latest score, so that an abandoned or empty set leaves
-- nothing. permit.lua releases and renews them. An acquire whose holder
-- already holds its permits, alive, on every concurrency plan is its own
-- call run again (a client's retry after a lost reply): it is allowed
-- and takes nothing, as a hold whose key holds its cost is.
--
-- Data of another schema or type is replaced, never misread. A window of
-- another shape (the plan's width, k or suppression changed) is replaced
-- too, but what it still counts moves into the current sub-window. A plan
-- that changed kind carries what the other kind has left (ADR 31): a
-- bucket reads a window as holding its capacity c less what it counts, a
-- window reads a bucket as counting its own capacity less the whole
-- tokens the bucket holds, in the current sub-window.

-- The numbers the store sends are decimal strings that arithmetic
-- converts (x + 0): once, where tonumber converts twice (Lua 5.1 checks,
-- then converts), and strtod was a tenth of a decision's cost.
local now = clock()
local cost = ARGV[1] + 0
local need = cost * 1000000
-- A hold adds one key and one argument to either layout (see above); a
-- hold has at least one plan beside it, and one bucket alone without a
-- hold has 3 arguments, which is 4 #KEYS - 1 too.
local held = #ARGV == 2 * #KEYS or #KEYS > 1 and #ARGV == 4 * #KEYS - 1
local plans = held and #KEYS - 1 or #KEYS
-- A hold whose key exists (see above): nil if it does not, else whether
-- it holds this call's cost.
local again
if held then
  local h = redis.pcall('GET', KEYS[#KEYS])
  if h ~= false then
    again = h == ARGV[1]
    cost, need = 0, 0
  end
end
local wide = #ARGV ~= 1 + 2 * plans + (held and 1 or 0) -- the layout with windows
local u = wide and tonumber(ARGV[2]) or 0
-- An acquire run again, as a client retries a call whose reply it lost:
-- its holder holds its permits, alive, on every concurrency plan, which
-- only its own call, allowed, gives (holder ids are never reused). It is
-- allowed again and takes nothing more: decided as a read, its free
-- permits told as if its own were not held yet. rerun is its cost.
local rerun
if wide and cost > 0 and not held then
  for i = 1, plans do
    if tonumber(ARGV[4 * i + 1]) < 0 then
      local id = ARGV[4 * i + 2]
      local s = redisPcall('ZSCORE', KEYS[i], id .. '.1')
      if type(s) ~= 'string' or s + 0 <= now or not holds(KEYS[i], id, cost, now) then
        rerun = nil
        break
      end
      rerun = cost
    end
  end
  if rerun then cost, need = 0, 0 end
end
local reply = {1, now} -- bucket plans: the state as read, until allowed
local wd, sd = 0, nil -- shadowed plans that would deny: bits, and by plan
-- Plan i refuses the request: an enforced plan denies it, a shadowed one
-- only records that it would have.
local function refuse(i, shadow)
  if shadow then
    sd = sd or {}
    sd[i], wd = true, wd + 2 ^ (i - 1)
  else
    reply[1] = 0
  end
end
local after = {} -- bucket plans: the state refilled to now, full and rate
local foreign -- window plans whose key holds data not ours, replaced on write
local pvs -- bucket plans with a version: the version and capacity to write
-- Plans brought back: buckets whose stamp Refill brought back or that
-- were read from a window ahead, and windows ahead; written, allowed or not.
local back
-- Window plans, by plan: the current sub-window (b), the counts (adm,
-- off), the offered count of the current sub-window (ob), the newest
-- sub-window (newest), the newest with an admitted count (last), stale
-- fields to delete (stale), and the fields read (xs).
local b, adm, off, ob, newest, last, stale, xs
local carry -- window plans whose key held a window of another shape, or a bucket: its counts
-- Window plans whose key held a window of another shape, not ahead: its
-- fields, sub-window width and k, from which a refusal or a read not
-- written waits, as window.go's memEntry.waiting reads the old window.
local waits
local wc -- window plans: the capacity their window holds, c
local inuse -- concurrency plans: the permits held, and reclaimed, by plan

for i = 1, plans do
  local a = wide and 4 * i - 1 or 2 * i -- plan i's first argument
  local cap = ARGV[a] + 0
  local shadow = cap < 0
  if shadow then cap = -cap end
  local k = wide and tonumber(ARGV[a + 2]) or 0
  if k == 0 then
    -- A bucket: refill, exactly as bucket.go does it.
    local full, rate = cap * 1000000, ARGV[a + 1] + 0
    local vs = wide and tonumber(ARGV[a + 3]) or 0
    local t, ts, pv, oc, _, ahead = readBucket(KEYS[i], full, now)
    if vs > 0 then
      t, ts = inherit(t, ts, full, now, vs, pv, oc)
      pv, oc = math.max(floor(vs / 4), pv), cap
    end
    if pv > 0 then
      pvs = pvs or {}
      pvs[2 * i - 1], pvs[2 * i] = pv, oc
    end
    reply[2 * i + 1], reply[2 * i + 2] = t, ts
    if cost > 0 and (ahead or tooFarAhead(ts, full, rate, now)) then
      back = back or {}
      back[i] = true
    end
    t, ts = refill(t, ts, full, rate, now)
    after[4 * i - 3], after[4 * i - 2], after[4 * i - 1], after[4 * i] = t, ts, full, rate
    if t < need then refuse(i, shadow) end
  elseif k < 0 then
    -- A concurrency plan: reclaim the permits whose lease ended, count
    -- the rest. A key of another type is another kind's state, which
    -- holds no permit and is replaced on write.
    local r = redisPcall('ZREMRANGEBYSCORE', KEYS[i], '-inf', now)
    local c = 0
    if type(r) == 'table' then
      foreign = foreign or {}
      foreign[i], r = true, 0
    else
      c = redisCall('ZCARD', KEYS[i])
    end
    inuse = inuse or {}
    inuse[2 * i - 1], inuse[2 * i] = c, r
    if c + cost > cap and not rerun then refuse(i, false) end
  else
    -- A window: read it and count it, as window.go does.
    if b == nil then
      b, adm, off, ob, newest, last, stale, xs = {}, {}, {}, {}, {}, {}, {}, {}
    end
    local g, hard = tonumber(ARGV[a + 1]), tonumber(ARGV[a + 3])
    local id = (hard > 0 and 's' or 'w') .. ARGV[a + 1] .. '/' .. ARGV[a + 2]
    local bi = floor(now / g)
    local from = bi - k
    local h = redis.pcall('HGETALL', KEYS[i])
    local ok, version = h.err == nil, nil
    local na, no, nb, nw, nl, sx = 0, 0, 0, nil, nil, nil
    if ok then
      for j = 1, #h, 2 do
        local f = h[j]
        if f == 'v' then
          version = h[j + 1]
        elseif f == 'c' then
          wc = wc or {}
          wc[i] = tonumber(h[j + 1])
        else
          -- Only what HINCRBY writes: digits, and 'o' before an offered
          -- count's sub-window. tonumber alone would take '1.0' or '0x1',
          -- on which HINCRBY then fails.
          local digits = string.match(f, '^o?(%d+)$')
          local x, offered = digits and tonumber(digits), string.byte(f) == 111
          local c = string.find(h[j + 1], '^%d+$') and tonumber(h[j + 1])
          if not x or not c or x > max53 or c > max53 then
            ok = false
            break
          end
          if nw == nil or x > nw then nw = x end
          if x < from then
            sx = sx or {}
            sx[#sx + 1] = f
          elseif offered then
            no = no + c
            if x == bi then nb = c end
          else
            na = na + c
            if c > 0 and (nl == nil or x > nl) then nl = x end
          end
        end
      end
    end
    -- A newest sub-window more than a window ahead (a clock stepped back
    -- that far, or garbage): its counts move into the current sub-window,
    -- as window.go's add moves them, and a decision that asks for tokens
    -- writes them back there, allowed or not (ADR 29).
    if not ok or (#h > 0 and version ~= id) or (nw and nw > bi + k) then
      if not ok or #h > 0 then
        foreign = foreign or {}
        foreign[i] = true
      end
      if wc then wc[i] = nil end -- replaced: its capacity goes with it
      local ca, co
      if h.err then
        -- A bucket of the name (the plan changed kind): what it holds, as
        -- stored, is what the window has left, as window.go's
        -- fromBucket counts it (ADR 31).
        local t = readBucket(KEYS[i], -1, now)
        if t >= 0 then
          ca = cap - math.min(cap, floor(t / 1000000))
          co = ca
        end
      elseif ok then
        -- A window of another shape (the plan changed), or of this one
        -- ahead: what it still counts moves into the current sub-window,
        -- where it stays longer, as window.go's carry does. Offered
        -- counts come along if it had them, or its admitted ones stand
        -- for them. Until a write carries them, they leave as the old
        -- shape says: a refusal or a read waits on its fields, g and k.
        local _, ahead, og, ok
        ca, co, _, ahead, og, ok = windowCounts(h, now)
        if co then co = math.min(co, maxOffered) end -- as window.add keeps it
        if ahead and cost > 0 then
          back = back or {}
          back[i] = true
        elseif ca and not ahead then
          waits = waits or {}
          waits[i] = {h, og, ok}
        end
      end
      if ca then
        carry = carry or {}
        carry[i] = {ca, co}
        na, no, nb, nw, nl, sx, h = ca, co, co, nil, nil, nil, {string.format('%d', bi), ca}
        if ca > 0 then nl = bi end
      else
        na, no, nb, nw, nl, sx, h = 0, 0, 0, nil, nil, nil, {}
      end
    end
    -- The fields read are kept: a refusal or a read walks them again.
    b[i], adm[i], off[i], ob[i], newest[i], last[i], stale[i], xs[i] = bi, na, no, nb, nw, nl, sx, h
    if cost > 0 then
      local f -- the probability of refusal, as suppression() computes it
      if na + cost <= cap then
        f = 0
      elseif hard == 0 or na + cost > hard then
        f = 1
      else
        f = 1 - cap / (no + cost) * ((hard - na - cost + 1) / (hard - cap))
      end
      if u < f * max53 then refuse(i, shadow) end
    end
  end
end

local allowed = reply[1] == 1
-- Buckets alone reply in place: reply already holds each bucket as read,
-- in the slot it keeps in the answer.
local out = wide and {reply[1], now} or reply
local n = 2
for i = 1, plans do
  local a = wide and 4 * i - 1 or 2 * i
  local k = wide and tonumber(ARGV[a + 2]) or 0
  if k == 0 then -- a bucket
    if allowed and need > 0 and not (sd and sd[i]) then
      local t, ts = after[4 * i - 3] - need, after[4 * i - 2]
      out[n + 1], out[n + 2] = t, ts
      writeBucket(KEYS[i], t, ts, after[4 * i - 1], after[4 * i], now, pvs and pvs[2 * i - 1] or 0, pvs and pvs[2 * i])
    else
      out[n + 1], out[n + 2] = reply[2 * i + 1], reply[2 * i + 2]
      if back and back[i] then
        writeBucket(KEYS[i], after[4 * i - 3], after[4 * i - 2], after[4 * i - 1], after[4 * i], now, pvs and pvs[2 * i - 1] or 0, pvs and pvs[2 * i])
      end
    end
    n = n + 2
  elseif k < 0 then -- a concurrency plan
    local c = inuse[2 * i - 1]
    -- An adopted permit (permit.lua), or a capacity lowered while its
    -- holders held them, may hold a set above its capacity.
    out[n + 1], out[n + 2] = math.max(ARGV[a] - c, 0) + (rerun or 0), inuse[2 * i]
    if allowed and cost > 0 then
      if foreign and foreign[i] then redisCall('DEL', KEYS[i]) end
      addPermits(KEYS[i], ARGV[a + 3], cost, now + ARGV[a + 1])
      expireAfterLast(KEYS[i], now)
    end
    n = n + 2
  else -- a window
    local cap, g, hard = math.abs(tonumber(ARGV[a])), tonumber(ARGV[a + 1]), tonumber(ARGV[a + 3])
    local bi = b[i]
    local take = allowed and cost > 0 and not (sd and sd[i])
    local ready = now
    if not take then
      -- The oldest sub-windows leave first, as window.readyAt computes.
      local c = math.max(cost, -cost, 1)
      local total = adm[i]
      if total + c > cap then
        -- The live admitted counts, oldest first, in the old shape if
        -- this decision writes no carry of them (a suppressed one does).
        local h, wg, wk = xs[i], g, k
        if waits and waits[i] and not (cost > 0 and hard > 0) then
          h, wg, wk = waits[i][1], waits[i][2], waits[i][3]
        end
        local from, live = floor(now / wg) - wk, {}
        for j = 1, #h, 2 do
          local x = tonumber(h[j])
          if x and x >= from then live[#live + 1] = {x, tonumber(h[j + 1])} end
        end
        table.sort(live, function(p, q) return p[1] < q[1] end)
        for _, e in ipairs(live) do
          total = total - e[2]
          if total + c <= cap then
            ready = (e[1] + 1 + wk) * wg
            break
          end
        end
      end
    end
    -- A suppressed decision that asks for tokens adds them to the offered
    -- count of now's sub-window, up to maxOffered, as window.add does; it
    -- reports what it leaves less its cost, as window.go does.
    local o = off[i]
    if hard > 0 and cost > 0 then
      o = math.min(ob[i] + cost, maxOffered)
      off[i] = off[i] - ob[i] + o - cost
    end
    out[n + 1], out[n + 2], out[n + 3] = adm[i], off[i], ready
    local l = last[i]
    if take or cost > 0 and (hard > 0 or back and back[i]) then
      -- Field names are formatted here: Lua's own number-to-string
      -- conversion turns 10^14 into '1e+14'.
      local field = string.format('%d', bi)
      if foreign and foreign[i] then redis.call('DEL', KEYS[i]) end
      if newest[i] == nil then
        redis.call('HSET', KEYS[i], 'v', (hard > 0 and 's' or 'w') .. ARGV[a + 1] .. '/' .. ARGV[a + 2], 'c', whole(cap))
      elseif not (wc and wc[i] == cap) then
        redis.call('HSET', KEYS[i], 'c', whole(cap)) -- the capacity changed
      end
      if carry and carry[i] and carry[i][1] > 0 then
        redis.call('HINCRBY', KEYS[i], field, whole(carry[i][1]))
      end
      if take then
        redis.call('HINCRBY', KEYS[i], field, whole(cost))
        if l == nil or bi > l then l = bi end
      end
      if hard > 0 then redis.call('HSET', KEYS[i], 'o' .. field, whole(o)) end
      if stale[i] then redis.call('HDEL', KEYS[i], unpack(stale[i])) end
      -- The key expires once its newest sub-window stops counting, plus a
      -- millisecond for the expiry clock; until then it keeps its expiry.
      if newest[i] == nil or bi > newest[i] then
        redis.call('PEXPIRE', KEYS[i], whole(floor(((bi + 1 + k) * g - now) / 1000) + 2))
      end
    end
    -- Nothing admitted counts once the newest sub-window with a count has
    -- left, as window.resetAt computes.
    out[n + 4] = l and (l + 1 + k) * g or now
    n = n + 4
  end
end
if held and allowed and need > 0 then
  -- ARGV[1], the digits the store sent: a Lua number would reach Redis
  -- 7.2.0 to 7.2.4 as '1e+8' for 100,000,000, which settle.lua does not
  -- read as a hold.
  redis.call('SET', KEYS[#KEYS], ARGV[1], 'PX', ARGV[#ARGV])
end
if again ~= nil then out[1] = again and 1 or 0 end
out[1] = out[1] + 2 * wd
return out
