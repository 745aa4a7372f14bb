-- Joins calendar's functions to the operations' scripts in a script of that algorithm alone
-- (throttle/scripts.go): decide.lua calls one_check and one_commit, and no
-- table is made for them (prelude.lua: cost per call).
local one_check, one_commit, checks, commits = check_calendar, commit_calendar, nil, nil
