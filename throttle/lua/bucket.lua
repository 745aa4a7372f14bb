-- The token bucket and the leaky bucket (GCRA) in one exact arithmetic.
-- Both are golang.org/x/time/rate's limiter: a bucket of extra (burst)
-- tokens refilled at count tokens per period. Kept as a GCRA: the
-- theoretical arrival time TAT, the moment from which the bucket is full
-- (tokens at t = burst - (TAT - t) / T, with T = period / count). The two
-- algorithms make the same decisions; they keep the same state.
--
-- count and period come reduced to lowest terms by the caller
-- (throttle/limiter.go), so T = period / count exactly. Every time here is an
-- exact rational w + r / count microseconds, w and r integers, 0 <= r <
-- count: no time is ever rounded, whatever count (issue 11: a double holding
-- an absolute time of 1.8e15 µs keeps only a quarter of a microsecond).
-- Times of about 1.8e15 and remainders below count (at most 2^40) are exact
-- in a double; products that could pass 2^53 go through bk_div.
--
-- State: TAT = tw + tr / count and ev = ew + er / count, the time to act
-- of the latest reservation (golang.org/x/time/rate's lastEvent), which
-- Cancel needs, in one string value. TTL: until both have passed; a
-- missing key is a full bucket. The string is, in order of preference:
--   - the integer form, when ev = TAT - T exactly and tr = 0 and
--     tw < 2^52 (until the year 2112): tw alone, in decimal. That is the
--     state after one permit taken from a full bucket (the latest time to
--     act is then the call's, one interval before the TAT), the commonest
--     state of a key by far (many subjects, each seen now and then), and
--     after any reservation under a burst of 1. Redis keeps a string that
--     reads as a 64-bit integer as the integer itself, inside its object
--     header: 16 bytes per key less than any other value (bench/, bytes
--     per key). ev is not stored: it is TAT - T, T being the rule's
--     interval when the state is read (a rule changed since moves it);
--   - the 12-byte form, when both remainders are 0, tw < 2^52 and
--     0 <= d = tw - ew < 2^40 - 1 µs (12.7 days), or ew = 0 (no
--     reservation on record: a pause of a missing key), written as
--     d = 2^40 - 1: big-endian, 0xF0 + tw's top 4 bits, tw's low 48 bits
--     in 6 bytes, d in 5 bytes. Redis keeps it in the smallest allocation
--     beside its object header. The first byte cannot start any decimal
--     form, and a string that is none of these is a full bucket;
--   - "<tw> <ew>" when both remainders are 0;
--   - "<tw> <tr> <ew> <er>".
-- bucket_fast.lua decides the commonest calls on the two short forms
-- inline and writes the same strings as bk_store.
--
-- A reservation's refund ticket is its exact time to act, "<w> <r>"
-- (bucket_fast.lua replies it as an integer, which the caller makes
-- "<w> 0"). The version before this one returned, for an allow decided by
-- bucket_fast.lua, the 12-byte state it wrote, whose time to act is ev
-- (bk_unpack); bk_ticket still reads those, for one release.

-- bk_div returns q, r with a * b = q * m + r, 0 <= r < m, exactly,
-- for integers a, b >= 0 and 1 <= m < 2^52 whose quotient q is below 2^53.
-- Below 2^52 the double product is exact and a division gives q to within
-- one; above, a long multiplication over the bits of a keeps every
-- intermediate below 2^53.
local function bk_div(a, b, m)
  local p = a * b
  if p < 4503599627370496 then
    local q = math.floor(p / m)
    local r = p - q * m
    if r < 0 then return q - 1, r + m end
    if r >= m then return q + 1, r - m end
    return q, r
  end
  local bq, br = bk_div(b, 1, m)
  local q, r, rest, bit = 0, 0, a, 1
  while bit * 2 <= rest do bit = bit * 2 end
  while bit >= 1 do
    q, r = q * 2, r * 2
    if r >= m then q, r = q + 1, r - m end
    if rest >= bit then
      rest = rest - bit
      r = r + br
      if r >= m then q, r = q + 1, r - m end
    end
    bit = bit / 2
  end
  return a * bq + q, r
end

-- bk_unpack reads the compact state (see State above): tw and ew, whole
-- µs; nil if v is not in that form.
local function bk_unpack(v)
  if #v ~= 12 then return nil end
  local c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12 = string.byte(v, 1, 12)
  if c1 < 240 then return nil end
  local tw = ((((((c1 - 240) * 256 + c2) * 256 + c3) * 256 + c4) * 256 + c5) * 256 + c6) * 256 + c7
  local d = (((c8 * 256 + c9) * 256 + c10) * 256 + c11) * 256 + c12
  if d == 1099511627775 then return tw, 0 end
  return tw, tw - d
end

-- bk_load reads the state: TAT and ev. A missing or unreadable key is a
-- full bucket (TAT = now) whose last reservation is long past. A number
-- is the integer form (ev = TAT - T); a fraction, in a GCRA state of the
-- format before issue 11 (TAT as a number), is rounded up to the µs. The
-- token bucket's format before issue 11, "<tokens> <time> <time to act>",
-- is read rounded up too.
local function bk_load(key, count, period, burst)
  local v = redis.call('GET', key)
  if not v then return now, 0, 0, 0 end
  local tw, ew = bk_unpack(v)
  if tw then return tw, 0, ew, 0 end
  local x = tonumber(v)
  if x then
    x = math.ceil(x)
    local q, r = bk_div(1, period, count)
    if r > 0 then return x, 0, x - q - 1, count - r end
    return x, 0, x - q, 0
  end
  local a, c = string.match(v, '^(%d+) (%d+)$')
  if a then return tonumber(a), 0, tonumber(c), 0 end
  local a, b, c, d = string.match(v, '^(%d+) (%d+) (%d+) (%d+)$')
  if a then
    a, b, c, d = tonumber(a), tonumber(b), tonumber(c), tonumber(d)
    -- A remainder of another count (the rule changed): rounded up.
    if b >= count then a, b = a + 1, 0 end
    if d >= count then c, d = c + 1, 0 end
    return a, b, c, d
  end
  local tk, ts, ev = string.match(v, '^(%S+) (%S+) (%S+)$')
  tk, ts, ev = tonumber(tk), tonumber(ts), tonumber(ev)
  if tk and ts and ev then
    return math.ceil(ts + (burst - tk) * period / count), 0, math.ceil(ev), 0
  end
  return now, 0, 0, 0
end

-- check: n tokens are taken from the bucket, which may go into debt for a
-- reservation (its time to act is when the debt is repaid: the new TAT
-- minus burst * T). Remaining and reset are read at the new TAT if the
-- request is admitted, else at the current one. s1, s2 = the new TAT.
local function bk_check(key, count, period, burst, n, reserve, max_wait)
  local tw, tr, ew, er = bk_load(key, count, period, burst)
  -- from: now, or a later not_before (time.lua): the bucket fills until
  -- then, and the turn acts no earlier.
  local from = now
  if not_before > now then from = not_before end
  if tw < from then tw, tr = from, 0 end
  local bq, br = bk_div(burst, period, count)
  local nq, nr = bk_div(n, period, count)
  local aw, ar = tw + nq, tr + nr
  if ar >= count then aw, ar = aw + 1, ar - count end
  -- x = the new TAT - burst * T: the time to act, if later than now
  local xw, xr = aw - bq, ar - br
  if xr < 0 then xw, xr = xw - 1, xr + count end
  if xw < from then xw, xr = from, 0 end
  local delay = 0
  if xw > now or (xw == now and xr > 0) then
    delay = xw - now
    if xr > 0 then delay = delay + 1 end
  end
  local ok = delay == 0 or (reserve and (max_wait < 0 or delay <= max_wait))
  local dw, dr = tw - now, tr
  if ok then dw, dr = aw - now, ar end
  local reset = dw
  if dr > 0 then reset = reset + 1 end
  -- Whole tokens: floor(burst - (TAT - now) / T), 0 in debt, with
  -- (TAT - now) / T = (dw * count + dr) / period.
  local left = 0
  if dw < bq or (dw == bq and dr <= br) then
    local q1, r1 = bk_div(dw, count, period)
    local q2, r2 = bk_div(r1 + dr, 1, period)
    if r2 > 0 then q2 = q2 + 1 end
    left = burst - q1 - q2
  end
  if ok then return true, delay, left, reset, aw, ar end
  return false, delay, left, reset
end

-- bk_store writes the state; the key lives until both TAT and ev passed.
local function bk_store(key, count, period, tw, tr, ew, er)
  local h, hr = tw, tr
  if ew > h or (ew == h and er > hr) then h, hr = ew, er end
  h = h - now
  if hr > 0 then h = h + 1 end
  local v
  local d = tw - ew
  -- ev = TAT - T, T = q + r / count: the integer form.
  local q, r = bk_div(1, period, count)
  local iw, ir = q, 0
  if r > 0 then iw, ir = q + 1, count - r end
  if ew == 0 and er == 0 then d = 1099511627775 elseif d >= 1099511627775 then d = -1 end
  if tr == 0 and tw < 4503599627370496 and tw - ew == iw and er == ir then
    v = string.format('%d', tw)
  elseif tr == 0 and er == 0 and tw < 4503599627370496 and d >= 0 then
    -- The 12-byte form. string.char truncates each argument: (x / 2^k)
    -- % 256 is exact in a double and truncates to byte k.
    v = string.char(240 + tw / 281474976710656, tw / 1099511627776 % 256, tw / 4294967296 % 256,
      tw / 16777216 % 256, tw / 65536 % 256, tw / 256 % 256, tw % 256,
      d / 4294967296, d / 16777216 % 256, d / 65536 % 256, d / 256 % 256, d % 256)
  elseif tr == 0 and er == 0 then
    v = string.format('%d %d', tw, ew)
  else
    v = string.format('%d %d %d %d', tw, tr, ew, er)
  end
  redis.call('SET', key, v, 'PX', ttl_ms(h))
end

-- commit stores the new TAT (aw, ar) and the reservation's time to act
-- (now if it had no delay), which is ev and the ticket.
local function bk_commit(key, count, period, burst, n, delay, aw, ar)
  local ew, er = now, 0
  if delay > 0 then
    local bq, br = bk_div(burst, period, count)
    ew, er = aw - bq, ar - br
    if er < 0 then ew, er = ew - 1, er + count end
    if ew < not_before then ew, er = not_before, 0 end
  end
  bk_store(key, count, period, aw, ar, ew, er)
  return string.format('%d %d', ew, er)
end
