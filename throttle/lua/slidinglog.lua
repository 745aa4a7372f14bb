-- Sliding log. State: sorted set, one member per admitted permit, scored by
-- its admission time; a permit counts while score > now - period.
-- Members are "<time>:<seq>", unique even for several permits in one
-- microsecond. TTL: one period after the newest permit.
--
-- Booking ahead (reserve, prepay, admit) adds members scored in the future.
-- The check counts every member not yet expired, future ones included, so
-- a permit admitted at t never makes a window around t hold more than
-- count: the ledger of future admissions is the log itself. newest is the
-- newest member's score, for the TTL and the member's sequence.
local function check_sliding_log(key, count, period, extra, n, reserve, max_wait)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', string.format('%d', now - period))
  local c = redis.call('ZCARD', key)
  local newest = now
  if c > 0 then
    local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
    newest = tonumber(last[2])
  end
  if c + n <= count then
    return true, 0, count - c - n, math.max(newest, now) + period - now, c, newest
  end
  -- The request fits once the (c + n - count) oldest permits have left.
  local k = c + n - count
  local e = redis.call('ZRANGE', key, k - 1, k - 1, 'WITHSCORES')
  local delay = tonumber(e[2]) + period - now
  local reset = newest + period - now
  if reserve and (max_wait < 0 or delay <= max_wait) then
    return true, delay, 0, math.max(reset, delay + period), c, newest
  end
  return false, delay, math.max(0, count - c), reset
end

-- commit adds n members at now + delay; newest is the newest member's
-- score before them. The ticket is "<time>:<seq>" for members
-- <time>:<seq+1..seq+n>.
local function commit_sliding_log(key, count, period, extra, n, delay, c, newest)
  local t = now + delay
  local ts = string.format('%d', t)
  -- Members must not collide with one already at this microsecond (a
  -- refund in between, or a booking made at another moment, can make the
  -- count repeat): if the log reaches t, each candidate is probed, and
  -- the block moves past any member it finds. Only ZSCORE, which every
  -- Redis has and the minimal ACL allows.
  local seq = c
  if newest >= t then
    local i = 1
    while i <= n do
      if redis.call('ZSCORE', key, ts .. ':' .. string.format('%d', seq + i)) then
        seq, i = seq + i, 1
      else
        i = i + 1
      end
    end
  end
  if n == 1 then
    redis.call('ZADD', key, ts, ts .. ':' .. string.format('%d', seq + 1))
  else
    local args = {}
    for i = 1, n do
      args[#args + 1] = ts
      args[#args + 1] = ts .. ':' .. string.format('%d', seq + i)
    end
    redis.call('ZADD', key, unpack(args))
  end
  redis.call('PEXPIRE', key, ttl_ms(math.max(t, newest) + period - now))
  return ts .. ':' .. string.format('%d', seq)
end

-- Refunds and pauses only (prelude.lua: rare).
if rare then

-- ticket: "<time>:<seq>"; the request added members <time>:<seq+1..seq+n>.
refund['sliding_log'] = function(key, count, period, extra, n, ticket)
  local ts, seq = string.match(ticket, '^(%d+):(%d+)$')
  if not ts then return end
  local members = {}
  for i = 1, n do members[#members + 1] = ts .. ':' .. string.format('%d', tonumber(seq) + i) end
  redis.call('ZREM', key, unpack(members))
end

-- settle: while the request's permits are in the log (time t, the
-- ticket's), fewer drops the last n - actual of its members; more adds
-- actual - n members at t, as commit adds them (the log may then hold more
-- than count: a debt that later requests wait for).
settle['sliding_log'] = function(key, count, period, extra, n, actual, ticket)
  local ts, seq = string.match(ticket, '^(%d+):(%d+)$')
  if not ts then return end
  local t = tonumber(ts)
  if t + period <= now then return end
  if actual < n then
    local members = {}
    for i = actual + 1, n do members[#members + 1] = ts .. ':' .. string.format('%d', tonumber(seq) + i) end
    redis.call('ZREM', key, unpack(members))
    return
  end
  local newest = t
  local last = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  if last[2] and tonumber(last[2]) > newest then newest = tonumber(last[2]) end
  commit_sliding_log(key, count, period, extra, actual - n, t - now, redis.call('ZCARD', key), newest)
end

-- pause: count placeholder members "!pause:1" … "!pause:<count>" (never a
-- "<time>:<seq>" member), scored untl - period, so the log is full until
-- untl and they leave at untl exactly; the check's own arithmetic then
-- reports untl or later. Rewriting them only raises their score. Costs
-- count members while paused: prefer sliding_window for large counts.
pause['sliding_log'] = function(key, count, period, extra, untl)
  local score = untl - period
  local cur = redis.call('ZSCORE', key, '!pause:' .. string.format('%d', count))
  if cur and tonumber(cur) >= score then return end
  local args = {}
  for i = 1, count do
    args[#args + 1] = string.format('%d', score)
    args[#args + 1] = '!pause:' .. string.format('%d', i)
    if #args >= 1000 or i == count then
      redis.call('ZADD', key, unpack(args))
      args = {}
    end
  end
  keep_ttl(key, untl - now)
end

end
