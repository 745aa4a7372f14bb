-- cancel (after upstream_rate.lua and upstream_state.lua, whose KEYS and
-- ARGV[1..8] it takes): gives back a departure that will not leave; the
-- schedule's end moves back if no later departure was booked behind it.
--
-- ARGV[9], ARGV[10], ARGV[11] -> t before and after the departure was
--             booked, and ls before ('' for none)
-- ARGV[12] -> its slot (µs, as booked)
--
-- Reply 1 if the schedule's end moved back, 0 if not.
if not known then return 0 end
local moved = give_back(tonumber(ARGV[9]), tonumber(ARGV[10]), ARGV[11], ARGV[12])
if moved == 1 then save() end
return moved
