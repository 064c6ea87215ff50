-- Grant permits of a fair semaphore, or queue for them.
--
-- KEYS: the ten of every fair script (see the prelude): TIMEOUTS, OWNERS,
-- COUNTER, QUEUE, WAITERS, CANCELLED, TICKETS, LIMIT, HOLDERS, RECEIPT
-- (unused here).
-- ARGV: the prelude's; ARGV[3] (the limit) is required, ARGV[8] is the mode,
-- ARGV[12] the record of the identifiers it queues or grants, ARGV[13..] the
-- identifiers.
-- MODE_TRY: grant if a permit is free and nobody is queued, else refuse.
-- MODE_WAIT: grant as MODE_TRY does, else join the queue.
-- MODE_COUNT (no identifiers): only reap and hand off, for the header.
-- Returns the prelude's reply; the results, per identifier: the fencing
-- token if granted; QUEUED if queued; REFUSED if refused; TOMBSTONED if the
-- identifier was cancelled before this call arrived (its tombstone, having
-- served, is removed); LIMIT_MISMATCH if the semaphore is in use with
-- another limit (see LIMIT): nothing is granted or queued then.
-- Queued waiters are served first, so a newcomer never jumps the queue. An
-- identifier that already holds gets its token again and its lease
-- restarted, and one already queued keeps its place: a retried call never
-- takes a second permit or a second place.
local function acquire(identifier, state, mismatch)
  if redis.call('ZREM', CANCELLED, identifier) == 1 then
    return TOMBSTONED
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
    return QUEUED
  end
  if mismatch then
    return LIMIT_MISMATCH
  end
  if state.queued == 0 and state.holders < state.limit then
    token = aiosem_next_token(state.now)
    redis.call('ZADD', OWNERS, token, identifier)
    redis.call('ZADD', TIMEOUTS, stamp, identifier)
    aiosem_enter(identifier, state)
    state.holders = state.holders + 1
    return token
  end
  if state.mode ~= MODE_WAIT then
    return REFUSED
  end
  redis.call('ZADD', QUEUE, redis.call('INCR', TICKETS), identifier)
  redis.call('ZADD', WAITERS, aiosem_seconds(state.now + state.waiter_ttl), identifier)
  aiosem_enter(identifier, state)
  state.queued = state.queued + 1
  state.waiters_written = true
  return QUEUED
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
