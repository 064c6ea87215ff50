-- Release permits of a fair semaphore, handing each freed permit to the
-- longest-waiting waiter in the same step.
--
-- KEYS: the twelve of every fair script (see the prelude); RECEIPT is this
-- call's receipt.
-- ARGV: the prelude's; ARGV[8] is the mode, ARGV[9] the call's id, ARGV[10]
-- how long its receipt is kept, ARGV[13..] the identifiers. Without a limit
-- (ARGV[3] = ''), as many permits are handed off as this call freed.
-- Returns the prelude's reply, with these results per identifier.
-- MODE_RELEASE: results are 1 if the identifier held a live permit, else 0.
-- A call with an id leaves a receipt of what it released, so that the same
-- call tried again -- its first reply was lost with its connection -- answers
-- 1 again for what the first try released, where a new call answers 0.
-- MODE_CANCEL (an acquire given up): as MODE_RELEASE, but a queued identifier
-- leaves the queue, and one the server has not seen yet is refused for a
-- while, so that its acquire, should it arrive after this call, takes
-- nothing.
-- MODE_PASS (a mutex relayed through a run of the caller's waiters, see
-- aiosem_relay_run): the identifiers come in threes, holder, successor
-- ('' for none) and the successor's token, and each three has the results
-- {released, installed, 0}: released as in MODE_RELEASE, and installed the
-- token if the successor, the head of the queue, now holds the permit the
-- holder released (or, the holder's permit gone, one that was free), taken
-- out of the queue; the token too if it held already, now held by that
-- token with its lease restarted; else 0 (a
-- successor no longer queued -- its acquire given up, or presumed dead --
-- and the permit goes to the queue's head). The same three sent again
-- answers the same.
local function release(identifier, state)
  if redis.call('ZREM', OWNERS, identifier) == 1 then
    redis.call('ZREM', TIMEOUTS, identifier)
    aiosem_forget({identifier}, state)
    -- It counted for 1, and for no more of WEIGHT than there is (eviction
    -- may have taken the key).
    local extra = math.min(aiosem_weight(identifier) - 1, state.extra)
    if extra > 0 then
      aiosem_add_weight(-extra, state)
    end
    local weight = 1 + extra
    state.freed = state.freed + weight
    state.holders = state.holders - weight
    return 1
  end
  if state.mode == MODE_CANCEL then
    if redis.call('ZREM', QUEUE, identifier) == 1 then
      redis.call('ZREM', WAITERS, identifier)
      aiosem_forget({identifier}, state)
      state.queued = state.queued - 1
    else
      -- Old tombstones go whenever a new one is written.
      redis.call('ZREMRANGEBYSCORE', CANCELLED, '-inf', aiosem_seconds(state.now))
      redis.call('ZADD', CANCELLED, aiosem_seconds(state.now + TOMBSTONE_SECONDS), identifier)
      redis.call('PEXPIRE', CANCELLED, TOMBSTONE_TTL_MS)
    end
  end
  return 0
end

local function pass(successor, token, released, state)
  if successor == '' then
    return 0
  end
  -- Holding already: installed by this pass sent before, or handed the
  -- permit from the queue's head meanwhile (its holder's lease ran out, or
  -- a raised limit reached it). Its acquire returned with the relayed token
  -- and a whole lease from the pass, so Redis is told the same: a hand-off
  -- to another process's waiter leaves it only a waiter timeout, for a
  -- claim that a waiter relayed to already never sends.
  if redis.call('ZSCORE', OWNERS, successor) then
    aiosem_stamp(successor, token, state.now)
    return tonumber(token)
  end
  -- The successor takes the permit its holder released -- or, the holder's
  -- gone, one that is free -- as the head of the queue, which a run's next
  -- waiter is: it stays queued, in its place, until a pass reaches it. It
  -- must fit under the limit in force, which may have been lowered since
  -- the run was formed; with no limit known, only in a permit released.
  if state.limit then
    if state.holders + aiosem_weight(successor) > state.limit then
      return 0
    end
  elseif released == 0 then
    return 0
  end
  if redis.call('ZRANGE', QUEUE, 0, 0)[1] ~= successor then
    return 0
  end
  redis.call('ZREM', QUEUE, successor)
  redis.call('ZREM', WAITERS, successor)
  state.queued = state.queued - 1
  aiosem_hold(successor, token, state.now, state)
  state.freed = state.freed - released
  return tonumber(token)
end

return aiosem_run(function(identifiers, state)
  local earlier = state.call ~= '' and redis.call('GET', RECEIPT)
  local results, receipt = {}, {}
  local step = state.mode == MODE_PASS and 3 or 1
  for i = 1, #identifiers, step do
    local released = release(identifiers[i], state)
    results[i] = released
    if released == 0 and earlier and string.sub(earlier, i, i) == '1' then
      results[i] = 1
    end
    receipt[i] = results[i]
    if step == 3 then
      -- Only a permit this try released is one to pass on: what an earlier
      -- try released went to the queue then.
      results[i + 1] = pass(identifiers[i + 1], identifiers[i + 2], released, state)
      results[i + 2] = 0
      receipt[i + 1], receipt[i + 2] = 0, 0
    end
  end
  local released = table.concat(receipt)
  if state.call ~= '' and string.find(released, '1', 1, true) then
    redis.call('SET', RECEIPT, released, 'PX', math.ceil(state.receipt_seconds * 1000))
  end
  return results
end, false)
