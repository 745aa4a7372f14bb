-- Fixed window. Windows are aligned to multiples of period on the Redis clock.
-- State: hash {w = window index, c = permits counted in that window,
-- pu = end of a pause (see pause below), if any}; TTL: until the end of the
-- window (or of the pause, if later).
--
-- A paused key denies everything before pu and reports the exact admission
-- time: pu if the window holding pu has room for n then, else that
-- window's end.
local function check_fixed_window(key, count, period, extra, n)
  local v = redis.call('HMGET', key, 'w', 'c', 'pu')
  local pu = tonumber(v[3])
  if pu and pu > now then
    local pw = math.floor(pu / period)
    local c = 0
    if tonumber(v[1]) == pw then c = tonumber(v[2]) or 0 end
    local delay, reset = pu - now, pu - now
    if c > 0 then reset = (pw + 1) * period - now end
    if c + n > count then delay = (pw + 1) * period - now end
    return false, delay, 0, reset
  end
  local w = math.floor(now / period)
  local wend = (w + 1) * period
  local c
  if tonumber(v[1]) == w then c = tonumber(v[2]) or 0 end
  if (c or 0) + n <= count then
    return true, 0, count - (c or 0) - n, wend - now, w, c
  end
  return false, wend - now, count - (c or 0), wend - now
end

-- commit counts n more permits in window w, which held c (nil if the key
-- held another window or nothing); the ticket is w. The key's TTL is set
-- when its window starts: the first commit in a window sets it to the
-- window's end, and nothing else shortens it.
local function commit_fixed_window(key, count, period, extra, n, delay, w, c)
  local s = string.format('%d', w)
  redis.call('HSET', key, 'w', s, 'c', string.format('%d', (c or 0) + n))
  if not c then redis.call('PEXPIRE', key, ttl_ms((w + 1) * period - now)) end
  return s
end

-- Refunds and pauses only (prelude.lua: rare).
if rare then

-- ticket: the window index the permits were counted in.
refund['fixed_window'] = function(key, count, period, extra, n, ticket)
  local v = redis.call('HMGET', key, 'w', 'c')
  if v[1] ~= ticket then return end
  local c = (tonumber(v[2]) or 0) - n
  if c < 0 then c = 0 end
  redis.call('HSET', key, 'c', string.format('%d', c))
end

-- pause: a window has no state for later windows, so a pause is a field of
-- its own, pu = untl (Redis time, microseconds), in the same hash, which
-- check honours. TTL: at least until pu.
pause['fixed_window'] = function(key, count, period, extra, untl)
  local pu = tonumber(redis.call('HGET', key, 'pu'))
  if pu and pu >= untl then return end
  redis.call('HSET', key, 'pu', string.format('%d', untl))
  keep_ttl(key, untl - now)
end

end
