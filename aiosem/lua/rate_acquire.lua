-- Take, reserve or give back a slot of a rate limiter: GCRA, the generic
-- cell rate algorithm, on one key.
--
-- The key holds the theoretical arrival time (TAT), in integer microseconds:
-- when the limiter will next be at rest if nobody else comes. A slot is
-- allowed at max(TAT, now) - tolerance; taking it moves the TAT on by one
-- emission interval. Reservations are made in the order the calls reach the
-- server, so waiters are served in arrival order, each after one sleep.
--
-- KEYS[1] the TAT key; it expires when the TAT is reached (idle: no state)
-- ARGV[1] now in seconds, or '' for the server's clock
-- ARGV[2] emission interval in microseconds (per / rate)
-- ARGV[3] tolerance in microseconds ((burst - 1) * emission interval)
-- ARGV[4] mode: 'try' takes a slot only if it is free now; 'reserve' takes
--         the next slot if it comes within ARGV[5]; 'return' gives back the
--         slot a reservation ending at ARGV[5] took, if nobody reserved since
-- ARGV[5] 'reserve': the longest wait accepted in microseconds ('' for any);
--         'return': the TAT the reservation left
-- Returns {granted (1 or 0), wait in microseconds, TAT after the call}: for
-- 'try' and 'reserve', the wait until the slot (or, refused, until one would
-- be free); for 'return', granted is 1 if the slot was given back.
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
    store(reserved - interval)
    return {1, 0, string.format('%d', reserved - interval)}
  end
  return {0, 0, string.format('%d', stored)}
end

local wait = math.max(0, tat - tolerance - now)
local longest = 0
if mode == 'reserve' then
  longest = tonumber(ARGV[5]) or math.huge
end
if wait > longest then
  return {0, wait, string.format('%d', stored)}
end
store(tat + interval)
return {1, wait, string.format('%d', tat + interval)}
