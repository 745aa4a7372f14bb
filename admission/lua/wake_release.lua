-- Ends the caller's watch of a shard of the ledger (a process stopping),
-- and says so on the shard's channel, so that a standby takes the shard at
-- once instead of at its next check (wake_pop.lua).
--
-- KEYS[1] -> the ledger (its channel is named like it)
-- KEYS[2] -> the shard's watch (see wake_pop.lua)
-- ARGV[1] -> the caller's ID
--
-- Returns 1 if the caller held the watch, else 0.
if redis.call('HGET', KEYS[2], 'o') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[2], 'e', '0')
local r = redis.pcall('SPUBLISH', KEYS[1], 'released')
if type(r) == 'table' and r.err then redis.pcall('PUBLISH', KEYS[1], 'released') end
return 1
