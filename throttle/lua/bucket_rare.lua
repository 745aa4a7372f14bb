-- The bucket algorithms' refunds, settles and pauses (bucket.lua holds
-- their state, its forms, and check and commit): bk_refund, bk_settle and
-- bk_pause, which tokenbucket.lua and gcra.lua register for the scripts of
-- refund.lua, settle.lua and pause.lua. Defined only for those operations
-- (prelude.lua: rare); built into every script of a bucket algorithm,
-- after bucket.lua (throttle/tokenbucket.go, gcra.go).

-- Refunds, settles and pauses only (prelude.lua: rare).
local bk_refund, bk_pause, bk_settle
if rare then

-- bk_ticket reads a refund ticket: a time to act "<w> <r>", or an allow's
-- ticket from the previous bucket_fast.lua, the 12-byte state it left
-- (time to act ev, bk_unpack); nil if neither.
local function bk_ticket(ticket)
  local xw, xr = string.match(ticket, '^(%d+) (%d+)$')
  if xw then return tonumber(xw), tonumber(xr) end
  local _
  _, xw = bk_unpack(ticket)
  if xw then return xw, 0 end
end

-- settle corrects a reservation of n tokens, whose time to act x is the
-- ticket, to actual tokens. More: TAT moves (actual - n) * T later, from
-- now if the bucket is full: a debt that later requests wait for.
--
-- Fewer: TAT moves back, by (n - actual) * T at most. Why it may not
-- always move that far: every reservation holds a place on the TAT line,
-- of its n * T, that starts at or after its time to act and ends at most
-- burst * T after it; that is what keeps any span within burst + rate.
-- Moving TAT back moves the places of the reservations behind this one
-- back too, so it may move by no more than the least room any of them has
-- between its place's start and its own time to act. Their places start
-- after this one's ends, at e (x + burst * T, or at least x + n * T if it
-- was admitted at once: x = booked, the Redis time of its call), less
-- what settles since its booking moved it back (recorded in skey), and their
-- times to act are at most ev: the room is at least e - ev. The latest
-- reservation (x = ev) gives back exactly; never before now (a full
-- bucket). ev is unchanged.
--
-- skey, a sorted set: each give-back, scored by the time to act of the
-- reservation that gave it, member "<x>:<µs given back>:<now>:<x rest>",
-- kept two burst * T.
function bk_settle(key, count, period, burst, n, actual, ticket, booked, skey)
  local xw, xr = bk_ticket(ticket)
  if not xw then return end
  if actual < n and redis.call('EXISTS', key) == 0 then return end
  local tw, tr, ew, er = bk_load(key, count, period, burst)
  if tw < now then tw, tr = now, 0 end
  if actual > n then
    local dq, dr = bk_div(actual - n, period, count)
    tw, tr = tw + dq, tr + dr
    if tr >= count then tw, tr = tw + 1, tr - count end
  else
    local dq, dr = bk_div(n - actual, period, count)
    local span = burst
    if xw == booked and xr == 0 then span = n end
    local sq, sr = bk_div(span, period, count)
    -- m = e - ev, then less the earlier give-backs
    local mw, mr = xw + sq - ew, xr + sr - er
    if mr < 0 then mw, mr = mw - 1, mr + count elseif mr >= count then mw, mr = mw + 1, mr - count end
    local bq, br = bk_div(burst, period, count)
    if br > 0 then bq = bq + 1 end
    redis.call('ZREMRANGEBYSCORE', skey, '-inf', '(' .. string.format('%d', now - 2 * bq))
    -- (ZRANGE by rank: the record is kept short, and it needs no command
    -- beyond the minimal ACL nor Redis 6.2's BYSCORE.)
    for _, m in ipairs(redis.call('ZRANGE', skey, 0, -1)) do
      local x, g, at = string.match(m, '^(%d+):(%d+):(%d+):')
      x = tonumber(x)
      -- one made before this reservation was booked did not move it
      if x >= xw - bq and x <= xw and tonumber(at) >= booked then mw = mw - tonumber(g) end
    end
    if mw < 0 or (mw == 0 and mr == 0) then return end
    if mw < dq or (mw == dq and mr < dr) then dq, dr = mw, mr end
    tw, tr = tw - dq, tr - dr
    if tr < 0 then tw, tr = tw - 1, tr + count end
    if tw < now then tw, tr = now, 0 end
    local g = dq
    if dr > 0 then g = g + 1 end
    redis.call('ZADD', skey, string.format('%d', xw), string.format('%d:%d:%d:%d', xw, g, now, xr))
    keep_ttl(skey, 2 * bq)
  end
  bk_store(key, count, period, tw, tr, ew, er)
end

-- refund (Reservation.Cancel) as golang.org/x/time/rate's CancelAt: a
-- reservation whose time to act x passed gives nothing back (its tokens
-- are taken to be used); otherwise it gives back n * T less what later
-- reservations took (ev - x), and, if it is the latest (x = ev), ev moves
-- back to its start unless that has passed. undo (a Group rolling back a
-- part) skips the time-to-act test: the caller never acted.
--
-- Beyond x/time/rate: a reservation that gives back nothing because later
-- ones hold its place is recorded in ckey, a sorted set scored by its
-- time to act's whole microseconds, members "<w> <r> <n>"; when ev comes
-- back to it (every later one was cancelled too), it is given back then.
-- So a storm of cancellations in any order returns the whole queue.
function bk_refund(key, count, period, burst, n, ticket, ckey, undo)
  local xw, xr = bk_ticket(ticket)
  if not xw then return end
  if (xw < now and not undo) or redis.call('EXISTS', key) == 0 then return end
  local tw, tr, ew, er = bk_load(key, count, period, burst)
  local nq, nr = bk_div(n, period, count)
  -- restore = n * T - (ev - x)
  local rw, rr = nq + xw - ew, nr + xr - er
  if rr < 0 then rw, rr = rw - 1, rr + count elseif rr >= count then rw, rr = rw + 1, rr - count end
  if rw < 0 or (rw == 0 and rr == 0) then
    if ckey and xw >= now then
      redis.call('ZADD', ckey, string.format('%d', xw), string.format('%d %d %d', xw, xr, n))
      keep_ttl(ckey, xw - now + 1)
    end
    return
  end
  if tw < now then tw, tr = now, 0 end
  tw, tr = tw - rw, tr - rr
  if tr < 0 then tw, tr = tw - 1, tr + count end
  if tw < now then tw, tr = now, 0 end
  if xw == ew and xr == er then
    while true do
      local pw, pr = ew - nq, er - nr
      if pr < 0 then pw, pr = pw - 1, pr + count end
      if pw < now then break end
      ew, er = pw, pr
      if not ckey then break end
      -- A recorded cancellation that ends where ev now is: give it back.
      -- Records past ev can no longer match, records before now are
      -- stale; the candidates are then the top ones (ZREVRANGE in pages:
      -- the least commands, none beyond the documented ACL set).
      redis.call('ZREMRANGEBYSCORE', ckey, '-inf', '(' .. string.format('%d', now))
      redis.call('ZREMRANGEBYSCORE', ckey, '(' .. string.format('%d', ew), '+inf')
      local hit, from = nil, 0
      while not hit do
        local page = redis.call('ZREVRANGE', ckey, from, from + 15)
        for _, m in ipairs(page) do
          local w, r, k = string.match(m, '^(%d+) (%d+) (%d+)$')
          if tonumber(w) ~= ew then page = {} break end
          if tonumber(r) == er then hit, n = m, tonumber(k) break end
        end
        if #page < 16 then break end
        from = from + 16
      end
      if not hit then break end
      redis.call('ZREM', ckey, hit)
      nq, nr = bk_div(n, period, count)
      tw, tr = tw - nq, tr - nr
      if tr < 0 then tw, tr = tw - 1, tr + count end
      if tw < now then tw, tr = now, 0 end
    end
  end
  bk_store(key, count, period, tw, tr, ew, er)
end

-- pause: TAT moves to untl + (burst - 1) * T, so that the bucket holds
-- exactly one token at untl: one permit then, the next ones at the steady
-- rate. A later TAT is kept; ev is unchanged (refund.lua and settle.lua
-- pause again).
function bk_pause(key, count, period, burst, untl)
  local tw, tr, ew, er = bk_load(key, count, period, burst)
  local fq, fr = bk_div(burst - 1, period, count)
  local fw = untl + fq
  if tw > fw or (tw == fw and tr >= fr) then return end
  bk_store(key, count, period, fw, fr, ew, er)
end

end
