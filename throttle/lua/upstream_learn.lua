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
--
-- Reply {lowered, from, rate, changed, q, w, since}: lowered 1 if a 429
-- lowered the rate from `from`; rate the learned rate after (text); changed
-- 1 if the policy changed; since how long before now the rate was last
-- lowered before this answer (µs; -1: never).
grow()
local too_many, booked, dep = ARGV[9] == '1', tonumber(ARGV[10]), tonumber(ARGV[11])
local quota, window, limit = tonumber(ARGV[12]), tonumber(ARGV[13]), tonumber(ARGV[14])
local remaining, reset_min, reset_max = tonumber(ARGV[15]), tonumber(ARGV[16]), tonumber(ARGV[17])
local dep_iv = tonumber(ARGV[18])
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
-- Under a policy, a 429 is alone unless another came within alone_policy
-- departures before it: 500, so that a rate refused as seldom as that
-- (0.2 % of its requests, the most a steady run should see) is lowered
-- for good.
local alone_policy = 500
local fresh = booked >= (s.d or 0)
if booked < 0 then fresh = now >= (s.d or 0) + 1e6 end
if too_many and fresh and (s.r or s.gap or booked < 0) then
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
    if policy() then pair = s.lone and s.n - s.lone <= alone_policy end
    if policy() and not pair then
      -- Under a policy, a 429 alone lowers the rate all the same (the
      -- resource refused it), but it recovers to where the 429 came
      -- rather than to up_below of it: the share of the policy kept is
      -- room for such late requests, which lowered it for good before
      -- (one 429 in a 90 s run left it at 93 % of the policy instead of
      -- 95 %). A second within alone_policy departures is a rate too
      -- high: it is lowered as always, for good.
      from = fmt(cur)
      set('hi', cur / up_below)
      set('r', math.max(cur * k, 1e-3))
      set('u', now)
      set('lone', s.n)
      set('lo', cur)
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
return {down, from, rate_text(), changed, pq, pw, since}
