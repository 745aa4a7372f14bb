-- Joins every algorithm's functions to the operations' scripts in the script for
-- policies that mix algorithms (throttle/scripts.go): decide.lua looks
-- them up by each rule's algorithm name.
local one_check, one_commit = nil, nil
local checks = {
  fixed_window = check_fixed_window, sliding_log = check_sliding_log, sliding_window = check_sliding_window,
  token_bucket = check_token_bucket, gcra = check_gcra, concurrency = check_concurrency,
  calendar = check_calendar,
}
local commits = {
  fixed_window = commit_fixed_window, sliding_log = commit_sliding_log, sliding_window = commit_sliding_window,
  token_bucket = commit_token_bucket, gcra = commit_gcra, concurrency = commit_concurrency,
  calendar = commit_calendar,
}
