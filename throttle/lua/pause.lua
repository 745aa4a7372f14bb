-- pause: holds every rule of a policy back until a time. Moves each rule's
-- state (pause[algo], prelude.lua) so that nothing is admitted before
-- now + ARGV[3], or before the end of a longer pause already running, and
-- records that end in the pause key. Built as allow.lua is, with pause.lua
-- last.
--
-- KEYS[i]    -> the key of rule i, i = 1..r (rules.lua)
-- KEYS[r+1]  -> the subject's pause key, <prefix>{<subject>}:!pause,
--               holding the Redis time (µs) the pause ends
-- ARGV[1]    -> 'pause'
-- ARGV[2]    -> 1 (unused: pause.go sends it as n)
-- ARGV[3]    -> the pause, microseconds (at least 1)
-- ARGV[4 + 5 * (i - 1)] ... -> rule i, five values (rules.lua)
-- r is floor((#ARGV - 3) / 5).
--
-- Returns the microseconds until the pause ends.
local nrules = math.floor((#ARGV - 3) / 5)
local untl = now + tonumber(ARGV[3])
local prev = tonumber(redis.call('GET', KEYS[nrules + 1]))
if prev and prev > untl then untl = prev end
pause_all(untl, nrules)
redis.call('SET', KEYS[nrules + 1], string.format('%d', untl), 'PX', ttl_ms(untl - now))
return untl - now
