-- The decision shared by allow.lua, prepay.lua and admit.lua; not a script
-- of its own (throttle/scripts.go puts it after rules.lua in theirs).
--
-- decide(n, reserve, max_wait, nrules, ns) checks a request of n permits
-- (or, with ns, of ns[i] permits under rule i, n their largest: per_rule,
-- rules.lua) against each of the nrules rules (rules.lua: KEYS[i] and ARGV
-- from 4) and,
-- if every rule admits it (reserve: within max_wait µs, -1 for no bound),
-- charges it. It returns
--   {ok (1/0), deciding rule index (1-based), remaining, delay µs,
--    reset µs, Redis now (µs of Redis TIME), ticket 1, ..., ticket r}
-- (tickets only if ok and n > 0), and final: true when a policy of one rule
-- charged nothing (denied, or n = 0), which its caller answers as it is.
-- Redis now lets the caller wake on Redis's clock (throttle/clock.go):
-- delay counts from it. Denied: the deciding rule is the one with the
-- longest delay, and delay is when a request of n would be admitted.
-- Admitted: the deciding rule is the one with the fewest permits remaining;
-- for reserve, delay is how long the caller must wait for its slot.
-- n = 0 charges nothing: ok tells whether a request of 0 would be admitted
-- now (reserve: within the bound; delay until then), with no tickets.
-- With ns, a rule charged 0 is not checked (it neither denies nor delays
-- the request, nor decides it) and its ticket is ''.
-- allow.lua decides a policy of one rule inline for allow and reserve
-- (not rare), and defines no decide: a function defined in the script body
-- is a new closure on every call (prelude.lua: cost per call), about 2 000
-- redis-server instructions per Allow of a window (BENCHMARKS.md).
local decide
if rare or #ARGV > 8 then decide = function(n, reserve, max_wait, nrules, ns)
  if nrules == 1 and not_before == 0 then
    -- One rule, the common case: no per-rule arrays, one reply table.
    local algo, count, period, extra = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
    local ok, delay, remaining, reset, s1, s2 =
      (one_check or checks[algo])(KEYS[1], count, period, extra, n, reserve, max_wait)
    -- remaining is clamped: a paused window may hold more than its count.
    if remaining < 0 then remaining = 0 end
    reset = math.ceil(math.min(reset, max_us))
    if not ok or n == 0 then
      return {ok and 1 or 0, 1, remaining, math.ceil(math.min(delay, max_us)), reset, now}, true
    end
    local ticket = (one_commit or commits[algo])(KEYS[1], count, period, extra, n, delay, s1, s2)
    return {1, 1, remaining, math.ceil(math.min(delay, max_us)), reset, now, ticket}, false
  end
  local oks, delays, rems, rsets, s1s, s2s = {}, {}, {}, {}, {}, {}
  local ok = true
  for i = 1, nrules do
    local algo, count, period, extra = rule(i)
    local m = ns and ns[i] or n
    if ns and m == 0 then
      oks[i], delays[i], rems[i], rsets[i] = true, 0, max_us, 0
    else
      oks[i], delays[i], rems[i], rsets[i], s1s[i], s2s[i] =
        (one_check or checks[algo])(KEYS[i], count, period, extra, m, reserve, max_wait)
    end
    if not oks[i] then ok = false end
  end
  local decider, delay, reset = 1, 0, 0
  for i = 1, nrules do
    if rsets[i] > reset then reset = rsets[i] end
    if ok then
      if delays[i] > delay then delay = delays[i] end
      if rems[i] < rems[decider] then decider = i end
    elseif not oks[i] and (oks[decider] or delays[i] > delay) then
      -- The longest delay among the rules that denied: every rule that
      -- admits now still admits then.
      decider, delay = i, delays[i]
    end
  end
  if not_before > now + delay then
    -- A turn asked for no earlier than not_before (allow.lua: meet) that
    -- no rule's own check put there (a sliding window or log does not
    -- read not_before): the turn is then, within the bound.
    delay = not_before - now
    if ok and not (reserve and (max_wait < 0 or delay <= max_wait)) then ok = false end
  end
  local reply = {ok and 1 or 0, decider, rems[decider], delay, reset, now}
  if ok and n > 0 then
    meet_at(nrules, n, ns, delay, delays, s1s, s2s)
    for i = 1, nrules do
      local algo, count, period, extra = rule(i)
      local m = ns and ns[i] or n
      if m > 0 then
        reply[6 + i] = (one_commit or commits[algo])(KEYS[i], count, period, extra, m, delays[i], s1s[i], s2s[i])
      else
        reply[6 + i] = ''
      end
    end
  end
  -- remaining is clamped: a paused window may hold more than its count.
  if reply[3] < 0 then reply[3] = 0 end
  reply[4] = math.ceil(math.min(reply[4], max_us))
  reply[5] = math.ceil(math.min(reply[5], max_us))
  return reply, false
end end
