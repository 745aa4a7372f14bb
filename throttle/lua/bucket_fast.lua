-- The commonest call of a token bucket or GCRA limiter, as a script of its
-- own (after time.lua): an allow or reserve under one rule whose interval
-- is a whole number of µs (count 1 in lowest terms, so T = period) and
-- whose burst lasts under 2^40 - 1 µs (12.7 days). scripts.go routes exactly
-- those calls here (fastRule, fastScript).
--
-- KEYS[1] -> the rule's key (bucket.lua's state)
-- ARGV[1] -> op: 'allow', 'reserve', or 'a': an allow answered in one
--            integer (below)
-- ARGV[2] -> n, the permits asked for
-- ARGV[3] -> T, the rule's interval (its period, count being 1), µs
-- ARGV[4] -> burst
-- ARGV[5] -> a reserve's max wait, µs; -1 for none (an allow sends none)
-- (allow.lua's ARGV less the algorithm, the count and the ticket, and an
-- allow's unused max wait: each argument costs Redis an object and a Lua
-- string per call.) The reply is allow.lua's but for the ticket (below),
-- or, to op 'a', one integer.
--
-- Its decisions, state, TTL and reply are those the general script
-- (bk_check, bk_commit and bk_store in bucket.lua, decide.lua and allow.lua) gives
-- the same call, to the µs. Only the work is less, in redis-server
-- instructions per call (bench/, server cost):
--   - it is small: Redis's Lua collector walks every loaded script's code
--     about every 50 calls, so a smaller script costs less on every call;
--   - no function is defined: each function a script body defines is a
--     new closure on every call (prelude.lua, "Cost per call");
--   - only the ARGV values it needs become numbers, by arithmetic
--     (time.lua); n = 1 and an unbounded max_wait are compared as strings;
--   - the state is written in bucket.lua's integer form by one
--     string.format, or in its 12-byte form by string.char, the TTL's
--     digits by string.char too when it is under 100 ms;
--   - the refund ticket is the time to act as an integer reply, not the
--     general script's "<w> <r>" string: the caller (policy.go, reply.tickets)
--     makes it "<w> 0" only when it keeps the ticket, which Allow does not.
-- A state in any other form (a decimal "<TAT> <ev>", or one that does not
-- fit the short forms) is handed back: the reply is an empty array, and
-- the caller (run.go) sends the same call, in allow.lua's form, to the
-- general script. Nothing has been written then.
local A = ARGV
local n = A[2]
if n == '1' then n = 1 else n = n + 0 end
local T = A[3] + 0
local B = A[4] * T -- burst * T, the bucket's depth in µs
local call = redis.call
local key = KEYS[1]
local v = call('GET', key)
-- tw: the TAT, or now if it has passed (a missing key is a full bucket).
local tw = now
if v then
  if #v == 12 then -- the 12-byte form
    local c1, c2, c3, c4, c5, c6, c7 = string.byte(v, 1, 7)
    if c1 < 240 then return {} end
    tw = ((((((c1 - 240) * 256 + c2) * 256 + c3) * 256 + c4) * 256 + c5) * 256 + c6) * 256 + c7
  else -- the integer form: the TAT itself (a whole number)
    tw = tonumber(v)
    if not tw or tw % 1 ~= 0 then return {} end
  end
  if tw < now then tw = now end
end
local aw = tw + n * T -- the TAT after this request
local x = aw - B      -- its time to act
local delay = 0
local ok = true
if x > now then
  delay = x - now
  local max_wait = A[5]
  ok = A[1] == 'reserve' and (max_wait == '-1' or delay <= max_wait + 0)
end
-- remaining and reset are read at the new TAT if admitted, else at the
-- current one: whole tokens, burst - ceil((TAT - now) / T), 0 in debt.
local dw = aw - now
if not ok then dw = tw - now end
-- An allow whose caller keeps only its Result (op 'a') is answered with
-- one integer, dw if admitted, -1 - dw if not: remaining and the delay
-- follow from dw, n, T and the burst (compactResult, replies.go), and the
-- array cost a seventh of the server's instructions per call and five of
-- the client's allocations (BENCHMARKS.md, 2026-11-28).
local answer = A[1] == 'a'
local left
if not answer then
  left = B - dw
  if left < 0 then left = 0 else left = (left - left % T) / T end
end
if not ok or n == 0 then
  if answer then
    if ok then return dw end
    return -1 - dw
  end
  local r = 1
  if not ok then r = 0 end
  return {r, 1, left, delay, dw, now}
end
if aw >= 4503599627370496 then return {} end -- past 2^52 µs: no short form
-- TTL: until aw (ev is not later): ceil(dw / 1000) ms, at least 1 as
-- dw >= T >= 1. m's whole part is that; string.char and '%d' take the
-- whole part of a number.
local m = (dw + 999) / 1000
local ttl
local char = string.char
if m < 10 then
  ttl = char(48 + m)
elseif m < 100 then
  ttl = char(48 + m / 10, 48 + m % 10)
else
  ttl = string.format('%d', m - m % 1)
end
-- The state: aw and d = aw - ev, where ev, the time to act, is now or x.
-- d = T (one permit taken from a full bucket, or any reservation under a
-- burst of 1) is the integer form: aw alone, in decimal, which Redis
-- keeps as an integer. ('%d' costs a third of what a number given to
-- redis.call does: Redis prints that with '%.17g'.) Otherwise the 12-byte
-- form; string.char truncates each argument: (aw / 2^k) % 256 is exact in
-- a double and truncates to byte k (the bytes of bk_store).
local d = dw
if delay > 0 then d = B end
if d == T then
  call('SET', key, string.format('%d', aw), 'PX', ttl)
else
  call('SET', key, char(240 + aw / 281474976710656, aw / 1099511627776 % 256, aw / 4294967296 % 256,
    aw / 16777216 % 256, aw / 65536 % 256, aw / 256 % 256, aw % 256,
    d / 4294967296, d / 16777216 % 256, d / 65536 % 256, d / 256 % 256, d % 256), 'PX', ttl)
end
if answer then return dw end
return {1, 1, left, delay, dw, now, now + delay}
