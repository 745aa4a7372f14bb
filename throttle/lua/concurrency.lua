-- Concurrency: at most count holders of a subject at once, each holding a
-- lease of period microseconds that it renews while it runs (lease.lua); a
-- holder that stops renewing (its process died) loses its place when the
-- lease expires.
--
-- State: one sorted set per key.
--   holders  member = the holder's id, score = its lease's expiry (Redis
--            time, µs; > 0)
--   waiters  member = the waiter's id, score = its arrival (Redis time, µs)
--            less cc_offset (< 0), so that the lowest score is the head
--            of a first-come, first-served queue
-- A place that frees (a release, or an expired lease reaped by any call)
-- is handed to the head waiter at once: its id becomes a holder, with a
-- lease, before it even comes back (a claim), so that no newcomer takes the
-- place in between; the call that hands it on returns the waiter's id for
-- its caller to wake it (Options.OnHandoff). A claim whose waiter never
-- comes back expires as any lease does. TTL: two leases, plus one lease
-- per count waiters (each waiter's fallback, see cc.queue).
--
-- The algorithm takes no permits: a request's n charges the policy's rate
-- rules, and a holder takes one place whatever its n. check and commit
-- only let the rate code (decide.lua) pass over the rule; admit.lua
-- asks cc (below) for the place. Defined only for rare operations
-- (prelude.lua): allow and reserve never reach a concurrency rule
-- (throttle/concurrency.go refuses them).
local check_concurrency, commit_concurrency
if rare then

-- cc_offset moves waiters below every holder: arrival times (about 1.8e15
-- µs) less 2^52 are negative and still exact in a double.
local cc_offset = 4503599627370496

function check_concurrency(key, count, period, extra, n, reserve, max_wait)
  return true, 0, max_us, 0
end

function commit_concurrency()
  return ''
end

-- A pause (PauseFor) holds back the policy's rate rules; places are not
-- paused. Refunds never reach the rule: its ticket is ''.
pause['concurrency'] = function() end

cc = {}

-- cc.open reaps expired leases of key, hands free places to the head
-- waiters, and returns the state of the caller's place: c.holding is true
-- if it holds one (a lease, or a claim just handed to it). The caller is
-- id; if it goes on as another id, as (a task requeued as a copy), as
-- takes over id's place, in the queue or among the holders.
function cc.open(key, count, lease, id, as)
  local c = {key = key, count = count, lease = lease, id = as or id, woken = {}}
  if as and as ~= '' and as ~= id then
    local s = redis.call('ZSCORE', key, id)
    if s then
      redis.call('ZREM', key, id)
      redis.call('ZADD', key, s, as)
    end
  end
  redis.call('ZREMRANGEBYSCORE', key, '0', string.format('%d', now))
  cc.handoff(c)
  local s = tonumber(redis.call('ZSCORE', key, id))
  c.holding = s ~= nil and s > 0
  return c
end

-- cc.handoff gives free places to the head waiters, oldest first, and
-- records their ids in c.woken (not c.id: it is the caller, and awake).
function cc.handoff(c)
  local live = redis.call('ZCOUNT', c.key, '0', '+inf')
  while live < c.count do
    local head = redis.call('ZRANGEBYSCORE', c.key, '-inf', '(0', 'LIMIT', 0, 1)[1]
    if not head then break end
    redis.call('ZADD', c.key, string.format('%d', now + c.lease), head)
    if head ~= c.id then c.woken[#c.woken + 1] = head end
    live = live + 1
  end
end

-- cc.free reports whether c.id may hold a place now: it does, or a place
-- is free (cc.open handed the free places to the waiters, so none waits).
function cc.free(c)
  return c.holding or redis.call('ZCOUNT', c.key, '0', '+inf') < c.count
end

-- cc.take gives c.id a place, or renews its lease.
function cc.take(c)
  redis.call('ZADD', c.key, string.format('%d', now + c.lease), c.id)
  c.holding = true
  cc.ttl(c)
end

-- cc.give gives c.id's place (or its place in the queue) up, to the next
-- waiter.
function cc.give(c)
  redis.call('ZREM', c.key, c.id)
  c.holding = false
  cc.handoff(c)
  cc.ttl(c)
end

-- cc.queue puts c.id in the queue of waiters, keeping its place if it has
-- one, and returns its fallback: the microseconds until it should come
-- back if no release wakes it first. The first count waiters come back
-- when the earliest lease expires, the next count one lease later, and so
-- on: if no live holder is left to notice an expiry and hand the place on
-- (see lease.lua), the first waiter to come back does.
function cc.queue(c)
  redis.call('ZADD', c.key, 'NX', string.format('%d', now - cc_offset), c.id)
  local rank = redis.call('ZRANK', c.key, c.id)
  local first = redis.call('ZRANGEBYSCORE', c.key, '0', '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  local d = c.lease
  if first[2] then d = tonumber(first[2]) - now end
  cc.ttl(c)
  return d + c.lease * math.floor(rank / c.count)
end

-- cc.ttl keeps the key for two leases, and one more per count waiters.
function cc.ttl(c)
  local waiting = redis.call('ZCOUNT', c.key, '-inf', '(0')
  redis.call('PEXPIRE', c.key, ttl_ms(c.lease * (2 + math.ceil(waiting / c.count))))
end

-- cc.reply appends what admit.lua's reply carries for a policy with
-- a concurrency rule: the refund tickets ('' where none, for nrules rules)
-- and then the ids woken by this call.
function cc.reply(c, t, nrules)
  for i = #t + 1, 6 + nrules do t[i] = '' end
  t[7 + nrules] = c.woken
  return t
end

end
