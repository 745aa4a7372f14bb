-- Leaky bucket as GCRA. Emission interval T = period / count; extra = burst,
-- the number of permits that may be admitted at one instant (tolerance
-- burst * T). State: the theoretical arrival time (TAT) as a string.
-- TTL: until TAT, after which the key is equivalent to a missing one.
check['gcra'] = function(key, count, period, burst, n, reserve, max_wait)
  local T = period / count
  local tat = tonumber(redis.call('GET', key)) or now
  if tat < now then tat = now end
  local new_tat = tat + n * T
  local delay = math.ceil(new_tat - burst * T - now)
  if delay < 0 then delay = 0 end
  local ok = delay == 0 or (reserve and (max_wait < 0 or delay <= max_wait))
  if not ok then
    return {ok = false, delay = delay,
      remaining = math.max(0, math.floor((burst * T - (tat - now)) / T + 1e-9)),
      reset = tat - now}
  end
  return {ok = true, delay = delay,
    remaining = math.max(0, math.floor((burst * T - (new_tat - now)) / T + 1e-9)),
    reset = new_tat - now,
    commit = function()
      redis.call('SET', key, num(new_tat), 'PX', ttl_ms(new_tat - now))
      return num(new_tat)
    end}
end

-- ticket: the TAT this reservation left. Later reservations moved TAT
-- further; their share is not given back, only what is still free.
refund['gcra'] = function(key, count, period, burst, n, ticket)
  local tat = tonumber(redis.call('GET', key))
  if not tat then return end
  local restore = n * (period / count) - (tat - tonumber(ticket))
  if restore <= 0 then return end
  tat = tat - restore
  if tat <= now then
    redis.call('DEL', key)
  else
    redis.call('SET', key, num(tat), 'PX', ttl_ms(tat - now))
  end
end

-- pause: TAT moves to untl + (burst - 1) * T, which admits one permit at
-- untl exactly and the next ones at the steady rate (the burst refills from
-- there, as after any full burst). A TAT already later is kept.
pause['gcra'] = function(key, count, period, burst, untl)
  local T = period / count
  local floor = untl + (burst - 1) * T
  local tat = tonumber(redis.call('GET', key))
  if tat and tat >= floor then return end
  redis.call('SET', key, num(floor), 'PX', ttl_ms(floor - now))
end
