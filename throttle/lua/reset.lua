-- Forgets a subject's state under the rules of a limiter (Limiter.Reset,
-- throttle/state.go), and records, per rule, the Redis time of the Reset,
-- so that a reservation made before it gives nothing back into the state
-- after it (refund.lua and settle.lua read the record). Built as
-- prelude.lua, reset.lua.
--
-- KEYS[1]  -> the subject's pause key, <prefix>{<subject>}:!pause
-- then for rule i = 1..r, four keys from KEYS[2 + 4 * (i - 1)]:
--   the rule's key <prefix>{<subject>}:<rule>, its records of cancelled
--   reservations (<rule>!cancelled) and of settles' give-backs
--   (<rule>!settled), and its record of the latest Reset (<rule>!reset)
-- ARGV[i]  -> rule i's afterlife, microseconds: how long after its key
--   would have expired a reservation made on that state could still give
--   something back (bucket.lua: 2 * burst * T; the windows: 0); -1 for a
--   rule without refund tickets (concurrency), which is only deleted
--
-- The record holds the Redis time (µs) of the Reset. A reservation made
-- at or before that microsecond (its booking time, which the caller sends
-- with every refund and settle) counts as made before it. The record is
-- kept as long as the rule's key would have lived, plus its afterlife: by
-- then every reservation made on the old state has passed its time to act
-- and left the room a settle gives back (bucket.lua), and a window's new
-- state counts none of the old one's permits. It is not written for a
-- rule whose key had already expired (nothing made on it can give back);
-- a longer-lived record of an earlier Reset keeps its TTL.
--
-- Returns 1.
local del = {KEYS[1]}
for i = 1, #ARGV do
  local b = 2 + 4 * (i - 1)
  local key, mark, after = KEYS[b], KEYS[b + 3], tonumber(ARGV[i])
  del[#del + 1], del[#del + 2], del[#del + 3] = key, KEYS[b + 1], KEYS[b + 2]
  local left = redis.call('PTTL', key)
  if after >= 0 and left > 0 then
    local want = left + math.ceil(after / 1000)
    local had = redis.call('PTTL', mark)
    if had > want then want = had end
    redis.call('SET', mark, string.format('%d', now), 'PX', string.format('%d', want))
  end
end
redis.call('DEL', unpack(del))
return 1
