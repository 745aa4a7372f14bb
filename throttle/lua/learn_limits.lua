-- learn_limits: records limits learned of the resource behind a policy
-- (Limiter.LearnLimits), which limits_pace.lua applies. Built as
-- time.lua, learn_limits.lua.
--
-- KEYS[1]  -> <prefix>{<subject>}:!limits(<rules>), a hash
-- ARGV[1]  -> the hash's TTL, milliseconds, from this call
-- then per rule learned, four values from ARGV[2 + 4k]: the rule's index
--   from 1, its learned count, period (microseconds) and burst (0: the
--   rule's)
--
-- Returns 1.
for j = 2, #ARGV, 4 do
  local i = ARGV[j]
  redis.call('HSET', KEYS[1], 'c' .. i, ARGV[j + 1], 'p' .. i, ARGV[j + 2], 'b' .. i, ARGV[j + 3])
end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
