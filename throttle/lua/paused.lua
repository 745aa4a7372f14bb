-- How long the subject's pause (pause.lua) still runs, read
-- from the Redis time the pause key holds rather than from its TTL: the
-- value is exact to the microsecond, and servers that do not expire keys
-- on their own clock (miniredis) answer the same.
--
-- KEYS[1] -> the subject's pause key: <prefix>{<subject>}:!pause
--
-- Returns the microseconds until the pause ends, 0 if none runs.
local untl = tonumber(redis.call('GET', KEYS[1]))
if not untl or untl <= now then return 0 end
return untl - now
