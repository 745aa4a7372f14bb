-- The statuses of admit.lua's reply (its first value), named; not a
-- script of its own (throttle/scripts.go puts it before line.lua in
-- admit's). throttle/replies.go decodes them (admitStatuses: what each
-- becomes for the caller), admission/status.go says what each layer above
-- calls them; admit.lua's header says when each is sent. decide.lua's ok
-- (1/0) is not a status: admit.lua turns it into one.
local DENIED, GRANTED, BOOKED, REDEEMED, HELD, QUEUED, IN_LINE = 0, 1, 2, 3, 4, 5, 6
