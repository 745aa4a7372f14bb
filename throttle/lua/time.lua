-- The first lines of every jobthrottle script (scripts.go): Redis's clock,
-- the only one any decision uses. t is the TIME reply, {seconds,
-- microseconds} as strings; now is it in µs. The strings are turned into
-- numbers by the arithmetic itself: tonumber would parse each twice (Lua
-- 5.1's tonumber checks, then converts), about 1 000 redis-server
-- instructions more per call (bench/, server cost).
local t = redis.call('TIME')
local now = t[1] * 1000000 + t[2]
-- not_before is the earliest Redis time (µs) a new turn may take: 0, or
-- what admit.lua reads (AdmitRequest.NotBefore), or a turn of several
-- rules (rules.lua: meet_at); bucket.lua's check and commit, and the
-- fixed and calendar windows' checks, honour it.
local not_before = 0
