-- The rules of a policy, as every policy script (allow.lua, prepay.lua,
-- admit.lua, refund.lua, settle.lua, pause.lua) receives them; not a script
-- of its own (throttle/scripts.go builds each as time.lua, prelude.lua, the
-- algorithm files, a use_*.lua file, this file, then the operation's).
--
-- KEYS[i] -> the key of rule i: <prefix>{<subject>}:<rule>, i = 1..r
-- ARGV[1] -> the operation: the script's name, or for allow.lua 'allow',
--            'reserve' or 'atmost', for refund.lua 'refund' or 'undo'
--            (prelude.lua reads it: rare)
-- ARGV[2] -> n, the number of permits: one number, which every rule is
--            charged, or one per rule, 'n1,n2,...,nr' (AdmitRequest.Costs;
--            per_rule reads both forms)
-- ARGV[3] -> the operation's bound or time (each script's header)
-- then for rule i, five values starting at ARGV[4 + 5 * (i - 1)]:
--   algorithm name, count, period (microseconds), extra (burst; precision
--   in microseconds for sliding_window), refund ticket ('' unless
--   refunding or settling)
-- Each script says what follows the rules, and how it counts them (r).

-- rule(i) reads rule i's arguments; the hot path of one rule (allow.lua:
-- 8 values) reads them inline and does not pay for the closure
-- (prelude.lua: cost per call).
local rule
if rare or #ARGV > 8 then
  rule = function(i)
    local b = 4 + 5 * (i - 1)
    return ARGV[b], tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), ARGV[b + 4]
  end
end

-- meet_at charges a turn of several rules to each rule at the turn, delay
-- µs from now, not at the rule's own earliest. Else a rule that did not
-- bind would hold the permit at its own earlier time: a bucket, and a
-- later caller whose other rules bind less (a request of few tokens after
-- one of many, under a requests limit beside a tokens bucket) takes the
-- moment the permit is really used, turns closer than the bucket allows;
-- a window, and the permit counts in a window before the one it acts in.
-- A bucket, a fixed window or a calendar window whose own turn
-- (delays[i]) comes earlier is checked again from the turn (not_before:
-- bucket.lua, fixedwindow.lua, calendar.lua), which admits it there (the
-- later window holds no more than the earlier one); a sliding window's or
-- log's permit is recorded at the turn (their checks count every permit
-- booked, so a later one never fills a window more). ms is each rule's
-- permits (nil: n for each); delays, s1s and s2s are decide's per-rule
-- check results, updated in place.
local meet_at
if rare or #ARGV > 8 then
  meet_at = function(nrules, n, ms, delay, delays, s1s, s2s)
    local nb = not_before
    not_before = now + delay
    for i = 1, nrules do
      local m = ms and ms[i] or n
      if delays[i] < delay and m > 0 then
        local algo, count, period, extra = rule(i)
        if algo == 'gcra' or algo == 'token_bucket' or algo == 'fixed_window' or algo == 'calendar' then
          local ok, d, _, _, s1, s2 = (one_check or checks[algo])(KEYS[i], count, period, extra, m, true, -1)
          if ok and d == delay then delays[i], s1s[i], s2s[i] = d, s1, s2 end
        elseif algo == 'sliding_window' then
          delays[i], s1s[i] = delay, now + delay
        elseif algo == 'sliding_log' then
          delays[i] = delay
        end
      end
    end
    not_before = nb
  end
end

-- per_rule reads a count of permits in either form of ARGV[2] (a number,
-- or 'n1,n2,...,nr': refund.lua's and settle.lua's counts too, and a line
-- member's, line.lua) and returns the largest and, for the second form,
-- the table of each rule's (nil for one number). A rule whose count is 0
-- in a table is neither checked nor charged (decide.lua): the request
-- does not wait for it. Defined where rule is: the hot path (one rule,
-- allow or reserve) reads ARGV[2] with tonumber and never gets a table.
local per_rule
if rare or #ARGV > 8 then
  per_rule = function(s)
    local x = tonumber(s)
    if x then return x, nil end
    local ns, most = {}, 0
    for v in string.gmatch(s, '%d+') do
      local c = tonumber(v)
      ns[#ns + 1] = c
      if c > most then most = c end
    end
    return most, ns
  end
end

-- pause_all applies pause[algo] to each of nrules rules, up to the Redis
-- time untl (pause.lua; refund.lua and settle.lua apply a running pause
-- again). resets returns, for each of nrules rules, the Redis time of its
-- latest Reset (reset.lua), held in KEYS[2 * nrules + 1 + i], or false if
-- none (refund.lua, settle.lua).
local pause_all, resets
if rare then
  pause_all = function(untl, nrules)
    for i = 1, nrules do
      local algo, count, period, extra = rule(i)
      pause[algo](KEYS[i], count, period, extra, untl)
    end
  end
  resets = function(nrules)
    local rs = {}
    for i = 1, nrules do rs[i] = tonumber(redis.call('GET', KEYS[2 * nrules + 1 + i])) or false end
    return rs
  end
end

-- lapse_turn forgets the tickets (in the hash tkey: prelude.lua,
-- keep_tickets) of member, a booking or receipt taken out of the receipt
-- set that will never be redeemed: its slot passed more than its
-- tolerance ago, or fell inside a pause (admit.lua). What its turn took
-- under a rule that registers lapse (prelude.lua: a calendar quota) goes
-- back, once, if member was booked under this policy's rules (its name
-- ends with them, throttle/prepay.go: member); under the other rules a
-- lapsed turn is only time gone by. drop_lapsed takes the members slotted
-- before upto (µs of Redis time) out of rkey, and lapses each if a rule
-- of the policy registers lapse (else it reads nothing more); those
-- rules' keys are then lapse_keys (prelude.lua: keep_tickets). Each
-- returns whether it gave a turn back (or one that has ended).
--
-- A bucket rule (GCRA, token bucket) gives a lapsed turn back too, where
-- the script declared the rules' records of give-backs (settled_key,
-- prelude.lua: admit.lua does) and the booking recorded its costs (after
-- its Redis time, "<µs> <costs>", as ARGV[2] of admit: admit.lua and
-- line_serve.lua book so): the turn is settled to nothing, as a settle
-- gives back (settle[algo], bucket_rare.lua, with its bound on how far
-- the state may move back), so that a caller back later than its
-- tolerance (a parked task on asynq's whole-second schedule) does not
-- cost the rule that turn's permits as well as its new one's. Not while
-- the subject is paused: admit.lua leaves settled_key unset then.
local lapse_turn, drop_lapsed
if rare then
  lapse_turn = function(tkey, member, nrules)
    local names = {}
    for i = 1, nrules do names[i] = string.match(KEYS[i], ':([^:]*)$') end
    local own = ' ' .. table.concat(names, ',')
    local tks = redis.call('HGET', tkey, member)
    if not tks or string.sub(member, -#own) ~= own then return false end
    redis.call('HDEL', tkey, member)
    -- The line after the tickets: the booking's Redis time and its costs.
    local booked, costs = string.match(tks, '\n(%d+) ([%d,]+)$')
    local n, ns
    if booked and settled_key then n, ns = per_rule(costs) end
    local i, gave = 0, false
    for tk in string.gmatch(tks, '([^\n]*)\n') do
      i = i + 1
      if i > nrules then break end
      local algo, count, period, extra = rule(i)
      if lapse[algo] and tk ~= '' then
        lapse[algo](KEYS[i], count, period, extra, tk)
        gave = true
      elseif n and bucket_lapse[algo] and tk ~= '' then
        local m = ns and ns[i] or n
        if m > 0 then settle[algo](KEYS[i], count, period, extra, m, 0, tk, tonumber(booked), settled_key(i)) end
      end
    end
    return gave
  end
  drop_lapsed = function(rkey, tkey, upto, nrules)
    local lo, hi = '0', '(' .. string.format('%d', upto)
    local buckets = false
    for i = 1, nrules do
      local algo = rule(i)
      if lapse[algo] then
        lapse_keys = lapse_keys or {}
        lapse_keys[#lapse_keys + 1] = KEYS[i]
      end
      buckets = buckets or (settled_key and bucket_lapse[algo])
    end
    local gave = false
    if lapse_keys or buckets then
      for _, m in ipairs(redis.call('ZRANGEBYSCORE', rkey, lo, hi)) do
        if lapse_turn(tkey, m, nrules) then gave = true end
      end
    end
    redis.call('ZREMRANGEBYSCORE', rkey, lo, hi)
    return gave
  end
end
