-- rebook: books a redeemed turn again, with its tickets, under the member
-- its caller comes back as (Reservation.Rebook, throttle/rebook.go), so
-- that a caller stopped before its slot (a worker draining for shutdown)
-- redeems the same turn when it comes back instead of taking a new one.
-- Built as prelude.lua, rebook.lua.
--
-- KEYS[1] -> the receipt set, <prefix>{<subject>}:!receipts
-- KEYS[2] -> the tickets, <prefix>{<subject>}:!tickets (prepay.lua)
-- KEYS[3..] -> the keys of the policy's calendar rules, if any (calendar.lua):
--            the booking and its tickets are kept as long as they live, so
--            that one that lapses is there to give its unit back (rules.lua:
--            drop_lapsed; prelude.lua: keep_tickets)
-- ARGV[1] -> 'rebook'
-- ARGV[2] -> the member to book it under (an id and the rule names)
-- ARGV[3] -> its slot, microseconds of Redis time
-- ARGV[4] -> tolerance, microseconds: how long after its slot the booking
--            may still be redeemed (admit.lua), and so kept
-- ARGV[5] -> its tickets, as admit.lua's REDEEMED reply carried them
--
-- Returns 1 if booked again; 0 if its slot has passed, or the member
-- already holds a booking (which is kept).
local slot = tonumber(ARGV[3])
if slot < now then return 0 end
if redis.call('ZADD', KEYS[1], 'NX', ARGV[3], ARGV[2]) == 0 then return 0 end
local keep = slot - now + tonumber(ARGV[4])
for i = 3, #KEYS do
  lapse_keys = lapse_keys or {}
  lapse_keys[#lapse_keys + 1] = KEYS[i]
end
keep_ttl(KEYS[1], keep)
keep_tickets(KEYS[2], KEYS[1], ARGV[2], ARGV[5], keep)
return 1
