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
