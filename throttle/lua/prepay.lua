-- prepay: reserve that, when admitted, also records a receipt scored by
-- the slot's Redis time (µs), which admit.lua later redeems, and the
-- reservation's refund tickets, which whoever redeems it can settle
-- (settle.lua). Built as allow.lua is, with prepay.lua last.
--
-- KEYS[i]    -> the key of rule i, i = 1..r (rules.lua)
-- KEYS[r+1]  -> the subject's receipt set, <prefix>{<subject>}:!receipts
--               (a sorted set: member -> its slot, µs of Redis time)
-- KEYS[r+2]  -> the subject's tickets of booked turns and receipts,
--               <prefix>{<subject>}:!tickets, a hash: member -> the refund
--               tickets of its rules and the Redis time (µs) of the call
--               that booked them, one a line (prelude.lua: keep_tickets);
--               a turn booked by admit adds its costs after that time,
--               "<µs> <costs>", which a lapse gives back (rules.lua)
-- ARGV[1]    -> 'prepay'
-- ARGV[2]    -> n, the number of permits (or one per rule, per_rule in
--               rules.lua); 0 charges nothing
-- ARGV[3]    -> the longest delay accepted, microseconds (-1: no bound)
-- ARGV[4 + 5 * (i - 1)] ... -> rule i, five values (rules.lua)
-- ARGV[4 + 5r] -> the receipt: id and rule names, a sorted-set member
-- ARGV[5 + 5r] -> how long the receipt is kept after its slot, microseconds
-- ARGV[6 + 5r] -> the soonest the slot may be, microseconds from now (0:
--                 now; only for a policy of buckets, see unshift)
-- r is floor((#ARGV - 3) / 5).
--
-- Returns decide's reply (decide.lua), as reserve.
local n, ns = per_rule(ARGV[2])
local max_wait = tonumber(ARGV[3])
local nrules = math.floor((#ARGV - 3) / 5)

-- ARGV[6 + 5r] (µs, optional) is the soonest the slot may be: a job needs
-- that long to reach whoever runs it, and a slot sooner would find it
-- late, its receipt stale. The rules decide as if called that much later,
-- as line_serve.lua's take does for a share (exact for the buckets, whose
-- state is a time; a policy with another rule, whose window would be
-- trimmed as of then, ignores it), and delays stay from the real now.
local unshift
local after = tonumber(ARGV[6 + 5 * nrules]) or 0
for i = 1, nrules do
  local algo = ARGV[4 + 5 * (i - 1)]
  if algo ~= 'gcra' and algo ~= 'token_bucket' then after = 0 end
end
if after > 0 and (max_wait < 0 or max_wait >= after) then
  now = now + after
  if max_wait >= 0 then max_wait = max_wait - after end
  -- unshift returns reply with its delay and now from the real now,
  -- the rules' TTLs lengthened to match (bucket.lua set them from the
  -- shifted now).
  unshift = function(reply)
    now = now - after
    reply[4], reply[6] = reply[4] + after, now
    for i = 1, nrules do
      local pt = redis.call('PTTL', KEYS[i])
      if pt > 0 then redis.call('PEXPIRE', KEYS[i], pt + math.ceil(after / 1000)) end
    end
    return reply
  end
end

local reply, final = decide(n, true, max_wait, nrules, ns)
if unshift then reply = unshift(reply) end
if final or reply[1] ~= 1 then return reply end
local rkey, keep = KEYS[nrules + 1], tonumber(ARGV[5 + 5 * nrules])
drop_lapsed(rkey, KEYS[nrules + 2], now - keep, nrules)
redis.call('ZADD', rkey, string.format('%d', now + reply[4]), ARGV[4 + 5 * nrules])
keep_ttl(rkey, reply[4] + keep)
if n > 0 then keep_tickets(KEYS[nrules + 2], rkey, ARGV[4 + 5 * nrules], table.concat(reply, '\n', 7, 6 + nrules) .. '\n' .. string.format('%d', now), reply[4] + keep) end
return reply
