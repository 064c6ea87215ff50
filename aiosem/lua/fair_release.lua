-- Release permits of a fair semaphore, handing each freed permit to the
-- longest-waiting waiter in the same step.
--
-- Keys and arguments: see the prelude. Without a limit (ARGV[3] = ''), as
-- many permits are handed off as this call freed.
-- Mode 'release': results are 1 if the identifier held a live permit, else 0.
-- A call with an id leaves a receipt of what it released, so that the same
-- call tried again -- its first reply was lost with its connection -- answers
-- 1 again for what the first try released, where a new call answers 0.
-- Mode 'cancel' (an acquire given up): as 'release', but a queued identifier
-- leaves the queue, and one the server has not seen yet is refused for a
-- while, so that its acquire, should it arrive after this call, takes
-- nothing.
local function release(identifier, state)
  if redis.call('ZREM', OWNERS, identifier) == 1 then
    redis.call('ZREM', TIMEOUTS, identifier)
    state.freed = state.freed + 1
    state.holders = state.holders - 1
    return 1
  end
  if state.mode == 'cancel' then
    if redis.call('ZREM', QUEUE, identifier) == 1 then
      redis.call('ZREM', WAITERS, identifier)
      state.queued = state.queued - 1
    else
      -- Old tombstones go whenever a new one is written.
      redis.call('ZREMRANGEBYSCORE', CANCELLED, '-inf', aiosem_seconds(state.now))
      redis.call('ZADD', CANCELLED, aiosem_seconds(state.now + TOMBSTONE_SECONDS), identifier)
      redis.call('PEXPIRE', CANCELLED, (TOMBSTONE_SECONDS + 1) * 1000)
    end
  end
  return 0
end

return aiosem_run(function(identifiers, state)
  local earlier = state.call ~= '' and redis.call('GET', RECEIPT)
  local results, receipt = {}, {}
  for i, identifier in ipairs(identifiers) do
    results[i] = release(identifier, state)
    if results[i] == 0 and earlier and string.sub(earlier, i, i) == '1' then
      results[i] = 1
    end
    receipt[i] = results[i]
  end
  local released = table.concat(receipt)
  if state.call ~= '' and string.find(released, '1', 1, true) then
    redis.call('SET', RECEIPT, released, 'PX', math.ceil(state.receipt_seconds * 1000))
  end
  return results
end, false)
