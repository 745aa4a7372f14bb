-- The state every upstream script (throttle/upstream.go) shares: the
-- schedule on which a limiter's requests of one subject leave for the
-- resource behind it, at the rate the fleet learned from that resource's
-- answers (upstream_rate.lua), never faster than the limiter's slowest
-- rule. Every process books its departures here, so what one of them
-- learned paces the next departure of every other. One script per
-- operation follows this file: upstream_depart.lua, upstream_confirm.lua,
-- upstream_cancel.lua, upstream_learn.lua, upstream_leave.lua, each with its
-- own ARGV and reply.
--
-- KEYS[1] -> <prefix>{<subject>}:!upstream(<rules>), a hash:
--   t      the schedule's theoretical arrival time (GCRA): µs of Redis TIME
--   n      departures booked so far; each departure carries its number
--   ls     the latest slot booked (µs), or reserved for the departures a
--          lowering forgot (lowered); gap the moving mean of the gaps
--          between slots (µs): the rate the resource has been seeing
--   r      the learned rate, requests per second (absent: none learned)
--   u      when r last grew (µs)
--   hi     the rate at which the last 429 came (absent: none yet)
--   lone, lo  n when a 429 came that was not counted for good, for
--          coming alone (upstream_learn.lua), and the rate it came at
--   lone2  under a policy, n of the alone 429 before lone
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
--   f      when a rate was first learned (µs): admit books its turns'
--          departures open for a while after (upstream_rate.lua: up_book)
--   al     when the latest request left (µs): a request on its turn says so
--          as it leaves (upstream_leave.lua), a departure when its slot is
--          about to come; the next leaves no sooner than an interval after
--   dv     1 once the limit of a resource that announces nothing was
--          discovered, or found not to bind (upstream_learn.lua); absent
--          while it is being discovered, when every answer is learned
--   ob     while discovering: the answers' leaves and outcomes (read by
--          upstream_learn.lua only)
--   cb     while discovering: the latest place (µs) given to a departure
--          told to come back (disc_ahead_wait); the next is given one an
--          interval after it
--   The TTL is ARGV[4] ms from the last call that wrote it. Admit reads r
--   (upstream_pace.lua).
-- KEYS[2] -> <prefix>{<subject>}:!pause (read only): the Redis time (µs)
--   the subject's pause ends (pause.go)
-- KEYS[3] -> <prefix>{<subject>}:!departures(<rules>): the departures
--   booked at a learned rate, by these scripts and by admit
--   (upstream_rate.lua)
--
-- ARGV[1]    -> the operation's name (for errors only)
-- ARGV[2]    -> the ceiling: the limiter's slowest rule's interval, µs (0: none)
-- ARGV[3]    -> the ceiling's burst
-- ARGV[4]    -> the state's TTL, ms
-- ARGV[5..8] -> the controller (upstream.go): the share of a policy to
--               start at, and the lowering factors: gentle (a 429 near where
--               the rate was meant to settle), lower (well under it) and
--               discover
-- The operation's own ARGV start at ARGV[9].

local key, pkey, dkey = KEYS[1], KEYS[2], KEYS[3]
local ceil_iv, ceil_b, ttl = tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
local k_start, k_gentle, k_lower, k_discover = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])

local names = {'t', 'n', 'ls', 'gap', 'r', 'u', 'hi', 'lone', 'lone2', 'lo', 'd', 'g', 'q', 'w', 'l', 'lw', 'wl', 'wa', 'wb', 'wk', 'p', 'f', 'al', 'dv', 'cb'}
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

local function policy() return up_policy(s) end
local least = up_least
local ceil_rate = nil
if ceil_iv > 0 then ceil_rate = 1e6 / ceil_iv end
local function cap() return least(ceil_rate, policy()) end
-- learned_iv is the interval of the learned rate (µs; s.r must be set),
-- never shorter than the cap's.
local function learned_iv() return 1e6 / least(s.r, cap()) end

-- grow raises the learned rate for the time since it last grew
-- (upstream_rate.lua); never above the cap.
local function grow()
  local r, hi = up_grown(s, now, ceil_rate)
  if not r then return end
  if hi then set('hi', hi) end
  set('r', r)
  -- (u ahead of now: a discovery's step holds the rate until then)
  if not s.u or s.u < now then set('u', now) end
end

-- lowered notes that the rate went down: departures booked before now
-- are booked again before they leave, and their 429s are not counted.
-- The departures booked at the faster pace are forgotten: each would
-- keep the next one booked at the slower pace an interval (the longer
-- one) away until its owner came to book again, and a turn's open
-- departure (up_claim) can no longer be claimed at the slower interval,
-- so its owner books again too (traced: a 680 ms hole after the second
-- 429 of a discovery; under a policy, a 429 at 0.39 s left eight turns'
-- departures 52 ms apart standing, and the owners, coming at their
-- turns, were booked behind all of them: a 575 ms hole, convergence at
-- 1.03 s). Their requests leave an interval after the latest leave all
-- the same (al). Their owners still come, one departure each: so that a
-- turn admit grants meanwhile is not booked among them, the slots they
-- will take, an interval apart at the slower rate from an interval after
-- the latest leave, are reserved as the latest slot (ls, which admit's
-- turns follow: upstream_pace.lua) when the state is saved (traced under
-- a policy at 10 worker processes: a turn admitted 16 ms after a 429 was
-- booked at the rule's next turn, 0.21 s on; three owners of forgotten
-- turns came back before it, only two fitted, and the third was booked
-- behind it: a 92 ms hole, the fleet under 95 % of the limit for that
-- second).
local forgot = 0
local function lowered()
  set('d', now)
  set('g', s.g + 1)
  forgot = forgot + redis.call('ZREMRANGEBYSCORE', dkey, '(' .. string.format('%d', math.floor(now)), '+inf')
end

local function save()
  if s.r and not s.f then set('f', now) end
  if forgot > 0 and s.r then
    -- (whole µs: each departure is booked a whole interval, rounded up,
    -- after the one before)
    local iv = math.ceil(learned_iv())
    local last = math.ceil(math.max(now - iv, s.al or 0)) + forgot * iv
    if not s.ls or last > s.ls then set('ls', last) end
  end
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

-- disc_flag is 1 while the fleet discovers the limit of a resource that
-- announces nothing (no policy, and dv not set): every answer is then
-- worth a learn (upstream_learn.lua), 200s too.
local function disc_flag()
  if policy() or s.dv then return 0 end
  return 1
end

local function rate_text()
  if s.r then return fmt(s.r) end
  return ''
end

-- left_at records a departure's slot as the latest leave (al, see
-- upstream_leave.lua) if it comes within confirm_after of now (µs;
-- throttle's confirmAfter): a later one is confirmed near its slot
-- (upstream_confirm.lua), which records it then.
local confirm_after = 5000
local function left_at(slot)
  slot = math.ceil(slot)
  if slot - now <= confirm_after and (not s.al or slot > s.al) then set('al', slot) end
end

-- disc_ahead_wait says how long (µs) a caller waits before asking again
-- for a departure at slot, booked at interval iv, rather than have it
-- booked now, and the place (µs) it comes back at; nil to book it. While a
-- limit is discovered (upstream_learn.lua), a departure asked near is
-- booked at most an interval ahead, one asked on a paced turn
-- up_disc_ahead (upstream_rate.lua), as admit books the turns: departures
-- booked further ahead at the interval tried would hold every faster one
-- tried after back until they had left (a fleet of goroutines books one
-- each: 12 of them, 0.7 s; turns admitted at the rules' pace before a rate
-- was learned, their departures booked 0.7 s ahead at the first step's).
--
-- Each caller told to come back is given a place in a line, an interval
-- after the one before it (cb), from when the schedule's end comes near
-- enough: each comes back when it may book, one an interval, where
-- coming back all at once (every 20 ms, or when the end came near) cost a
-- call of every waiting caller for each departure booked (ten worker
-- processes: 100-150 calls in a run's first second). A caller back from
-- its place (place, 0 for none) that may not book yet (a departure was
-- booked meanwhile without a place, or the rate was lowered) takes the
-- line's head again, not its end; one back before its place (the
-- caller's own bound) keeps it. A faster step meanwhile is met by the
-- callers that come, and by the line, as it comes back. A place that
-- would make a caller's departure later than its bound (max_wait) is not
-- given: -1 and when the departure would be.
local function disc_ahead_wait(slot, iv, near, place, max_wait)
  if not s.r or iv <= 0 or disc_flag() ~= 1 then return nil end
  local ahead = up_disc_ahead(iv)
  if near then ahead = iv end
  if slot - now <= ahead then return nil end
  local at = slot - ahead
  if place > now then
    at = math.max(at, place)
    return math.ceil(at - now), at
  end
  if place <= 0 and s.cb and s.cb + iv > at then at = s.cb + iv end
  at = math.ceil(at)
  if max_wait >= 0 and at + ahead - now > max_wait then return -1, at + ahead end
  if not s.cb or at > s.cb then
    set('cb', at)
    save()
  end
  return math.ceil(at - now), at
end

-- too_far is depart's reply when its slot, delay µs away, is past the
-- caller's bound: nothing booked.
local function too_far(delay)
  return {0, math.ceil(delay), '', 0, 0, now, '', '', 0, rate_text(), s.q or 0, s.w or 0, 0, '', disc_flag()}
end

-- come_back is depart's reply to a caller that asks again in wait µs,
-- at place (text, '' for none); disc 1 while a limit is discovered.
local function come_back(wait, place, disc)
  return {2, math.ceil(wait), place, 0, 0, now, '', '', 0, '', 0, 0, 0, '', disc}
end

-- depart books the next departure: on the learned rate, at the first
-- slot at least one interval from every departure booked (up_gap, so a
-- new rate holds from the next departure on, faster or slower); or
-- without one on the
-- ceiling (a GCRA with its burst); after the subject's pause; and within
-- the window an answer described. A caller that may claim (claim true:
-- its first call, not after waiting for the first answer) is handed an
-- open departure admit booked near now (its turn's, up_claim) instead, if
-- the subject's pause does not cover it: within the tolerance ahead, or
-- less than an interval behind (its owner late: ten worker processes
-- starting on two cores came 2-4 ms late for their first turns, and each
-- turn left unclaimed was a hole). It leaves at its slot, or now if that
-- passed more than the tolerance ago, and no sooner than an interval
-- after the latest leave (al), which it becomes. A caller that asks near
-- (near true) is, while a limit is discovered, booked no more than an
-- interval ahead (below).
local function depart(max_wait, probe_wait, claim, near, place)
  local probe = 0
  if not known then
    probe = 1
    set('p', now + probe_wait)
  elseif s.p and s.p > now and not s.r and not policy() then
    return come_back(math.min(s.p - now, 20000), '', 0)
  end
  grow()
  local pause = tonumber(redis.call('GET', pkey)) or 0
  if claim and s.r and pause <= now then
    local iv = learned_iv()
    local tol = math.min(math.max(iv / 40, 2000), 5000)
    local c = up_claim(dkey, now, iv - 1, tol, iv)
    if c then
      local at = c
      if now > c + tol then at = now end
      if s.al then at = math.max(at, s.al + iv) end
      -- The schedule keeps its slot (the next turn's departure is an
      -- interval from it, and pushed by al); the leave is recorded.
      at = math.ceil(at)
      left_at(at)
      save()
      local ls_text, t_text = '', fmt(s.t or now)
      if s.ls then ls_text = fmt(s.ls) end
      return {1, math.max(at - now, 0), fmt(c), s.n, s.g, now, t_text, t_text, math.ceil(iv), rate_text(), s.q or 0, s.w or 0, 0, ls_text, disc_flag()}
    end
  end
  local before = s.t or now
  local slot, after, iv = math.max(now, pause), before, 0
  if s.r then
    iv = learned_iv()
    -- An interval after the latest leave (al).
    if s.al then slot = math.max(slot, s.al + iv) end
    slot = up_gap(dkey, slot, iv, nil)
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
        if s.r then slot = up_gap(dkey, slot, iv, nil) end
        if iv > 0 then after = math.max(after, slot + iv) end
      else
        wl = wl - 1
      end
    end
  end
  if max_wait >= 0 and slot - now > max_wait then return too_far(slot - now) end
  local back, at = disc_ahead_wait(slot, iv, near, place, max_wait)
  if back == -1 then return too_far(at - now) end
  if back then return come_back(back, fmt(at), 1) end
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
  if iv > 0 then up_book(dkey, math.ceil(slot), now, iv, ttl) end
  if s.r then left_at(slot) end
  save()
  local pq, pw = s.q or 0, s.w or 0
  if pq == 0 and s.l and s.lw then pq, pw = s.l, s.lw end
  local ls_text = ''
  if ls then ls_text = fmt(ls) end
  return {1, math.ceil(slot - now), fmt(slot), s.n, s.g, now, fmt(before), fmt(after), math.ceil(iv), rate_text(), pq, pw, probe, ls_text, disc_flag()}
end


-- give_back moves the schedule back to before a departure that will not
-- leave, if no later one was booked behind it: its end (before) and its
-- latest slot (ls, '' for none); and forgets its slot (text, as booked).
local function give_back(before, after, ls, slot)
  if slot and slot ~= '' then redis.call('ZREM', dkey, string.format('%d', math.ceil(tonumber(slot)))) end
  if s.t and math.abs(s.t - after) < 0.5 then
    set('t', before)
    set('ls', tonumber(ls))
    return 1
  end
  return 0
end
