-- Drain or undrain one replica in the operator's drained set (router/routing/drain.py),
-- restoring first a set that Redis lost.
-- KEYS[1]: <ns>:drained, a set of replica ids plus the marker member "" (from the first
--   drain on: a set gone whole then tells a Redis that lost its data from undrains)
-- ARGV: 1 "add" | "rem", 2 the replica id, 3.. the caller's copy of the set (its last read,
--   recent enough to be trusted; none otherwise), written back first when the set is gone
-- Returns the set's members after the change (the marker included).
local key = KEYS[1]
if #ARGV > 2 and redis.call('EXISTS', key) == 0 then
  redis.call('SADD', key, '', unpack(ARGV, 3))
end
if ARGV[1] == 'add' then
  redis.call('SADD', key, '', ARGV[2])
else
  redis.call('SREM', key, ARGV[2])
end
return redis.call('SMEMBERS', key)
