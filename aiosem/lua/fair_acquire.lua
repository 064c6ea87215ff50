-- Grant permits of a fair semaphore, or queue for them.
--
-- KEYS: the twelve of every fair script (see the prelude): TIMEOUTS, OWNERS,
-- COUNTER, QUEUE, WAITERS, CANCELLED, TICKETS, LIMIT, HOLDERS, WEIGHT, ARRIVING,
-- RECEIPT (unused here).
-- ARGV: the prelude's; ARGV[3] is the caller's limit ('': the stored one),
-- ARGV[8] the mode, ARGV[12] the record of the identifiers it queues or
-- grants, ARGV[13..] the identifiers.
-- MODE_TRY: grant if the identifier's weight is free and nobody who could be
-- served is queued, else refuse.
-- MODE_WAIT: grant as MODE_TRY does, else join the queue.
-- MODE_COUNT (no identifiers): only reap and hand off, for the header.
-- MODE_LIMIT: the "identifiers" are limits, set in order: each is in force
-- for every caller from then on, whatever limit it brings, until one that
-- is '' clears it: the limit set is then as if its users had brought it,
-- in force while anybody holds or waits, and the next caller's once idle.
-- Raising the limit hands the new permits to the queue in the same step;
-- lowering it takes nothing back, and no permit is granted until fewer
-- than the new limit are held. Each result is the limit stored before it,
-- set or brought (0: none).
-- Returns the prelude's reply; the results, per identifier: the fencing
-- token if granted; QUEUED if queued; REFUSED if refused; TOMBSTONED if the
-- identifier was cancelled before this call arrived (its tombstone, having
-- served, is removed); LIMIT_MISMATCH if the semaphore is in use with
-- another limit, which the caller brought (see LIMIT); NO_LIMIT if the
-- caller brought none and none is stored; TOO_HEAVY if the identifier weighs
-- more than the limit in force: nothing is granted or queued then.
-- A permit is granted straight away if its weight fits in what the holders
-- leave of the limit, and nobody who could be served is queued (a waiter
-- heavier than the limit in force cannot).
-- Queued waiters are served first, so a newcomer never jumps the queue. An
-- identifier that already holds gets its token again and its lease
-- restarted, and one already queued keeps its place: a retried call never
-- takes a second permit or a second place.
-- `found` holds what the step read of the identifier before deciding any:
-- its tombstone, its token and its place in the queue (false: none).
-- Waiters that join the queue are noted in `joining`, in order, and written
-- together by join_queue once the step's identifiers are all decided.
local function acquire(identifier, found, state, refusal, joining)
  if found.tombstone then
    return TOMBSTONED
  end
  local token = found.token
  if token then
    redis.call('ZADD', TIMEOUTS, 'XX', aiosem_seconds(state.now), identifier)
    return tonumber(token)
  end
  if found.place then
    redis.call('ZADD', WAITERS, 'XX', aiosem_seconds(state.now + state.waiter_ttl), identifier)
    state.waiters_written = true
    return QUEUED
  end
  if refusal then
    return refusal
  end
  local weight = aiosem_weight(identifier)
  if weight > state.limit then
    return TOO_HEAVY
  end
  if not state.served_first and state.holders + weight <= state.limit then
    token = aiosem_next_tokens(state.now, 1)
    aiosem_hold(identifier, token, state.now, state)
    aiosem_enter_all({identifier}, state)
    return token
  end
  if state.mode ~= MODE_WAIT then
    return REFUSED
  end
  joining[#joining + 1] = identifier
  state.queued = state.queued + 1
  state.served_first = true
  state.waiters_written = true
  return QUEUED
end

-- Queue the waiters `joining` noted, in order: their tickets drawn at once,
-- and each key written by one command, however many joined.
local function join_queue(joining, state)
  local count = #joining
  if count == 0 then
    return
  end
  -- As INCR would, count times (and in the rights every user already has): KEEPTTL keeps the TTL.
  local first = tonumber(redis.call('GET', TICKETS) or 0) + 1
  redis.call('SET', TICKETS, string.format('%d', first + count - 1), 'KEEPTTL')
  local alive_until = aiosem_seconds(state.now + state.waiter_ttl)
  local tickets, deadlines = {}, {}
  for i, identifier in ipairs(joining) do
    tickets[#tickets + 1] = first + i - 1
    tickets[#tickets + 1] = identifier
    deadlines[#deadlines + 1] = alive_until
    deadlines[#deadlines + 1] = identifier
  end
  -- state.queued counts them already.
  aiosem_add_all({QUEUE, WAITERS}, state.queued - count, {tickets, deadlines})
  aiosem_enter_all(joining, state)
end

local function set_limit(value, state)
  local before = state.stored or 0
  if value == '' then
    if state.set then
      redis.call('SET', LIMIT, state.stored)
      state.set = false
    end
  else
    state.stored, state.set, state.limit = tonumber(value), true, tonumber(value)
    redis.call('SET', LIMIT, '=' .. value)
  end
  state.limit_changed = true
  return before
end

return aiosem_run(function(identifiers, state)
  local results = {}
  if #identifiers == 0 then
    return results
  end
  if state.mode == MODE_LIMIT then
    for i, value in ipairs(identifiers) do
      results[i] = set_limit(value, state)
    end
    return results
  end
  -- A limit brought by another caller counts only while somebody holds or
  -- waits under it; a limit set counts for everybody.
  local refusal
  if not state.limit then
    refusal = NO_LIMIT
  elseif state.caller_limit and not state.set and state.stored and state.stored ~= state.caller_limit
      and (state.holders > 0 or state.queued > 0) then
    refusal = LIMIT_MISMATCH
  end
  if not refusal and not state.set and state.caller_limit then
    -- The caller's limit is in force: the stored one, or none yet.
    state.limit = state.caller_limit
    if state.stored ~= state.caller_limit then
      redis.call('SET', LIMIT, state.caller_limit)
      state.stored = state.caller_limit
    end
  end
  -- What each identifier has is read for all of them at once: three
  -- commands a step, not three per identifier. An identifier named twice in
  -- one step (each acquire has its own, so none is) gets its first answer.
  local tombstones = aiosem_each('ZMSCORE', CANCELLED, identifiers)
  local tokens = aiosem_each('ZMSCORE', OWNERS, identifiers)
  local places = aiosem_each('ZMSCORE', QUEUE, identifiers)
  local joining, answered, tombstoned = {}, {}, {}
  for i, identifier in ipairs(identifiers) do
    if answered[identifier] == nil then
      local found = {tombstone = tombstones[i], token = tokens[i], place = places[i]}
      answered[identifier] = acquire(identifier, found, state, refusal, joining)
      if found.tombstone then
        tombstoned[#tombstoned + 1] = identifier
      end
    end
    results[i] = answered[identifier]
  end
  -- A tombstone that served is removed.
  aiosem_in_chunks('ZREM', CANCELLED, tombstoned)
  join_queue(joining, state)
  return results
end, true)
