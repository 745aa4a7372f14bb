-- The learned rate of an upstream (throttle/upstream.go), as the
-- upstream_* scripts keep it in the subject's upstream hash and as admit
-- reads it (upstream_pace.lua): both grow it the same way, here; and the
-- departures both book at that rate (up_gap, up_book).
--
-- The hash's fields read here (upstream_state.lua lists them all): r the
-- learned rate, requests per second; u when it last grew (µs); hi the rate
-- at which the last 429 came; q, w the announced policy (q per w µs); l, lw
-- the policy inferred from a limit without a window.
--
-- A 429 leaves the rate below hi; it recovers at up_recover of hi a second
-- to up_below of hi, then grows by up_grow a second (raising hi with it),
-- never above the cap: the slowest rule's rate or the policy's, whichever
-- is lower. upstream.go's learnBelow, learnRecover and learnGrow are these
-- (a test checks that they agree).
local up_below, up_recover, up_grow = 0.98, 0.1, 0.0002

-- up_least is the lower of two rates, either of which may be nil.
local function up_least(a, b)
  if not a then return b end
  if not b then return a end
  return math.min(a, b)
end

-- up_policy is the rate of the announced policy, else of the inferred one,
-- per second; nil if none.
local function up_policy(s)
  if s.q and s.w then return s.q * 1e6 / s.w end
  if s.l and s.lw then return s.l * 1e6 / s.lw end
  return nil
end

-- up_grown returns the learned rate as of now (nil if none) and, if it
-- grew past up_below of hi, the hi that goes with it. ceil_rate is the
-- slowest rule's rate (nil: none).
local function up_grown(s, now, ceil_rate)
  if not s.r then return nil end
  local r, hi = s.r, nil
  if s.u and now > s.u then
    local dt = (now - s.u) / 1e6
    if s.hi and r < up_below * s.hi then
      r = math.min(up_below * s.hi, r + up_recover * s.hi * dt)
    else
      r = r * (1 + up_grow * dt)
      if s.hi and r > up_below * s.hi then hi = r / up_below end
    end
  end
  local c = up_least(ceil_rate, up_policy(s))
  if c and r > c then r = c end
  return r, hi
end

-- The departures booked at a learned rate, by admit for the turns it lets
-- run (upstream_pace.lua) and by the upstream scripts for the others
-- (upstream_state.lua), are a sorted set, <prefix>{<subject>}:!departures(<rules>),
-- each member and score a slot (µs of Redis TIME, whole). A departure is
-- booked at least the learned interval from every other, wherever the
-- others are: turns are let run (and booked) out of their order, early or
-- late, and a departure booked after a later one must not come too close
-- to it.

-- up_gap returns the earliest slot from `from` on (µs, rounded up) that is
-- at least iv from every departure booked in dkey, or nil if that is more
-- than bound after from (bound nil: no bound).
local function up_gap(dkey, from, iv, bound)
  local c = from
  while true do
    local near = redis.call('ZRANGEBYSCORE', dkey, '(' .. string.format('%d', math.floor(c - iv)), '+inf', 'WITHSCORES', 'LIMIT', 0, 16)
    for i = 2, #near, 2 do
      local e = tonumber(near[i])
      if e >= c + iv then return math.ceil(c) end
      c = math.max(c, e + iv)
      if bound and c - from > bound then return nil end
    end
    if #near < 32 then return math.ceil(c) end
  end
end

-- up_book books a departure at slot (µs, whole) in dkey, forgets those an
-- interval iv and a second before now, and keeps dkey for ttl ms.
local function up_book(dkey, slot, now, iv, ttl)
  local v = string.format('%d', slot)
  redis.call('ZADD', dkey, v, v)
  redis.call('ZREMRANGEBYSCORE', dkey, '-inf', '(' .. string.format('%d', math.floor(now - iv - 1e6)))
  redis.call('PEXPIRE', dkey, ttl)
end
