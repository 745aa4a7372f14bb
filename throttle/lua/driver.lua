-- Decides (or refunds) one request against every rule of a policy, atomically.
--
-- KEYS[i]    -> the key of rule i: <prefix>{<subject>}:<rule>, i = 1..r
-- KEYS[r+1]  -> refund (optional) and pause: the subject's pause key,
--               <prefix>{<subject>}:!pause, holding the Redis time (µs) the
--               pause ends; prepay: the subject's receipt set,
--               <prefix>{<subject>}:!receipts
-- KEYS[r+1+i] -> refund: rule i's record of cancelled reservations,
--               <prefix>{<subject>}:<rule>!cancelled (bucket.lua)
-- KEYS[2r+1+i] -> refund and settle: rule i's record of its latest Reset,
--               <prefix>{<subject>}:<rule>!reset (reset.lua); a refund
--               always has these 3r + 1 keys
-- ARGV[1]    -> operation: 'allow', 'reserve', 'prepay', 'refund', 'undo',
--               'atmost', 'pause' or 'settle'
-- ARGV[2]    -> n, the number of permits; 0 (allow, reserve) reads the state
--               and charges nothing
-- ARGV[3]    -> reserve, prepay: the longest delay accepted, microseconds
--               (-1: no bound); pause: the pause, microseconds (at least 1);
--               settle: the actual cost, permits (ARGV[2] is the reserved n);
--               refund: the Redis time (µs) of the call that made the
--               reservation (-1 if unknown)
-- then for rule i, five values starting at ARGV[4 + 5 * (i - 1)]:
--   algorithm name, count, period (microseconds),
--   extra (burst; precision in microseconds for sliding_window),
--   refund ticket ('' unless refunding)
-- prepay only, after the rules:
--   ARGV[4 + 5r] -> the receipt: id and rule names, a sorted-set member
--   ARGV[5 + 5r] -> how long the receipt is kept after its slot, microseconds
--   ARGV[6 + 5r] -> the soonest the slot may be, microseconds from now (0:
--                   now; only for a policy of buckets, see unshift)
-- prepay and admit: KEYS[r+2] (prepay), KEYS[r+3] (admit) -> the subject's
--   tickets of booked turns and receipts, <prefix>{<subject>}:!tickets, a
--   hash: member -> the refund tickets of its rules and the Redis time
--   (µs) of the call that booked them, one a line, kept
--   so that whoever redeems it can settle it (op 'settle'). admit's reply
--   for a redeemed one (status 3) carries them, one string, as its 7th
--   value (with a concurrency rule, the padding and waiters follow).
-- admit only (KEYS[r+1] is the receipt set, as for prepay, and KEYS[r+2] the
-- pause key: a booking is not redeemed while the subject is paused), after
-- the rules:
--   ARGV[4 + 5r] -> the member to book a new turn under: an id and the
--                   rule names ('' if the caller cannot book)
--   ARGV[5 + 5r] -> tolerance, microseconds: a booking or receipt whose slot
--                   passed more than this long ago is stale
--   ARGV[6 + 5r] -> horizon, microseconds: the latest slot a new booking may
--                   take (-1: no bound)
--   ARGV[7 + 5r] -> how long the caller can wait where it is for a booking
--                   or receipt that comes due, microseconds (-1: no bound)
--   ARGV[8 + 5r] -> the caller's id under a concurrency rule of the policy
--                   (concurrency.lua): the holder or waiter it is ('' if
--                   the policy has none)
--   ARGV[9 + 5r] -> the id it holds or waits under from now on (a task
--                   requeued as a copy), which takes over ARGV[8 + 5r]'s
--                   place; the same id otherwise
--   ARGV[10 + 5r] -> the caller's share of the line (below), '' for none
--   ARGV[11 + 5r] -> the share's weight, at least 1
--   ARGV[12 + 5r], ARGV[13 + 5r], ARGV[14 + 5r] -> the cap of each share
--                   of the line (below): count (0: none), period
--                   (microseconds) and burst
--   ARGV[15 + 5r] ... -> members to redeem, in order: the caller's earlier
--                   booking, a receipt made by prepay
--   KEYS[r+4], KEYS[r+5], KEYS[r+6] -> the subject's line (below):
--                   <prefix>{<subject>}:!line(<rules>) (a sorted set of
--                   the waiting members by their place; one line per
--                   limiter's rules, which its servings charge), :!line:e
--                   (that key and ':e', as for the others: a hash: member ->
--                   its n and waiter, one a line) and :!line:f (a hash:
--                   's' .. share -> the place of the share's last member,
--                   'v' -> the place of the last member served)
--   KEYS[r+7] ... KEYS[r+10] -> with share caps: :!line:h (a sorted set:
--                   the shares served, by the place of their first member),
--                   :!line:q (the members by share, a sorted set ordered by
--                   name: share, place, member), :!line:s (a sorted set: the
--                   shares asleep, by the Redis time their cap admits them)
--                   and :!line:c (a sorted set: each share's cap state, the
--                   theoretical arrival time of the GCRA, µs of Redis time)
--   ARGV[3] is how long the caller can wait where it is for a new turn
--   (-1: no bound).
-- refund only, after the rules: more reservations to give back in the same
-- call, each as 2 + r values: its n, the Redis time (µs) of the call that
-- made it, then its ticket for each rule
-- The number of rules r is floor((#ARGV - 3) / 5), for refund (#KEYS - 1) / 3,
-- for admit #KEYS - 11: its last key is the subject's upstream hash,
-- read by upstream_pace (upstream_pace.lua) before anything else.
-- settle (KEYS[r+1]: the pause key; KEYS[r+1+i]: rule i's record of
-- give-backs, <prefix>{<subject>}:<rule>!settled, bucket.lua; KEYS[2r+1+i]
-- its record of Resets, as for refund) charges (ARGV[3] - ARGV[2]) more
-- permits, or gives back that many if negative, against each rule's
-- ticket (settle[algo], prelude.lua), then applies a running pause again
-- as refund does; it returns 1. ARGV[4 + 5r] is the Redis time (µs) of the
-- call that made the reservation, -1 if unknown.
-- A reservation made no later than a rule's latest Reset (its booking
-- time at or before the time the record holds) gives nothing back under
-- that rule, by refund, undo or settle: its permits were counted in the
-- state the Reset forgot (issue 20). A settle for more still charges the
-- difference to the new state: the work used it, and a charge can never
-- admit more than the rule's bound.
--
-- allow and reserve return
--   {ok (1/0), deciding rule index (1-based), remaining, delay microseconds,
--    reset microseconds, Redis now (µs of Redis TIME), ticket 1, ..., ticket r}
-- (tickets only if ok). Redis now lets the caller wake on Redis's clock
-- (throttle/clock.go): delay counts from it.
-- ok = 0 charges nothing. Denied: the deciding rule is the one with the
-- longest delay, and delay is when a request of n would be admitted.
-- Admitted: the deciding rule is the one with the fewest permits remaining;
-- for reserve, delay is how long the caller must wait for its slot.
-- prepay is reserve that, when admitted, also records the receipt scored
-- by the slot's Redis time (µs), for a later redeem (redeem.lua).
-- admit decides for a caller that may come back later (a queued task): it
-- redeems the caller's booking or receipt if one is due within ARGV[7 + 5r]
-- (status 3; delay until its slot), reports one that is later (status 4,
-- nothing changes), drops a stale one, and otherwise takes a new turn: a
-- slot within ARGV[3] is granted as reserve grants it (status 1, with
-- tickets), a later one within the horizon is booked under the caller's
-- booking, scored by the slot (status 2), a slot past the horizon is
-- denied, charging nothing (status 0). Its reply has the shape above, the
-- status in place of ok.
-- With a concurrency rule, admit also needs the caller's place under it to
-- run (status 1 or 3): if every place is taken, the caller is queued for one
-- (status 5, the concurrency rule deciding, delay = its fallback, see
-- concurrency.lua); a new turn of the rate rules is taken only with a place
-- free, and a booking that comes due while every place is taken is kept,
-- paid, until the caller has one. A caller that must come back later
-- (status 2, 0) gives up a place it was handed. The reply then always has
-- 6 + r values (tickets, or ''; for status 3 the 7th is the redeemed
-- tickets string, if any) and, last, the ids of the waiters this call
-- handed a place to.
-- The line (admit with a horizon, ARGV[6 + 5r] >= 0, a booking id, and no
-- concurrency rule): a caller whose new turn would be past the horizon,
-- or who comes while others wait in the subject's line, is not booked but
-- joins the line (status 6): its place is max(the place of the last member
-- served, the place of its share's last member) + n / weight, so that the
-- shares with members waiting are served in turn, each by its weight, and
-- a share that has waited for nothing starts level with the head. Nothing
-- is charged. Its reply is {6, 1, members in line, fallback µs, serve µs,
-- now}: fallback is how long until the caller should come back by itself
-- if nobody wakes it; serve, if not -1, is when the line should next be
-- served (the caller is its only member, or came back still in it and
-- nobody has served it for two horizons: field 't' of :!line:f, the Redis
-- time of the last serving). A caller that comes back while still in line
-- stays in its place (renamed to the booking id).
-- Share caps (ARGV[12 + 5r] > 0): each share of the line is also limited
-- by its own GCRA (count per period, burst), kept under the subject's hash
-- tag: a per-tenant limit inside an API key's. A share whose cap admits its
-- next member later than the rules would sleeps until then, and the other
-- shares are served meanwhile. When nobody else waits (every share asleep,
-- or no line), the turn is booked ahead, for when the cap admits it, if
-- that is within the horizon (take, with at; the rules are buckets); else
-- the caller starts the line, its share asleep.
-- admit with n = 0 and a horizon serves the line: from its head, each
-- member's turn is taken and booked under it (as status 2 books) while
-- the turn is within the horizon, at most 256 a call. It replies {2 (some
-- still wait) or 0, 1, members left, µs until the line should be served
-- again, 0, now, '' x r, waiter 1, slot 1 (µs of Redis time), waiter 2,
-- ...}: the members booked, for the caller to wake at their slots.
-- atmost is allow of as many of n permits as every rule has now, at least
-- 1; when admitted, its reply ends with that number after the tickets.
-- n = 0 charges nothing: ok tells whether a request of 0 would be admitted
-- now (reserve: within the bound; delay until then), with no tickets.
-- undo is refund for a part a Group rolls back, which its caller never
-- used: the bucket algorithms give it back even after its time to act.
-- refund returns 1. After refunding, a pause still running is applied again,
-- so that giving back a permit booked before the pause cannot admit a
-- request before the pause ends.
-- pause moves every rule's state (pause[algo], prelude.lua) so that nothing
-- is admitted before now + ARGV[3], or before the end of a longer pause
-- already running, records that end in the pause key, and returns the
-- microseconds until it.
local op = ARGV[1]
local n = tonumber(ARGV[2])
local max_wait = tonumber(ARGV[3])
local nrules = math.floor((#ARGV - 3) / 5)
if op == 'admit' then
  nrules = #KEYS - 11
  upstream_pace(KEYS[#KEYS], nrules)
end

-- one_check and one_commit (a script of one algorithm) or checks and
-- commits (by algorithm name) come from the use_*.lua file before this one.

-- rule(i) reads rule i's arguments; the hot path of one rule reads them
-- inline and does not pay for the closure (prelude.lua: cost per call).
local rule
if rare or nrules > 1 then
  rule = function(i)
    local b = 4 + 5 * (i - 1)
    return ARGV[b], tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), ARGV[b + 4]
  end
end

if rare then
  -- pause_all applies pause[algo] to every rule, up to the Redis time untl.
  local function pause_all(untl)
    for i = 1, nrules do
      local algo, count, period, extra = rule(i)
      pause[algo](KEYS[i], count, period, extra, untl)
    end
  end

  if op == 'pause' then
    local untl = now + max_wait
    local prev = tonumber(redis.call('GET', KEYS[nrules + 1]))
    if prev and prev > untl then untl = prev end
    pause_all(untl)
    redis.call('SET', KEYS[nrules + 1], string.format('%d', untl), 'PX', ttl_ms(untl - now))
    return untl - now
  end

  -- resets returns, for each rule, the Redis time of its latest Reset
  -- (reset.lua), held in KEYS[2 * nrules + 1 + i], or false if none.
  local function resets()
    local rs = {}
    for i = 1, nrules do rs[i] = tonumber(redis.call('GET', KEYS[2 * nrules + 1 + i])) or false end
    return rs
  end

  if op == 'refund' or op == 'undo' then
    nrules = (#KEYS - 1) / 3
    local rs = resets()
    -- refund_one gives back m permits, of a reservation made at the Redis
    -- time booked, with the tickets ticket(i); nothing under a rule reset
    -- since (at or after booked).
    local function refund_one(m, booked, ticket)
      for i = 1, nrules do
        local algo, count, period, extra = rule(i)
        local tk = ticket(i)
        if tk ~= '' and not (rs[i] and booked <= rs[i]) then
          refund[algo](KEYS[i], count, period, extra, m, tk, KEYS[nrules + 1 + i], op == 'undo')
        end
      end
    end
    -- ARGV[3], the bound of other operations, is the first reservation's
    -- booking time.
    refund_one(n, max_wait, function(i) return ARGV[4 + 5 * (i - 1) + 4] end)
    local b = 4 + 5 * nrules
    while ARGV[b] do
      local base = b
      refund_one(tonumber(ARGV[base]), tonumber(ARGV[base + 1]), function(i) return ARGV[base + 1 + i] end)
      b = b + 2 + nrules
    end
    if KEYS[nrules + 1] then
      local untl = tonumber(redis.call('GET', KEYS[nrules + 1]))
      if untl and untl > now then pause_all(untl) end
    end
    return 1
  end

  if op == 'settle' then
    local booked = tonumber(ARGV[4 + 5 * nrules]) or -1
    local rs = resets()
    for i = 1, nrules do
      local algo, count, period, extra, tk = rule(i)
      -- Under a rule reset since the reservation, only a charge.
      if tk ~= '' and (max_wait > n or not (rs[i] and booked <= rs[i])) then
        settle[algo](KEYS[i], count, period, extra, n, max_wait, tk, booked, KEYS[nrules + 1 + i])
      end
    end
    local untl = tonumber(redis.call('GET', KEYS[nrules + 1]))
    if untl and untl > now then pause_all(untl) end
    return 1
  end
end

-- atmost: n becomes what every rule has now (a state read, n = 0), at
-- least 1, and the request an allow of that many.
local atmost = op == 'atmost'
if atmost then
  for i = 1, nrules do
    local algo, count, period, extra = rule(i)
    local _, _, left = (one_check or checks[algo])(KEYS[i], count, period, extra, 0, false, 0)
    if left < n then n = left end
  end
  if n < 1 then n = 1 end
  op = 'allow'
end

-- line is the subject's line of callers waiting beyond the horizon (see
-- above), when admit uses one; nil otherwise.
local line
-- line_open returns the line's helpers for an admit whose arguments start
-- at ARGV[b], booking into the receipt set rkey and the tickets tkey.
-- Defined for admit only: allow and reserve do not pay for the closure.
local line_open
if op == 'admit' then line_open = function(b, rkey, tkey, tol)
  local l = {key = KEYS[nrules + 4], ekey = KEYS[nrules + 5], fkey = KEYS[nrules + 6],
    horizon = tonumber(ARGV[b + 2])}
  local function fmt(x) return string.format('%.17g', x) end
  -- The shares' caps (ARGV[b + 8] > 0, see above): cap interval ci (µs a
  -- permit) and burst cb; hkey, qkey, skey and ckey hold the awake shares,
  -- the members by share, the sleeping shares and the caps' states.
  local ccount = tonumber(ARGV[b + 8])
  if ccount > 0 then
    l.hkey, l.qkey, l.skey, l.ckey = KEYS[nrules + 7], KEYS[nrules + 8], KEYS[nrules + 9], KEYS[nrules + 10]
    l.ci, l.cb = tonumber(ARGV[b + 9]) / ccount, tonumber(ARGV[b + 10])
  end
  -- keep makes the line's keys outlive the caller's fallback.
  local function keep(us)
    keep_ttl(l.key, us)
    keep_ttl(l.ekey, us)
    keep_ttl(l.fkey, us)
    if l.ci then
      keep_ttl(l.hkey, us)
      keep_ttl(l.qkey, us)
      keep_ttl(l.skey, us)
    end
  end
  -- qpre is the prefix of share sh's entries in qkey (its length first, so
  -- that no share's prefix starts another's); qentry is member's entry
  -- there, ordered by its place.
  local function qpre(sh) return string.format('%d:', #sh) .. sh .. '\0' end
  local function qentry(sh, place, member) return qpre(sh) .. string.format('%024.6f', place) .. '\0' .. member end
  -- qhead returns share sh's first member in line, its entry and place.
  local function qhead(sh)
    local p = qpre(sh)
    local e = redis.call('ZRANGEBYLEX', l.qkey, '[' .. p, '(' .. p .. '\255', 'LIMIT', 0, 1)[1]
    if not e then return nil end
    return string.sub(e, #p + 26), e, tonumber(string.sub(e, #p + 1, #p + 24))
  end
  -- cap_delay is when share sh's cap admits m permits (µs from now).
  local function cap_delay(sh, m)
    if m > l.cb then return max_us end
    local tat = tonumber(redis.call('ZSCORE', l.ckey, sh)) or 0
    return math.max(0, tat + (m - l.cb) * l.ci - now)
  end
  -- cap_take charges share sh's cap m permits at the slot now + d.
  local function cap_take(sh, m, d)
    local tat = math.max(tonumber(redis.call('ZSCORE', l.ckey, sh)) or 0, now + d) + m * l.ci
    redis.call('ZADD', l.ckey, fmt(tat), sh)
    keep_ttl(l.ckey, tat - now)
  end
  -- sleep takes share sh off the served shares until the Redis time t.
  local function sleep(sh, t)
    redis.call('ZREM', l.hkey, sh)
    redis.call('ZADD', l.skey, fmt(t), sh)
  end
  -- fallback is how long a caller with ahead members before it may wait
  -- for its turn: twice its share of the line at the slowest rule's rate
  -- (or with caps, twice the members of its share ahead at the cap's
  -- rate, if longer), plus the horizon.
  local function fallback(ahead, m, sh)
    local slowest = 0
    for i = 1, nrules do
      local _, count, period = rule(i)
      if period / count > slowest then slowest = period / count end
    end
    local w = 2 * (ahead + 1) * m * slowest
    if l.ci and sh then
      local p = qpre(sh)
      local mine = redis.call('ZLEXCOUNT', l.qkey, '[' .. p, '(' .. p .. '\255')
      w = math.max(w, 2 * mine * m * l.ci)
    end
    return math.ceil(math.min(l.horizon + w, max_us / 4))
  end
  -- enqueue puts member, at place, in share sh's queue, and the share among
  -- the served ones if it is neither served nor asleep; it returns true if
  -- that share is the only one served (every other asleep, or none).
  local function enqueue(sh, place, member)
    redis.call('ZADD', l.qkey, 0, qentry(sh, place, member))
    if not redis.call('ZSCORE', l.hkey, sh) and not redis.call('ZSCORE', l.skey, sh) then
      local alone = redis.call('EXISTS', l.hkey) == 0
      redis.call('ZADD', l.hkey, fmt(place), sh)
      return alone
    end
    return false
  end
  -- join puts the caller, booking as ARGV[b], at the end of its share.
  -- serve is when the line should be served (µs from now), nil if another
  -- caller has seen to it. asleep, if set, is when the caller's share's
  -- cap admits it (µs from now): the share sleeps until then.
  function l.join(serve, asleep)
    local sh = ARGV[b + 6]
    local share, weight = 's' .. sh, tonumber(ARGV[b + 7])
    local f = redis.call('HMGET', l.fkey, 'v', share)
    local place = math.max(tonumber(f[1]) or 0, tonumber(f[2]) or 0) + n / weight
    local ahead = redis.call('ZCARD', l.key)
    redis.call('ZADD', l.key, fmt(place), ARGV[b])
    redis.call('HSET', l.ekey, ARGV[b], string.format('%d', n) .. '\n' .. ARGV[b + 5])
    redis.call('HSET', l.fkey, share, fmt(place))
    if l.ci then
      -- A share that wakes a line whose shares all sleep (served only when
      -- the first wakes) has it served now.
      if enqueue(sh, place, ARGV[b]) and not serve then serve = 0 end
      if asleep then sleep(sh, now + asleep) end
    end
    local back = fallback(ahead, n, l.ci and sh)
    keep(back + l.horizon + tol)
    if not serve then serve = -1 elseif serve < 0 then serve = 0 end
    return {6, 1, ahead + 1, back, serve, now}
  end
  -- stay keeps a caller that came back still in line (as member, at
  -- place) there, as the booking id; if nobody has served the line for two
  -- horizons, whoever served it may have stopped: it is served at once.
  function l.stay(member, place)
    local e = redis.call('HGET', l.ekey, member) or ''
    local m = tonumber(string.match(e, '^(%d+)')) or n
    local sh = ARGV[b + 6]
    if member ~= ARGV[b] then
      redis.call('ZREM', l.key, member)
      redis.call('HDEL', l.ekey, member)
      redis.call('ZADD', l.key, place, ARGV[b])
      if l.ci then redis.call('ZREM', l.qkey, qentry(sh, tonumber(place), member)) end
    end
    if l.ci then enqueue(sh, tonumber(place), ARGV[b]) end
    redis.call('HSET', l.ekey, ARGV[b], string.format('%d', m) .. '\n' .. ARGV[b + 5])
    local ahead = redis.call('ZCOUNT', l.key, '-inf', '(' .. place)
    local back = fallback(ahead, m, l.ci and sh)
    keep(back + l.horizon + tol)
    local serve = -1
    if now - (tonumber(redis.call('HGET', l.fkey, 't')) or 0) > 2 * l.horizon then serve = 0 end
    return {6, 1, redis.call('ZCARD', l.key), back, serve, now}
  end
  -- take books m permits under every rule (and share sh's cap, if given)
  -- if the turn is within the horizon, and returns true, its delay and the
  -- tickets; else false and the delay until the rules would admit it, and
  -- with a cap that admits later than the rules, the cap's delay. With by,
  -- a turn at or after the Redis time by is not taken: false, its delay,
  -- nil, true.
  local function take_now(m, sh, by)
    local delays, s1s, s2s, late = {}, {}, {}, -1
    for i = 1, nrules do
      local algo, count, period, extra = rule(i)
      local ok, d, _, _, s1, s2 = (one_check or checks[algo])(KEYS[i], count, period, extra, m, true, l.horizon)
      if not ok then
        if d > late then late = d end
      end
      delays[i], s1s[i], s2s[i] = d, s1, s2
    end
    if late >= 0 then return false, late end
    local tks, delay = {}, 0
    for i = 1, nrules do
      if delays[i] > delay then delay = delays[i] end
    end
    if by and now + delay >= by then return false, delay, nil, true end
    if sh then
      local dc = cap_delay(sh, m)
      if dc > delay then return false, delay, dc end
      cap_take(sh, m, delay)
    end
    for i = 1, nrules do
      local algo, count, period, extra = rule(i)
      tks[i] = (one_commit or commits[algo])(KEYS[i], count, period, extra, m, delays[i], s1s[i], s2s[i])
    end
    return true, math.ceil(delay), tks
  end
  -- take is take_now, or with at (µs), take_now as if called at now + at:
  -- a turn booked ahead at that moment, which may leave the rules' turns
  -- before it unused. It is asked only where no one waits for those turns
  -- (nobody in line, or every share asleep), for a share whose own limit
  -- admits it at now + at, and only of the bucket algorithms (every rule
  -- of a limiter with share limits is one, throttle/admit.go), whose state
  -- is a time and books any moment. Delays are from the real now.
  local function take(m, sh, by, at)
    if not at or at <= 0 then return take_now(m, sh, by) end
    local real = now
    now = now + at
    local ok, delay, x, first = take_now(m, sh, by)
    now = real
    delay = delay + at
    if ok then
      -- bucket.lua set the keys' TTLs from the shifted now: at too short.
      for i = 1, nrules do
        local pt = redis.call('PTTL', KEYS[i])
        if pt > 0 then redis.call('PEXPIRE', KEYS[i], pt + math.ceil(at / 1000)) end
      end
      keep_ttl(l.ckey, (tonumber(redis.call('ZSCORE', l.ckey, sh)) or now) - now)
    elseif type(x) == 'number' then
      x = x + at
    end
    return ok, delay, x, first
  end
  -- book records member's turn, taken with delay and tickets tks.
  local function book(member, delay, tks)
    local slot = now + delay
    redis.call('ZADD', rkey, string.format('%d', slot), member)
    keep_ttl(rkey, delay + tol)
    keep_tickets(tkey, rkey, member, table.concat(tks, '\n') .. '\n' .. string.format('%d', now), delay + tol)
    return slot
  end
  -- hand takes member out of the line, books the turn taken for it (ok,
  -- delay, tks) and adds its waiter and slot to reply. A member that can
  -- never be admitted now (the rules changed under it) is woken with
  -- nothing booked: it asks again, and is told why.
  local function hand(reply, member, waiter, ok, delay, tks)
    redis.call('ZREM', l.key, member)
    redis.call('HDEL', l.ekey, member)
    local slot = now
    if ok then slot = book(member, delay, tks) end
    if waiter then
      reply[#reply + 1] = waiter
      reply[#reply + 1] = string.format('%d', slot)
    end
  end
  -- serve books the turns of the line's head members that fall within the
  -- horizon, in order.
  local function serve_plain(reply)
    local next_us = -1
    for _ = 1, 256 do
      local head = redis.call('ZRANGE', l.key, 0, 0, 'WITHSCORES')
      if not head[1] then break end
      local member = head[1]
      local e = redis.call('HGET', l.ekey, member) or ''
      local m, waiter = string.match(e, '^(%d+)\n(.*)$')
      m = tonumber(m)
      local ok, delay, tks = false, max_us, nil
      if m then ok, delay, tks = take(m) end
      if not ok and m and delay < max_us / 2 then
        next_us = math.max(delay - l.horizon / 2, 0)
        break
      end
      redis.call('HSET', l.fkey, 'v', head[2])
      hand(reply, member, waiter, ok, delay, tks)
    end
    return next_us
  end
  -- serve_capped is serve_plain with the shares' caps: the head of the
  -- line is the first member of the awake share (hkey) that came first; a
  -- share whose cap admits its first member later than the rules would
  -- sleeps (skey) until then, and the others are served meanwhile; shares
  -- whose sleep ends by the slot at hand wake first.
  local function serve_capped(reply)
    local next_us = -1
    redis.call('ZREMRANGEBYSCORE', l.ckey, '-inf', fmt(now))
    local function first_asleep()
      local s = redis.call('ZRANGE', l.skey, 0, 0, 'WITHSCORES')
      return tonumber(s[2]) or max_us * 4
    end
    local function wake(upto)
      for _, sh in ipairs(redis.call('ZRANGEBYSCORE', l.skey, '-inf', fmt(upto))) do
        redis.call('ZREM', l.skey, sh)
        local _, _, place = qhead(sh)
        if place then redis.call('ZADD', l.hkey, fmt(place), sh) end
      end
      return first_asleep()
    end
    local asleep = wake(now)
    local v = tonumber(redis.call('HGET', l.fkey, 'v')) or 0
    -- ahead: the share woken ahead of its sleep's end (every share was
    -- asleep) and when it ends, µs from now.
    local ahead, ahead_at
    for _ = 1, 256 do
      local sh = redis.call('ZRANGE', l.hkey, 0, 0)[1]
      if not sh and asleep - now <= l.horizon then
        -- Every share asleep, the first within the horizon: nobody waits
        -- for the rules' turns before its sleep ends, so its turn is
        -- booked ahead, for when its own limit admits it.
        ahead, ahead_at = redis.call('ZRANGE', l.skey, 0, 0)[1], asleep - now
        redis.call('ZREM', l.skey, ahead)
        local _, _, p = qhead(ahead)
        if p then redis.call('ZADD', l.hkey, fmt(p), ahead) end
        asleep = first_asleep()
        sh = p and ahead
      end
      if not sh then break end
      local member, entry, place = qhead(sh)
      local e = member and redis.call('HGET', l.ekey, member)
      local m, waiter
      if e then m, waiter = string.match(e, '^(%d+)\n(.*)$') end
      m = tonumber(m)
      if not member then
        redis.call('ZREM', l.hkey, sh)
      elseif not e then
        -- Left the line another way (served while the caps were off).
        redis.call('ZREM', l.qkey, entry)
        local _, _, p = qhead(sh)
        if p then redis.call('ZADD', l.hkey, fmt(p), sh) else redis.call('ZREM', l.hkey, sh) end
      else
        local ok, delay, tks, first = false, max_us, nil, nil
        local dc
        -- The share woken ahead is the first asleep: nobody goes first.
        local at, by = nil, asleep
        if sh == ahead then at, by, ahead = ahead_at, nil, nil end
        if m then ok, delay, dc, first = take(m, sh, by, at) end
        if ok then tks, dc = dc, nil end
        if not ok and m and delay < max_us / 2 and not dc and not first then
          next_us = math.max(delay - l.horizon / 2, 0)
          break
        end
        if first then
          -- The shares asleep until this slot wake, and may go first.
          asleep = wake(now + delay)
        elseif dc and dc < max_us / 2 then
          sleep(sh, now + dc)
          if now + dc < asleep then asleep = now + dc end
        else
          redis.call('ZREM', l.qkey, entry)
          if place > v then v = place end
          hand(reply, member, waiter, ok, delay, tks)
          local _, _, p = qhead(sh)
          if p then redis.call('ZADD', l.hkey, fmt(p), sh) else redis.call('ZREM', l.hkey, sh) end
        end
      end
    end
    redis.call('HSET', l.fkey, 'v', fmt(v))
    if next_us < 0 and redis.call('EXISTS', l.hkey) == 0 and asleep < max_us * 4 then
      -- Every share asleep past the horizon: served when the first comes
      -- within half of it.
      next_us = math.max(asleep - now - l.horizon / 2, 0)
    end
    return next_us
  end
  function l.serve()
    local reply = {0, 1, 0, 0, 0, now}
    for i = 1, nrules do reply[6 + i] = '' end
    redis.call('HSET', l.fkey, 't', string.format('%d', now))
    local next_us
    if l.ci and (redis.call('EXISTS', l.hkey) == 1 or redis.call('EXISTS', l.skey) == 1) then
      next_us = serve_capped(reply)
    else
      -- Without caps, or members who joined while there were none.
      next_us = serve_plain(reply)
    end
    local left = redis.call('ZCARD', l.key)
    if left == 0 then
      redis.call('DEL', l.ekey, l.fkey)
      if l.ci then redis.call('DEL', l.hkey, l.qkey, l.skey) end
    else
      if next_us < 0 then next_us = 0 end
      reply[1], reply[3], reply[4] = 2, left, math.ceil(next_us)
    end
    return reply
  end
  -- direct takes a new turn for a caller with a cap when nobody waits in
  -- line: granted within the caller's wait, booked within the horizon,
  -- else the caller starts the line, its share asleep if its cap is what
  -- holds it back.
  function l.direct()
    local sh = ARGV[b + 6]
    -- Spent states (a share's time passed) are a fresh share's.
    redis.call('ZREMRANGEBYSCORE', l.ckey, '-inf', fmt(now))
    local ok, delay, x = take(n, sh)
    if not ok then
      if delay >= max_us / 2 or (x and x >= max_us / 2) then
        return {0, 1, 0, math.ceil(math.min(x or delay, max_us)), 0, now}
      end
      if not x then return l.join(delay - l.horizon / 2) end
      -- Its own share's limit holds it back: with nobody in line, its
      -- turn is booked ahead, for when that limit admits it, if within the
      -- horizon; else it starts the line, its share asleep.
      if x > l.horizon then return l.join(x - l.horizon / 2, x) end
      ok, delay, x = take(n, sh, nil, x)
      if not ok then return l.join(math.max(delay, x or 0) - l.horizon / 2, x) end
    end
    local wait = tonumber(ARGV[3])
    if wait >= 0 and delay > wait then
      book(ARGV[b], delay, x)
      return {2, 1, 0, delay, 0, now}
    end
    local reply = {1, 1, 0, delay, 0, now}
    for i = 1, nrules do reply[6 + i] = x[i] end
    return reply
  end
  return l
end end

local reserve = op == 'reserve' or op == 'prepay' or op == 'admit'
local wait_here = max_wait
-- c is the caller's place under the policy's concurrency rule, if it has
-- one (concurrency.lua): admit asks for it with the caller's id.
local c
if op == 'admit' then
  local rkey, b = KEYS[nrules + 1], 4 + 5 * nrules
  local booking, tol = ARGV[b], tonumber(ARGV[b + 1])
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
      return cc.reply(c, {0, c.rule, c.count - live, 0, 0, now}, nrules)
    end
    local first = redis.call('ZRANGEBYSCORE', c.key, '0', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local d = c.lease
    if first[2] then d = tonumber(first[2]) - now end
    return cc.reply(c, {5, c.rule, c.count - live, d, 0, now}, nrules)
  end
  -- wait_place queues the caller for a place of the concurrency rule: it
  -- comes back when a place is handed to it, or at the fallback.
  local function wait_place()
    return cc.reply(c, {5, c.rule, 0, cc.queue(c), 0, now}, nrules)
  end
  -- Stale bookings go; a turn paid for and waiting for a place of the
  -- concurrency rule (a negative score, see below) stays.
  redis.call('ZREMRANGEBYSCORE', rkey, '0', '(' .. string.format('%d', now - tol))
  -- A booking whose turn falls inside a pause (the upstream said stop) is
  -- not redeemed: it is dropped and its caller takes a new turn, which the
  -- pause has moved past its end.
  local pause_end = tonumber(redis.call('GET', KEYS[nrules + 2])) or 0
  local tkey = KEYS[nrules + 3]
  local early = tonumber(ARGV[b + 3])
  line = not c and tonumber(ARGV[b + 2]) >= 0 and (booking ~= '' or n == 0) and line_open(b, rkey, tkey, tol)
  if line and n == 0 then return line.serve() end
  for i = b + 11, #ARGV do
    local slot = tonumber(redis.call('ZSCORE', rkey, ARGV[i]))
    if slot and slot < 0 and c and not cc.free(c) then
      local reply = wait_place()
      keep_ttl(rkey, reply[4] + c.lease)
      return reply
    end
    if slot and slot >= 0 and slot < pause_end then
      redis.call('ZREM', rkey, ARGV[i])
      slot = nil
    end
    if slot then
      local d = slot - now
      if d < 0 then d = 0 end
      if early >= 0 and d > early then
        if not c then return {4, 1, 0, d, 0, now} end
        if c.holding then cc.give(c) end
        return cc.reply(c, {4, 1, 0, d, 0, now}, nrules)
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
      local reply = {3, 1, 0, d, 0, now}
      local tk = redis.call('HGET', tkey, ARGV[i])
      if tk then
        redis.call('HDEL', tkey, ARGV[i])
        reply[7] = tk
      end
      if not c then return reply end
      -- cc.reply pads the tickets after tk with '': the redeemed tickets
      -- stay one string in reply[7], where admit.go reads them.
      cc.take(c)
      return cc.reply(c, reply, nrules)
    end
  end
  -- None redeemed: their tickets, if any (stale, or dropped in a pause),
  -- go too.
  if #ARGV >= b + 11 then redis.call('HDEL', tkey, unpack(ARGV, b + 11)) end
  if line then
    -- A caller still in line keeps its place; one that comes while
    -- others wait joins them.
    local place = ARGV[b + 11] and redis.call('ZSCORE', line.key, ARGV[b + 11])
    if place then return line.stay(ARGV[b + 11], place) end
    if redis.call('EXISTS', line.key) == 1 then return line.join(nil) end
    if line.ci and n > 0 then return line.direct() end
  end
  -- A new turn, booked as far as the horizon allows; without a booking id,
  -- only as far as the caller can wait.
  max_wait = tonumber(ARGV[b + 2])
  if booking == '' then max_wait = wait_here end
  -- A caller waiting for a place of the concurrency rule takes no turn of
  -- the rate rules: it is charged when it has a place.
  if c and not cc.free(c) then return wait_place() end
end
-- prepay's ARGV[6 + 5r] (µs, optional) is the soonest its slot may be:
-- a job needs that long to reach whoever runs it, and a slot sooner would
-- find it late, its receipt stale. The rules decide as if called that
-- much later, as take does for a share (exact for the buckets, whose
-- state is a time; a policy with another rule, whose window would be
-- trimmed as of then, ignores it), and delays stay from the real now.
local unshift
if op == 'prepay' then
  local after = tonumber(ARGV[6 + 5 * nrules]) or 0
  for i = 1, nrules do
    local algo = ARGV[4 + 5 * (i - 1)]
    if algo ~= 'gcra' and algo ~= 'token_bucket' then after = 0 end
  end
  if after > 0 and (max_wait < 0 or max_wait >= after) then
    now = now + after
    if max_wait >= 0 then max_wait = max_wait - after end
    -- unshift returns reply with its delay and now from the real now,
    -- the rules' TTLs lengthened to match (bucket.lua set them from the
    -- shifted now).
    unshift = function(reply)
      now = now - after
      reply[4], reply[6] = reply[4] + after, now
      for i = 1, nrules do
        local pt = redis.call('PTTL', KEYS[i])
        if pt > 0 then redis.call('PEXPIRE', KEYS[i], pt + math.ceil(after / 1000)) end
      end
      return reply
    end
  end
end
local reply
if nrules == 1 then
  -- One rule, the common case: no per-rule arrays, one reply table.
  local algo, count, period, extra = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
  local ok, delay, remaining, reset, s1, s2 =
    (one_check or checks[algo])(KEYS[1], count, period, extra, n, reserve, max_wait)
  -- remaining is clamped: a paused window may hold more than its count.
  if remaining < 0 then remaining = 0 end
  reset = math.ceil(math.min(reset, max_us))
  if not ok or n == 0 then
    delay = math.ceil(math.min(delay, max_us))
    -- Past the horizon: the caller starts the line (see below).
    if line and not ok then return line.join(delay - line.horizon / 2) end
    reply = {ok and 1 or 0, 1, remaining, delay, reset, now}
    if unshift then return unshift(reply) end
    return reply
  end
  local ticket = (one_commit or commits[algo])(KEYS[1], count, period, extra, n, delay, s1, s2)
  reply = {1, 1, remaining, math.ceil(math.min(delay, max_us)), reset, now, ticket}
  if op ~= 'prepay' and op ~= 'admit' and not atmost then return reply end
else
  local oks, delays, rems, resets, s1s, s2s = {}, {}, {}, {}, {}, {}
  local ok = true
  for i = 1, nrules do
    local algo, count, period, extra = rule(i)
    oks[i], delays[i], rems[i], resets[i], s1s[i], s2s[i] =
      (one_check or checks[algo])(KEYS[i], count, period, extra, n, reserve, max_wait)
    if not oks[i] then ok = false end
  end
  local decider, delay, reset = 1, 0, 0
  for i = 1, nrules do
    if resets[i] > reset then reset = resets[i] end
    if ok then
      if delays[i] > delay then delay = delays[i] end
      if rems[i] < rems[decider] then decider = i end
    elseif not oks[i] and (oks[decider] or delays[i] > delay) then
      -- The longest delay among the rules that denied: every rule that
      -- admits now still admits then.
      decider, delay = i, delays[i]
    end
  end
  reply = {ok and 1 or 0, decider, rems[decider], delay, reset, now}
  if ok and n > 0 then
    for i = 1, nrules do
      local algo, count, period, extra = rule(i)
      reply[6 + i] = (one_commit or commits[algo])(KEYS[i], count, period, extra, n, delays[i], s1s[i], s2s[i])
    end
  end
  -- remaining is clamped: a paused window may hold more than its count.
  if reply[3] < 0 then reply[3] = 0 end
  reply[4] = math.ceil(math.min(reply[4], max_us))
  reply[5] = math.ceil(math.min(reply[5], max_us))
end

if unshift then reply = unshift(reply) end
if line and reply[1] == 0 then
  -- Past the horizon: the caller starts the line, which is served when its
  -- turn comes within half the horizon.
  return line.join(reply[4] - line.horizon / 2)
end
local later = op == 'admit' and wait_here >= 0 and reply[4] > wait_here
if c then
  -- A caller that runs now (or after waiting where it is) takes its place;
  -- one that must come back later gives a place it holds to the next.
  if reply[1] == 1 and not later then cc.take(c) elseif c.holding then cc.give(c) end
end
if reply[1] == 1 and later then
  -- Later than the caller can wait: book the slot under its id.
  local b = 4 + 5 * nrules
  local rkey, tol = KEYS[nrules + 1], tonumber(ARGV[b + 1])
  redis.call('ZADD', rkey, string.format('%d', now + reply[4]), ARGV[b])
  keep_ttl(rkey, reply[4] + tol)
  if n > 0 then keep_tickets(KEYS[nrules + 3], rkey, ARGV[b], table.concat(reply, '\n', 7, 6 + nrules) .. '\n' .. string.format('%d', now), reply[4] + tol) end
  reply = {2, reply[2], reply[3], reply[4], reply[5], now}
  if c then return cc.reply(c, reply, nrules) end
  return reply
end
if reply[1] == 1 and op == 'prepay' then
  local rkey, keep = KEYS[nrules + 1], tonumber(ARGV[5 + 5 * nrules])
  redis.call('ZREMRANGEBYSCORE', rkey, '0', '(' .. string.format('%d', now - keep))
  redis.call('ZADD', rkey, string.format('%d', now + reply[4]), ARGV[4 + 5 * nrules])
  keep_ttl(rkey, reply[4] + keep)
  if n > 0 then keep_tickets(KEYS[nrules + 2], rkey, ARGV[4 + 5 * nrules], table.concat(reply, '\n', 7, 6 + nrules) .. '\n' .. string.format('%d', now), reply[4] + keep) end
end
if atmost and reply[1] == 1 then reply[#reply + 1] = n end
if c then return cc.reply(c, reply, nrules) end
return reply
