-- The subject's line, part 2 of 2 (not a script: part of admit's,
-- throttle/scripts.go, after line.lua): booking members' turns (taken by
-- line.lua's take) and serving the line.
--
-- A serving (admit with n = 0 and a horizon) books, from the line's head,
-- each member's turn (as admit's BOOKED books) while the turn is within
-- the horizon, at most 256 a call; with share caps, a share whose cap admits
-- its next member later than the rules would sleeps until then, and the
-- other shares are served meanwhile (a per-tenant limit inside an API
-- key's). When nobody else waits (every share asleep, or no line), a
-- capped caller's turn is booked ahead, for when its cap admits it, if that
-- is within the horizon (take, with at; the rules are buckets); else the
-- caller starts the line, its share asleep.

-- line_open returns the line of an admit (line_base's arguments, line.lua,
-- and ns, the caller's permits per rule if ARGV[2] gives them: per_rule):
-- l with join, stay, serve and direct.
local function line_open(n, nrules, b, rkey, tkey, tol, ns)
  local l, h = line_base(n, nrules, b, rkey, tkey, tol)
  local fmt, qhead, sleep, take = h.fmt, h.qhead, h.sleep, h.take
  -- book records member's turn, taken with delay and tickets tks for
  -- costs (ARGV[2]'s form; a lapse gives them back: rules.lua, lapse_turn).
  local function book(member, delay, tks, costs)
    local slot = now + delay
    redis.call('ZADD', rkey, string.format('%d', slot), member)
    keep_ttl(rkey, delay + tol)
    keep_tickets(tkey, rkey, member, table.concat(tks, '\n') .. '\n' .. string.format('%d', now) .. ' ' .. costs, delay + tol)
    return slot
  end
  -- hand takes member out of the line, books the turn taken for it (ok,
  -- delay, tks; costs as book's) and adds its waiter and slot to reply. A
  -- member that can never be admitted now (the rules changed under it) is
  -- woken with nothing booked: it asks again, and is told why.
  local function hand(reply, member, waiter, ok, delay, tks, costs)
    redis.call('ZREM', l.key, member)
    redis.call('HDEL', l.ekey, member)
    local slot = now
    if ok then slot = book(member, delay, tks, costs) end
    if waiter then
      reply[#reply + 1] = waiter
      reply[#reply + 1] = string.format('%d', slot)
    end
  end
  -- pick returns the member to serve next, its score and level: the
  -- line's head (the first of its highest level), unless the head of a
  -- lower level is promoted (its age bound passed) and was promoted before
  -- the line's head, if that is: then the earliest promoted of those heads.
  -- heads caches each lower level's head ({} if none) for one serving.
  local function pick(heads)
    local top = redis.call('ZRANGE', l.key, 0, 0, 'WITHSCORES')
    if not top[1] then return nil end
    local score = tonumber(top[2])
    if score > 0 then return top[1], score, 0 end -- one level: in order
    local tl = line_level(score)
    local best, bs, bl = top[1], score, tl
    local _, bp = line_entry(redis.call('HGET', l.ekey, top[1]))
    if bp and bp > now then bp = nil end
    for lv = tl - 1, 0, -1 do
      local h = heads[lv]
      if not h then
        local lo, hi = '(' .. fmt(-lv * place_band), '(' .. fmt(-(lv - 1) * place_band)
        if lv == 0 then lo, hi = '(0', '+inf' end
        local r = redis.call('ZRANGEBYSCORE', l.key, lo, hi, 'WITHSCORES', 'LIMIT', 0, 1)
        h = {}
        if r[1] then
          local _, p = line_entry(redis.call('HGET', l.ekey, r[1]))
          h = {member = r[1], score = tonumber(r[2]), promote = p}
        end
        heads[lv] = h
      end
      if h.promote and h.promote <= now and (not bp or h.promote < bp) then
        best, bs, bl, bp = h.member, h.score, lv, h.promote
      end
    end
    return best, bs, bl
  end
  -- serve books the turns of the line's members that fall within the
  -- horizon, in the order pick gives.
  local function serve_plain(reply)
    local next_us = -1
    local heads = {}
    local booked = {} -- the members booked, each {member, delay}
    for _ = 1, 256 do
      local member, score, lv = pick(heads)
      if not member then break end
      local m, _, waiter = line_entry(redis.call('HGET', l.ekey, member))
      local ms, costs = nil, m
      if m then m, ms = per_rule(m) end
      local ok, delay, tks = false, max_us, nil
      if m then ok, delay, tks = take(m, nil, nil, nil, ms) end
      if not ok and m and delay < max_us / 2 then
        next_us = math.max(delay - l.horizon / 2, 0)
        -- With heads serving (l.heads), this member serves the line next,
        -- woken for its own turn.
        l.next_head = {waiter, string.format('%d', now + delay)}
        break
      end
      heads[lv] = nil
      redis.call('HSET', l.fkey, (line_fields(lv, '')), fmt(score + lv * place_band))
      hand(reply, member, waiter, ok, delay, tks, costs)
      if ok then booked[#booked + 1] = {member, delay} end
    end
    if l.heads and l.next_head and booked[1] then
      -- With heads serving, a member booked here serves the line again
      -- when it comes back for its turn (admit.lua: 'last'): the one
      -- whose turn is the latest at least half the horizon before the
      -- next head's (else the first). By then the settles of the members
      -- before it have moved the rules' schedule back, and the head, woken
      -- at the turn it was named for here (and late by its wake-up's
      -- latency), would find the room they gave back passed: a bucket
      -- cannot hold a gap. Half a horizon ahead, as ServeLine's servings
      -- come, absorbs both.
      local by, pick = tonumber(l.next_head[2]) - now - l.horizon / 2, booked[1][1]
      for _, bk in ipairs(booked) do
        if bk[2] <= by then pick = bk[1] end
      end
      redis.call('HSET', l.fkey, 'last', pick)
    end
    return next_us
  end
  -- serve_capped is serve_plain with the shares' caps: the head of the
  -- line is the first member of the awake share (hkey) that came first; a
  -- share whose cap admits its first member later than the rules would
  -- sleeps (skey) until then, and the others are served meanwhile; shares
  -- whose sleep ends by the slot at hand wake first.
  local function serve_capped(reply)
    local next_us = -1
    redis.call('ZREMRANGEBYSCORE', l.ckey, '-inf', fmt(now))
    local function first_asleep()
      local s = redis.call('ZRANGE', l.skey, 0, 0, 'WITHSCORES')
      return tonumber(s[2]) or max_us * 4
    end
    local function wake(upto)
      for _, sh in ipairs(redis.call('ZRANGEBYSCORE', l.skey, '-inf', fmt(upto))) do
        redis.call('ZREM', l.skey, sh)
        local _, _, place = qhead(sh)
        if place then redis.call('ZADD', l.hkey, fmt(place), sh) end
      end
      return first_asleep()
    end
    local asleep = wake(now)
    local v = tonumber(redis.call('HGET', l.fkey, 'v')) or 0
    -- ahead: the share woken ahead of its sleep's end (every share was
    -- asleep) and when it ends, µs from now.
    local ahead, ahead_at
    for _ = 1, 256 do
      local sh = redis.call('ZRANGE', l.hkey, 0, 0)[1]
      if not sh and asleep - now <= l.horizon then
        -- Every share asleep, the first within the horizon: nobody waits
        -- for the rules' turns before its sleep ends, so its turn is
        -- booked ahead, for when its own limit admits it.
        ahead, ahead_at = redis.call('ZRANGE', l.skey, 0, 0)[1], asleep - now
        redis.call('ZREM', l.skey, ahead)
        local _, _, p = qhead(ahead)
        if p then redis.call('ZADD', l.hkey, fmt(p), ahead) end
        asleep = first_asleep()
        sh = p and ahead
      end
      if not sh then break end
      local member, entry, place = qhead(sh)
      local e = member and redis.call('HGET', l.ekey, member)
      local m, _, waiter = line_entry(e)
      local ms, costs = nil, m
      if m then m, ms = per_rule(m) end
      if not member then
        redis.call('ZREM', l.hkey, sh)
      elseif not e then
        -- Left the line another way (served while the caps were off).
        redis.call('ZREM', l.qkey, entry)
        local _, _, p = qhead(sh)
        if p then redis.call('ZADD', l.hkey, fmt(p), sh) else redis.call('ZREM', l.hkey, sh) end
      else
        local ok, delay, tks, first = false, max_us, nil, nil
        local dc
        -- The share woken ahead is the first asleep: nobody goes first.
        local at, by = nil, asleep
        if sh == ahead then at, by, ahead = ahead_at, nil, nil end
        if m then ok, delay, dc, first = take(m, sh, by, at, ms) end
        if ok then tks, dc = dc, nil end
        if not ok and m and delay < max_us / 2 and not dc and not first then
          next_us = math.max(delay - l.horizon / 2, 0)
          break
        end
        if first then
          -- The shares asleep until this slot wake, and may go first.
          asleep = wake(now + delay)
        elseif dc and dc < max_us / 2 then
          sleep(sh, now + dc)
          if now + dc < asleep then asleep = now + dc end
        else
          redis.call('ZREM', l.qkey, entry)
          if place > v then v = place end
          hand(reply, member, waiter, ok, delay, tks, costs)
          local _, _, p = qhead(sh)
          if p then redis.call('ZADD', l.hkey, fmt(p), sh) else redis.call('ZREM', l.hkey, sh) end
        end
      end
    end
    redis.call('HSET', l.fkey, 'v', fmt(v))
    if next_us < 0 and redis.call('EXISTS', l.hkey) == 0 and asleep < max_us * 4 then
      -- Every share asleep past the horizon: served when the first comes
      -- within half of it.
      next_us = math.max(asleep - now - l.horizon / 2, 0)
    end
    return next_us
  end
  -- heads_served keeps, for l.tail, what a serving by a member of the
  -- line (l.heads) did: the members left, the next head's waiter and
  -- when its turn comes (µs of Redis time; its return serves the line),
  -- or '' and when to serve the line if none was found (256 booked), ''
  -- and '' once the line is empty; then the members booked, as a
  -- serving's reply has them.
  local function heads_served(reply, left, next_us)
    local nh = {'', ''}
    if left > 0 then nh = l.next_head or {'', string.format('%d', now + math.max(next_us, 0))} end
    l.served = {left, nh[1], nh[2], unpack(reply, 7 + nrules)}
  end
  -- tail ends reply with the tickets' places ('' where it has none) and
  -- what a serving by the caller did (heads_served), if any.
  function l.tail(reply)
    if not l.served then return reply end
    for i = 7, 6 + nrules do reply[i] = reply[i] or '' end
    for _, v in ipairs(l.served) do reply[#reply + 1] = v end
    return reply
  end
  function l.serve()
    local reply = {DENIED, 1, 0, 0, 0, now}
    for i = 1, nrules do reply[6 + i] = '' end
    redis.call('HSET', l.fkey, 't', string.format('%d', now))
    redis.call('HDEL', l.fkey, 'g')
    local next_us
    if l.ci and (redis.call('EXISTS', l.hkey) == 1 or redis.call('EXISTS', l.skey) == 1) then
      next_us = serve_capped(reply)
    else
      -- Without caps, or members who joined while there were none.
      next_us = serve_plain(reply)
    end
    local left = redis.call('ZCARD', l.key)
    if l.heads then heads_served(reply, left, next_us) end
    if left == 0 then
      redis.call('DEL', l.ekey, l.fkey)
      if l.ci then redis.call('DEL', l.hkey, l.qkey, l.skey) end
    else
      if next_us < 0 then next_us = 0 end
      reply[1], reply[3], reply[4] = BOOKED, left, math.ceil(next_us)
    end
    return reply
  end
  -- direct takes a new turn for a caller with a cap when nobody waits in
  -- line: granted within the caller's wait (its reply ends with the share
  -- ticket, refund.lua), booked within the horizon,
  -- else the caller starts the line, its share asleep if its cap is what
  -- holds it back.
  function l.direct()
    local sh = ARGV[b + 6]
    -- Spent states (a share's time passed) are a fresh share's.
    redis.call('ZREMRANGEBYSCORE', l.ckey, '-inf', fmt(now))
    local ok, delay, x = take(n, sh, nil, nil, ns)
    if not ok then
      if delay >= max_us / 2 or (x and x >= max_us / 2) then
        return {DENIED, 1, 0, math.ceil(math.min(x or delay, max_us)), 0, now}
      end
      if not x then return l.join(delay - l.horizon / 2) end
      -- Its own share's limit holds it back: with nobody in line, its
      -- turn is booked ahead, for when that limit admits it, if within the
      -- horizon; else it starts the line, its share asleep.
      if x > l.horizon then return l.join(x - l.horizon / 2, x) end
      ok, delay, x = take(n, sh, nil, x, ns)
      if not ok then return l.join(math.max(delay, x or 0) - l.horizon / 2, x) end
    end
    local wait = tonumber(ARGV[3])
    if wait >= 0 and delay > wait then
      book(ARGV[b], delay, x, ARGV[2])
      return {BOOKED, 1, 0, delay, 0, now}
    end
    local reply = {GRANTED, 1, 0, delay, 0, now}
    for i = 1, nrules do reply[6 + i] = x[i] end
    -- After the tickets, the share ticket, to give the share's turn back
    -- with the rules' if the caller cancels (refund.lua).
    reply[7 + nrules] = string.format('%d %s %s %s', now + delay,
      fmt(tonumber(redis.call('ZSCORE', l.ckey, sh))), fmt(n * l.ci), sh)
    return reply
  end
  return l
end
