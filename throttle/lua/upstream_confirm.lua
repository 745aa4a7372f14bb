-- confirm (after upstream_rate.lua and upstream_state.lua, whose KEYS and
-- ARGV[1..8] it takes): does a departure that waited for its slot still
-- stand? Not if a pause now covers its slot, the rate was lowered since it
-- was booked (g), a request left closer than the learned interval before
-- its slot since (al, upstream_leave.lua), or it is later than it may
-- leave: it is then given back and a new departure booked, as
-- upstream_depart.lua does.
--
-- ARGV[9], ARGV[10] -> as for depart (for the booking that replaces it)
-- ARGV[11] -> the slot (µs)
-- ARGV[12] -> the g it was booked under
-- ARGV[13] -> how late it may leave, µs
-- ARGV[14], ARGV[15], ARGV[16] -> t before and after it was booked, and ls
--             before ('' for none)
--
-- Reply {3} when the slot stands, else depart's reply:
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
-- learned interval before this slot (upstream_leave.lua).
local after_leave = true
if s.r and s.al then
  after_leave = slot >= s.al + math.ceil(1e6 / least(up_grown(s, now, ceil_rate), cap()))
end
if pause <= slot and g == s.g and now <= slot + late and after_leave then
  -- It leaves at its slot: the latest leave (upstream_leave.lua).
  if s.al == nil or slot > s.al then redis.call('HSET', key, 'al', ARGV[11]) end
  return {3}
end
-- Void: paused over, slowed down since, or too late: given back, then
-- booked again.
give_back(tonumber(ARGV[14]), tonumber(ARGV[15]), ARGV[16], ARGV[11])
return depart(tonumber(ARGV[9]), tonumber(ARGV[10]), false)
