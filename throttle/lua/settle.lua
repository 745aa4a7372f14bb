-- settle: corrects a reservation of every rule of a policy to its real
-- cost, after the caller acted: charges (ARGV[3] - ARGV[2]) more permits,
-- or gives back that many if negative, against each rule's ticket
-- (settle[algo], prelude.lua), then applies a running pause again as
-- refund.lua does. Built as allow.lua is, with limits_pace.lua and
-- settle.lua last.
--
-- KEYS[i]      -> the key of rule i, i = 1..r (rules.lua)
-- KEYS[r+1]    -> the subject's pause key, <prefix>{<subject>}:!pause
-- KEYS[r+1+i]  -> rule i's record of give-backs,
--                 <prefix>{<subject>}:<rule>!settled (bucket.lua)
-- KEYS[2r+1+i] -> rule i's record of its latest Reset (refund.lua)
-- KEYS[3r+2]   -> the limits learned of the resource,
--                 <prefix>{<subject>}:!limits(<rules>) (limits_pace.lua):
--                 a rule is settled at the limit its turn was decided at
-- ARGV[1]      -> 'settle'
-- ARGV[2]      -> n, the permits reserved (a number, or one per rule:
--                 per_rule, rules.lua)
-- ARGV[3]      -> the actual cost, permits, in either form as well
-- ARGV[4 + 5 * (i - 1)] ... -> rule i, five values (rules.lua), with the
--                 reservation's ticket for it
-- ARGV[4 + 5r] -> the Redis time (µs) of the call that made the
--                 reservation, -1 if unknown
-- r is floor((#ARGV - 3) / 5).
--
-- Under a rule reset since the reservation (refund.lua) nothing is given
-- back; a settle for more still charges the difference to the new state:
-- the work used it, and a charge can never admit more than the rule's
-- bound.
--
-- A rule the reservation charged nothing (its ticket '': a cost of 0) is
-- charged what the settle says it used if it is a bucket, as a settle for
-- more charges it (into debt if need be); a window, which has no count of
-- the reservation's to correct, is left as it is.
--
-- Returns 1.
local n, ns = per_rule(ARGV[2])
local actual, as = per_rule(ARGV[3])
local nrules = math.floor((#ARGV - 3) / 5)
local booked = tonumber(ARGV[4 + 5 * nrules]) or -1
local rs = resets(nrules)
limits_pace(KEYS[3 * nrules + 2], nrules, function(i) return math.max(ns and ns[i] or n, as and as[i] or actual) end)
for i = 1, nrules do
  local algo, count, period, extra, tk = rule(i)
  local m, a = ns and ns[i] or n, as and as[i] or actual
  if tk == '' and m == 0 and a > 0 and (algo == 'gcra' or algo == 'token_bucket') then
    tk = string.format('%d 0', now)
  end
  -- Under a rule reset since the reservation, only a charge.
  if tk ~= '' and a ~= m and (a > m or not (rs[i] and booked <= rs[i])) then
    settle[algo](KEYS[i], count, period, extra, m, a, tk, booked, KEYS[nrules + 1 + i])
  end
end
local untl = tonumber(redis.call('GET', KEYS[nrules + 1]))
if untl and untl > now then pause_all(untl, nrules) end
return 1
