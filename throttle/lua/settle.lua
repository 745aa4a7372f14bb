-- settle: corrects a reservation of every rule of a policy to its real
-- cost, after the caller acted: charges (ARGV[3] - ARGV[2]) more permits,
-- or gives back that many if negative, against each rule's ticket
-- (settle[algo], prelude.lua), then applies a running pause again as
-- refund.lua does. Built as allow.lua is, with settle.lua last.
--
-- KEYS[i]      -> the key of rule i, i = 1..r (rules.lua)
-- KEYS[r+1]    -> the subject's pause key, <prefix>{<subject>}:!pause
-- KEYS[r+1+i]  -> rule i's record of give-backs,
--                 <prefix>{<subject>}:<rule>!settled (bucket.lua)
-- KEYS[2r+1+i] -> rule i's record of its latest Reset (refund.lua)
-- ARGV[1]      -> 'settle'
-- ARGV[2]      -> n, the permits reserved
-- ARGV[3]      -> the actual cost, permits
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
-- Returns 1.
local n, actual = tonumber(ARGV[2]), tonumber(ARGV[3])
local nrules = math.floor((#ARGV - 3) / 5)
local booked = tonumber(ARGV[4 + 5 * nrules]) or -1
local rs = resets(nrules)
for i = 1, nrules do
  local algo, count, period, extra, tk = rule(i)
  -- Under a rule reset since the reservation, only a charge.
  if tk ~= '' and (actual > n or not (rs[i] and booked <= rs[i])) then
    settle[algo](KEYS[i], count, period, extra, n, actual, tk, booked, KEYS[nrules + 1 + i])
  end
end
local untl = tonumber(redis.call('GET', KEYS[nrules + 1]))
if untl and untl > now then pause_all(untl, nrules) end
return 1
