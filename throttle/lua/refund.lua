-- refund and undo: give reservations back to every rule of a policy. undo
-- is refund for a part a Group rolls back, which its caller never used:
-- the bucket algorithms give it back even after its time to act; refund
-- is a Reservation.Cancel, which they honour only before it (bucket.lua).
-- After giving back, a pause still running is applied again, so that a
-- permit booked before the pause cannot admit a request before it ends.
-- Built as allow.lua is, with refund.lua last.
--
-- KEYS[i]      -> the key of rule i, i = 1..r (rules.lua)
-- KEYS[r+1]    -> the subject's pause key, <prefix>{<subject>}:!pause
-- KEYS[r+1+i]  -> rule i's record of cancelled reservations,
--                 <prefix>{<subject>}:<rule>!cancelled (bucket.lua)
-- KEYS[2r+1+i] -> rule i's record of its latest Reset,
--                 <prefix>{<subject>}:<rule>!reset (reset.lua)
-- ARGV[1]      -> 'refund' or 'undo'
-- ARGV[2]      -> n, the first reservation's permits (a number, or one
--                 per rule: per_rule, rules.lua; so is each later n)
-- ARGV[3]      -> the Redis time (µs) of the call that made the first
--                 reservation (-1 if unknown)
-- ARGV[4 + 5 * (i - 1)] ... -> rule i, five values (rules.lua), with the
--                 first reservation's ticket for it
-- then more reservations to give back in the same call, each as 2 + r
-- values: its n, the Redis time (µs) of the call that made it, then its
-- ticket for each rule.
-- KEYS[3r+2]   -> optional: the caps of the subject's line's shares,
--                 <prefix>{<subject>}:!line(<rules>):c (line.lua). With
--                 it, every reservation has one more value after the
--                 rules' (the first's at ARGV[4 + 5r], each later one's
--                 after its booking time): its share ticket, '' for none,
--                 else "<slot> <end> <give> <share>", µs of Redis time:
--                 its slot, the share's cap state its turn left, and the
--                 cap it took (line_serve.lua, direct).
-- r is floor((#KEYS - 1) / 3).
--
-- A reservation made no later than a rule's latest Reset (its booking time
-- at or before the time the record holds) gives nothing back under that
-- rule: its permits were counted in the state the Reset forgot (issue 20).
--
-- A share ticket gives the share's cap back as bk_refund gives a bucket's
-- (bucket_rare.lua): nothing once its slot has passed (undo apart), else
-- what it took less what the share's later turns took (the cap's state
-- past its end), and nothing if a rule was reset since it was made: the
-- share's turn goes back with the rules' turn, or not at all.
--
-- Returns 1.
local undo = ARGV[1] == 'undo'
local nrules = math.floor((#KEYS - 1) / 3)
local caps = KEYS[3 * nrules + 2]
local rs = resets(nrules)
-- refund_share gives back the share's cap of share ticket st.
local function refund_share(st)
  local slot, e, g, sh = string.match(st, '^(%S+) (%S+) (%S+) (.*)$')
  if not slot or (tonumber(slot) < now and not undo) then return end
  local tat = tonumber(redis.call('ZSCORE', caps, sh))
  if not tat then return end
  local back = tonumber(g) - (tat - tonumber(e))
  if back <= 0 then return end
  redis.call('ZADD', caps, string.format('%.17g', math.max(tat - back, now)), sh)
end
-- refund_one gives back m permits (ARGV's form: per_rule), of a
-- reservation made at the Redis time booked, with the tickets ticket(i)
-- and share ticket st; nothing under a rule reset since (at or after
-- booked).
local function refund_one(m, booked, ticket, st)
  local reset = false
  local most, ms = per_rule(m)
  for i = 1, nrules do
    local algo, count, period, extra = rule(i)
    local tk = ticket(i)
    if rs[i] and booked <= rs[i] then
      reset = true
    elseif tk ~= '' then
      refund[algo](KEYS[i], count, period, extra, ms and ms[i] or most, tk, KEYS[nrules + 1 + i], undo)
    end
  end
  if st and st ~= '' and not reset then refund_share(st) end
end
local b = 4 + 5 * nrules
local stride = 2 + nrules
if caps then stride = stride + 1 end
refund_one(ARGV[2], tonumber(ARGV[3]), function(i) return ARGV[4 + 5 * (i - 1) + 4] end, caps and ARGV[b])
if caps then b = b + 1 end
while ARGV[b] do
  local base = b
  local st = caps and ARGV[base + 2]
  local t0 = base + 1
  if caps then t0 = base + 2 end
  refund_one(ARGV[base], tonumber(ARGV[base + 1]), function(i) return ARGV[t0 + i] end, st)
  b = b + stride
end
if KEYS[nrules + 1] then
  local untl = tonumber(redis.call('GET', KEYS[nrules + 1]))
  if untl and untl > now then pause_all(untl, nrules) end
end
return 1
