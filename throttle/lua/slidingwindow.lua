-- Sliding window counter. extra = precision (bucket width, microseconds).
-- State: hash {bucket start (Redis time, microseconds) -> permits admitted
-- in that bucket}. Fields are start times, not bucket numbers, so that a
-- bucket written under another precision (the rule's period or precision
-- changed while its key lived) still means the same moment.
-- A bucket starting at s counts while any part of it lies inside the window
-- (now - period, now], i.e. until s + precision + period. Counting the
-- partly-covered oldest bucket whole makes the limit hold in every window of
-- length period; the price is a throughput of at worst count per
-- (period + precision). TTL: until the newest bucket stops counting.
--
-- Booking ahead (reserve, prepay, admit) counts permits in a future
-- bucket. The check counts every bucket that has not stopped counting,
-- future ones included, so the ledger of future admissions is the hash
-- itself; a deep backlog costs one field per bucket booked.
local function check_sliding_window(key, count, period, precision, n, reserve, max_wait)
  -- A bucket starting at s stops counting in (s + span - now) µs.
  local span = precision + period
  local flat = redis.call('HGETALL', key)
  -- cur: the bucket a permit admitted now goes in; newest: the newest
  -- bucket holding permits (a booked one may lie ahead of cur).
  local cur = math.floor(now / precision) * precision
  local stale, c, newest = nil, 0, nil
  for i = 1, #flat, 2 do
    local s = tonumber(flat[i])
    if not s or s + span - now <= 0 then
      stale = stale or {}
      stale[#stale + 1] = flat[i]
    else
      local v = tonumber(flat[i + 1])
      if v > 0 then
        c = c + v
        if not newest or s > newest then newest = s end
      end
    end
  end
  if stale then redis.call('HDEL', key, unpack(stale)) end
  local last = math.max(cur, newest or cur)
  if c + n <= count then
    return true, 0, count - c - n, last + span - now, now, last
  end
  -- Denied now: the request fits once the oldest buckets holding
  -- c + n - count permits have left.
  local buckets = {}
  for i = 1, #flat, 2 do
    local s = tonumber(flat[i])
    local v = tonumber(flat[i + 1])
    if s and s + span - now > 0 and v > 0 then buckets[#buckets + 1] = {s, v} end
  end
  table.sort(buckets, function(a, b) return a[1] < b[1] end)
  local need, freed, delay = c + n - count, 0, 0
  for _, b in ipairs(buckets) do
    freed = freed + b[2]
    if freed >= need then delay = b[1] + span - now; break end
  end
  if reserve and (max_wait < 0 or delay <= max_wait) then
    local b = math.floor((now + delay) / precision) * precision
    return true, delay, 0, math.max(newest, b) + span - now, now + delay, newest
  end
  return false, delay, count - c, newest + span - now
end

-- commit counts n more permits in the bucket holding the Redis time at;
-- the ticket is that bucket's start. The TTL covers the newest bucket
-- (newest: the newest holding permits before this one, as check saw).
local function commit_sliding_window(key, count, period, precision, n, delay, at, newest)
  local b = math.floor(at / precision) * precision
  local s = string.format('%d', b)
  redis.call('HINCRBY', key, s, n)
  redis.call('PEXPIRE', key, ttl_ms(math.max(b, newest) + precision + period - now))
  return s
end

-- Refunds and pauses only (prelude.lua: rare).
if rare then

-- ticket: the start of the bucket the permits were counted in.
refund['sliding_window'] = function(key, count, period, precision, n, ticket)
  if redis.call('HEXISTS', key, ticket) == 0 then return end
  if redis.call('HINCRBY', key, ticket, -n) <= 0 then
    redis.call('HDEL', key, ticket)
  end
end

-- settle: the ticket's bucket counts actual instead of n permits, while it
-- still counts (more than count in the window is a debt: nothing more is
-- admitted until enough buckets leave).
settle['sliding_window'] = function(key, count, period, precision, n, actual, ticket)
  local s = tonumber(ticket)
  if not s or s + precision + period - now <= 0 then return end
  if actual < n then
    if redis.call('HEXISTS', key, ticket) == 0 then return end
    if redis.call('HINCRBY', key, ticket, actual - n) <= 0 then
      redis.call('HDEL', key, ticket)
    end
    return
  end
  redis.call('HINCRBY', key, ticket, actual - n)
  keep_ttl(key, s + precision + period - now)
end

-- pause: the bucket j = ceil((untl - period) / precision) - 1 (starting at
-- j * precision), the last one still counting just before untl, is filled
-- to count, so nothing is admitted before untl (and, the bucket's width being the algorithm's
-- grain, nothing before that bucket stops counting, less than one
-- precision after untl). Other buckets keep their permits. j may lie ahead
-- of the current bucket, which the check counts like any other.
pause['sliding_window'] = function(key, count, period, precision, untl)
  local j = math.ceil((untl - period) / precision) - 1
  local f = string.format('%d', j * precision)
  if (tonumber(redis.call('HGET', key, f)) or 0) < count then
    redis.call('HSET', key, f, string.format('%d', count))
  end
  keep_ttl(key, (j + 1) * precision + period - now)
end

end
