-- refund and undo: give reservations back to every rule of a policy. undo
-- is refund for a part a Group rolls back, which its caller never used:
-- the bucket algorithms give it back even after its time to act; refund
-- is a Reservation.Cancel, which they honour only before it (bucket.lua).
-- After giving back, a pause still running is applied again, so that a
-- permit booked before the pause cannot admit a request before it ends.
-- Built as allow.lua is, with refund.lua last.
--
-- KEYS[i]      -> the key of rule i, i = 1..r (rules.lua)
-- KEYS[r+1]    -> the subject's pause key, <prefix>{<subject>}:!pause
-- KEYS[r+1+i]  -> rule i's record of cancelled reservations,
--                 <prefix>{<subject>}:<rule>!cancelled (bucket.lua)
-- KEYS[2r+1+i] -> rule i's record of its latest Reset,
--                 <prefix>{<subject>}:<rule>!reset (reset.lua)
-- ARGV[1]      -> 'refund' or 'undo'
-- ARGV[2]      -> n, the first reservation's permits
-- ARGV[3]      -> the Redis time (µs) of the call that made the first
--                 reservation (-1 if unknown)
-- ARGV[4 + 5 * (i - 1)] ... -> rule i, five values (rules.lua), with the
--                 first reservation's ticket for it
-- then more reservations to give back in the same call, each as 2 + r
-- values: its n, the Redis time (µs) of the call that made it, then its
-- ticket for each rule.
-- r is (#KEYS - 1) / 3.
--
-- A reservation made no later than a rule's latest Reset (its booking time
-- at or before the time the record holds) gives nothing back under that
-- rule: its permits were counted in the state the Reset forgot (issue 20).
--
-- Returns 1.
local undo = ARGV[1] == 'undo'
local nrules = (#KEYS - 1) / 3
local rs = resets(nrules)
-- refund_one gives back m permits, of a reservation made at the Redis
-- time booked, with the tickets ticket(i); nothing under a rule reset
-- since (at or after booked).
local function refund_one(m, booked, ticket)
  for i = 1, nrules do
    local algo, count, period, extra = rule(i)
    local tk = ticket(i)
    if tk ~= '' and not (rs[i] and booked <= rs[i]) then
      refund[algo](KEYS[i], count, period, extra, m, tk, KEYS[nrules + 1 + i], undo)
    end
  end
end
refund_one(tonumber(ARGV[2]), tonumber(ARGV[3]), function(i) return ARGV[4 + 5 * (i - 1) + 4] end)
local b = 4 + 5 * nrules
while ARGV[b] do
  local base = b
  refund_one(tonumber(ARGV[base]), tonumber(ARGV[base + 1]), function(i) return ARGV[base + 1 + i] end)
  b = b + 2 + nrules
end
if KEYS[nrules + 1] then
  local untl = tonumber(redis.call('GET', KEYS[nrules + 1]))
  if untl and untl > now then pause_all(untl, nrules) end
end
return 1
