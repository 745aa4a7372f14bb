-- Takes the wake-ups that are due, for the process that holds the shard's
-- watch: each is returned to exactly one caller. A shard is looked at by
-- one process at a time, its holder, whose looks renew the watch; every
-- other process (a standby) is told when to check the watch again, the
-- fleet's checks of one shard spaced apart, so that a fleet of many
-- processes looks at a shard about as often as one does (wake_sched.go).
--
-- KEYS[1] -> the ledger (see wake_add.lua)
-- KEYS[2] -> the shard's watch (optional; without it every caller takes
--            what is due): a hash of o (the holder's ID), e (when its watch
--            ends, microseconds of Redis TIME), c (the latest standby check
--            given out, µs) and l (when the last standby check came, µs)
-- ARGV[1] -> lead, microseconds: wake-ups due up to this long from now are
--            taken
-- ARGV[2] -> the most wake-ups to take
-- ARGV[3] -> the caller's ID (with KEYS[2])
-- ARGV[4] -> the longest the watch lasts past this look, microseconds (the
--            holder looks at least this often less ARGV[9])
-- ARGV[5] -> the spacing of the fleet's standby checks of this shard, µs
-- ARGV[6] -> the least time from a standby check to the same caller's next, µs
-- ARGV[7] -> the most time from a standby check to the same caller's next, µs
-- ARGV[8] -> the shortest time between two looks of the holder, µs (its tick)
-- ARGV[9] -> how long past its next look the holder's watch lasts, µs: a
--            holder that misses its look by this long (stalled, or dead)
--            loses the watch to the next standby check
-- ARGV[10] -> grace, µs (optional; 0 or absent for none): a standby that
--            finds the shard's first wake-up due (its score less ARGV[1])
--            at least this long ago takes the watch, whatever its end: the
--            holder missed work it had to do, so it is dead or stalled.
--            A standby whose next check would come after the first
--            wake-up is due plus the grace checks then instead (a probe),
--            the fleet's probes of a shard at least ARGV[5] apart
--
-- Returns {members taken, microseconds from now until the next wake-up is
-- due (its score less the lead; 0 if due already) or -1 if none is left,
-- Redis now (microseconds of Redis TIME), 1 if the caller holds the watch
-- (always, without KEYS[2]) else 0, microseconds until the watch ends (the
-- holder) or until the caller's next check (a standby)}. Taking a watch
-- its holder released publishes 'taken' on the channel named like the
-- ledger, so that standbys told of its release (wake_release.lua) stop
-- racing for it. The watch names (field s) the latest standby to check:
-- wake_add.lua tells it of a wake-up that became the shard's first, so
-- that it probes when that is due (wake_sched.go).
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local upto = now + tonumber(ARGV[1])

local function nextDue()
  local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if not nxt[2] then return -1 end
  local wait = tonumber(nxt[2]) - upto
  if wait < 0 then wait = 0 end
  return wait
end

local function publish(msg)
  -- Sharded pub/sub (Redis 7) keeps the message on the shard's master;
  -- older servers have only PUBLISH. pcall: a user whose ACL grants no
  -- channels still looks.
  local r = redis.pcall('SPUBLISH', KEYS[1], msg)
  if type(r) == 'table' and r.err then redis.pcall('PUBLISH', KEYS[1], msg) end
end

-- firstDue returns when the shard's first wake-up is due (its score less
-- the lead, µs), or nil if there is none.
local function firstDue()
  local nxt = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
  if not nxt[2] then return nil end
  return tonumber(nxt[2]) - tonumber(ARGV[1])
end

local watchFor, holder, ends = 0, nil, nil
if KEYS[2] then
  local l = redis.call('HMGET', KEYS[2], 'o', 'e', 'c', 'l', 'q', 's')
  holder, ends = l[1], tonumber(l[2] or 0)
  local grace, first = tonumber(ARGV[10] or 0), firstDue()
  -- Work overdue by the grace: the holder is dead or stalled; take over.
  local overdue = grace > 0 and first ~= nil and first + grace <= now
  if holder and holder ~= ARGV[3] and ends > now and not overdue then
    -- A standby: the next check of this shard by the fleet is a spacing
    -- after the latest given out, but no sooner than the least time for
    -- this caller. If no check came for long, the processes given the
    -- checks out there are gone: count from now again.
    local gap, least, most = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
    local c, last = tonumber(l[3] or 0), tonumber(l[4] or 0)
    if c < now or now - last > 2 * least then c = now end
    local at = math.max(c + gap, now + least)
    if at > now + most then at = now + most end
    -- A wake-up due before then: probe when it is overdue, the fleet's
    -- probes a spacing apart (so a busy shard costs one a spacing).
    local probe = nil
    if grace > 0 and first ~= nil then probe = math.max(first + grace, tonumber(l[5] or 0) + gap) end
    if probe ~= nil and probe < at then
      at = probe
      redis.call('HSET', KEYS[2], 'q', string.format('%d', at), 'l', string.format('%d', now), 's', ARGV[3])
    else
      redis.call('HSET', KEYS[2], 'c', string.format('%d', at), 'l', string.format('%d', now), 's', ARGV[3])
    end
    local keep = math.ceil((math.max(at, ends) - now) / 1000) + 60000
    if redis.call('PTTL', KEYS[2]) < keep then redis.call('PEXPIRE', KEYS[2], keep) end
    return {{}, nextDue(), now, 0, at - now}
  end
  -- The caller holds the watch from here on: no longer a standby to tell.
  if l[6] == ARGV[3] then redis.call('HDEL', KEYS[2], 's') end
end

local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%d', upto), 'LIMIT', 0, tonumber(ARGV[2]))
if #due > 0 then redis.call('ZREM', KEYS[1], unpack(due)) end
local wait = nextDue()
if KEYS[2] then
  -- The holder looks again when the next wake-up is due (a tick at the
  -- least; at once after a full batch), or at its idle look: its watch
  -- lasts that long and ARGV[9] more.
  watchFor = tonumber(ARGV[4])
  local nextLook = wait
  if #due == tonumber(ARGV[2]) then nextLook = 0 end
  if nextLook >= 0 then
    watchFor = math.min(watchFor, math.max(nextLook, tonumber(ARGV[8])) + tonumber(ARGV[9]))
  end
  redis.call('HSET', KEYS[2], 'o', ARGV[3], 'e', string.format('%d', now + watchFor))
  local keep = math.ceil(watchFor / 1000) + 60000
  if redis.call('PTTL', KEYS[2]) < keep then redis.call('PEXPIRE', KEYS[2], keep) end
  -- Only a released watch has standbys racing for it; a watch taken
  -- from a dead or stalled holder is news to nobody, and a message to every
  -- process of a large fleet would only load a stalled Redis more.
  if holder and holder ~= ARGV[3] and ends == 0 then publish('taken') end
end
return {due, wait, now, 1, watchFor}
