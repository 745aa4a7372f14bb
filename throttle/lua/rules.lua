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
