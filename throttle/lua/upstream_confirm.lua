-- confirm (after upstream_rate.lua and upstream_state.lua, whose KEYS and
-- ARGV[1..8] it takes): does a departure that waited for its slot still
-- stand? Not if a pause now covers its slot, the rate was lowered since it
-- was booked (g), or it is later than it may leave (an interval, at a
-- learned rate): it is then given back and a new departure booked, as
-- upstream_depart.lua does. A request that left closer than the learned
-- interval before its slot since (al, upstream_leave.lua) pushes it, as
-- its own lateness does.
--
-- ARGV[9], ARGV[10] -> as for depart (for the booking that replaces it)
-- ARGV[11] -> the slot (µs)
-- ARGV[12] -> the g it was booked under
-- ARGV[13] -> how late it may leave, µs
-- ARGV[14], ARGV[15], ARGV[16] -> t before and after it was booked, and ls
--             before ('' for none)
--
-- Reply {3, push} when the slot stands (push: µs it leaves after it, the
-- lateness of a request that left before it), else depart's reply:
-- Reply {status, delay, slot, n, g, now, t before, t after, interval, rate,
-- q, w, probe, ls before}: status 1 booked (delay µs from now, at slot; n
-- its number; interval the spacing it was booked at, µs; rate the learned
-- rate as text, '' for none; q and w the policy, 0 0 for none; probe 1 if
-- it is the first departure, whose answer the others await), 0 too far
-- (delay: when it would be; nothing booked), 2 come back in delay (the
-- first departure's answer is awaited; nothing booked).
local slot, g, late = tonumber(ARGV[11]), tonumber(ARGV[12]), tonumber(ARGV[13])
local pause = tonumber(redis.call('GET', pkey)) or 0
-- A request left (or is about to) since it was booked, closer than the
-- learned interval before this slot (upstream_leave.lua): an owner of the
-- turn before it, late within its tolerance. The departure is pushed by
-- that lateness, as leave pushes the next owner, rather than booked again
-- behind every turn booked meanwhile: its slot would be a hole, and at 10
-- workers the usual few ms of an owner's lateness voided the departure
-- behind it again and again (a fleet at 60 % of the limit for 10 s).
--
-- A departure confirmed after its slot (its process held up: ten worker
-- processes starting on two cores confirmed 4-9 ms late in their first
-- second) leaves now, pushed by its own lateness as by another's, if that
-- is less than an interval: voided, its slot was a hole and its request
-- booked behind every turn booked meanwhile (four holes in a 10-worker
-- run's first second kept it from 95 % of the limit until 1.01 s). The
-- departures after it are pushed in turn (al), as behind a late owner.
local at, iv = slot, nil
if s.r then iv = math.ceil(1e6 / least(up_grown(s, now, ceil_rate), cap())) end
if iv and s.al then at = math.max(slot, s.al + iv) end
if iv and now > slot + late and now < slot + iv then
  at, late = math.max(at, now), iv
end
local bound = tonumber(ARGV[9])
if pause <= slot and g == s.g and now <= slot + late and (bound < 0 or at - now <= bound) then
  -- It leaves at its slot, or pushed: the latest leave.
  if s.al == nil or at > s.al then redis.call('HSET', key, 'al', fmt(at)) end
  return {3, math.ceil(at - slot)}
end
-- Void: paused over, slowed down since, too late, or pushed past what the
-- caller waits: given back, then booked again.
give_back(tonumber(ARGV[14]), tonumber(ARGV[15]), ARGV[16], ARGV[11])
return depart(tonumber(ARGV[9]), tonumber(ARGV[10]), false, false, 0)
