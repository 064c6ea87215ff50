-- Shared by every aiosem script (prepended when the script is loaded): the
-- clock, the score format and the reaper.
--
-- Scores of a timeout set are float seconds -- the time of the grant or of the
-- last refresh -- exactly as in Redis in Action, so clients written from the
-- book can share a semaphore with aiosem on one node. A permit granted at t
-- with lease L is live while now < t + L.

-- The time every decision of one call is made at: the caller's override
-- (tests, or clients of servers that forbid TIME in scripts), else the
-- server's clock, so that no client clock can steal or revive a permit.
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

-- ZREM takes its members as arguments; unpack() is bounded by the Lua stack.
local function aiosem_zrem_all(key, members)
  for i = 1, #members, 1000 do
    redis.call('ZREM', key, unpack(members, i, math.min(i + 999, #members)))
  end
end

-- Remove every permit whose lease ran out from both sets. A book client
-- writes the two sets in separate steps, and eviction may take one set and
-- not the other, so afterwards drop any member that is in one set only: an
-- owner entry without a lease would hold a permit forever, a lease without
-- an owner entry counts for nothing. (ZINTERCARD needs Redis 7.)
local function aiosem_reap(timeout_set, owner_set, cutoff)
  local expired = redis.call('ZRANGEBYSCORE', timeout_set, '-inf', aiosem_seconds(cutoff))
  if #expired > 0 then
    aiosem_zrem_all(timeout_set, expired)
    aiosem_zrem_all(owner_set, expired)
  end
  local held = redis.call('ZCARD', owner_set)
  if held ~= redis.call('ZCARD', timeout_set)
      or (held > 0 and redis.call('ZINTERCARD', 2, owner_set, timeout_set) ~= held) then
    redis.call('ZINTERSTORE', owner_set, 2, owner_set, timeout_set, 'WEIGHTS', 1, 0)
    redis.call('ZINTERSTORE', timeout_set, 2, timeout_set, owner_set, 'WEIGHTS', 1, 0)
  end
end

-- The two fields every fair script returns first: how many permits are held
-- after the call, and how long until the earliest lease runs out, in whole
-- microseconds of the script's clock (-1: nobody holds).
local function aiosem_header(timeout_set, owner_set, now, lease)
  local holders = redis.call('ZCARD', owner_set)
  local first = redis.call('ZRANGE', timeout_set, 0, 0, 'WITHSCORES')
  local next_expiry = -1
  if first[2] then
    next_expiry = math.max(0, math.floor((tonumber(first[2]) + lease - now) * 1000000))
  end
  return holders, next_expiry
end
