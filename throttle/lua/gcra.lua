-- Leaky bucket as GCRA. Emission interval T = period / count; extra = burst,
-- the number of permits that may be admitted at one instant (tolerance
-- burst * T). State: the theoretical arrival time (TAT) as a string.
-- TTL: until TAT, after which the key is equivalent to a missing one.
local function check_gcra(key, count, period, burst, n, reserve, max_wait)
  local T = period / count
  local tat = tonumber(redis.call('GET', key)) or now
  if tat < now then tat = now end
  local new_tat = tat + n * T
  local delay = math.ceil(new_tat - burst * T - now)
  if delay < 0 then delay = 0 end
  if delay == 0 or (reserve and (max_wait < 0 or delay <= max_wait)) then
    return true, delay, math.max(0, math.floor((burst * T - (new_tat - now)) / T + 1e-9)),
      new_tat - now, new_tat
  end
  return false, delay, math.max(0, math.floor((burst * T - (tat - now)) / T + 1e-9)), tat - now
end

-- commit stores the new TAT, which is also the ticket.
local function commit_gcra(key, count, period, burst, n, delay, new_tat)
  local s = num(new_tat)
  redis.call('SET', key, s, 'PX', ttl_ms(new_tat - now))
  return s
end

-- ticket: the TAT this reservation left, the end of its place in the queue
-- (ticket - n * T, ticket]. The last place gives TAT back to its start, and
-- the cancelled places before it (ckey, prelude.lua) follow. An earlier
-- place is recorded in ckey, unless the later reservations hold less than
-- its n * T: then what they do not hold is given back at once, as
-- golang.org/x/time/rate's Cancel does.
-- Refunds and pauses only (prelude.lua: rare).
if rare then

refund['gcra'] = function(key, count, period, burst, n, ticket, ckey)
  local tat = tonumber(redis.call('GET', key))
  if not tat then
    if ckey then redis.call('DEL', ckey) end
    return
  end
  local T = period / count
  local x = tonumber(ticket)
  -- Places are at least T apart; tickets are exact to about 0.25µs.
  local eps = math.min(T, 1) / 2
  if tat - x > eps then
    -- Within eps, the later places hold all of this one: rounding, not room.
    local restore = n * T - (tat - x)
    if restore > eps then
      tat = tat - restore
    elseif ckey and x > now then
      cancelled_add(ckey, ticket, n, tat)
      return
    else
      return
    end
  else
    tat = x - n * T
    if ckey then
      tat = cancelled_pop(ckey, tat, eps, function(hn) return hn * T end, now)
    end
  end
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

end
