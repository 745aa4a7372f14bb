-- Calendar window: a fixed window whose boundaries are midnights on a
-- time zone's calendar (throttle/calendar.go). Lua cannot compute those
-- (time zones, daylight saving), so the caller sends them, computed in Go
-- around its estimate of Redis TIME, as the rule's values (rules.lua):
--   period -> the length of the window around the estimate, µs
--   extra  -> that window's end, µs of Redis time (so it starts at extra - period)
--   ticket -> the next window's end, µs of Redis time (deciding operations
--             only; refunds and settles carry their ticket there)
-- and Redis TIME picks among them: a call that crosses midnight counts in
-- the window after it. If now is in neither window (the caller's estimate
-- was wrong: a clock step), check answers "not now, no delay" and charges
-- nothing, and the caller asks again with windows around the reply's now.
-- State: the fixed window's hash (fixedwindow.lua), w = the start of the
-- latest window holding permits, c = its count, pu = a pause's end, and
-- e = that window's end; TTL: until e (or the pause's end, if later). So
-- the fixed window's refund, settle and pause serve it (given the window
-- of a ticket, which also carries the permits: commit below).
--
-- Booking ahead: a request that does not fit goes into the next window if
-- the caller sent it; a later one is not known, and the request is denied
-- with the delay until the window it does not fit in ends.

-- calendar_windows returns the windows a calendar rule's values describe:
-- the start and end of the first, and the end of the next (nil if the
-- call carries none). The rule's ticket value is found by its key: rule i
-- has KEYS[i] and its ticket at ARGV[8 + 5 * (i - 1)] in every policy
-- script (rules.lua).
local function calendar_windows(key, period, extra)
  for i = 1, #KEYS do
    if KEYS[i] == key then return extra - period, extra, tonumber(ARGV[8 + 5 * (i - 1)]) end
  end
end

local function check_calendar(key, count, period, extra, n, reserve, max_wait)
  local b0, b1, b2 = calendar_windows(key, period, extra)
  if not b2 or now < b0 or now >= b2 then return false, 0, 0, 0 end
  local v = redis.call('HMGET', key, 'w', 'c', 'pu', 'e')
  local from = now
  local pu = tonumber(v[3])
  if pu and pu > now then from = pu end
  if not_before > from then from = not_before end -- (rules.lua: meet_at)
  if from >= b2 then return false, from - now, 0, from - now end
  -- cs, ce: the window holding from; w, c, e: the latest window holding
  -- permits if it is that one or a later one, else that one, empty.
  local cs, ce = b0, b1
  if from >= b1 then cs, ce = b1, b2 end
  local w, c, e = tonumber(v[1]), tonumber(v[2]), tonumber(v[4])
  if not w or w < cs or not c or not e then w, c, e = cs, nil, ce end
  local remaining = 0
  if from == now and w == cs then remaining = count - (c or 0) end
  -- the window this request would go in, and the count it holds
  local at, held, at_end = w, c or 0, e
  if held + n > count then
    if at_end ~= b1 then return false, at_end - now, remaining, at_end - now end
    at, held, at_end = b1, 0, b2
  end
  local slot = at
  if slot < from then slot = from end
  local delay = slot - now
  local ok = delay == 0 or (reserve and (max_wait < 0 or delay <= max_wait))
  local last = e
  if ok then last = at_end end
  local reset = last - now
  if pu and pu > now + reset then reset = pu - now end
  if not ok then return false, delay, remaining, reset end
  remaining = 0
  if delay == 0 then remaining = count - held - n end
  if at ~= w then c = nil end
  return true, delay, remaining, reset, at, c
end

-- commit counts n more permits in the window starting at w, which held c
-- (nil if the key held an earlier window or nothing: the window starts
-- here, with its end and TTL); the ticket is 'w n', the window and the
-- permits, so that a turn that lapses gives them back by itself (lapse).
local function commit_calendar(key, count, period, extra, n, delay, w, c)
  local s = string.format('%d', w)
  local tk = s .. ' ' .. string.format('%d', n)
  if c then
    redis.call('HSET', key, 'c', string.format('%d', c + n))
    return tk
  end
  local _, b1, b2 = calendar_windows(key, period, extra)
  local e = b1
  if w >= b1 then e = b2 end
  redis.call('HSET', key, 'w', s, 'c', string.format('%d', n), 'e', string.format('%d', e))
  redis.call('PEXPIRE', key, ttl_ms(e - now))
  return tk
end

if rare then
  -- The fixed window's refund and settle, given the ticket's window (a
  -- ticket written before tickets carried the permits is the window alone).
  local fw_refund, fw_settle = refund['fixed_window'], settle['fixed_window']
  local function window_of(ticket) return string.match(ticket, '^%S*') end
  refund['calendar'] = function(key, count, period, extra, n, ticket, ...)
    fw_refund(key, count, period, extra, n, window_of(ticket), ...)
  end
  settle['calendar'] = function(key, count, period, extra, n, actual, ticket, ...)
    fw_settle(key, count, period, extra, n, actual, window_of(ticket), ...)
  end
  pause['calendar'] = pause['fixed_window']
  -- A turn that lapsed (never redeemed, rules.lua: lapse_turn) gives its
  -- permits back to its window if that is still the one held: a quota's
  -- unit is capacity, which would otherwise be lost until the window ends.
  -- Once the window has ended there is nothing to give back.
  lapse['calendar'] = function(key, count, period, extra, ticket)
    local w, n = string.match(ticket, '^(%S+) (%d+)$')
    if n then fw_refund(key, count, period, extra, tonumber(n), w) end
  end
end
