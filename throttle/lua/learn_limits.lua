-- learn_limits: records the limits learned of the resource behind a
-- policy (Limiter.LearnLimits), which limits_pace.lua applies, and where
-- the resource said how much of a limit is left, takes the rule's bucket
-- down to that much at most. Built as pause.lua is, with limits_pace.lua
-- and learn_limits.lua last.
--
-- KEYS[i]   -> the key of rule i, i = 1..r (rules.lua)
-- KEYS[r+1] -> <prefix>{<subject>}:!limits(<rules>), the hash of learned
--              limits
-- ARGV[1]   -> 'learn limits'
-- ARGV[2]   -> 1 (unused)
-- ARGV[3]   -> the hash's TTL, milliseconds, from this call
-- ARGV[4 + 5 * (i - 1)] ... -> rule i, five values (rules.lua)
-- then per rule learned, five values from ARGV[4 + 5r + 5k]: the rule's
--   index from 1, its learned count, period (microseconds), burst (0: the
--   rule's) and what is left of it now (-1: not said)
-- r is #KEYS - 1.
--
-- A rule with something left is moved (pause[algo], as PauseFor moves
-- it) so that at most that much is available now, at its learned limit;
-- a rule with less available is left as it is.
--
-- Returns 1.
local nrules = #KEYS - 1
local lkey = KEYS[nrules + 1]
local left = {}
for j = 4 + 5 * nrules, #ARGV, 5 do
  local i = ARGV[j]
  redis.call('HSET', lkey, 'c' .. i, ARGV[j + 1], 'p' .. i, ARGV[j + 2], 'b' .. i, ARGV[j + 3])
  left[tonumber(i)] = tonumber(ARGV[j + 4])
end
redis.call('PEXPIRE', lkey, ARGV[3])
local learned = limits_pace(lkey, nrules, function() return 1 end)
for i, r in pairs(left) do
  if r >= 0 and learned[i] then
    local algo, count, period, burst = rule(i)
    -- One permit at untl, then the rate: r now.
    pause[algo](KEYS[i], count, period, burst, math.ceil(now + (1 - r) * period / count))
  end
end
return 1
