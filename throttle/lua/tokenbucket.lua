-- Token bucket. count tokens are added per period, up to extra (burst);
-- a reservation takes its tokens at once, leaving the bucket in debt, and
-- acts when the debt is repaid. The arithmetic, the state, the TTL and the
-- refund ticket are in bucket.lua, shared with GCRA: the token count at
-- time t is burst - (TAT - t) * count / period.
local check_token_bucket, commit_token_bucket = bk_check, bk_commit

-- Refunds and pauses only (prelude.lua: rare).
if rare then
  refund['token_bucket'] = bk_refund
  pause['token_bucket'] = bk_pause
  settle['token_bucket'] = bk_settle
end
