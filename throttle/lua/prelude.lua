-- Shared by every jobthrottle script. The Go side (scripts.go) builds each
-- script as: time.lua, prelude.lua, the algorithm files it needs,
-- a use_*.lua file, rules.lua and the operation's files (bucket_fast.lua
-- stands alone).
--
-- Units: every time and duration is in microseconds of Redis TIME, every TTL
-- given to Redis is in milliseconds. No client clock reaches a script.
--
-- Requires Redis 5 or later: scripts replicate their effects, not their
-- text (so reading TIME before writing is allowed) without calling
-- redis.replicate_commands().
--
-- Every call runs the whole script body, and each function defined in it
-- is a new closure each time. So the functions that only refunds and
-- pauses use are defined only for those operations (inside `if rare`
-- blocks), and allow and reserve pay for none of them.
--
-- t (Redis TIME) and now (its µs) come from time.lua, before this file.

-- rare is true for the operations other than allow and reserve (see
-- allow.lua): they define and use the helpers below.
local rare = ARGV[1] ~= 'allow' and ARGV[1] ~= 'reserve'

-- Integers are formatted with string.format('%d', x): exact, where
-- tostring would switch to exponent notation above 1e14 (times here are
-- about 1.8e15); a fraction is dropped (rounded toward zero). '%d' (a C
-- long: 64 bits on every platform Redis supports) costs about half a
-- microsecond less than '%.0f' or '%.17g' on a 16-digit time. It is not
-- wrapped in a helper: every function a script defines is a new closure on
-- every call (see "Cost per call" below).

-- num formats a number so that tonumber(num(x)) == x; a whole number with
-- '%d', the same text as '%.17g' gives it, only faster.
local function num(x)
  if x % 1 == 0 then return string.format('%d', x) end
  return string.format('%.17g', x)
end

-- max_us bounds every duration a script replies with or gives Redis as a
-- TTL: 2^53 - 1 microseconds, about 285 years. A queue of reservations can
-- reach further (Waits without a deadline on a rule of one per ten years,
-- or a backlog booked under a far larger rule before it was changed);
-- beyond this a reply would lose integer precision, overflow Redis's
-- integer conversion or a Go time.Duration and come back negative (which
-- a waiter would take as "now"), and PEXPIRE would refuse the TTL.
local max_us = 9007199254740991

-- ttl_ms turns a horizon in microseconds into a key TTL in milliseconds:
-- rounded up, never less than 1 (PEXPIRE 0 would delete the key), never
-- more than max_us.
local function ttl_ms(us)
  local ms = math.ceil(math.min(us, max_us) / 1000)
  if ms < 1 then ms = 1 end
  return string.format('%d', ms)
end

-- Each algorithm file defines check_<name> and commit_<name> as local
-- functions, and registers refund and pause functions in the tables below
-- (only when rare). A use_*.lua file hands check and commit to the operation's script
-- (throttle/scripts.go).
--
-- check(key, count, period, extra, n, reserve, max_wait) returns a
-- decision as values, not a table, so that deciding allocates nothing:
--   ok        true if the request can be charged (now, or for reserve within max_wait)
--   delay     microseconds until a request of n would be admitted (0 if now)
--   remaining permits left after this request if ok, else permits left now
--   reset     microseconds until the key is back to full capacity
--   s1, s2    when ok, what commit needs of the state check read
-- commit(key, count, period, extra, n, delay, s1, s2) charges the request
-- that check admitted and returns its refund ticket.
-- refund(key, count, period, extra, n, ticket, ckey, undo) gives back what
-- commit took. ckey (nil if the caller gave none) is the rule's record of
-- cancelled reservations (bucket algorithms, bucket.lua). undo is true when
-- a Group rolls back a part its caller never used; otherwise the refund is
-- a Reservation.Cancel, which the bucket algorithms honour only before the
-- time to act (bucket.lua). The windows give back in both cases.
--
-- Each algorithm also registers a settle function (settle.lua): settle(key, count, period, extra, n, actual, ticket, booked,
-- skey) corrects
-- a request of n permits that commit charged (ticket: its refund ticket)
-- to actual permits, after the caller acted: actual > n charges the
-- difference, even into debt (the rule then admits nothing more until it
-- is repaid); actual < n gives it back, as far as the rule still holds
-- it (each algorithm's file says how far). booked is the Redis time of the
-- call that made the reservation (-1 if unknown); skey the rule's record
-- of give-backs (bucket.lua).
--
-- Each algorithm also registers a pause function (pause.lua): pause(key, count, period, extra, untl) moves the rule's state so
-- that no request is admitted before the Redis time untl (microseconds),
-- and requests after it are admitted as the algorithm's own state allows.
-- It only ever holds a key back longer, never releases it earlier, so it
-- may be applied again (refund.lua and settle.lua do so).
--
-- An algorithm whose turn that lapses (booked, never redeemed: rules.lua,
-- lapse_turn) is capacity lost, not only time, registers a lapse function:
-- lapse(key, count, period, extra, ticket) gives back what commit took
-- (ticket: its refund ticket) if the rule still holds it. Only calendar
-- does (calendar.lua). A bucket rule (GCRA, token bucket) gives a lapsed
-- turn back through its settle instead, where the script declares the
-- records of give-backs (settled_key, below; rules.lua: lapse_turn); for
-- the windows a lapsed turn is time gone by.
--
-- Cost per call. Redis runs the whole script body on every EVALSHA, so
-- each function or table it defines is allocated (and later collected) on
-- every call, allow included; the benchmark counts what that costs in
-- redis-server instructions per Allow (bench/, BENCHMARKS.md). So allow
-- and reserve, the hot path, define only the check and commit functions of
-- the algorithms in the script and the num/ttl_ms helpers; everything else
-- is defined inside `if rare`.
local refund, pause, settle, lapse
if rare then refund, pause, settle, lapse = {}, {}, {}, {} end

-- cc holds the helpers of concurrency rules (concurrency.lua), in the
-- scripts that include it and for rare operations only; nil otherwise.
local cc

-- lapse_keys, if set (rules.lua: drop_lapsed), are the keys of the
-- policy's rules that register lapse: keep_tickets keeps a booking as long
-- as they live, so that it is there to give back if it lapses.
local keep_ttl, keep_tickets, cancelled_add, cancelled_pop, rint, lapse_keys

-- settled_key, if set, returns rule i's record of give-backs (the key
-- settle.lua declares as KEYS[r+1+i]), declared by the script: a lapsed
-- turn of a bucket rule is then given back (rules.lua: lapse_turn).
-- bucket_lapse names the algorithms that give back so.
local settled_key
local bucket_lapse = {gcra = true, token_bucket = true}
if rare then

-- rint formats a number that may have a fraction as the nearest integer.
function rint(x)
  return string.format('%.0f', x)
end

-- keep_ttl makes key live at least us more microseconds; a longer TTL is
-- kept (PEXPIRE would shorten it).
function keep_ttl(key, us)
  local want = tonumber(ttl_ms(us))
  local cur = redis.call('PTTL', key)
  if cur >= 0 and cur >= want then return end
  redis.call('PEXPIRE', key, want)
end

-- keep_tickets records the refund tickets of a booking or receipt (member of
-- the receipt set rkey) in the hash tkey, kept at least us more
-- microseconds, so that whoever redeems it can settle it. A member that
-- leaves rkey unredeemed (stale, cancelled) leaves its field behind: the
-- field '#' (never a member: members hold a space) counts the fields
-- written since the last sweep, and when it passes twice the members of
-- rkey, the fields whose member is gone are dropped (rarely, so at a small
-- cost per booking; with the commands of the minimal ACL). Under a rule
-- that gives a lapsed turn back (lapse_keys) rkey and tkey are kept as
-- long as its key (its window), so that a booking that lapses is there to
-- give back when the next call comes, not expired with its slot.
function keep_tickets(tkey, rkey, member, tickets, us)
  for _, k in ipairs(lapse_keys or {}) do
    local ttl = redis.call('PTTL', k) * 1000
    if ttl > us then
      us = ttl
      keep_ttl(rkey, us)
    end
  end
  redis.call('HSET', tkey, member, tickets)
  keep_ttl(tkey, us)
  local h = redis.call('HINCRBY', tkey, '#', 1)
  if h > 64 and h > 2 * redis.call('ZCARD', rkey) then
    local flat, left = redis.call('HGETALL', tkey), 0
    for i = 1, #flat, 2 do
      local f = flat[i]
      if f ~= '#' then
        if redis.call('ZSCORE', rkey, f) then left = left + 1 else redis.call('HDEL', tkey, f) end
      end
    end
    redis.call('HSET', tkey, '#', string.format('%d', left))
  end
end

-- cancelled_add and cancelled_pop are the record of cancelled places the
-- bucket algorithms kept before issue 11; bucket.lua now keeps its own,
-- with exact times, and these stay for other operations that may use them.
-- A reservation holds a place in the rule's queue that ends at its ticket (GCRA: the TAT it left;
-- token bucket: its time to act). Cancelling the last place moves the
-- queue's end back; cancelling one with later places still held cannot
-- (they were granted times that count on it), so it is recorded in ckey, a
-- sorted set scored by the ticket with members "<ticket> <n>", and given
-- back when every place after it has been cancelled too. So a storm of
-- cancellations in any order, from any number of processes, gives back
-- all of its capacity, and a cancelled place is never lent twice.

-- cancelled_add records a cancelled place that ends at ticket and holds n
-- permits; end_us is the queue's end, until which the record is kept.
function cancelled_add(ckey, ticket, n, end_us)
  redis.call('ZADD', ckey, ticket, ticket .. ' ' .. n)
  keep_ttl(ckey, end_us - now)
end

-- cancelled_pop takes the recorded places that now end the queue, whose
-- end is at e (within eps), one after another, and returns the new end and
-- the permits given back. size(n) is the length of n permits' place. Places
-- that end at or before stale are dropped: the rule is back to full
-- capacity by the time the queue's end reaches them.
function cancelled_pop(ckey, e, eps, size, stale)
  redis.call('ZREMRANGEBYSCORE', ckey, '-inf', rint(stale))
  local permits = 0
  while true do
    local top = redis.call('ZREVRANGE', ckey, 0, 0, 'WITHSCORES')
    if not top[1] then break end
    local x = tonumber(top[2])
    if x < e - eps then break end
    redis.call('ZREM', ckey, top[1])
    if x <= e + eps then
      local hn = tonumber(string.match(top[1], ' (%d+)$'))
      e = x - size(hn)
      permits = permits + hn
    end
  end
  return e, permits
end

end
