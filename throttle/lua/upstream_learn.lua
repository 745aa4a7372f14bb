-- learn (after upstream_rate.lua and upstream_state.lua, whose KEYS and
-- ARGV[1..8] it takes): records what the resource answered to a
-- departure's request: a policy, a window, a 429 (throttle/upstream.go).
--
-- ARGV[9]  -> 1 if the answer was a 429, else 0
-- ARGV[10] -> when the departure was booked (µs; -1: unknown, a request
--             sent on an admitted turn without a departure of its own)
-- ARGV[11] -> its number (-1: unknown)
-- ARGV[12], ARGV[13] -> a policy: quota, window (µs); 0 0 for none
-- ARGV[14] -> a limit without a window (0: none)
-- ARGV[15] -> requests remaining until the reset (-1: not said)
-- ARGV[16], ARGV[17] -> the reset comes between these, µs from now (-1 -1:
--             not said)
-- ARGV[18] -> the interval the departure was booked at, µs (0: unknown, or
--             none)
-- ARGV[19] -> when the request left (µs of Redis TIME; -1: unknown)
--
-- Reply {lowered, from, rate, changed, q, w, since, discovering, step}:
-- lowered 1 if a 429 lowered the rate from `from`; rate the learned rate
-- after (text); changed 1 if the policy changed; since how long before now
-- the rate was last lowered before this answer (µs; -1: never);
-- discovering 1 while the limit of a resource that announces nothing is
-- being discovered (below), after this answer; step 1 if this answer was
-- a step of that discovery (the last one too).
grow()
local too_many, booked, dep = ARGV[9] == '1', tonumber(ARGV[10]), tonumber(ARGV[11])
local quota, window, limit = tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
local remaining, reset_min, reset_max = tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17])
local dep_iv = tonumber(ARGV[18])
local left = tonumber(ARGV[19])
local changed, down, from = 0, 0, ''
local since = -1
if s.d then since = now - s.d end
-- The first answer (the probe's, awaited while p is set) says when the
-- next request may leave: no sooner than an interval after now. The probe
-- reached the resource at some moment between its slot and its answer,
-- and on a cold connection (the process's first request: a dial, a TLS
-- handshake) that may be well after its slot: traced, 5.6 ms after it on
-- loopback, and the next request, booked an interval after the slot,
-- reached the resource 48 ms after the probe, under its 50 ms interval
-- (a 429 in the first second). Costs the fleet one round trip, once.
if s.p then
  set('p', nil)
  if not s.al or now > s.al then set('al', now) end
end

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
-- A 429 to a request sent on an admitted turn (booked unknown) counts once
-- the last lowering is a second old: the turns admitted before it, at the
-- old pace, have left by then (the 429's Retry-After pauses the subject,
-- and a booked turn inside a pause is taken again).
--
-- A 429 from a resource that announces nothing, once one has been counted
-- (hi), is counted only if it is not alone: another came within
-- alone_after departures before it. A rate above the resource's limit is
-- refused again and again, at least once in alone_after departures from
-- 0.5 % above it; a rate under it only when a request reaches the
-- resource late, closer than its limit to the one after (traced: 4-19ms
-- after their departures on a loaded machine, on the path Redis does not
-- see), now and then. Counted, each such 429 set the rate 2 % lower for
-- good near the last one's rate (a 3-worker run slid from 20.4/s to
-- 17.3/s in 90 s), or pinned it lower still while it recovered (a
-- 10-worker run: a 429 at 16.7/s, its request 45.6ms after one 15ms late
-- under the API's 50ms); alone, one lowers nothing.
local alone_after = 200
-- Under a policy, a 429 is alone unless two others came within
-- alone_policy departures before it: three in 1,000 departures is a rate
-- refused more often than 0.2 % of its requests, the most a steady run
-- should see, and is lowered for good. Two within 500, as this was, came
-- by chance in 3 of 12 1,500-task runs with headers, at a rate refused
-- 0.07-0.13 % of the time (requests that reached the resource late): the
-- pair lowered it for good, the fleet at 94.2-94.7 % of the limit for the
-- rest of the run, not 95.8 % (BENCHMARKS.md).
local alone_policy = 1000
-- Under a policy, a 429 alone lowers the rate by k_alone, not k_gentle:
-- it came from a request that reached the resource late, not from a rate
-- above the policy, and 3 % more room for the 0.3 s it takes to recover is
-- what a busy spell needs. At k_gentle the fleet ran under 90 % of the
-- limit for half a second after one and under 95 % for a second: each of
-- the 7 of 48 runs with headers that missed convergence within a second
-- had one 0.3-0.8 s after the first request (BENCHMARKS.md).
-- throttle.learnAlone is this (a test checks that they agree).
local k_alone = 0.97
-- Discovery. A resource that announces nothing says only, of each
-- request, whether it came too soon after the last one it accepted: one
-- with no burst (a GCRA with burst 1, as most per-second limits are
-- enforced) accepts a request no sooner than its interval T after the
-- last one it accepted. So the leaves of the answers, in order, bound T
-- from both sides: every gap between two accepted requests is at least
-- T (hi, the least), every refused request came less than T after the
-- last accepted one (lo, the most). While the fleet discovers (no policy,
-- dv unset), every answer comes here with its leave (ARGV[19]); they are
-- kept in ob for disc_span, at most disc_keep of them. The interval:
--   a 429 before any two requests were accepted (hi unknown): twice the
--     largest refused gap (2 lo), unless longer already (a back-off that
--     passes T in log2 steps);
--   both bounds, hi > disc_close lo: the interval tried is kept while it
--     lies well between them (its answers are to come), else it goes to
--     their midpoint (a bisection: a step a request on either side);
--   hi <= disc_close lo: found, disc_room times the larger bound (hi, or
--     lo when jitter crossed them): 86-97 % of the limit (at 98 %, the
--     requests' jitter on a busy machine brought 429s every few hundred
--     ms for a second after it was found: traced); dv is set, the
--     rate is held there (hi, the rate a 429 came at, just above it), and
--     from here on a 429 is answered as for any learned rate (below).
-- The fleet is not paused while discovering (httpthrottle: fleetPause):
-- each step backs off by itself. Through cmd/worker processes (3 and 10,
-- a 20/s API under a 100/s rule) it found the limit with 2-6 429s and
-- converged within a second in 20 of 24 runs (1.006-1.19 s in the other
-- four, each a 429 late in the first second or just after the limit was
-- found), where halving on
-- 429s and recovering at 10 % a second took 2.4-3.3 s (BENCHMARKS.md).
-- Discovery ends unfound, and the 429s are answered as before, when the
-- bounds disagree (hi < disc_apart lo: a resource with a burst, or a
-- window; crossed by less, they are the jitter between leaves and
-- arrivals, and the larger is the limit found), when they bound a limit
-- within disc_near of the rules' interval (a resource with a burst or a
-- window: its first 429 comes at the rules' pace), when disc_keep answers
-- did not settle it, and once disc_quiet answers came with no 429 (the
-- rules bind, not the resource).
-- What was sent while discovering counts against the limit found: the
-- next request leaves no sooner than each kept leave plus as many
-- intervals as requests left from it on, so that no window holds more
-- than its share of the limit, 429s included, however close together
-- the steps were.
local disc_keep, disc_span, disc_quiet = 64, 3e6, 20
local disc_close, disc_room, disc_apart, disc_near, disc_untried = 1.1, 1.05, 0.8, 1.25, 1.03
local disc_step = 0
local disc_done = false

local function disc_hold(obs, iv)
  local at = 0
  for i, o in ipairs(obs) do at = math.max(at, o[1] + (#obs - i + 1) * iv) end
  at = math.ceil(at - iv)
  if not s.al or at > s.al then set('al', at) end
end

-- keep writes the answers kept back to ob.
local function keep(obs)
  local parts = {}
  for i, o in ipairs(obs) do
    local b = '0'
    if o[2] then b = '1' end
    parts[i] = string.format('%d', o[1]) .. ':' .. b
  end
  redis.call('HSET', key, 'ob', table.concat(parts, ','))
end

-- disc_answers returns the answers kept, this one among them, in the
-- order their requests left.
local function disc_answers()
  local obs = {}
  for t, ok in string.gmatch(redis.call('HGET', key, 'ob') or '', '(%d+):(%d)') do
    t = tonumber(t)
    if t >= now - disc_span then obs[#obs + 1] = {t, ok == '1'} end
  end
  obs[#obs + 1] = {left, not too_many}
  table.sort(obs, function(a, b) return a[1] < b[1] end)
  while #obs > disc_keep do table.remove(obs, 1) end
  return obs
end

-- disc_bounds returns lo and hi (µs; nil if none yet) and how many of
-- the answers were refused and accepted.
local function disc_bounds(obs)
  local last, lo, hi, refused, ok = nil, nil, nil, 0, 0
  for _, o in ipairs(obs) do
    if o[2] then
      ok = ok + 1
      if last then hi = math.min(hi or math.huge, o[1] - last) end
      last = o[1]
    else
      refused = refused + 1
      if last then lo = math.max(lo or 0, o[1] - last) end
    end
  end
  return lo, hi, refused, ok
end

-- disc_apply sets the rate to the interval iv (µs), lo the largest
-- refused gap (nil: none), obs the answers kept (for disc_hold).
local function disc_apply(iv, lo, cur, obs)
  local r = 1e6 / iv
  local c = cap()
  if c and r > c then r = c end
  if s.r and r < s.r or not s.r and cur > 0 and r < 1e6 / cur then
    -- (the departures booked at the faster pace are forgotten)
    lowered()
    if too_many then
      from = fmt(s.r or 1e6 / cur)
      down = 1
    end
  end
  set('r', r)
  if disc_done then
    -- held where it is found: no recovery past it
    set('u', now)
    set('hi', r / up_below)
    disc_hold(obs, 1e6 / r)
  else
    -- A step holds its rate until its answers judge it, for as long as
    -- they are kept at most (u, when the rate may grow again, is then
    -- ahead): recovering towards the slowest rate refused, a step drifted
    -- into the bounds it had set and was never judged (traced: a rate
    -- tried at 12.4/s crept to 16.9/s in 1.1 s, and no step came).
    set('u', now + disc_span)
    -- the slowest rate refused
    if lo then set('hi', 1e6 / lo) end
  end
end

-- discover takes the answer as a step of the discovery; false if it is
-- to be answered as any 429 (below) instead.
local function discover()
  local obs = disc_answers()
  local lo, hi, refused, ok = disc_bounds(obs)
  local cur = ceil_iv
  if s.r then cur = 1e6 / s.r end
  local iv
  if refused == 0 then
    if ok >= disc_quiet then disc_done = true end
  elseif too_many and not lo then
    -- A 429 with no request accepted before it says only "wait", which
    -- its Retry-After does: answered as before (a lone request's pauses
    -- the fleet).
    keep(obs)
    return false
  elseif (hi and lo and (hi < disc_apart * lo or hi <= disc_close * lo and math.max(hi, lo) < disc_near * ceil_iv)) or #obs >= disc_keep then
    -- The bounds disagree (not a resource this reads), or bound a limit
    -- at the rules' pace (a resource with a burst or a window refuses
    -- its first 429 there), or too many answers did not settle it: the
    -- 429s are answered as before.
    redis.call('HDEL', key, 'ob')
    set('dv', 1)
    return false
  elseif hi and lo then
    if hi <= disc_close * lo then
      -- Found; bounds crossed by less than disc_apart are the leaves'
      -- jitter at the resource, and the larger is taken.
      iv, disc_done = math.max(hi, lo) * disc_room, true
    elseif not (cur > lo * disc_untried and cur < hi / disc_untried) then
      iv = (lo + hi) / 2
    end
    -- else the interval tried is well between the bounds (not tried yet:
    -- its answers are to come)
  elseif too_many and lo then
    iv = math.max(cur, 2 * lo)
  end
  if iv and iv > 0 then disc_apply(iv, lo, cur, obs) end
  if disc_done then
    redis.call('HDEL', key, 'ob')
    set('dv', 1)
  else
    keep(obs)
  end
  disc_step = 1
  return true
end

local handled = false
if disc_flag() == 1 and left >= 0 then handled = discover() end

local fresh = booked >= (s.d or 0)
if booked < 0 then fresh = now >= (s.d or 0) + 1e6 end
if too_many and not handled and fresh and (s.r or s.gap or booked < 0) then
  -- The rate the resource saw: the one the departure was booked at (the
  -- learned rate may have grown since, departures booked ahead keep
  -- theirs), else the learned one, else the gaps between departures.
  local cur = s.r
  if dep_iv > 0 then
    cur = 1e6 / dep_iv
  elseif not cur and s.gap and s.gap > 0 then
    cur = 1e6 / s.gap
  end
  -- A request sent on an admitted turn came at the rules' pace at most.
  if not cur and booked < 0 then cur = ceil_rate end
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
    local pair = s.lone and s.n - s.lone <= alone_after
    if policy() then pair = s.lone2 and s.n - s.lone2 <= alone_policy end
    if policy() and not pair then
      -- Under a policy, a 429 alone lowers the rate all the same (the
      -- resource refused it), but it recovers to where the 429 came
      -- rather than to up_below of it: the share of the policy kept is
      -- room for such late requests, which lowered it for good before
      -- (one 429 in a 90 s run left it at 93 % of the policy instead of
      -- 95 %). A third within alone_policy departures is a rate too
      -- high: it is lowered as always, for good, to the least of the
      -- three's rates.
      from = fmt(cur)
      set('hi', cur / up_below)
      set('r', math.max(cur * k_alone, 1e-3))
      set('u', now)
      if s.lone and s.n - s.lone <= alone_policy then
        set('lone2', s.lone)
        set('lo', math.min(cur, s.lo or cur))
      else
        set('lone2', nil)
        set('lo', cur)
      end
      set('lone', s.n)
      lowered()
      down = 1
    elseif policy() or not s.hi or pair then
      -- Of a pair, the lower rate: the resource refused both.
      if pair and s.lo then cur = math.min(cur, s.lo) end
      from = fmt(cur)
      set('hi', cur)
      set('r', math.max(cur * k, 1e-3))
      set('u', now)
      if s.lone then
        set('lone', nil)
        set('lone2', nil)
        set('lo', nil)
      end
      lowered()
      down = 1
    else
      set('lone', s.n)
      set('lo', cur)
    end
  end
end
save()
local pq, pw = s.q or 0, s.w or 0
if pq == 0 and s.l and s.lw then pq, pw = s.l, s.lw end
return {down, from, rate_text(), changed, pq, pw, since, disc_flag(), disc_step}
