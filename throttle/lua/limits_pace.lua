-- limits_pace (admit.lua, settle.lua): the limits the fleet learned of the
-- resource behind a policy, one per rule (Limiter.LearnLimits: an LLM
-- provider's requests, input-token and output-token limits, read from its
-- headers), applied where a turn is decided and settled. Never looser
-- than the rule: a learned rate only slows a rule down, a learned burst
-- only lowers it.
--
-- lkey -> <prefix>{<subject>}:!limits(<rules>), a hash with, for rule i,
--         'c<i>' (count), 'p<i>' (period, µs) and 'b<i>' (burst); read
--         only. A missing hash changes nothing.
-- nrules -> the rules of the policy, whose arguments (rules.lua) are
--         rewritten in place for every gcra and token_bucket rule with a
--         learned limit: its count and period become the learned ones if
--         their rate is slower, its burst the learned one if lower, but
--         never below the request's cost under the rule (cost(i)), which
--         could then never be admitted. The bucket state is a time
--         (bucket.lua), which stays meaningful at another rate; the windows
--         and a concurrency rule are left alone.
-- Returns the set of rules with a learned limit (rule index -> true),
-- applied or not.
local function limits_pace(lkey, nrules, cost)
  local v = redis.call('HGETALL', lkey)
  local learned = {}
  if #v == 0 then return learned end
  local h = {}
  for j = 1, #v, 2 do h[v[j]] = tonumber(v[j + 1]) end
  for i = 1, nrules do
    local b = 4 + 5 * (i - 1)
    local algo = ARGV[b]
    local c, p, lb = h['c' .. i], h['p' .. i], h['b' .. i]
    if c and p and c > 0 and p > 0 and (algo == 'gcra' or algo == 'token_bucket') then
      learned[i] = true
      local count, period, burst = tonumber(ARGV[b + 1]), tonumber(ARGV[b + 2]), tonumber(ARGV[b + 3])
      if p * count > period * c then -- p / c > period / count, exactly
        ARGV[b + 1], ARGV[b + 2] = string.format('%d', c), string.format('%d', p)
      end
      if lb and lb < burst then
        ARGV[b + 3] = string.format('%d', math.max(lb, cost(i), 1))
      end
    end
  end
  return learned
end
