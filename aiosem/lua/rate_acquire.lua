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
-- The calls of one batch -- the calls of a process's tasks made together --
-- are applied in order, as if each were a script of its own: one read of
-- the key, one write.
--
-- KEYS[1] the TAT key; it expires when the TAT is reached (idle: no state)
-- ARGV[1] now in seconds, or '' for the server's clock
-- ARGV[2] emission interval in microseconds (per / rate)
-- ARGV[3] tolerance in microseconds ((burst - 1) * emission interval)
-- then, for each call, three arguments:
--   mode: 'try' takes the slots only if they are free now; 'reserve' takes
--         the next ones if they come within the next argument; 'return'
--         gives back the slots a reservation ending at it took, if nobody
--         reserved since
--   'reserve': the longest wait accepted in microseconds ('' for any);
--   'return': the TAT the reservation left
--   the cost k: how many slots the call takes (or gives back), 1 to burst
-- Returns, for each call, {granted (1 or 0), wait in microseconds, TAT after
-- the call}, flat: for 'try' and 'reserve', the wait until the slots (or,
-- refused, until they would be free); for 'return', granted is 1 if the
-- slots were given back.
local now
if ARGV[1] ~= '' then
  now = math.floor(tonumber(ARGV[1]) * 1000000)
else
  local t = redis.call('TIME')
  now = tonumber(t[1]) * 1000000 + tonumber(t[2])
end
local interval = tonumber(ARGV[2])
local tolerance = tonumber(ARGV[3])

-- The TAT stored, 0 for none: as each call leaves it.
local stored = tonumber(redis.call('GET', KEYS[1]) or '0')
local changed = false
local replies = {}

local function store(value)
  -- A TAT not ahead of now is the limiter at rest: no key.
  if value > now then stored = value else stored = 0 end
  changed = true
end

local function reply(granted, wait, tat)
  replies[#replies + 1] = granted
  replies[#replies + 1] = wait
  replies[#replies + 1] = string.format('%d', tat)
end

for call = 4, #ARGV, 3 do
  local mode = ARGV[call]
  local argument = ARGV[call + 1]
  local increment = tonumber(ARGV[call + 2]) * interval
  if mode == 'return' then
    local reserved = tonumber(argument)
    if stored == reserved then
      store(reserved - increment)
      reply(1, 0, reserved - increment)
    else
      reply(0, 0, stored)
    end
  else
    local tat = math.max(stored, now)
    local wait = math.max(0, tat - tolerance + increment - interval - now)
    local longest = 0
    if mode == 'reserve' then
      longest = tonumber(argument) or math.huge
    end
    if wait > longest then
      reply(0, wait, stored)
    else
      store(tat + increment)
      reply(1, wait, tat + increment)
    end
  end
end

if changed then
  if stored > 0 then
    redis.call('SET', KEYS[1], string.format('%d', stored), 'PX', math.ceil((stored - now) / 1000))
  else
    redis.call('DEL', KEYS[1])
  end
end
return replies
