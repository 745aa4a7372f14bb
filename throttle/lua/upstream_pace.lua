-- upstream_pace (admit only, admit.lua): a turn of a subject whose
-- upstream's learned rate (throttle/upstream.go) is slower than a bucket
-- rule's is decided at the learned rate instead, with a burst of 1: so
-- bookings, lines and parked tasks keep the pace the upstream accepts, and
-- a request sent on such a turn departs at once (upstream_depart.lua),
-- with no second wait that could send its task back.
--
-- ukey -> <prefix>{<subject>}:!upstream(<rules>), the subject's upstream
--         hash (upstream_state.lua); read only. A missing hash, or one with
--         no learned rate, changes nothing.
-- nrules -> the rules of the policy, whose arguments (rules.lua: algorithm,
--         count, period µs, burst at ARGV[4 + 5 * (i - 1)]) are rewritten in
--         place for every gcra and token_bucket rule whose interval
--         (period / count) is shorter than the learned one: count 1, period
--         the learned interval (µs, rounded up), burst 1. The bucket state
--         is a time (bucket.lua), which stays meaningful at another
--         interval; the windows and a concurrency rule are left alone. Such
--         a rule's state is also moved (pause[algo], as PauseFor moves it)
--         so that its next turn is no sooner than the next departure's
--         slot on the upstream schedule: the two schedules stay aligned.
-- ukey's ls (the latest departure's slot) is read for that.
-- counts(i) -> whether rule i counts this request as requests do (one
--         permit a request): a learned rate of requests paces only those,
--         not a rule of tokens charged hundreds a request (Costs).
-- Returns the learned interval applied (µs), or 0 if none was, and
-- whether the rate is a step of a discovery (upstream_learn.lua: no
-- policy, dv unset, as upstream_state.lua's disc_flag reads it), which
-- the next answers may change.
local function upstream_pace(ukey, nrules, counts)
  local v = redis.call('HMGET', ukey, 'r', 'u', 'hi', 'q', 'w', 'l', 'lw', 'ls', 'al', 'dv')
  local s = {r = tonumber(v[1]), u = tonumber(v[2]), hi = tonumber(v[3]), q = tonumber(v[4]),
    w = tonumber(v[5]), l = tonumber(v[6]), lw = tonumber(v[7]), ls = tonumber(v[8]), al = tonumber(v[9])}
  if not s.r then return 0, false end
  local discovering = not up_policy(s) and not v[10]
  -- The ceiling, as Limiter.Upstream computes it: the slowest rule that
  -- sets a rate.
  local ceil_iv = 0
  for i = 1, nrules do
    local b = 4 + 5 * (i - 1)
    if ARGV[b] ~= 'concurrency' then
      local iv = tonumber(ARGV[b + 2]) / tonumber(ARGV[b + 1])
      if iv > ceil_iv then ceil_iv = iv end
    end
  end
  local ceil_rate = nil
  if ceil_iv > 0 then ceil_rate = 1e6 / ceil_iv end
  local r = up_grown(s, now, ceil_rate)
  if not r or r <= 0 then return 0, false end
  local iv = math.ceil(1e6 / r)
  local applied = 0
  for i = 1, nrules do
    local b = 4 + 5 * (i - 1)
    local algo = ARGV[b]
    if (algo == 'gcra' or algo == 'token_bucket') and counts(i) and tonumber(ARGV[b + 2]) / tonumber(ARGV[b + 1]) < iv then
      ARGV[b + 1], ARGV[b + 2], ARGV[b + 3] = '1', string.format('%d', iv), '1'
      applied = iv
      -- No turn before the next departure's slot (one interval after the
      -- latest slot and the latest leave, upstream_depart.lua): a request
      -- sent on the turn then departs at it, without waiting (and asking
      -- again).
      local last = math.max(s.ls or 0, s.al or 0)
      if last + iv > now then pause[algo](KEYS[i], 1, iv, 1, last + iv) end
    end
  end
  return applied, applied > 0 and discovering
end

-- up_ttl is the upstream hash's TTL in ms (throttle.UpstreamTTL; a test
-- checks that they agree): admit refreshes it when it books a departure.
local up_ttl = 600000

-- upstream_turn (admit only, after upstream_pace applied the learned
-- interval iv, µs): a caller about to run on a turn at slot (µs of Redis
-- TIME; a new turn granted, or a booking redeemed) departs on it, and the
-- departure is booked in dkey (upstream_rate.lua) and as the hash's latest
-- slot (ls) in this call, so that its request leaves with no call of its
-- own (throttle.Upstream). It departs on its own slot (now, if the slot
-- passed) if no departure is booked within iv of it: turns booked at the
-- learned rate are spaced by it already, whatever order they come back
-- in. Else at the next slot that is (a turn booked at a faster pace,
-- before the rate was learned or lowered; a departure of another kind
-- near it), if that is at most iv later, so that the delay it adds stays
-- bounded; else nil is returned, nothing booked, and the caller takes a
-- new turn (force: no bound). Returns the departure's slot, µs.
local function upstream_turn(ukey, dkey, slot, iv, force)
  local bound = iv
  if force then bound = nil end
  local dep = up_gap(dkey, math.max(slot, now), iv, bound)
  if not dep then return nil end
  local v = redis.call('HMGET', ukey, 'ls', 'n', 'f')
  -- While the rate is new, the caller's process may not know that the
  -- turn is its departure: booked open, for it to claim (up_claim).
  local f = tonumber(v[3])
  up_book(dkey, dep, now, iv, up_ttl, f and now - f < up_claimable)
  local f = function(x) return string.format('%d', x) end
  redis.call('HSET', ukey, 'ls', f(math.max(tonumber(v[1]) or dep, dep)), 'n', (tonumber(v[2]) or 0) + 1)
  redis.call('PEXPIRE', ukey, up_ttl)
  return dep
end
