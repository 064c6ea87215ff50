-- Extend the leases of held permits of a fair semaphore.
--
-- KEYS[1] timeout set, KEYS[2] owner set, KEYS[3] counter (unused)
-- ARGV[1] now in seconds, or '' for the server's clock
-- ARGV[2] lease in seconds
-- ARGV[3..] identifiers to refresh
-- Returns {holders, next_expiry_us, refreshed_1, ..., refreshed_n}: 0 means
-- the permit was lost. Expired permits are reaped before anything else and
-- the lease is only ever updated in place (ZADD XX), so a lost permit is
-- never revived, not even for the duration of this script.
local now = aiosem_now(ARGV[1])
local lease = tonumber(ARGV[2])
aiosem_reap(KEYS[1], KEYS[2], now - lease)

local stamp = aiosem_seconds(now)
local result = {0, -1}
for i = 3, #ARGV do
  local refreshed = 0
  if redis.call('ZSCORE', KEYS[2], ARGV[i]) then
    redis.call('ZADD', KEYS[1], 'XX', stamp, ARGV[i])
    refreshed = 1
  end
  result[#result + 1] = refreshed
end
result[1], result[2] = aiosem_header(KEYS[1], KEYS[2], now, lease)
return result
