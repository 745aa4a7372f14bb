-- Decides (or refunds) one request against every rule of a policy, atomically.
--
-- KEYS[i]    -> the key of rule i: <prefix>{<subject>}:<rule>
-- ARGV[1]    -> operation: 'allow', 'reserve' or 'refund'
-- ARGV[2]    -> n, the number of permits
-- ARGV[3]    -> reserve: the longest delay accepted, microseconds (-1: no bound)
-- then for rule i, five values starting at ARGV[4 + 5 * (i - 1)]:
--   algorithm name, count, period (microseconds),
--   extra (burst; precision in microseconds for sliding_window),
--   refund ticket ('' unless refunding)
--
-- allow and reserve return
--   {ok (1/0), deciding rule index (1-based), remaining, delay microseconds,
--    reset microseconds, ticket 1, ..., ticket #KEYS}
-- ok = 0 charges nothing. Denied: the deciding rule is the one with the
-- longest delay, and delay is when a request of n would be admitted.
-- Admitted: the deciding rule is the one with the fewest permits remaining;
-- for reserve, delay is how long the caller must wait for its slot.
-- refund returns 1.
local op = ARGV[1]
local n = tonumber(ARGV[2])
local max_wait = tonumber(ARGV[3])

local function rule(i)
  local b = 4 + 5 * (i - 1)
  return ARGV[b], tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3]), ARGV[b + 4]
end

if op == 'refund' then
  for i = 1, #KEYS do
    local algo, count, period, extra, ticket = rule(i)
    if ticket ~= '' then refund[algo](KEYS[i], count, period, extra, n, ticket) end
  end
  return 1
end

local reserve = op == 'reserve'
local decisions = {}
local ok = true
for i = 1, #KEYS do
  local algo, count, period, extra = rule(i)
  local d = check[algo](KEYS[i], count, period, extra, n, reserve, max_wait)
  decisions[i] = d
  if not d.ok then ok = false end
end

local decider, delay, reset = 1, 0, 0
for i, d in ipairs(decisions) do
  if d.reset > reset then reset = d.reset end
  if ok then
    if d.delay > delay then delay = d.delay end
    if d.remaining < decisions[decider].remaining then decider = i end
  elseif not d.ok and (decisions[decider].ok or d.delay > delay) then
    -- The longest delay among the rules that denied: every rule that
    -- admits now still admits then.
    decider, delay = i, d.delay
  end
end

local reply = {ok and 1 or 0, decider, decisions[decider].remaining, math.ceil(delay), math.ceil(reset)}
if ok then
  for i, d in ipairs(decisions) do reply[#reply + 1] = d.commit() end
end
return reply
