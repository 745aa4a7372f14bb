-- Joins concurrency's functions to driver.lua in a script of that algorithm
-- alone (throttle/scripts.go); driver.lua's admit asks cc for the place.
local one_check, one_commit, checks, commits = check_concurrency, commit_concurrency, nil, nil
