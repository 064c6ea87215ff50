-- Grant a permit of the book's basic (unfair) semaphore.
--
-- KEYS[1] timeout set (member: identifier, score: grant time in seconds)
-- ARGV[1] now in seconds, or '' for the server's clock
-- ARGV[2] lease in seconds
-- ARGV[3] limit
-- ARGV[4] identifier
-- Returns 1 if granted, else 0; a refused identifier leaves no trace.
local now = aiosem_now(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', aiosem_seconds(now - tonumber(ARGV[2])))
if redis.call('ZCARD', KEYS[1]) < tonumber(ARGV[3]) then
  redis.call('ZADD', KEYS[1], aiosem_seconds(now), ARGV[4])
  return 1
end
return 0
