-- Release a permit of the book's basic (unfair) semaphore.
--
-- KEYS[1] timeout set
-- ARGV[1] now in seconds, or '' for the server's clock
-- ARGV[2] lease in seconds
-- ARGV[3] identifier
-- Returns 1 if the identifier held a live permit, else 0.
local now = aiosem_now(ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', aiosem_seconds(now - tonumber(ARGV[2])))
return redis.call('ZREM', KEYS[1], ARGV[3])
