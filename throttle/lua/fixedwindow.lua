-- Fixed window. Windows are aligned to multiples of period on the Redis clock.
-- State: hash {w = the latest window holding permits, c = permits counted in
-- it, pu = end of a pause (see pause below), if any}; TTL: until the end of
-- window w (or of the pause, if later).
--
-- Booking ahead (reserve, prepay, admit): a request that does not fit is
-- counted in a later window, and w moves there. Permits only ever go into
-- window w or the one after it, so every window before w is full (or past)
-- and the hash never needs more than the latest window: the ledger of
-- future admissions is one counter, whatever the backlog. A request is
-- admitted no earlier than the start of its window, and no earlier than a
-- pause's end.
local function check_fixed_window(key, count, period, extra, n, reserve, max_wait)
  local v = redis.call('HMGET', key, 'w', 'c', 'pu')
  local from = now
  local pu = tonumber(v[3])
  if pu and pu > now then from = pu end
  if not_before > from then from = not_before end -- (rules.lua: meet_at)
  local w0 = math.floor(from / period)
  local w, c = tonumber(v[1]), tonumber(v[2])
  if not w or w < w0 or not c then w, c = w0, nil end
  -- the window this request would go in, and the count it holds
  local at, held = w, c or 0
  if held + n > count then at, held = w + 1, 0 end
  local slot = at * period
  if slot < from then slot = from end
  local delay = slot - now
  local ok = delay == 0 or (reserve and (max_wait < 0 or delay <= max_wait))
  -- reset: the end of the latest window holding permits (or of the pause)
  local last = w
  if ok then last = at end
  local reset = (last + 1) * period - now
  if pu and pu > now + reset then reset = pu - now end
  if ok then
    local remaining = 0
    if delay == 0 then remaining = count - held - n end
    if at ~= w then c = nil end
    return true, delay, remaining, reset, at, c
  end
  local remaining = 0
  if from == now and w == w0 then remaining = count - (c or 0) end
  return false, delay, remaining, reset
end

-- commit counts n more permits in window w, which held c (nil if the key
-- held an earlier window or nothing); the ticket is w. The key's TTL is set
-- when its window starts to hold permits, to the window's end (which is
-- after any pause: a window is never charged before a pause ends);
-- nothing else shortens it.
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

-- settle: the ticket's window, if it is still the one held, counts actual
-- instead of n permits (more than count is a debt: the window admits
-- nothing more). Once the ticket's window has ended there is nothing to
-- correct: a fixed window forgets its past. If a later window is already
-- booked (w > ticket), more permits are counted there; fewer cannot be
-- given back, since the ticket's window is no longer held.
settle['fixed_window'] = function(key, count, period, extra, n, actual, ticket)
  local v = redis.call('HMGET', key, 'w', 'c')
  local w, t = tonumber(v[1]), tonumber(ticket)
  if not w or not t then return end
  if w == t then
    local c = (tonumber(v[2]) or 0) + actual - n
    if c < 0 then c = 0 end
    redis.call('HSET', key, 'c', string.format('%d', c))
  elseif w > t and actual > n then
    redis.call('HINCRBY', key, 'c', actual - n)
  end
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
