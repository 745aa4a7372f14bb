-- allow, reserve and atmost: one request against every rule of a policy,
-- decided atomically. The three share this script: their KEYS and ARGV
-- have one layout. Built as time.lua, prelude.lua, the algorithm files, a
-- use_*.lua file, rules.lua, decide.lua, allow.lua (throttle/scripts.go).
--
-- KEYS[i]   -> the key of rule i: <prefix>{<subject>}:<rule>, i = 1..r
-- ARGV[1]   -> 'allow', 'reserve', 'meet' or 'atmost'
-- ARGV[2]   -> n, the number of permits; 0 (allow, reserve) reads the
--              state and charges nothing. Under several rules, allow and
--              reserve also take one per rule, 'n1,n2,...,nr' (per_rule,
--              rules.lua)
-- ARGV[3]   -> reserve: the longest delay accepted, microseconds (-1: no
--              bound); allow and atmost: -1; meet: 'bound not_before', a
--              reserve whose turn is at not_before (µs of Redis time) or
--              later, charged to every rule at that turn (rules.lua:
--              meet_at)
-- ARGV[4 + 5 * (i - 1)] ... -> rule i, five values (rules.lua), its
--              ticket ''
-- r is floor((#ARGV - 3) / 5).
--
-- Returns decide's reply (decide.lua): {ok (1/0), deciding rule index,
-- remaining, delay µs, reset µs, Redis now µs, ticket 1, ..., ticket r}.
-- atmost is allow of as many of n permits as every rule has now, at least
-- 1; when admitted, its reply ends with that number after the tickets.
-- A policy of one token bucket or GCRA rule sends most of its allow and
-- reserve calls to bucket_fast.lua instead, which hands back what it
-- cannot decide.
local op = ARGV[1]
local n = tonumber(ARGV[2])
local nrules = math.floor((#ARGV - 3) / 5)

-- atmost: n becomes what every rule has now (a state read, n = 0), at
-- least 1, and the request an allow of that many.
local atmost = op == 'atmost'
if atmost then
  for i = 1, nrules do
    local algo, count, period, extra = rule(i)
    local _, _, left = (one_check or checks[algo])(KEYS[i], count, period, extra, 0, false, 0)
    if left < n then n = left end
  end
  if n < 1 then n = 1 end
end

if not decide then
  -- allow or reserve under one rule, the hot path: decide's one-rule
  -- decision (decide.lua) inline, so that no closure is made.
  local algo, count, period, extra = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
  local max_wait = tonumber(ARGV[3])
  local ok, delay, remaining, reset, s1, s2 =
    (one_check or checks[algo])(KEYS[1], count, period, extra, n, op == 'reserve', max_wait)
  if remaining < 0 then remaining = 0 end
  reset = math.ceil(math.min(reset, max_us))
  if not ok or n == 0 then return {ok and 1 or 0, 1, remaining, math.ceil(math.min(delay, max_us)), reset, now} end
  local ticket = (one_commit or commits[algo])(KEYS[1], count, period, extra, n, delay, s1, s2)
  return {1, 1, remaining, math.ceil(math.min(delay, max_us)), reset, now, ticket}
end
local ns
if not n then n, ns = per_rule(ARGV[2]) end
local max_wait = ARGV[3]
if op == 'meet' then
  -- reserve at a turn no earlier than not_before (a limiter over several
  -- subjects meets its parts at one turn, throttle/subjects.go).
  local b, nb = string.match(max_wait, '^(%-?%d+) (%d+)$')
  max_wait, not_before = b, tonumber(nb)
end
local reply = decide(n, op == 'reserve' or op == 'meet', tonumber(max_wait), nrules, ns)
if atmost and reply[1] == 1 then reply[#reply + 1] = n end
return reply
