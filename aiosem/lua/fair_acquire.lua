-- Grant permits of a fair semaphore, in the order the identifiers are given.
--
-- KEYS[1] timeout set (member: identifier, score: grant or refresh time, s)
-- KEYS[2] owner set (member: identifier, score: fencing token)
-- KEYS[3] counter (the last fencing token handed out; never expires)
-- ARGV[1] now in seconds, or '' for the server's clock
-- ARGV[2] lease in seconds
-- ARGV[3] limit
-- ARGV[4..] identifiers to grant
-- Returns {holders, next_expiry_us, token_1, ..., token_n}: token 0 means not
-- granted. An identifier that already holds gets its token again and its
-- lease restarted, so a retried grant never takes a second permit.
--
-- The first write that grows memory is the reaper's or INCR's: an
-- out-of-memory refusal there aborts the script with nothing written.
local now = aiosem_now(ARGV[1])
local lease = tonumber(ARGV[2])
local limit = tonumber(ARGV[3])
aiosem_reap(KEYS[1], KEYS[2], now - lease)

local stamp = aiosem_seconds(now)
local held = redis.call('ZCARD', KEYS[2])
local result = {0, -1}
for i = 4, #ARGV do
  local identifier = ARGV[i]
  local token = redis.call('ZSCORE', KEYS[2], identifier)
  if token then
    redis.call('ZADD', KEYS[1], 'XX', stamp, identifier)
    token = tonumber(token)
  elseif held < limit then
    token = redis.call('INCR', KEYS[3])
    redis.call('ZADD', KEYS[2], token, identifier)
    redis.call('ZADD', KEYS[1], stamp, identifier)
    held = held + 1
  else
    token = 0
  end
  result[#result + 1] = token
end
result[1], result[2] = aiosem_header(KEYS[1], KEYS[2], now, lease)
return result
