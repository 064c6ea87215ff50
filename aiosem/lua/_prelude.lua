-- Shared by every aiosem script (prepended when the script is loaded): the
-- keys, the clock, the score format, the reaper and the hand-off.
--
-- The constants named in capitals below and in the scripts -- the server's
-- rules (TOMBSTONE_SECONDS, TOMBSTONE_TTL_MS, COUNTER_TTL_MS,
-- EXPIRE_MARGIN_MS, EXPIRE_SLACK_MS, RUN_LENGTH), the result codes (QUEUED,
-- REFUSED, TOMBSTONED, LIMIT_MISMATCH, NO_LIMIT, TOO_HEAVY) and the modes
-- (MODE_WAIT, MODE_CANCEL, MODE_PASS, ...) -- are not defined here: aiosem/_scripts.py
-- writes them as locals above this prelude, from aiosem/_rules.py and
-- aiosem/_protocol.py, where the Lua-free step reads them too.
--
-- Scores of the timeout set are float seconds -- the time of the grant or of
-- the last refresh -- exactly as in Redis in Action, so book clients can
-- share a semaphore with aiosem on one node. A permit granted at t with lease
-- L is live while now < t + L.
--
-- Every fair script takes the same keys:
local TIMEOUTS = KEYS[1]   -- identifier -> grant or refresh time (s)
local OWNERS = KEYS[2]     -- identifier -> fencing token
local COUNTER = KEYS[3]    -- the last fencing token handed out (see aiosem_next_tokens)
local QUEUE = KEYS[4]      -- waiting identifier -> ticket (arrival order)
local WAITERS = KEYS[5]    -- waiting identifier -> when it is presumed dead (s)
local CANCELLED = KEYS[6]  -- identifier -> when its tombstone ends (s)
local TICKETS = KEYS[7]    -- the last ticket handed to a waiter
local LIMIT = KEYS[8]      -- the limit in force: 'n' as a caller brought it,
                           -- while anybody holds or waits; '=n' as set by
                           -- a limit step, until cleared (see aiosem_stored_limit)
local HOLDERS = KEYS[9]    -- identifier -> its record (see aiosem_enter_all), while
                           -- it holds or waits
local WEIGHT = KEYS[10]    -- how much more than 1 each permit held weighs (see
                           -- aiosem_weight), together; absent for 0
local ARRIVING = KEYS[11]  -- waiters of the Lua-free class that hold a ticket
                           -- and are not queued yet -> when they are presumed
                           -- gone (s), or inf until a Lua-free step sees them
local RECEIPT = KEYS[12]   -- what this call released, if it is a release with
                           -- an id: one '1' or '0' per identifier
--
-- and the same arguments:
-- ARGV[1] now in seconds, or '' for the server's clock
-- ARGV[2] lease in seconds
-- ARGV[3] the caller's limit, or '' when it has none: it takes the stored one
-- ARGV[4] waiter TTL in seconds
-- ARGV[5] the caller's process token ('' for none); waiter identifiers are
--         '<process token>.<random>'
-- ARGV[6] the prefix of the wake-up channels: a process's is prefix .. token
-- ARGV[7] how to wake a process: 'PUBLISH', or 'SPUBLISH' on a cluster,
--         where the channel shares the keys' hash tag and so their slot
-- ARGV[8] the mode of the operation
-- ARGV[9] the call's id ('' for none): a call retried because its reply was
--         lost carries the same id, and reads the receipt of the first try
-- ARGV[10] how long a call's receipt is kept, in seconds: as long as the
--         caller may still try the call again
-- ARGV[11] '1' if the caller relays a mutex through a run of its own waiters
--         (see aiosem_relay_run), else ''
-- ARGV[12] the caller's record of who it is (see aiosem_enter_all), '' for none
-- ARGV[13..] identifiers: one that ends in '*k' is of a permit weighing k
--         (k > 1), any other of one weighing 1 (see aiosem_weight)
--
-- and every script returns {held, waiting, next_expiry_us, relayed,
-- limit, result_1, ..., result_n, granted_id_1, token_1, ..., relayed_id_1,
-- token_1, ...}: held is the weight of the permits held, next_expiry_us how
-- long until the earliest lease runs out (-1: nobody holds), limit the
-- limit in force (0: none); the results are one per identifier, the
-- granted pairs are the waiters this call handed a permit, and the last
-- `relayed` pairs are the run of the caller's waiters that permit is
-- relayed to (see aiosem_relay_run).

-- What a permit weighs: k if its identifier ends in '*k' with k > 1, else
-- 1. The weight is part of the identifier so that whoever reads one -- a
-- hand-off, the reaper, a release -- knows it without another read. Most
-- identifiers have no '*': a plain search rules them out at once, where the
-- pattern would be tried from every position in turn (a microsecond each,
-- and a cycle reads a permit's weight about three times).
local function aiosem_weight(identifier)
  if not string.find(identifier, '*', 1, true) then
    return 1
  end
  local weight = tonumber(string.match(identifier, '%*(%d+)$'))
  if weight and weight > 1 then
    return weight
  end
  return 1
end

local function aiosem_now(override)
  if override ~= '' then
    return tonumber(override)
  end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end

-- Lua's own number formatting keeps 14 digits, which rounds epoch seconds
-- to 100 us; microseconds are what TIME gives.
local function aiosem_seconds(x)
  return string.format('%.6f', x)
end

-- The next `n` fencing tokens; returns the first. Each is one more than the
-- last, and never less than the clock in microseconds. Tokens therefore
-- keep increasing after the counter expired, or Redis lost it, unless the
-- clock stepped back further than the time since the last grant. (A token
-- is under 2^53, until the year 2255: exact in a Lua number and in a sorted
-- set's score.)
local function aiosem_next_tokens(now, n)
  local last = tonumber(redis.call('GET', COUNTER) or 0)
  local first = math.max(last + 1, math.floor(now * 1000000))
  redis.call('SET', COUNTER, string.format('%d', first + n - 1), 'PX', COUNTER_TTL_MS)
  return first
end

-- Run `command` on `key` with `arguments`, 1,000 of them at most a call:
-- unpack() is bounded by the Lua stack (pairs, an even number, stay whole).
-- Answers the sum of the replies: what ZREM, ZADD, HSET and HDEL counted.
local function aiosem_in_chunks(command, key, arguments)
  local total = 0
  for i = 1, #arguments, 1000 do
    total = total + redis.call(command, key, unpack(arguments, i, math.min(i + 999, #arguments)))
  end
  return total
end

-- What `command` (ZMSCORE, HMGET) answers for each of `members` in `key`,
-- false where absent, in chunks that unpack() can take.
local function aiosem_each(command, key, members)
  local values = {}
  for i = 1, #members, 1000 do
    local chunk = redis.call(command, key, unpack(members, i, math.min(i + 999, #members)))
    for j = 1, #chunk do
      values[#values + 1] = chunk[j]
    end
  end
  return values
end

-- Set one score for all `members` that are in `key` already (ZADD XX).
local function aiosem_touch_all(key, score, members)
  for i = 1, #members, 500 do
    local arguments = {}
    for j = i, math.min(i + 499, #members) do
      arguments[#arguments + 1] = score
      arguments[#arguments + 1] = members[j]
    end
    redis.call('ZADD', key, 'XX', unpack(arguments))
  end
end

-- Add to each of the sorted sets `keys`, which hold `size` members now, its
-- score-member pairs in `pairs_by_key` (one list a key). A set that grows
-- to SKIPLIST_AT members goes to Redis's skiplist encoding first, where a
-- member costs the same to add whatever the set's size: in the compact one
-- (listpack) each is placed by a scan that parses every score on its way,
-- so a step that adds many pays for the set's size many times over. A
-- member too long for the compact encoding, added first and taken out last,
-- moves it; nobody sees it, and no set moves back on its own. (A set
-- emptied is deleted, and starts compact again.)
local function aiosem_add_all(keys, size, pairs_by_key)
  local grows = size < SKIPLIST_AT and size + #pairs_by_key[1] / 2 >= SKIPLIST_AT
  local mover = grows and string.rep(SKIPLIST_MOVER_BYTE, SKIPLIST_MEMBER_BYTES)
  for i, key in ipairs(keys) do
    if mover then
      redis.call('ZADD', key, 0, mover)
    end
    aiosem_in_chunks('ZADD', key, pairs_by_key[i])
    if mover then
      redis.call('ZREM', key, mover)
    end
  end
end

-- Who an identifier is, for `python -m aiosem status` and the reaper: the
-- caller's record, a JSON array [lease in ms, pid, host, label or null],
-- written once, as the identifier joins the queue or is granted a permit
-- straight away; it follows the identifier through a hand-off. A caller
-- without one (a book client) writes nothing. One HSET per 500 identifiers.
local function aiosem_enter_all(identifiers, state)
  if state.record == '' then
    return
  end
  local fields = {}
  for _, identifier in ipairs(identifiers) do
    state.forgotten[identifier] = nil
    fields[#fields + 1] = identifier
    fields[#fields + 1] = state.record
  end
  aiosem_in_chunks('HSET', HOLDERS, fields)
end

-- Note that the records of `members`, which neither hold nor wait any
-- more, are to go: at the end of the step (aiosem_forget_now), or with the
-- whole hash if the step leaves nobody holding or waiting -- one command
-- fewer for most releases. An identifier entered again meanwhile keeps its
-- new record.
local function aiosem_forget(members, state)
  for _, member in ipairs(members) do
    state.forgotten[member] = true
  end
end

-- HDEL the records aiosem_forget noted. Records left by identifiers that
-- went another way -- a key evicted or expired, a book client's ZREM -- go
-- with the whole hash once nobody holds or waits (see aiosem_run).
local function aiosem_forget_now(state)
  local members = {}
  for member in pairs(state.forgotten) do
    members[#members + 1] = member
  end
  aiosem_in_chunks('HDEL', HOLDERS, members)
end

-- The lease an identifier's record gives, in seconds; nil for none.
local function aiosem_own_lease(record)
  local ms = record and string.match(record, '^%[(%d+),')
  return ms and tonumber(ms) / 1000
end

-- Of the permits whose last confirmation is at or before `cutoff` (the
-- caller's lease ago): those whose own recorded lease, longer than the
-- caller's, has not run out yet (the spared: members, scores, own leases),
-- and the others (the expired: members). A permit is thus reaped once the
-- longer of its own lease and the caller's has run out, never before its
-- own: holders may use different leases. Costs nothing more than a
-- ZRANGEBYSCORE unless some permit is past the caller's lease.
local function aiosem_past(now, cutoff)
  local found = redis.call('ZRANGEBYSCORE', TIMEOUTS, '-inf', aiosem_seconds(cutoff), 'WITHSCORES')
  local spared, expired = {members = {}, scores = {}, leases = {}}, {}
  if #found == 0 then
    return spared, expired
  end
  local members = {}
  for i = 1, #found, 2 do
    members[#members + 1] = found[i]
  end
  local records = aiosem_each('HMGET', HOLDERS, members)
  for i, member in ipairs(members) do
    local score = tonumber(found[2 * i])
    local own = aiosem_own_lease(records[i])
    if own and score > tonumber(aiosem_seconds(now - own)) then
      spared.members[#spared.members + 1] = member
      spared.scores[#spared.scores + 1] = score
      spared.leases[#spared.leases + 1] = own
    else
      expired[#expired + 1] = member
    end
  end
  return spared, expired
end

-- How much more than 1 each the permits held weigh, together: WEIGHT, kept
-- by every step that grants or takes away a weighted permit, so that a step
-- reads it in one command.
local function aiosem_extra_weight()
  return tonumber(redis.call('GET', WEIGHT) or 0)
end

-- Add `delta` (not 0) to WEIGHT, and to state.extra, its value; a key at 0
-- goes.
local function aiosem_add_weight(delta, state)
  state.extra = state.extra + delta
  if redis.call('INCRBY', WEIGHT, delta) <= 0 then
    redis.call('DEL', WEIGHT)
  end
end

-- Count WEIGHT again, from the permits held: after the reaper took a
-- weighted permit, or eviction took permits it cannot name. Answers it.
local function aiosem_recount_weight()
  local extra = 0
  for _, member in ipairs(redis.call('ZRANGE', OWNERS, 0, -1)) do
    extra = extra + aiosem_weight(member) - 1
  end
  if extra > 0 then
    redis.call('SET', WEIGHT, extra)
  else
    redis.call('DEL', WEIGHT)
  end
  return extra
end

-- Count a permit just granted to `identifier` as held: its weight.
local function aiosem_count_held(identifier, state)
  local weight = aiosem_weight(identifier)
  if weight > 1 then
    aiosem_add_weight(weight - 1, state)
  end
  state.holders = state.holders + weight
end

-- Write a permit's token and the start of its lease.
local function aiosem_stamp(identifier, token, stamp)
  redis.call('ZADD', OWNERS, token, identifier)
  redis.call('ZADD', TIMEOUTS, aiosem_seconds(stamp), identifier)
end

-- Hold a permit: `identifier` is granted `token`, with a lease from `stamp`.
local function aiosem_hold(identifier, token, stamp, state)
  aiosem_stamp(identifier, token, stamp)
  aiosem_count_held(identifier, state)
end


-- Remove every permit whose lease ran out from both sets, and return the
-- weight freed and the weight held (state.extra is WEIGHT after it). A book
-- client writes the two sets in separate steps, and eviction may take one
-- set and not the other, so afterwards drop any member that is in one set
-- only: an owner entry without a lease would hold a permit forever, a lease
-- without an owner entry counts for nothing. (ZINTERCARD needs Redis 7.) Notes in
-- state.spared whether a permit past the caller's lease was spared.
local function aiosem_reap(state)
  local before = redis.call('ZCARD', OWNERS)
  local leases = redis.call('ZCARD', TIMEOUTS)
  local extra = aiosem_extra_weight()
  local weighed = before + extra
  local spared, expired = aiosem_past(state.now, state.now - state.lease)
  state.spared = #spared.members > 0
  local held, recount = before, false
  if #expired > 0 then
    leases = leases - aiosem_in_chunks('ZREM', TIMEOUTS, expired)
    held = held - aiosem_in_chunks('ZREM', OWNERS, expired)
    aiosem_forget(expired, state)
    for _, member in ipairs(expired) do
      recount = recount or aiosem_weight(member) > 1
    end
  end
  if held ~= leases or (held > 0 and redis.call('ZINTERCARD', 2, OWNERS, TIMEOUTS) ~= held) then
    redis.call('ZINTERSTORE', OWNERS, 2, OWNERS, TIMEOUTS, 'WEIGHTS', 1, 0)
    redis.call('ZINTERSTORE', TIMEOUTS, 2, TIMEOUTS, OWNERS, 'WEIGHTS', 1, 0)
    held = redis.call('ZCARD', OWNERS)
    recount = true
  end
  -- The weight of permits taken, by the reaper or by eviction, goes too;
  -- with none held, none weighs, whatever eviction left behind.
  if extra > 0 and (recount or held == 0) then
    extra = aiosem_recount_weight()
  end
  state.extra = extra
  return weighed - held - extra, held + extra
end

-- Forget waiters that stopped proving they are alive; return how many are
-- left in the queue.
local function aiosem_reap_waiters(state)
  local dead = redis.call('ZRANGEBYSCORE', WAITERS, '-inf', aiosem_seconds(state.now))
  if #dead > 0 then
    aiosem_in_chunks('ZREM', QUEUE, dead)
    aiosem_in_chunks('ZREM', WAITERS, dead)
    aiosem_forget(dead, state)
  end
  return redis.call('ZCARD', QUEUE)
end

local function aiosem_owner(identifier)
  return string.match(identifier, '^(%x+)%.')
end

-- A mutex just handed to one of the caller's own waiters is relayed, too, to
-- the caller's waiters queued right behind it: each gets its fencing token
-- now, and the caller passes the permit from each to the next without
-- waiting for Redis (a 'pass' release tells Redis afterwards, and takes the
-- next one out of the queue). They stay queued meanwhile, in their places:
-- should the caller not pass the permit on -- a holder given up before it
-- heard of its grant, a lease run out -- the permit goes from the queue's
-- head to them all the same. With one permit nobody else can be served
-- before the run ends, so arrival order holds; another process's waiter
-- ends the run. A waiter of the Lua-free class that holds a ticket and is not
-- queued yet may have come before the run: while one is on its way, nothing
-- is relayed. Appends identifier and token of each to `relayed`.
local function aiosem_relay_run(head, state, relayed)
  if not state.relays or state.limit ~= 1 or aiosem_owner(head) ~= state.caller then
    return
  end
  local now = '(' .. aiosem_seconds(state.now)
  if #redis.call('ZRANGEBYSCORE', ARRIVING, now, '+inf', 'LIMIT', 0, 1) > 0 then
    return
  end
  local behind = redis.call('ZRANGE', QUEUE, 0, RUN_LENGTH - 1)
  local run = {}
  for _, identifier in ipairs(behind) do
    if aiosem_owner(identifier) ~= state.caller or aiosem_weight(identifier) ~= 1 then
      break
    end
    run[#run + 1] = identifier
  end
  if #run == 0 then
    return
  end
  local first = aiosem_next_tokens(state.now, #run)
  for i, identifier in ipairs(run) do
    relayed[#relayed + 1] = identifier
    relayed[#relayed + 1] = first + i - 1
  end
end

-- The waiters that `free` weight goes to, in queue order: each in turn while
-- its weight fits in what is left. A head that does not fit holds back the
-- waiters behind it (none of them starves); one heavier than the limit in
-- force, which can never fit until the limit is raised, is passed over.
-- Also answers whether a waiter that could be served is left queued (when
-- the free weight ran out first, it may be).
local function aiosem_heads(free, state)
  local heads, offset = {}, 0
  while free > 0 do
    local batch = redis.call('ZRANGE', QUEUE, offset, offset + free - 1)
    for _, identifier in ipairs(batch) do
      local weight = aiosem_weight(identifier)
      if not state.limit or weight <= state.limit then
        if weight > free then
          return heads, true
        end
        heads[#heads + 1] = identifier
        free = free - weight
        if free == 0 then
          return heads, true
        end
      end
    end
    if #batch == 0 then
      return heads, false
    end
    offset = offset + #batch
  end
  return heads, true
end

-- Grant `free` weight to the longest-waiting waiters (see aiosem_heads),
-- appending identifier and token of each to `granted`, and tell each
-- waiter's process on its channel (the caller learns of its own from the
-- reply). A permit handed to another process's waiter lasts only a waiter
-- TTL until that process claims it with a refresh: a waiter that died while
-- queued never holds the line for a whole lease.
-- Notes in state.served_first whether a waiter that could be served is left
-- queued: a newcomer must not be granted ahead of it.
local function aiosem_hand_off(free, state, granted, relayed)
  if free <= 0 or state.queued == 0 then
    state.served_first = state.queued > 0
    return
  end
  local now, lease, waiter_ttl = state.now, state.lease, state.waiter_ttl
  local heads
  heads, state.served_first = aiosem_heads(free, state)
  if #heads == 0 then
    return
  end
  -- The tokens drawn and the permits written together: a step that serves
  -- many waiters pays for one command of each kind, not one per waiter.
  local messages, tokens, leases = {}, {}, {}
  -- Counted before aiosem_count_held adds the heads.
  local held = state.holders - state.extra
  local first = aiosem_next_tokens(now, #heads)
  local own_stamp = aiosem_seconds(now)
  local handed_stamp = aiosem_seconds(now - lease + math.min(waiter_ttl, lease))
  for i, identifier in ipairs(heads) do
    local token = first + i - 1
    local owner = aiosem_owner(identifier)
    local stamp = own_stamp
    if owner ~= state.caller then
      stamp = handed_stamp
      if owner then
        messages[owner] = (messages[owner] or '') .. identifier .. ':' .. string.format('%d', token) .. ' '
      end
    end
    tokens[#tokens + 1] = token
    tokens[#tokens + 1] = identifier
    leases[#leases + 1] = stamp
    leases[#leases + 1] = identifier
    aiosem_count_held(identifier, state)
    granted[#granted + 1] = identifier
    granted[#granted + 1] = token
  end
  aiosem_add_all({OWNERS, TIMEOUTS}, held, {tokens, leases})
  aiosem_in_chunks('ZREM', QUEUE, heads)
  aiosem_in_chunks('ZREM', WAITERS, heads)
  state.queued = state.queued - #heads
  for owner, text in pairs(messages) do
    redis.call(state.publish, state.channels .. owner, text)
  end
  aiosem_relay_run(heads[1], state, relayed)
end

-- The queue's keys expire once no waiter in them can still be alive; called
-- by every step that queues a waiter or proves one alive. A TTL is only
-- ever lengthened, so a caller with a shorter waiter timeout never cuts
-- another's waiters short; and only once EXPIRE_SLACK_MS of its
-- EXPIRE_MARGIN_MS has run down, so that most such steps only read it.
local function aiosem_expire(waiter_ttl)
  local waiter_ms = math.ceil(waiter_ttl * 1000) + EXPIRE_MARGIN_MS
  for _, key in ipairs({QUEUE, WAITERS, TICKETS}) do
    local ttl = redis.call('PTTL', key)
    if ttl == -1 or (ttl >= 0 and ttl < waiter_ms - EXPIRE_SLACK_MS) then
      redis.call('PEXPIRE', key, waiter_ms)
    end
  end
end

-- The permit sets and the limit carry no TTL while anybody holds or waits:
-- a volatile-* eviction policy, which takes only keys with a TTL, can then
-- never delete a live permit. A TTL found on one (an older aiosem set a
-- day) is removed; a key without one is only read, so most steps write
-- nothing here. Nothing is left for ever all the same: the sets are deleted
-- with their last entry and the limit once idle, and what a holder that
-- died leaves is reaped by the next step on the name.
local function aiosem_persist_permits()
  for _, key in ipairs({TIMEOUTS, OWNERS, LIMIT}) do
    if redis.call('PTTL', key) >= 0 then
      redis.call('PERSIST', key)
    end
  end
end

-- The header every script returns first. The permits the reaper spared
-- (see aiosem_past), unless refreshed or released since, are still at or
-- before the cutoff, and end with their own leases; the others with the
-- caller's, as far as it knows.
local function aiosem_header(state, relayed)
  local first, spared
  if state.spared then
    local cutoff = state.now - state.lease
    spared = aiosem_past(state.now, cutoff)
    first = redis.call('ZRANGEBYSCORE', TIMEOUTS, '(' .. aiosem_seconds(cutoff), '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
  else
    first = redis.call('ZRANGE', TIMEOUTS, 0, 0, 'WITHSCORES')
  end
  local next_expiry = -1
  if first[2] then
    next_expiry = math.max(0, math.floor((tonumber(first[2]) + state.lease - state.now) * 1000000))
  end
  for i, score in ipairs(spared and spared.scores or {}) do
    local left = math.max(0, math.floor((score + spared.leases[i] - state.now) * 1000000))
    if next_expiry < 0 or left < next_expiry then
      next_expiry = left
    end
  end
  return {state.holders, state.queued, next_expiry, #relayed / 2, state.limit or 0}
end

-- The stored limit, and whether a limit step set it ('=n'). A limit a caller
-- brought ('n') is the one every caller must bring while the semaphore is
-- in use, and goes once it is idle; a limit set is in force for every
-- caller, whatever it brings, until a limit step clears it.
local function aiosem_stored_limit()
  local stored = redis.call('GET', LIMIT)
  if not stored then
    return nil, false
  end
  if string.sub(stored, 1, 1) == '=' then
    return tonumber(string.sub(stored, 2)), true
  end
  return tonumber(stored), false
end

-- The part every script shares: read the arguments, reap, let `operation`
-- act on the identifiers, hand off what is free, and answer.
-- `operation(identifiers, state)` returns one result per identifier; `state`
-- carries now, lease, limit (the limit in force: the stored one, else the
-- caller's, else nil), caller_limit, stored (the stored limit) and set (whether
-- a limit step set it), waiter_ttl, mode, call, receipt_seconds, relays, record,
-- `forgotten` (see aiosem_forget), `spared` (see aiosem_reap), `freed` (permits given up
-- by the operation, which matter when the limit is unknown), `holders` (the
-- weight held) and `queued` (the waiters), which every write keeps up to date,
-- `waiters_written`, which an operation sets when it queues a waiter or
-- proves one alive, `limit_changed`, which it sets when it changes the
-- limit in force: what is free then goes to the queue after it, too, and
-- `served_first` (see aiosem_hand_off), and `extra` (WEIGHT's value).
local function aiosem_run(operation, hand_off_first)
  local state = {
    now = aiosem_now(ARGV[1]),
    lease = tonumber(ARGV[2]),
    caller_limit = tonumber(ARGV[3]),
    waiter_ttl = tonumber(ARGV[4]),
    caller = ARGV[5],
    channels = ARGV[6],
    publish = ARGV[7],
    mode = ARGV[8],
    call = ARGV[9],
    receipt_seconds = tonumber(ARGV[10]),
    relays = ARGV[11] == '1',
    record = ARGV[12],
    forgotten = {},
    waiters_written = false,
    limit_changed = false,
  }
  state.stored, state.set = aiosem_stored_limit()
  state.limit = state.stored or state.caller_limit
  -- Checked before anything is written: a script refused half-way would leave
  -- its writes behind.
  if state.publish ~= 'PUBLISH' and state.publish ~= 'SPUBLISH' then
    return redis.error_reply('ERR aiosem: ARGV[7] must be PUBLISH or SPUBLISH')
  end
  -- The first write drops spent tombstones. It must come first and never
  -- grow memory: Redis refuses a script over maxmemory (noeviction) only
  -- at a memory-growing write made before any other write, so every step
  -- -- a refresh too, not only acquires and releases -- runs whole or not
  -- at all, and a full server never takes its holders' leases from them.
  redis.call('ZREMRANGEBYSCORE', CANCELLED, '-inf', aiosem_seconds(state.now))
  state.freed, state.holders = aiosem_reap(state)
  state.queued = aiosem_reap_waiters(state)
  local granted, relayed = {}, {}
  local function hand_off()
    local free = state.freed
    if state.limit then
      free = state.limit - state.holders
    end
    aiosem_hand_off(free, state, granted, relayed)
    state.freed = 0
  end
  if hand_off_first then
    hand_off()
  end
  local identifiers = {}
  for i = 13, #ARGV do
    identifiers[#identifiers + 1] = ARGV[i]
  end
  local results = operation(identifiers, state)
  if not hand_off_first or state.limit_changed then
    hand_off()
  end
  if state.waiters_written then
    aiosem_expire(state.waiter_ttl)
  end
  if state.holders == 0 and state.queued == 0 then
    -- Idle: whoever comes next may bring another limit, unless one was set;
    -- and no record is of anybody who holds or waits.
    if state.set then
      redis.call('DEL', HOLDERS, WEIGHT)
    else
      redis.call('DEL', LIMIT, HOLDERS, WEIGHT)
      state.limit = state.caller_limit
    end
  else
    aiosem_forget_now(state)
    aiosem_persist_permits()
  end
  local reply = aiosem_header(state, relayed)
  for _, list in ipairs({results, granted, relayed}) do
    for _, value in ipairs(list) do
      reply[#reply + 1] = value
    end
  end
  return reply
end
