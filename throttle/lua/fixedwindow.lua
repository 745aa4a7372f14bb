-- Fixed window. Windows are aligned to multiples of period on the Redis clock.
-- State: hash {w = window index, c = permits counted in that window};
-- TTL: until the end of the window.
check['fixed_window'] = function(key, count, period, extra, n)
  local w = math.floor(now / period)
  local wend = (w + 1) * period
  local v = redis.call('HMGET', key, 'w', 'c')
  local c = 0
  if tonumber(v[1]) == w then c = tonumber(v[2]) or 0 end
  if c + n <= count then
    return {ok = true, delay = 0, remaining = count - c - n, reset = wend - now,
      commit = function()
        redis.call('HSET', key, 'w', int(w), 'c', int(c + n))
        redis.call('PEXPIRE', key, ttl_ms(wend - now))
        return int(w)
      end}
  end
  return {ok = false, delay = wend - now, remaining = count - c, reset = wend - now}
end

-- ticket: the window index the permits were counted in.
refund['fixed_window'] = function(key, count, period, extra, n, ticket)
  local v = redis.call('HMGET', key, 'w', 'c')
  if v[1] ~= ticket then return end
  local c = (tonumber(v[2]) or 0) - n
  if c < 0 then c = 0 end
  redis.call('HSET', key, 'c', int(c))
end

-- pause: a window has no state for later windows, so a pause is a field of
-- its own, pu = untl (Redis time, microseconds), in the same hash; the check
-- below, wrapped around the one above, denies everything before pu and
-- reports the exact admission time: pu if the window holding pu has room
-- for n then, else that window's end. TTL: at least until pu.
pause['fixed_window'] = function(key, count, period, extra, untl)
  local pu = tonumber(redis.call('HGET', key, 'pu'))
  if pu and pu >= untl then return end
  redis.call('HSET', key, 'pu', int(untl))
  keep_ttl(key, untl - now)
end

local fw_check = check['fixed_window']
check['fixed_window'] = function(key, count, period, extra, n)
  local v = redis.call('HMGET', key, 'w', 'c', 'pu')
  local pu = tonumber(v[3])
  if not pu or pu <= now then return fw_check(key, count, period, extra, n) end
  local w = math.floor(now / period)
  local pw = math.floor(pu / period)
  local c = 0
  if tonumber(v[1]) == pw then c = tonumber(v[2]) or 0 end
  local delay, reset = pu - now, pu - now
  if c > 0 then reset = (pw + 1) * period - now end
  if c + n > count then delay = (pw + 1) * period - now end
  return {ok = false, delay = delay, remaining = 0, reset = reset}
end
