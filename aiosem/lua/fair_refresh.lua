-- Refresh holders and waiters of a fair semaphore.
--
-- Keys and arguments: see the prelude; the mode is ignored.
-- Results, per identifier: the fencing token if it holds a permit (its
-- lease restarts now; this is also how a process claims a permit handed to
-- one of its waiters); 0 if it is queued (it is presumed alive for another
-- waiter TTL); -1 if it is neither: a lost permit, or a waiter dropped from
-- the queue. Expired permits are reaped before anything else and leases are
-- only updated in place (ZADD XX), so a lost permit is never revived, not
-- even for the duration of this script.
return aiosem_run(function(identifier, state)
  local token = redis.call('ZSCORE', OWNERS, identifier)
  if token then
    redis.call('ZADD', TIMEOUTS, 'XX', aiosem_seconds(state.now), identifier)
    return tonumber(token)
  end
  if redis.call('ZSCORE', WAITERS, identifier) then
    redis.call('ZADD', WAITERS, aiosem_seconds(state.now + state.waiter_ttl), identifier)
    return 0
  end
  return -1
end, false)
