-- Forgets a member of the ledger if it is still due at the given time, not
-- if another process has moved it since: a serving's guard (parking.go),
-- once the line it guarded has emptied.
--
-- KEYS[1] -> the ledger
-- ARGV[1] -> the member
-- ARGV[2] -> the time it must still be due at, microseconds of Redis TIME
--
-- Returns 1 if the member was forgotten, else 0.
local at = redis.call('ZSCORE', KEYS[1], ARGV[1])
if at and tonumber(at) == tonumber(ARGV[2]) then
  return redis.call('ZREM', KEYS[1], ARGV[1])
end
return 0
