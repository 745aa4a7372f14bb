-- Leaky bucket as GCRA. Emission interval T = period / count; extra = burst,
-- the number of permits that may be admitted at one instant (tolerance
-- burst * T). The arithmetic, the state (the theoretical arrival time TAT,
-- and the time to act of the latest reservation), the TTL and the refund
-- ticket are the token bucket's: bucket.lua. The two make the same
-- decisions; GCRA is the name under which many users know it.
local check_gcra, commit_gcra = bk_check, bk_commit

-- Refunds and pauses only (prelude.lua: rare).
if rare then
  refund['gcra'] = bk_refund
  pause['gcra'] = bk_pause
  settle['gcra'] = bk_settle
end
