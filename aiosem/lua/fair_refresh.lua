-- Refresh holders and waiters of a fair semaphore.
--
-- KEYS: the twelve of every fair script (see the prelude); RECEIPT is unused.
-- ARGV: the prelude's; the mode is ignored, ARGV[13..] are the identifiers.
-- Returns the prelude's reply; the results, per identifier: the fencing
-- token if it holds a permit (its lease restarts now; this is also how a
-- process claims a permit handed to one of its waiters); QUEUED if it is
-- queued (it is presumed alive for another waiter TTL); REFUSED if it is
-- neither: a lost permit, or a waiter dropped from the queue. Expired
-- permits are reaped before anything else and leases are only updated in
-- place (ZADD XX), so a lost permit is never revived, not even for the
-- duration of this script.
--
-- However many identifiers, this costs a handful of commands: one batch of
-- waiters proving they are alive is one call, whatever its size.
return aiosem_run(function(identifiers, state)
  local tokens = aiosem_each('ZMSCORE', OWNERS, identifiers)
  local queued = aiosem_each('ZMSCORE', WAITERS, identifiers)
  local results, holders, waiters = {}, {}, {}
  for i, identifier in ipairs(identifiers) do
    if tokens[i] then
      holders[#holders + 1] = identifier
      results[i] = tonumber(tokens[i])
    elseif queued[i] then
      waiters[#waiters + 1] = identifier
      results[i] = QUEUED
    else
      results[i] = REFUSED
    end
  end
  aiosem_touch_all(TIMEOUTS, aiosem_seconds(state.now), holders)
  if #waiters > 0 then
    aiosem_touch_all(WAITERS, aiosem_seconds(state.now + state.waiter_ttl), waiters)
    state.waiters_written = true
  end
  return results
end, false)
