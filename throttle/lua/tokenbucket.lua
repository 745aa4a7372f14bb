-- Token bucket. count tokens are added per period, up to extra (burst).
-- State: one string "<tk> <ts> <ev>": tk = tokens at ts (negative while
-- reservations are queued), ts = time of tk, ev = time to act of the latest
-- reservation. One string rather than a hash: GET and SET ... PX are two
-- commands where HMGET, HSET and PEXPIRE are three.
-- TTL: until the bucket is full again (a missing key is a full bucket).
local tb_eps = 1e-9

-- Rates are applied as count / period and durations as tokens * period /
-- count, multiplying before dividing, so whole-token times are exact.
-- A string it cannot read is taken for a full bucket, as GCRA takes one;
-- a key of another type (another algorithm's, or a hash as builds before
-- the first release kept) fails with WRONGTYPE, as for every algorithm.
local function tb_load(key, count, period, burst)
  local v = redis.call('GET', key)
  if not v then return burst, 0 end
  local tk, ts, ev = string.match(v, '^(%S+) (%S+) (%S+)$')
  local tokens = tonumber(tk)
  ts = tonumber(ts)
  if not tokens or not ts then return burst, 0 end
  if now > ts then tokens = math.min(burst, tokens + (now - ts) * count / period) end
  return tokens, tonumber(ev) or 0
end

-- tb_store writes the state; evs is ev already formatted (int).
local function tb_store(key, count, period, burst, tokens, evs)
  redis.call('SET', key, num(tokens) .. ' ' .. string.format('%d', now) .. ' ' .. evs,
    'PX', ttl_ms((burst - tokens) * period / count))
end

local function check_token_bucket(key, count, period, burst, n, reserve, max_wait)
  local tokens, ev = tb_load(key, count, period, burst)
  local left = tokens - n
  local delay = 0
  if left < -tb_eps then delay = math.ceil(-left * period / count) end
  if delay == 0 or (reserve and (max_wait < 0 or delay <= max_wait)) then
    return true, delay, math.max(0, math.floor(left + tb_eps)),
      (burst - left) * period / count, left, ev
  end
  return false, delay, math.max(0, math.floor(tokens + tb_eps)),
    math.max(0, (burst - tokens) * period / count)
end

-- commit stores the tokens left and the latest time to act; the ticket is
-- this reservation's time to act.
local function commit_token_bucket(key, count, period, burst, n, delay, left, ev)
  local act = now + delay
  if ev < act then ev = act end
  local s = string.format('%d', act)
  tb_store(key, count, period, burst, left, ev == act and s or string.format('%d', ev))
  return s
end

-- Refunds and pauses only (prelude.lua: rare).
if rare then

-- ticket: the reservation's time to act, the end of its place in the
-- queue of reservations (ticket - n * period / count, ticket]. The last
-- place gives its n tokens back and moves ev to its start, and the
-- cancelled places before it (ckey, prelude.lua) follow. An earlier place
-- is recorded in ckey, unless the tokens reserved after it are fewer than
-- its n: then the difference is given back at once, as
-- golang.org/x/time/rate's Cancel does.
refund['token_bucket'] = function(key, count, period, burst, n, ticket, ckey)
  if redis.call('EXISTS', key) == 0 then
    if ckey then redis.call('DEL', ckey) end
    return
  end
  local tokens, ev = tb_load(key, count, period, burst)
  local x = tonumber(ticket)
  local iv = period / count
  -- Times to act are whole microseconds, rounded up: neighbours are
  -- n * iv apart to within 1µs.
  local eps = math.min(iv / 2, 1.5)
  -- A place whose time to act passed still holds tokens that the bucket
  -- has not refilled, until it would be full again: burst * iv later.
  local stale = now - burst * iv
  if ev - x > eps then
    -- Within eps, the later places hold all of this one: rounding, not room.
    local restore = n - (ev - x) * count / period
    if restore > eps / iv then
      tb_store(key, count, period, burst, math.min(burst, tokens + restore), rint(ev))
    elseif ckey and x > stale then
      cancelled_add(ckey, ticket, n, ev)
    end
    return
  end
  local back = n
  ev = x - n * iv
  if ckey then
    local more
    ev, more = cancelled_pop(ckey, ev, eps, function(hn) return hn * iv end, stale)
    back = back + more
  end
  tb_store(key, count, period, burst, math.min(burst, tokens + back), rint(ev))
end

-- pause: the bucket goes into debt so that it holds exactly one token at
-- untl: tk = 1 - (untl - now) * count / period. The first permit is
-- admitted at untl, the next ones at the steady rate; a deeper debt is
-- kept. ev is unchanged: refunds are re-paused by the driver.
pause['token_bucket'] = function(key, count, period, burst, untl)
  local tokens, ev = tb_load(key, count, period, burst)
  local target = 1 - (untl - now) * count / period
  if tokens <= target then return end
  tb_store(key, count, period, burst, target, rint(ev))
end

end
