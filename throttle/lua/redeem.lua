-- Redeems a receipt that the driver's 'prepay' operation recorded: the
-- permits were charged when the receipt was made, so the caller acts
-- without charging them again. A receipt is redeemed once.
--
-- KEYS[1] -> the subject's receipt set: <prefix>{<subject>}:!receipts
-- ARGV[1] -> the receipt: its id and the limiter's rule names
--
-- Returns -1 if the receipt is unknown: never recorded for these rules,
-- already redeemed, or expired. Otherwise removes it and returns the
-- microseconds until its slot (0 if the slot has come).
local slot = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not slot then return -1 end
redis.call('ZREM', KEYS[1], ARGV[1])
local d = tonumber(slot) - now
if d < 0 then d = 0 end
return d
