-- left (after upstream_rate.lua and upstream_state.lua, whose KEYS and
-- ARGV[1..8] it takes): a request that reached the resource later than
-- the leave recorded for it (its departure's slot, or its Leave) says when
-- it did. What the resource sees is when requests arrive: the first
-- request of a process dials a connection after its slot (traced: 4.8 ms
-- on loopback while ten worker processes start), and the next request,
-- on time an interval after the slot, reached the resource 48.4 ms after
-- it, under its 50 ms interval (a 429). Recorded as the latest leave (al),
-- it pushes the next departure (upstream_confirm.lua) or leave
-- (upstream_leave.lua) to an interval after it.
--
-- ARGV[9] -> how long before now the request left, µs
--
-- Reply 1 if it is now the latest leave, else 0.
local at = math.floor(now - tonumber(ARGV[9]))
if not s.r or (s.al and at <= s.al) then return 0 end
redis.call('HSET', key, 'al', fmt(at))
return 1
