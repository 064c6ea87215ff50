-- Grant permits of a fair semaphore, or queue for them.
--
-- Keys and arguments: see the prelude. ARGV[3] (the limit) is required.
-- Mode 'try': grant if a permit is free and nobody is queued, else refuse.
-- Mode 'wait': grant as 'try' does, else join the queue.
-- Results, per identifier: the fencing token if granted; 0 if queued; -1 if
-- refused; -2 if the identifier was cancelled before this call arrived (its
-- tombstone, having served, is removed); -3 if the semaphore is in use with
-- another limit (see LIMIT): nothing is granted or queued then.
-- Queued waiters are served first, so a newcomer never jumps the queue. An
-- identifier that already holds gets its token again and its lease
-- restarted, and one already queued keeps its place: a retried call never
-- takes a second permit or a second place.
local function acquire(identifier, state, mismatch)
  if redis.call('ZREM', CANCELLED, identifier) == 1 then
    return -2
  end
  local stamp = aiosem_seconds(state.now)
  local token = redis.call('ZSCORE', OWNERS, identifier)
  if token then
    redis.call('ZADD', TIMEOUTS, 'XX', stamp, identifier)
    return tonumber(token)
  end
  if redis.call('ZSCORE', QUEUE, identifier) then
    redis.call('ZADD', WAITERS, 'XX', aiosem_seconds(state.now + state.waiter_ttl), identifier)
    state.waiters_written = true
    return 0
  end
  if mismatch then
    return -3
  end
  if state.queued == 0 and state.holders < state.limit then
    token = aiosem_next_token(state.now)
    redis.call('ZADD', OWNERS, token, identifier)
    redis.call('ZADD', TIMEOUTS, stamp, identifier)
    state.holders = state.holders + 1
    return token
  end
  if state.mode ~= 'wait' then
    return -1
  end
  redis.call('ZADD', QUEUE, redis.call('INCR', TICKETS), identifier)
  redis.call('ZADD', WAITERS, aiosem_seconds(state.now + state.waiter_ttl), identifier)
  state.queued = state.queued + 1
  state.waiters_written = true
  return 0
end

return aiosem_run(function(identifiers, state)
  local results = {}
  if #identifiers == 0 then
    return results
  end
  -- Another limit counts only while somebody holds or waits under it.
  local stored = redis.call('GET', LIMIT)
  local mismatch = stored and tonumber(stored) ~= state.limit and (state.holders > 0 or state.queued > 0)
  for i, identifier in ipairs(identifiers) do
    results[i] = acquire(identifier, state, mismatch)
  end
  if not mismatch and stored ~= tostring(state.limit) then
    redis.call('SET', LIMIT, state.limit)
  end
  return results
end, true)
