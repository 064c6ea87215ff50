-- Take, reserve or give back slots of a rate limiter: GCRA, the generic
-- cell rate algorithm, on one key.
--
-- The key holds the theoretical arrival time (TAT), in integer microseconds:
-- when the limiter will next be at rest if nobody else comes. Reservations
-- are made in the order the calls reach the server, so waiters are served
-- in arrival order, each after one sleep.
--
-- A call of cost k takes k slots at once (as redis-cell and throttled do),
-- with T the emission interval and B the burst:
--   new TAT = max(TAT, now) + k * T
--   allowed at new TAT - B * T = max(TAT, now) - tolerance + (k - 1) * T
-- where tolerance = (B - 1) * T: the limiter lets a call through once no
-- more than B intervals of work, its own k included, lie ahead. With k = 1
-- this is plain GCRA: allowed at max(TAT, now) - tolerance, TAT moved on by
-- one interval. A call of cost B waits until the limiter is at rest; one
-- above B could never be allowed, and the client refuses it unsent.
--
-- KEYS[1] the TAT key; it expires when the TAT is reached (idle: no state)
-- ARGV[1] now in seconds, or '' for the server's clock
-- ARGV[2] emission interval in microseconds (per / rate)
-- ARGV[3] tolerance in microseconds ((burst - 1) * emission interval)
-- ARGV[4] mode: 'try' takes the slots only if they are free now; 'reserve'
--         takes the next ones if they come within ARGV[5]; 'return' gives
--         back the slots a reservation ending at ARGV[5] took, if nobody
--         reserved since
-- ARGV[5] 'reserve': the longest wait accepted in microseconds ('' for any);
--         'return': the TAT the reservation left
-- ARGV[6] the cost k: how many slots the call takes (or gives back), 1 to
--         burst
-- Returns {granted (1 or 0), wait in microseconds, TAT after the call}: for
-- 'try' and 'reserve', the wait until the slots (or, refused, until they
-- would be free); for 'return', granted is 1 if the slots were given back.
local now
if ARGV[1] ~= '' then
  now = math.floor(tonumber(ARGV[1]) * 1000000)
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local interval = tonumber(ARGV[2])
local tolerance = tonumber(ARGV[3])
local mode = ARGV[4]
local cost = tonumber(ARGV[6])
local increment = cost * interval

local stored = tonumber(redis.call('GET', KEYS[1]) or '0')
local tat = math.max(stored, now)

local function store(value)
  if value > now then
    redis.call('SET', KEYS[1], string.format('%d', value), 'PX', math.ceil((value - now) / 1000))
  else
    redis.call('DEL', KEYS[1])
  end
end

if mode == 'return' then
  local reserved = tonumber(ARGV[5])
  if stored == reserved then
    store(reserved - increment)
    return {1, 0, string.format('%d', reserved - increment)}
  end
  return {0, 0, string.format('%d', stored)}
end

local wait = math.max(0, tat - tolerance + increment - interval - now)
local longest = 0
if mode == 'reserve' then
  longest = tonumber(ARGV[5]) or math.huge
end
if wait > longest then
  return {0, wait, string.format('%d', stored)}
end
store(tat + increment)
return {1, wait, string.format('%d', tat + increment)}
