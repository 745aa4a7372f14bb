-- admit: the decision for a caller that may come back later (a queued
-- task). It redeems the caller's booking or receipt if one is due within
-- ARGV[b+3] (REDEEMED, 3; delay until its slot, or until its departure's
-- at a learned upstream rate, upstream_turn), reports one that is
-- later (HELD, 4, nothing changes), drops a stale one or one inside a pause,
-- and otherwise takes a new turn: a slot within ARGV[3] is granted as
-- reserve grants it (GRANTED, 1, with tickets), a later one within the
-- horizon is booked under ARGV[b], scored by the slot (BOOKED, 2), a slot
-- past the horizon is denied, charging nothing (DENIED, 0). Built as
-- time.lua, prelude.lua, the algorithm files, a use_*.lua file, rules.lua,
-- upstream_rate.lua, upstream_pace.lua, limits_pace.lua,
-- decide.lua, status.lua, line.lua, line_serve.lua, admit.lua
-- (throttle/scripts.go). status.lua names the statuses.
--
-- KEYS[i]     -> the key of rule i, i = 1..r (rules.lua)
-- KEYS[r+1]   -> the receipt set, <prefix>{<subject>}:!receipts (bookings
--                and prepay.lua's receipts, by slot)
-- KEYS[r+2]   -> the pause key, <prefix>{<subject>}:!pause: a booking is
--                not redeemed while the subject is paused
-- KEYS[r+3]   -> the tickets, <prefix>{<subject>}:!tickets (prepay.lua)
-- KEYS[r+4] ... KEYS[r+10] -> the subject's line (line.lua)
-- ARGV[1]     -> 'admit'
-- ARGV[2]     -> n, the permits; 0 serves the line (with a concurrency
--                rule: reads the places). Or one per rule, 'n1,n2,...,nr'
--                (per_rule, rules.lua; not with a concurrency rule or
--                share caps), which a member of the line keeps
-- ARGV[3]     -> how long the caller can wait where it is for a new turn,
--                microseconds (-1: no bound)
-- ARGV[4 + 5 * (i - 1)] ... -> rule i, five values (rules.lua)
-- with b = 4 + 5r:
-- ARGV[b]     -> the member to book a new turn under: an id and the rule
--                names ('' if the caller cannot book)
-- ARGV[b+1]   -> tolerance, microseconds: a booking or receipt whose slot
--                passed more than this long ago is stale; or 'tolerance
--                not_before', not_before the earliest Redis time (µs) a new
--                turn may take (bucket rules only, no line: time.lua)
-- ARGV[b+2]   -> horizon, microseconds: the latest slot a new booking may
--                take (-1: no bound, and no line)
-- ARGV[b+3]   -> how long the caller can wait where it is for a booking or
--                receipt that comes due, microseconds (-1: no bound)
-- ARGV[b+4]   -> the caller's id under a concurrency rule of the policy
--                (concurrency.lua): the holder or waiter it is ('' if the
--                policy has none)
-- ARGV[b+5]   -> the id it holds or waits under from now on (a task
--                requeued as a copy), which takes over ARGV[b+4]'s place;
--                the same id otherwise. In the line: the waiter to name.
-- ARGV[b+6]   -> the caller's share of the line, '' for none
-- ARGV[b+7]   -> the share's weight, at least 1; with a priority,
--                'weight level max_age' (line.lua)
-- ARGV[b+8], ARGV[b+9], ARGV[b+10] -> the cap of each share of the line:
--                count (0: none), period (microseconds) and burst
-- ARGV[b+11] ... -> members to redeem, in order: the caller's earlier
--                booking, a receipt made by prepay
-- KEYS[r+11]  -> the subject's upstream hash, <prefix>{<subject>}:!upstream(<rules>)
--                (upstream_pace.lua): a learned rate slower than a bucket
--                rule's paces that rule, and a caller that runs on a turn
--                at that pace takes its request's departure in this call
--                (upstream_turn): the delay replied is until it. A
--                booking whose departure is not free near its slot is
--                dropped, and its caller takes a new turn
-- KEYS[r+12]  -> the limits learned of the resource, <prefix>{<subject>}:!limits(<rules>)
--                (limits_pace.lua): a learned limit slower than a bucket
--                rule paces that rule
-- KEYS[r+13]  -> the departures booked at the learned rate,
--                <prefix>{<subject>}:!departures(<rules>) (upstream_rate.lua)
-- KEYS[r+13+i] -> rule i's record of give-backs, <prefix>{<subject>}:<rule>!settled
--                (settle.lua's): a stale booking of a bucket rule gives its
--                turn back, as a settle to nothing (rules.lua: lapse_turn)
-- r is (#KEYS - 13) / 2.
--
-- Returns {status, deciding rule index, remaining, delay µs, reset µs,
-- Redis now µs, ticket 1, ..., ticket r}, the status one of those above
-- (GRANTED under share caps adds the share ticket, line_serve.lua) or:
--   QUEUED (5) with a concurrency rule, every place taken: the caller is queued for
--     one (the concurrency rule deciding, delay = its fallback, see
--     concurrency.lua). A new turn of the rate rules is taken only with a
--     place free; a booking that comes due while every place is taken is
--     kept, paid, until the caller has one. A caller that must come back
--     later (BOOKED, DENIED) gives up a place it was handed. The reply then
--     always has 6 + r values (tickets, or '') and, last, the ids of the
--     waiters this call handed a place to.
--   IN_LINE (6) the caller joins the line (a horizon, a booking id, no
--     concurrency rule): its turn is past the horizon, or others wait.
--     {6, 1, members in line, fallback µs, serve µs, now}: fallback is how
--     long until it should come back by itself if nobody wakes it; serve,
--     if not -1, is when the line should next be served (the caller is its
--     only member, or came back still in it and nobody has served it for
--     two horizons). A caller that comes back still in line keeps its
--     place (renamed to ARGV[b]).
-- A redeemed booking's reply (REDEEMED) carries its tickets (prepay.lua),
-- one string, as its 7th value. A serving (n = 0) replies {BOOKED (some
-- still wait) or DENIED, 1, members left, µs until the line should be
-- served again, 0, now, '' x r, waiter 1, slot 1 (µs of Redis time),
-- waiter 2, ...}.
local n, ns = per_rule(ARGV[2])
local wait_here = tonumber(ARGV[3])
local nrules = (#KEYS - 13) / 2
-- A limit learned of the resource for a rule (a provider's requests or
-- tokens) paces that rule; the learned rate of requests (issue 19) the
-- other rules a request counts once (all of them for a single n: a
-- serving of the line too).
local learned = limits_pace(KEYS[nrules + 12], nrules, function(i) return ns and ns[i] or n end)
local ukey, dkey = KEYS[nrules + 11], KEYS[nrules + 13]
local paced, discovering = upstream_pace(ukey, nrules, function(i) return not learned[i] and (not ns or ns[i] == 1) end)
local rkey, b = KEYS[nrules + 1], 4 + 5 * nrules
local booking, tol, nb = ARGV[b], string.match(ARGV[b + 1], '^(%d+) (%d+)$')
if nb then not_before = tonumber(nb) end
tol = tonumber(tol or ARGV[b + 1])
-- c is the caller's place under the policy's concurrency rule, if it has
-- one (concurrency.lua), asked for with the caller's id.
local c
if ARGV[b + 4] ~= '' then
  for i = 1, nrules do
    local algo, count, period = rule(i)
    if algo == 'concurrency' then
      c = cc.open(KEYS[i], count, period, ARGV[b + 4], ARGV[b + 5])
      c.rule = i
    end
  end
end
if c and n == 0 then
  -- n = 0 reads the places: cc.open has reaped the expired leases and
  -- handed their places on; nothing is taken. Status 5 while some wait,
  -- with the delay until the earliest lease expires (when to look
  -- again), else 0; remaining is the free places.
  local live = redis.call('ZCOUNT', c.key, '0', '+inf')
  if redis.call('ZCOUNT', c.key, '-inf', '(0') == 0 then
    return cc.reply(c, {DENIED, c.rule, c.count - live, 0, 0, now}, nrules)
  end
  local first = redis.call('ZRANGEBYSCORE', c.key, '0', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local d = c.lease
  if first[2] then d = tonumber(first[2]) - now end
  return cc.reply(c, {QUEUED, c.rule, c.count - live, d, 0, now}, nrules)
end
-- wait_place queues the caller for a place of the concurrency rule: it
-- comes back when a place is handed to it, or at the fallback.
local function wait_place()
  return cc.reply(c, {QUEUED, c.rule, 0, cc.queue(c), 0, now}, nrules)
end
-- Stale bookings go, a calendar quota's share of their turns back to it
-- (rules.lua: drop_lapsed), and a line that may wait for that share is
-- served when the next caller joins or stays (line.lua: 'g'); a turn paid
-- for and waiting for a place of the concurrency rule (a negative score,
-- see below) stays.
local tkey = KEYS[nrules + 3]
local function gave_back()
  if redis.call('EXISTS', KEYS[nrules + 4]) == 1 then redis.call('HSET', KEYS[nrules + 6], 'g', '1') end
end
-- A booking whose turn falls inside a pause (the upstream said stop) is
-- not redeemed: it lapses and its caller takes a new turn, which the
-- pause has moved past its end. A stale one gives a bucket rule its turn
-- back, but not inside a pause, which that would undo.
local pause_end = tonumber(redis.call('GET', KEYS[nrules + 2])) or 0
if pause_end <= now then settled_key = function(i) return KEYS[nrules + 13 + i] end end
if drop_lapsed(rkey, tkey, now - tol, nrules) then gave_back() end
settled_key = nil
local early = tonumber(ARGV[b + 3])
-- 'horizon h': the line's members serve it (ARGV[b+2]).
local hz, heads = string.match(ARGV[b + 2], '^(-?%d+) (h)$')
if heads then ARGV[b + 2] = hz end
-- While an upstream's limit is discovered (upstream_pace), its next
-- answers may step the rate faster: turns are booked no further ahead
-- than up_disc_ahead (upstream_rate.lua), so that a faster step applies
-- within it, not once the turns booked at the slower rate tried have run
-- (traced: 0.8 s behind a second of them, at 10 workers).
if discovering then
  local h = up_disc_ahead(paced)
  if tonumber(ARGV[b + 2]) > h then ARGV[b + 2] = string.format('%d', h) end
end
local line = not c and tonumber(ARGV[b + 2]) >= 0 and (booking ~= '' or n == 0) and line_open(n, nrules, b, rkey, tkey, tol, ns)
if line and n == 0 then return line.serve() end
-- out ends a reply with what a serving by the caller left to wake.
local function out(reply) return line and line.tail(reply) or reply end
if line and heads and not line.ci and ARGV[b + 11] and redis.call('ZSCORE', line.key, ARGV[b + 11]) then
  -- A member back in line serves it: its own turn, if within the horizon,
  -- is booked now and redeemed below.
  line.heads = true
  line.serve()
elseif line and heads and not line.ci and ARGV[b + 11] and redis.call('HGET', line.fkey, 'last') == ARGV[b + 11]
    and redis.call('ZSCORE', rkey, ARGV[b + 11]) then
  -- The member a serving chose, back for its turn, serves the line
  -- (line_serve.lua: serve_plain): the turns it books start where the
  -- settles so far have moved the schedule back to, before the head named
  -- then is woken.
  redis.call('HDEL', line.fkey, 'last')
  if redis.call('EXISTS', line.key) == 1 then
    line.heads = true
    line.serve()
  end
end
if not line and not c and booking ~= '' then
  -- A caller that books without the line (no horizon: admission's
  -- BookAhead, a rule found stacked while its job waited in line) leaves
  -- it, under its booking or the id it waited as: a serving would else
  -- book a turn for a job that took its own, and wake it for nothing (a
  -- turn lost at the line's pace: issue 19).
  local function leave(id)
    if redis.call('ZREM', KEYS[nrules + 4], id) == 1 then redis.call('HDEL', KEYS[nrules + 5], id) end
  end
  leave(booking)
  for i = b + 11, #ARGV do leave(ARGV[i]) end
end
for i = b + 11, #ARGV do
  local slot = tonumber(redis.call('ZSCORE', rkey, ARGV[i]))
  if slot and slot < 0 and c and not cc.free(c) then
    local reply = wait_place()
    keep_ttl(rkey, reply[4] + c.lease)
    return reply
  end
  if slot and slot >= 0 and slot < pause_end then
    redis.call('ZREM', rkey, ARGV[i])
    if lapse_turn(tkey, ARGV[i], nrules) then gave_back() end
    slot = nil
  end
  if slot then
    local d = slot - now
    if d < 0 then d = 0 end
    if early >= 0 and d > early then
      if not c then return out({HELD, 1, 0, d, 0, now}) end
      if c.holding then cc.give(c) end
      return cc.reply(c, {HELD, 1, 0, d, 0, now}, nrules)
    end
    if c and not cc.free(c) then
      -- The turn has come but every place of the concurrency rule is
      -- taken: the caller waits for one with its turn paid. The booking
      -- is kept with its slot negated, which neither goes stale nor is
      -- charged again: the caller runs on it when it has a place.
      redis.call('ZADD', rkey, string.format('%d', -slot), ARGV[i])
      local reply = wait_place()
      keep_ttl(rkey, reply[4] + c.lease)
      return reply
    end
    redis.call('ZREM', rkey, ARGV[i])
    -- At the learned pace, the caller runs at its request's departure;
    -- none free near the turn: it takes a new one (below).
    local dep = slot
    if paced > 0 then dep = upstream_turn(ukey, dkey, slot, paced, false) end
    if dep then
      local reply = {REDEEMED, 1, 0, math.max(dep - now, 0), 0, now}
      local tk = redis.call('HGET', tkey, ARGV[i])
      if tk then
        redis.call('HDEL', tkey, ARGV[i])
        reply[7] = tk
      end
      if not c then return out(reply) end
      -- cc.reply pads the tickets after tk with '': the redeemed tickets
      -- stay one string in reply[7], where admit.go reads them.
      cc.take(c)
      return cc.reply(c, reply, nrules)
    end
  end
end
-- None redeemed: their tickets, if any (stale, or dropped in a pause),
-- go too.
if #ARGV >= b + 11 then redis.call('HDEL', tkey, unpack(ARGV, b + 11)) end
if line then
  -- A caller still in line keeps its place; one that comes while
  -- others wait joins them.
  local place = ARGV[b + 11] and redis.call('ZSCORE', line.key, ARGV[b + 11])
  if place then return out(line.stay(ARGV[b + 11], place)) end
  if redis.call('EXISTS', line.key) == 1 then return out(line.join(nil)) end
  if line.ci and n > 0 then return line.direct() end
end
-- A new turn, booked as far as the horizon allows; without a booking id,
-- only as far as the caller can wait.
local max_wait = tonumber(ARGV[b + 2])
if booking == '' then max_wait = wait_here end
-- A caller waiting for a place of the concurrency rule takes no turn of
-- the rate rules: it is charged when it has a place.
if c and not cc.free(c) then return wait_place() end

local reply, final = decide(n, true, max_wait, nrules, ns)
-- decide's ok is the status from here on: 1 is GRANTED, 0 DENIED.
if line and reply[1] == 0 then
  -- Past the horizon: the caller starts the line, which is served when its
  -- turn comes within half the horizon.
  if not heads or line.ci then return line.join(reply[4] - line.horizon / 2) end
  -- With heads serving, it serves it itself, woken for its turn.
  line.served = {0, ARGV[b + 5], string.format('%d', now + reply[4])}
  return out(line.join(nil))
end
if final then return out(reply) end
local later = wait_here >= 0 and reply[4] > wait_here
if paced > 0 and reply[1] == 1 and not later then
  -- At the learned pace, the caller runs at its request's departure.
  reply[4] = upstream_turn(ukey, dkey, now + reply[4], paced, true) - now
end
if c then
  -- A caller that runs now (or after waiting where it is) takes its place;
  -- one that must come back later gives a place it holds to the next.
  if reply[1] == 1 and not later then cc.take(c) elseif c.holding then cc.give(c) end
end
if reply[1] == 1 and later then
  -- Later than the caller can wait: book the slot under its id.
  redis.call('ZADD', rkey, string.format('%d', now + reply[4]), booking)
  keep_ttl(rkey, reply[4] + tol)
  -- The tickets, then the booking's Redis time and costs (a lapse gives
  -- them back: rules.lua, lapse_turn).
  if n > 0 then keep_tickets(KEYS[nrules + 3], rkey, booking, table.concat(reply, '\n', 7, 6 + nrules) .. '\n' .. string.format('%d', now) .. ' ' .. ARGV[2], reply[4] + tol) end
  reply = {BOOKED, reply[2], reply[3], reply[4], reply[5], now}
end
if c then return cc.reply(c, reply, nrules) end
return out(reply)
