-- Takes the wake-ups that are due: each is returned to exactly one caller,
-- whichever process asks first.
--
-- KEYS[1] -> the ledger (see wake_add.lua)
-- ARGV[1] -> lead, microseconds: wake-ups due up to this long from now are
--            taken
-- ARGV[2] -> the most wake-ups to take
--
-- Returns {members taken, microseconds from now until the next wake-up is
-- due (its score less the lead; 0 if due already) or -1 if none is left,
-- Redis now (microseconds of Redis TIME)}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local upto = now + tonumber(ARGV[1])
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', upto), 'LIMIT', 0, tonumber(ARGV[2]))
if #due > 0 then redis.call('ZREM', KEYS[1], unpack(due)) end
local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local wait = -1
if nxt[2] then
  wait = tonumber(nxt[2]) - upto
  if wait < 0 then wait = 0 end
end
return {due, wait, now}
