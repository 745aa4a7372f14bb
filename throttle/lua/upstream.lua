-- The upstream schedule (throttle/upstream.go): when a limiter's requests
-- of one subject leave for the resource behind it, at the rate the fleet
-- learned from that resource's answers, never faster than the limiter's
-- slowest rule. Every process books its departures here, so what one of
-- them learned paces the next departure of every other.
--
-- KEYS[1] -> <prefix>{<subject>}:!upstream(<rules>), a hash:
--   t      the schedule's theoretical arrival time (GCRA): µs of Redis TIME
--   n      departures booked so far; each departure carries its number
--   ls     the latest slot booked (µs); gap the moving mean of the gaps
--          between slots (µs): the rate the resource has been seeing
--   r      the learned rate, requests per second (absent: none learned)
--   u      when r last grew (µs)
--   hi     the rate at which the last 429 came (absent: none yet)
--   d      when the rate was last lowered (µs): a 429 to a departure booked
--          before it is not counted again
--   g      how many times the rate was lowered: a departure booked under
--          another g is booked again before it leaves
--   q, w   the announced policy: q requests per w µs
--   l, lw  a limit without a window (X-RateLimit-Limit) and the longest
--          reset seen (µs, in whole seconds): the policy l per lw inferred
--   wl, wa, wb, wk  the window an answer described: at most wl more
--          departures until it resets, between wa and wb (µs); wk the
--          number of the departure whose answer said so
--   p      while the first departure's answer is awaited: until when (µs)
--   The TTL is ARGV[4] ms from the last call that wrote it.
-- KEYS[2] -> <prefix>{<subject>}:!pause (read only): the Redis time (µs)
--   the subject's pause ends (pause.go)
--
-- ARGV[1]     -> 'depart', 'confirm', 'cancel' or 'learn'
-- ARGV[2]     -> the ceiling: the limiter's slowest rule's interval, µs (0: none)
-- ARGV[3]     -> the ceiling's burst
-- ARGV[4]     -> the state's TTL, ms
-- ARGV[5..11] -> the controller (upstream.go): the share of a policy to
--                start at, the share of hi to recover to, the recovery per
--                second (a share of hi), the growth per second past it, and
--                the lowering factors: gentle (a 429 near where the rate was
--                meant to settle), lower (well under it) and discover
-- depart:  ARGV[12] -> the longest delay accepted, µs (-1: no bound)
--          ARGV[13] -> how long the first departure's answer is waited for, µs
-- confirm: ARGV[12], ARGV[13] as for depart (for the booking that replaces
--          a void one), then ARGV[14] -> the slot (µs), ARGV[15] -> the g it
--          was booked under, ARGV[16] -> how late it may leave, µs,
--          ARGV[17], ARGV[18], ARGV[19] -> t before and after it was
--          booked, and ls before ('' for none)
-- cancel:  ARGV[12], ARGV[13], ARGV[14] -> t before and after the
--          departure given back was booked, and ls before
-- learn:   ARGV[12] -> 1 if the answer was a 429, else 0
--          ARGV[13] -> when the departure was booked (µs; -1: unknown)
--          ARGV[14] -> its number (-1: unknown)
--          ARGV[15], ARGV[16] -> a policy: quota, window (µs); 0 0 for none
--          ARGV[17] -> a limit without a window (0: none)
--          ARGV[18] -> requests remaining until the reset (-1: not said)
--          ARGV[19], ARGV[20] -> the reset comes between these, µs from
--          now (-1 -1: not said)
--          ARGV[21] -> the interval the departure was booked at, µs (0:
--          unknown, or none)
--
-- depart and confirm reply {status, delay, slot, n, g, now, t before, t
-- after, interval, rate, q, w, probe, ls before}: status 1 booked (delay µs from now,
-- at slot; n its number; interval the spacing it was booked at, µs; rate
-- the learned rate as text, '' for none; q and w the policy, 0 0 for none;
-- probe 1 if it is the first departure, whose answer the others await),
-- 0 too far (delay: when it would be; nothing booked), 2 come back in
-- delay (the first departure's answer is awaited; nothing booked); confirm
-- replies {3} when the slot stands. cancel replies 1 if the schedule's end
-- moved back, 0 if a later departure was booked behind it. learn replies {lowered, from, rate,
-- changed, q, w}: lowered 1 if a 429 lowered the rate from `from`; rate
-- the learned rate after (text); changed 1 if the policy changed.

local op = ARGV[1]
local key, pkey = KEYS[1], KEYS[2]
local ceil_iv, ceil_b, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local k_start, k_below, k_recover = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local k_probe, k_gentle, k_lower, k_discover = tonumber(ARGV[8]), tonumber(ARGV[9]), tonumber(ARGV[10]), tonumber(ARGV[11])

local names = {'t', 'n', 'ls', 'gap', 'r', 'u', 'hi', 'd', 'g', 'q', 'w', 'l', 'lw', 'wl', 'wa', 'wb', 'wk', 'p'}
local raw = redis.call('HMGET', key, unpack(names))
local s = {}
for i, f in ipairs(names) do s[f] = tonumber(raw[i]) end
local known = s.n ~= nil
s.n, s.g = s.n or 0, s.g or 0
local dirty = {}
local function set(f, v) s[f] = v; dirty[f] = true end

local function fmt(x)
  if x % 1 == 0 then return string.format('%d', x) end
  return string.format('%.17g', x)
end

-- the policy's rate, per second: announced, else inferred; nil if none
local function policy()
  if s.q and s.w then return s.q * 1e6 / s.w end
  if s.l and s.lw then return s.l * 1e6 / s.lw end
  return nil
end
local function least(a, b)
  if not a then return b end
  if not b then return a end
  return math.min(a, b)
end
local ceil_rate = nil
if ceil_iv > 0 then ceil_rate = 1e6 / ceil_iv end
local function cap() return least(ceil_rate, policy()) end

-- grow raises the learned rate for the time since it last grew: back to
-- k_below of the rate the last 429 came at, at k_recover of it a second,
-- then by k_probe a second (and hi with it); never above the cap.
local function grow()
  if not s.r or not s.u or now <= s.u then return end
  local dt, r = (now - s.u) / 1e6, s.r
  if s.hi and r < k_below * s.hi then
    r = math.min(k_below * s.hi, r + k_recover * s.hi * dt)
  else
    r = r * (1 + k_probe * dt)
    if s.hi and r > k_below * s.hi then set('hi', r / k_below) end
  end
  local c = cap()
  if c and r > c then r = c end
  set('r', r)
  set('u', now)
end

-- lowered notes that the rate went down: departures booked before now
-- are booked again before they leave, and their 429s are not counted.
local function lowered()
  set('d', now)
  set('g', s.g + 1)
end

local function save()
  local args = {}
  for f in pairs(dirty) do
    if s[f] ~= nil then
      args[#args + 1] = f
      args[#args + 1] = fmt(s[f])
    end
  end
  if #args > 0 then redis.call('HSET', key, unpack(args)) end
  for f in pairs(dirty) do
    if s[f] == nil then redis.call('HDEL', key, f) end
  end
  redis.call('PEXPIRE', key, ttl)
end

local function rate_text()
  if s.r then return fmt(s.r) end
  return ''
end

-- depart books the next departure: on the learned rate, at least one
-- interval after the latest departure booked (so a new rate holds from
-- the next departure on, faster or slower); or without one on the
-- ceiling (a GCRA with its burst); after the subject's pause; and within
-- the window an answer described.
local function depart(max_wait, probe_wait)
  local probe = 0
  if not known then
    probe = 1
    set('p', now + probe_wait)
  elseif s.p and s.p > now and not s.r and not policy() then
    return {2, math.ceil(math.min(s.p - now, 20000)), '', 0, 0, now, '', '', 0, '', 0, 0, 0, ''}
  end
  grow()
  local pause = tonumber(redis.call('GET', pkey)) or 0
  local before = s.t or now
  local slot, after, iv = math.max(now, pause), before, 0
  if s.r then
    iv = 1e6 / least(s.r, cap())
    if s.ls then slot = math.max(slot, s.ls + iv) end
    after = slot + iv
  elseif ceil_iv > 0 then
    iv = ceil_iv
    local tol, tat = (ceil_b - 1) * iv, before
    if pause > now then tat = math.max(tat, pause + tol) end
    slot = math.max(slot, tat - tol)
    after = math.max(tat, slot) + iv
  end
  local wl = s.wl
  if wl and s.wb and s.wb > now then
    local wend = s.wb
    if policy() then wend = s.wa end
    if slot < wend then
      if wl <= 0 then
        slot = wend
        if iv > 0 then after = math.max(after, slot + iv) end
      else
        wl = wl - 1
      end
    end
  end
  if max_wait >= 0 and slot - now > max_wait then
    return {0, math.ceil(slot - now), '', 0, 0, now, '', '', 0, rate_text(), s.q or 0, s.w or 0, 0, ''}
  end
  local ls = s.ls
  set('t', after)
  set('n', s.n + 1)
  if wl ~= s.wl then set('wl', wl) end
  if ls and slot >= ls then
    local g = slot - ls
    if s.gap then g = 0.9 * s.gap + 0.1 * g end
    set('gap', g)
  end
  set('ls', math.max(ls or slot, slot))
  save()
  local pq, pw = s.q or 0, s.w or 0
  if pq == 0 and s.l and s.lw then pq, pw = s.l, s.lw end
  local ls_text = ''
  if ls then ls_text = fmt(ls) end
  return {1, math.ceil(slot - now), fmt(slot), s.n, s.g, now, fmt(before), fmt(after), math.ceil(iv), rate_text(), pq, pw, probe, ls_text}
end

if op == 'depart' then
  return depart(tonumber(ARGV[12]), tonumber(ARGV[13]))
end

-- give_back moves the schedule back to before a departure that will not
-- leave, if no later one was booked behind it: its end (before) and its
-- latest slot (ls, '' for none).
local function give_back(before, after, ls)
  if s.t and math.abs(s.t - after) < 0.5 then
    set('t', before)
    set('ls', tonumber(ls))
    return 1
  end
  return 0
end

if op == 'confirm' then
  local slot, g, late = tonumber(ARGV[14]), tonumber(ARGV[15]), tonumber(ARGV[16])
  local pause = tonumber(redis.call('GET', pkey)) or 0
  if pause <= slot and g == s.g and now <= slot + late then return {3} end
  -- Void: paused over, slowed down since, or too late: given back, then
  -- booked again.
  give_back(tonumber(ARGV[17]), tonumber(ARGV[18]), ARGV[19])
  return depart(tonumber(ARGV[12]), tonumber(ARGV[13]))
end

if op == 'cancel' then
  if not known then return 0 end
  local moved = give_back(tonumber(ARGV[12]), tonumber(ARGV[13]), ARGV[14])
  if moved == 1 then save() end
  return moved
end

-- learn
grow()
local too_many, booked, dep = ARGV[12] == '1', tonumber(ARGV[13]), tonumber(ARGV[14])
local quota, window, limit = tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17])
local remaining, reset_min, reset_max = tonumber(ARGV[18]), tonumber(ARGV[19]), tonumber(ARGV[20])
local dep_iv = tonumber(ARGV[21])
local changed, down, from = 0, 0, ''
if s.p then set('p', nil) end

-- adopt follows a new policy: a faster one starts again at k_start of
-- it; a slower one lowers the rate to that at once.
local function adopt(old)
  local c = cap()
  if not s.r or not old or policy() > old then
    set('r', k_start * c)
    set('hi', nil)
    set('u', now)
  elseif s.r > k_start * c then
    set('r', k_start * c)
    lowered()
  end
end

if quota > 0 and window > 0 then
  if s.q ~= quota or s.w ~= window then
    local old = policy()
    set('q', quota)
    set('w', window)
    changed = 1
    adopt(old)
  end
elseif limit > 0 and reset_max > 0 and remaining <= limit then
  local lw = math.max(s.lw or 0, math.max(1, math.ceil(reset_max / 1e6)) * 1e6)
  if s.l ~= limit or s.lw ~= lw then
    local old = policy()
    set('l', limit)
    set('lw', lw)
    if not s.q then
      changed = 1
      adopt(old)
    end
  end
end

if remaining >= 0 and reset_max >= 0 and dep >= (s.wk or -1) then
  local left = remaining
  if dep >= 0 then left = remaining - (s.n - dep) end
  set('wl', left)
  set('wa', now + reset_min)
  set('wb', now + reset_max)
  set('wk', dep)
end

-- A 429 says the rate was too high only if there was a rate: a learned
-- one, or departures close enough together to have one (a 429 to a lone
-- request says only "wait", which its Retry-After does).
if too_many and booked >= (s.d or 0) and (s.r or s.gap) then
  -- The rate the resource saw: the one the departure was booked at (the
  -- learned rate may have grown since, departures booked ahead keep
  -- theirs), else the learned one, else the gaps between departures.
  local cur = s.r
  if dep_iv > 0 then
    cur = 1e6 / dep_iv
  elseif not cur and s.gap > 0 then
    cur = 1e6 / s.gap
  end
  cur = least(cur, cap())
  if cur then
    -- Lowered by k_gentle when the 429 came where the rate was meant to
    -- settle (near the last 429's rate, or at a policy's share with none
    -- yet); by k_lower when it came well under it (the rate the last 429
    -- left is still too high); by k_discover when a resource that
    -- announces nothing is being discovered, or the 429 came under 70 %
    -- of the last one's rate.
    local k = k_discover
    if s.hi then
      local x = cur / s.hi
      if x >= 0.95 then k = k_gentle elseif x >= 0.7 then k = k_lower end
    elseif policy() then
      k = k_gentle
    end
    from = fmt(cur)
    set('hi', cur)
    set('r', math.max(cur * k, 1e-3))
    set('u', now)
    lowered()
    down = 1
  end
end
save()
local pq, pw = s.q or 0, s.w or 0
if pq == 0 and s.l and s.lw then pq, pw = s.l, s.lw end
return {down, from, rate_text(), changed, pq, pw}
