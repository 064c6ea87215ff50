-- Delete a lock, but only for its owner.
--
-- KEYS[1] lock key
-- ARGV[1] the owner's identifier
-- Returns 1 if the lock was the caller's and is now deleted, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
