-- leave (after upstream_rate.lua and upstream_state.lua, whose KEYS and
-- ARGV[1..8] it takes): a request that leaves without a departure of its
-- own (on a turn admit booked as its departure, upstream_pace.lua) says
-- that it is leaving, in the call that reads the subject's pause before
-- it. What the resource sees is when the requests leave, not their slots:
-- one that leaves late (its handler started late, within the tolerance)
-- would leave the next one, on time, closer than the learned interval to
-- it. So the latest leave is kept (al), and a request leaves no sooner
-- than 98 % of the learned interval after it: the lateness of one pushes
-- the next, instead of coming out of the room below the resource's limit.
-- The latest leave may be to come: a request pushed so, or a departure
-- whose slot is a few ms away (upstream_depart.lua, upstream_confirm.lua);
-- each leave is an interval after it all the same.
--
-- No ARGV of its own.
--
-- Reply {paused, wait, now, discovering}: paused 1 when the subject's
-- pause runs (wait: µs until it ends; nothing recorded: the request
-- departs on the schedule, after it), else 0 and wait the µs the request waits before it
-- leaves (0 while no rate is learned: nothing recorded); now the Redis
-- time it counts from (µs), so that the caller leaves at the moment
-- recorded whenever it reads the reply; discovering as depart's
-- (upstream_depart.lua).
local leave_share = 0.98
local pause = tonumber(redis.call('GET', pkey)) or 0
if pause > now then return {1, math.ceil(pause - now), now, disc_flag()} end
if not s.r then return {0, 0, now, disc_flag()} end
local r = up_grown(s, now, ceil_rate)
-- The interval as admit spaces the turns (upstream_pace.lua), less a
-- fiftieth: a request pushed waits on its own timer, whose lateness on a
-- busy machine nobody sees, so only lateness above that (about 1ms at
-- 20/s; a schedule at 95 % of a policy leaves 2.6ms) is pushed.
local at = now
if s.al then
  local iv = math.ceil(1e6 / least(r, cap()))
  at = math.max(now, s.al + iv * leave_share)
  -- A request queued behind another's push (pushed by more than half an
  -- interval: after a stall every request is late and each is pushed)
  -- leaves a whole interval after it: at the fiftieth less, a catch-up
  -- ran 1.6ms above the resource's interval at 20/s, which the jitter of
  -- arrival took (429s within 0.25s of a stall's end, traced). A request
  -- pushed a little (the one before it late by a few ms) keeps the
  -- fiftieth, so that one lateness is not carried by every request after.
  if at - now > iv / 2 then at = s.al + iv end
end
if not s.al or at > s.al then redis.call('HSET', key, 'al', fmt(at)) end
return {0, math.ceil(at - now), now, disc_flag()}
