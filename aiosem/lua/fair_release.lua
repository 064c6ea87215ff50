-- Release permits of a fair semaphore.
--
-- KEYS[1] timeout set, KEYS[2] owner set, KEYS[3] counter (unused; kept so
-- every fair script takes the same keys)
-- ARGV[1] now in seconds, or '' for the server's clock
-- ARGV[2] lease in seconds
-- ARGV[3..] identifiers to release
-- Returns {holders, next_expiry_us, released_1, ..., released_n}: 1 if the
-- identifier held a live permit, 0 if it had expired or was never granted.
local now = aiosem_now(ARGV[1])
local lease = tonumber(ARGV[2])
aiosem_reap(KEYS[1], KEYS[2], now - lease)

local result = {0, -1}
for i = 3, #ARGV do
  local released = redis.call('ZREM', KEYS[2], ARGV[i])
  redis.call('ZREM', KEYS[1], ARGV[i])
  result[#result + 1] = released
end
result[1], result[2] = aiosem_header(KEYS[1], KEYS[2], now, lease)
return result
