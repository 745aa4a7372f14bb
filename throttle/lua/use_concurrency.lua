-- Joins concurrency's functions to the operations' scripts in a script of that algorithm
-- alone (throttle/scripts.go); admit.lua asks cc for the place.
local one_check, one_commit, checks, commits = check_concurrency, commit_concurrency, nil, nil
