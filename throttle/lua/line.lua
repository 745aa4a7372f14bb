-- The subject's line, part 1 of 2 (not a script: part of admit's,
-- throttle/scripts.go): its keys, the shares' caps, joining or staying in
-- it, and taking a member's turn (take). line_serve.lua adds the servings. admit.lua documents the line's
-- KEYS and ARGV; a line's state:
--
--   KEYS[r+4] <prefix>{<subject>}:!line(<rules>): a sorted set of the
--             waiting members by their place (one line per limiter's rules,
--             which its servings charge)
--   KEYS[r+5] :!line:e, a hash: member -> its n (ARGV[2]'s form: one
--             number, or one per rule, per_rule in rules.lua) and waiter
--   KEYS[r+6] :!line:f, a hash: 's' .. share -> the place of the share's
--             last member; 'v' -> the place of the last member served;
--             't' -> the Redis time (µs) of the last serving; 'g' -> set
--             when a lapsed turn gave a quota back (admit.lua), so that the
--             next caller to join or stay has the line served at once
--   with share caps (ARGV[b + 8] > 0), KEYS[r+7] ... KEYS[r+10]:
--             :!line:h (a sorted set: the shares served, by the place of
--             their first member), :!line:q (the members by share, ordered
--             by name: share, place, member), :!line:s (the shares asleep,
--             by the Redis time their cap admits them) and :!line:c (each
--             share's cap state, the theoretical arrival time of its GCRA,
--             µs of Redis time)
--
-- A caller joins at max(the place of the last member served, the place of
-- its share's last member) + n / weight, so that the shares with members
-- waiting are served in turn, each by its weight, and a share that has
-- waited for nothing starts level with the head. Nothing is charged.
--
-- Priorities: ARGV[b + 7] is the weight, or 'weight level max_age' (level
-- 0 to 9, max_age in µs). A member of level L is scored by its place less
-- L * band (place_band below), so the line's head is the first member of
-- its highest level; places are counted per level (:f fields 'v' .. L and
-- 'S' .. L .. ':' .. share for L > 0; level 0 keeps 'v' and 's' .. share).
-- Such a member's entry in :e is 'n promote\nwaiter', promote the Redis
-- time (µs) from which it is served before every younger member
-- (line_serve.lua, pick); an entry 'n\nwaiter' is never promoted.

-- place_band is the score between two levels of the line: a line's places
-- (its permits, divided by weights, while it is not empty) stay below it.
local place_band = 2 ^ 40

-- line_entry splits an entry of :e into its n (as ARGV[2] gave it: read
-- it with per_rule), promote time (nil if none) and waiter.
local function line_entry(e)
  local m, p, waiter = string.match(e or '', '^([%d,]+) ?(%d*)\n(.*)$')
  return m, tonumber(p), waiter
end

-- line_level returns the level of a member of the line scored score.
local function line_level(score)
  if score > 0 then return 0 end
  return math.ceil(-score / place_band)
end

-- line_fields returns the :f fields of level lv: its last place served
-- and share sh's last place.
local function line_fields(lv, sh)
  if lv == 0 then return 'v', 's' .. sh end
  return 'v' .. lv, 'S' .. lv .. ':' .. sh
end

-- line_base returns the line of an admit of n permits under nrules rules,
-- whose arguments after the rules' start at ARGV[b] (admit.lua), booking
-- into the receipt set rkey and the tickets tkey with tolerance tol (µs):
-- the table l with join and stay, and h, the helpers line_serve.lua uses.
local function line_base(n, nrules, b, rkey, tkey, tol)
  local l = {key = KEYS[nrules + 4], ekey = KEYS[nrules + 5], fkey = KEYS[nrules + 6],
    horizon = tonumber(ARGV[b + 2])}
  -- The caller's weight, level and age bound (µs; nil: never promoted).
  do
    local w, lv, age = string.match(ARGV[b + 7], '^(%d+) (%d) (%d+)$')
    l.weight, l.level, l.max_age = tonumber(w or ARGV[b + 7]), tonumber(lv) or 0, tonumber(age)
  end
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
    -- Younger members of higher levels may pass it for its age bound.
    if l.max_age then w = w + l.max_age end
    return math.ceil(math.min(l.horizon + w, max_us / 4))
  end
  -- entry is a member's :e entry: m permits, its waiter, and with an age
  -- bound, when it is promoted (promote, or the age bound from now).
  local function entry(m, waiter, promote)
    if not promote and l.max_age then promote = now + l.max_age end
    if not promote then return m .. '\n' .. waiter end
    return m .. string.format(' %d', promote) .. '\n' .. waiter
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
    local served, share = line_fields(l.level, sh)
    local f = redis.call('HMGET', l.fkey, served, share, 'g')
    if f[3] and not serve then serve = 0 end
    local place = math.max(tonumber(f[1]) or 0, tonumber(f[2]) or 0) + n / l.weight
    local ahead = redis.call('ZCARD', l.key)
    redis.call('ZADD', l.key, fmt(place - l.level * place_band), ARGV[b])
    redis.call('HSET', l.ekey, ARGV[b], entry(ARGV[2], ARGV[b + 5]))
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
    return {IN_LINE, 1, ahead + 1, back, serve, now}
  end
  -- stay keeps a caller that came back still in line (as member, at
  -- place) there, as the booking id; if nobody has served the line for two
  -- horizons, whoever served it may have stopped: it is served at once.
  function l.stay(member, place)
    local m, promote = line_entry(redis.call('HGET', l.ekey, member))
    m = m or ARGV[2]
    local sh = ARGV[b + 6]
    if member ~= ARGV[b] then
      redis.call('ZREM', l.key, member)
      redis.call('HDEL', l.ekey, member)
      redis.call('ZADD', l.key, place, ARGV[b])
      if l.ci then redis.call('ZREM', l.qkey, qentry(sh, tonumber(place), member)) end
    end
    if l.ci then enqueue(sh, tonumber(place), ARGV[b]) end
    redis.call('HSET', l.ekey, ARGV[b], entry(m, ARGV[b + 5], promote))
    local ahead = redis.call('ZCOUNT', l.key, '-inf', '(' .. place)
    local back = fallback(ahead, (per_rule(m)), l.ci and sh)
    keep(back + l.horizon + tol)
    local serve = -1
    local f = redis.call('HMGET', l.fkey, 't', 'g')
    if f[2] or now - (tonumber(f[1]) or 0) > 2 * l.horizon then serve = 0 end
    return {IN_LINE, 1, redis.call('ZCARD', l.key), back, serve, now}
  end
  -- take books m permits under every rule (and share sh's cap, if given)
  -- if the turn is within the horizon, and returns true, its delay and the
  -- tickets; else false and the delay until the rules would admit it, and
  -- with a cap that admits later than the rules, the cap's delay. With by,
  -- a turn at or after the Redis time by is not taken: false, its delay,
  -- nil, true. ms, if given, is the permits per rule (m their largest):
  -- a rule of 0 is not checked nor charged, its ticket ''.
  local function take_now(m, sh, by, ms)
    local delays, s1s, s2s, late = {}, {}, {}, -1
    for i = 1, nrules do
      local algo, count, period, extra = rule(i)
      local mi = ms and ms[i] or m
      local ok, d, _, _, s1, s2 = true, 0
      if mi > 0 or not ms then
        ok, d, _, _, s1, s2 = (one_check or checks[algo])(KEYS[i], count, period, extra, mi, true, l.horizon)
      end
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
    meet_at(nrules, m, ms, delay, delays, s1s, s2s)
    for i = 1, nrules do
      local algo, count, period, extra = rule(i)
      local mi = ms and ms[i] or m
      tks[i] = ''
      if mi > 0 or not ms then
        tks[i] = (one_commit or commits[algo])(KEYS[i], count, period, extra, mi, delays[i], s1s[i], s2s[i])
      end
    end
    return true, math.ceil(delay), tks
  end
  -- take is take_now (ms: its permits per rule), or with at (µs),
  -- take_now as if called at now + at:
  -- a turn booked ahead at that moment, which may leave the rules' turns
  -- before it unused. It is asked only where no one waits for those turns
  -- (nobody in line, or every share asleep), for a share whose own limit
  -- admits it at now + at, and only of the bucket algorithms (every rule
  -- of a limiter with share limits is one, throttle/admit.go), whose state
  -- is a time and books any moment. Delays are from the real now.
  local function take(m, sh, by, at, ms)
    if not at or at <= 0 then return take_now(m, sh, by, ms) end
    local real = now
    now = now + at
    local ok, delay, x, first = take_now(m, sh, by, ms)
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
  return l, {fmt = fmt, qhead = qhead, sleep = sleep, take = take}
end
