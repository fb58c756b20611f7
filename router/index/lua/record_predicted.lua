-- Predicted entries for one replica.
-- KEYS[1]: the replica's set of predicted block hashes; KEYS[2..]: block keys
-- ARGV[1]: replica id; ARGV[2]: expiry (ms); ARGV[3..]: the block hashes of KEYS[2..]
-- A field's expiry only moves later. A block key without exact entries expires with its
-- latest predicted entry; a key with exact entries has no expiry (exact entries live until
-- the engine reports their removal).
local field = '~' .. ARGV[1]
local expiry = tonumber(ARGV[2])
for i = 2, #KEYS do
  local key = KEYS[i]
  local ttl = redis.call('PTTL', key)  -- -2 missing, -1 persistent (exact entries), else volatile
  local old = tonumber(redis.call('HGET', key, field))
  if not old or old < expiry then
    redis.call('HSET', key, field, expiry)
  end
  if ttl == -2 then
    redis.call('PEXPIREAT', key, expiry)
  elseif ttl ~= -1 then
    redis.call('PEXPIREAT', key, expiry, 'GT')
  end
  redis.call('SADD', KEYS[1], ARGV[i + 1])
end
redis.call('PEXPIREAT', KEYS[1], expiry, 'GT')
if redis.call('PTTL', KEYS[1]) == -1 then redis.call('PEXPIREAT', KEYS[1], expiry) end
return #KEYS - 1
