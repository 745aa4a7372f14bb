-- Adds a wake-up to the ledger, or moves an existing one.
--
-- KEYS[1] -> the ledger: a sorted set of members scored by the Redis time
--            (microseconds) at which to wake them
-- ARGV[1] -> the member (opaque to the ledger: the adapter's task reference)
-- ARGV[2] -> when to wake it, microseconds of Redis TIME
-- ARGV[3] -> how long the ledger is kept past the latest wake-up, milliseconds
-- ARGV[4] -> 'NX' to leave a member already in the ledger where it is (optional;
--            '' for none)
-- ARGV[5], ARGV[6], ... -> more members and their times, in pairs (optional)
-- KEYS[2] -> the shard's watch (optional; see wake_pop.lua)
--
-- Returns 1. The ledger's TTL covers its latest wake-up plus ARGV[3]; it is
-- only ever lengthened. If an added member is now the ledger's first, its
-- time (µs) is published on the channel named like the ledger's key (a
-- shard channel where the server has them), so
-- that the processes waking jobs, which sleep until the first wake-up they
-- know of (wake.go, Run), look again now instead. If the watch names a
-- standby (the latest to check it), the message goes on with its ID and
-- the µs from now to that time: '<time> <ID> <µs>', so that the standby
-- probes the shard when the wake-up is overdue, in case its holder died.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local latest = tonumber(ARGV[2])
local earliest = latest
if ARGV[4] == 'NX' then
  redis.call('ZADD', KEYS[1], 'NX', ARGV[2], ARGV[1])
else
  redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
end
for i = 5, #ARGV - 1, 2 do
  redis.call('ZADD', KEYS[1], ARGV[i + 1], ARGV[i])
  if tonumber(ARGV[i + 1]) > latest then latest = tonumber(ARGV[i + 1]) end
  if tonumber(ARGV[i + 1]) < earliest then earliest = tonumber(ARGV[i + 1]) end
end
local want = math.ceil((latest - now) / 1000) + tonumber(ARGV[3])
if want < 1 then want = 1 end
local cur = redis.call('PTTL', KEYS[1])
if cur < want then redis.call('PEXPIRE', KEYS[1], string.format('%d', want)) end
local first = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if first[2] and tonumber(first[2]) >= earliest then
  -- Sharded pub/sub (Redis 7) keeps the message on the shard's master;
  -- older servers have only PUBLISH. pcall: a user whose ACL grants no
  -- channels still adds wake-ups (its wakers look every tick instead).
  local msg = string.format('%d', earliest)
  local standby = KEYS[2] and redis.call('HGET', KEYS[2], 's')
  if standby then msg = string.format('%s %s %d', msg, standby, earliest - now) end
  local r = redis.pcall('SPUBLISH', KEYS[1], msg)
  if type(r) == 'table' and r.err then redis.pcall('PUBLISH', KEYS[1], msg) end
end
return 1
