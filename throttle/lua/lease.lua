-- Renews and releases the leases of a concurrency rule (concurrency.lua),
-- built as prelude.lua, concurrency.lua, lease.lua (throttle/concurrency.go).
--
-- KEYS[1] -> the rule's key: <prefix>{<subject>}:<rule>
-- ARGV[1] -> 'renew' or 'release'
-- ARGV[2] -> count, the places
-- ARGV[3] -> the lease, microseconds
-- ARGV[4] ... -> holder ids: renew: every id this process holds for the
--               subject; release: the ids giving up their places (or their
--               places in the queue of waiters)
--
-- renew moves each held lease's expiry to now + lease (an id whose place
-- was reaped and handed on is not given one back), then reaps expired
-- leases; release drops the ids. Both then hand free places to the head
-- waiters. Returns {ids woken: the waiters handed a place, ids lost: renew's
-- ids that no longer held a place}.
local key, count, lease = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local lost = {}
if ARGV[1] == 'renew' then
  local exp = string.format('%d', now + lease)
  for i = 4, #ARGV do
    local s = tonumber(redis.call('ZSCORE', key, ARGV[i]))
    if s and s > 0 then
      redis.call('ZADD', key, exp, ARGV[i])
    else
      lost[#lost + 1] = ARGV[i]
    end
  end
else
  for i = 4, #ARGV do redis.call('ZREM', key, ARGV[i]) end
end
local c = cc.open(key, count, lease, '')
if redis.call('EXISTS', key) == 1 then cc.ttl(c) end
return {c.woken, lost}
