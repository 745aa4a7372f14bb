-- The learned rate of an upstream (throttle/upstream.go), as the
-- upstream_* scripts keep it in the subject's upstream hash and as admit
-- reads it (upstream_pace.lua): both grow it the same way, here; and the
-- departures both book at that rate (up_gap, up_book).
--
-- The hash's fields read here (upstream_state.lua lists them all): r the
-- learned rate, requests per second; u when it last grew (µs; ahead of
-- now while a discovery's step holds it, upstream_learn.lua); hi the rate
-- at which the last 429 came; q, w the announced policy (q per w µs); l, lw
-- the policy inferred from a limit without a window.
--
-- A 429 leaves the rate below hi; it recovers at up_recover of hi a second
-- to up_below of hi, then grows by up_grow a second (raising hi with it),
-- never above the cap: the slowest rule's rate or the policy's, whichever
-- is lower. upstream.go's learnBelow, learnRecover and learnGrow are these
-- (a test checks that they agree).
local up_below, up_recover, up_grow = 0.98, 0.1, 0.0002

-- While the limit of a resource that announces nothing is discovered
-- (upstream_learn.lua), no turn or departure is booked further ahead than
-- up_disc_ahead(iv) µs, iv the interval tried: the next answers may step
-- the rate faster, and a step applies only once what was booked at the
-- slower rate has left. Two intervals, at least 100 ms (a serving of the
-- line and a round trip): at the 250 ms or four intervals this was, a
-- step waited 0.35 s behind them, and a bisection of four steps up at 3
-- workers took 1.3-1.5 s to converge (BENCHMARKS.md).
local function up_disc_ahead(iv) return math.max(100000, 2 * iv) end

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
-- slowest rule's rate (nil: none). Both phases are computed from the
-- state as last written (r, u): the recovery to up_below of hi, then the
-- growth for the rest of the time. Admit and a request that leaves on its
-- turn read the rate without writing it, and most of a paced fleet's
-- requests do only that: computed as one phase or the other, a rate
-- recovered from a 429 stayed at up_below of hi until some call wrote it
-- (a fleet at 95.0 % of the limit for a run after one 429 in its first
-- second, 95.8 % without: BENCHMARKS.md).
local function up_grown(s, now, ceil_rate)
  if not s.r then return nil end
  local r, hi = s.r, nil
  if s.u and now > s.u then
    local dt = (now - s.u) / 1e6
    if s.hi and r < up_below * s.hi then
      local rec = (up_below * s.hi - r) / (up_recover * s.hi)
      if dt <= rec then
        r = r + up_recover * s.hi * dt
      else
        r = up_below * s.hi * (1 + up_grow * (dt - rec))
        hi = r / up_below
      end
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
-- interval iv and a second before now, and keeps dkey for ttl ms. A
-- departure admit books for a turn while the rate is new (up_claimable)
-- is a member '<slot>' .. up_open: its request may come from a process
-- that does not know yet that its turn is its departure, and departs on
-- the schedule; depart hands it that same slot (up_claim) instead of a
-- second one, which would leave a hole. Every other member is '<slot>'.
local up_open = ':open'
local function up_book(dkey, slot, now, iv, ttl, open)
  local v = string.format('%d', slot)
  local member = v
  if open then member = v .. up_open end
  redis.call('ZADD', dkey, v, member)
  redis.call('ZREMRANGEBYSCORE', dkey, '-inf', '(' .. string.format('%d', math.floor(now - iv - 1e6)))
  redis.call('PEXPIRE', dkey, ttl)
end

-- up_claimable is how long after the rate was first learned (the hash's
-- f, µs) admit books its departures open (up_book): longer than a
-- worker process takes to hear of the rate from its first departure
-- (httpthrottle's paced Transport departs on the schedule until it has,
-- at most its wait for a departure, a second, after it). After that, a
-- request that departs on the schedule is late for its turn, or was
-- turned at another pace: not the owner of a departure near now.
local up_claimable = 3e6

-- up_claim hands the caller of depart, at now, the earliest open
-- departure from late µs before now to tol after, if there is one (its
-- own turn's, which admit booked while the caller's process did not know)
-- and it is at least iv (µs, the learned interval now) from every other
-- departure booked: it is no longer open, and its slot (µs) is returned;
-- else nil. An open departure
-- closer than that to another was booked at a faster pace, before the
-- rate was lowered: its caller takes a slot at the new pace instead (a
-- 3-worker run claimed one 36ms after the last request under a 50ms
-- limit, and its 429, counted at the new pace, pinned the rate at 75 %
-- of the limit). It stays booked: its turn's request may still leave on
-- it from a process that knows the rate.
local function up_claim(dkey, now, late, tol, iv)
  local near = redis.call('ZRANGEBYSCORE', dkey, string.format('%d', math.ceil(now - late)), string.format('%d', math.floor(now + tol)), 'WITHSCORES')
  for i = 1, #near, 2 do
    local m, slot = near[i], tonumber(near[i + 1])
    if string.sub(m, -#up_open) == up_open and #redis.call('ZRANGEBYSCORE', dkey, string.format('%d', math.floor(slot - iv) + 1), string.format('%d', math.ceil(slot + iv) - 1), 'LIMIT', 0, 2) == 1 then
      redis.call('ZREM', dkey, m)
      redis.call('ZADD', dkey, near[i + 1], near[i + 1])
      return slot
    end
  end
  return nil
end
