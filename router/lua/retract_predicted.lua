-- Take back the predicted entries that one route script wrote for a replica the request
-- did not go to: the script ran after its caller had stopped waiting, and the caller sent
-- the request elsewhere (router/routing/core.py, the late route's settlement).
-- KEYS[1]: the replica's predicted hash (block -> expiry ms)
-- ARGV[1]: the script's expiry for that replica (its now_ms plus the replica's TTL, in ms,
--          as decimal text, as route.lua wrote it); ARGV[2]: the request's block hashes,
--          8 bytes each, big-endian (router/redis_keys.py pack_hashes)
-- Only fields whose value is exactly that expiry go: the ones the script wrote, and no
-- later write (a later one has another expiry). An entry the script refreshed goes too:
-- a prediction is taken back whole, never left at the script's longer expiry.
-- Returns: the number of entries removed.
local key, stamp, packed = KEYS[1], ARGV[1], ARGV[2]
local hs = {}
for i = 1, #packed, 8 do hs[#hs + 1] = string.sub(packed, i, i + 7) end
local gone = {}
-- in chunks: unpack takes at most about 8,000 values
for c = 1, #hs, 1024 do
  local part = redis.call('HMGET', key, unpack(hs, c, math.min(c + 1023, #hs)))
  for k = 1, #part do
    if part[k] == stamp then gone[#gone + 1] = hs[c + k - 1] end
  end
end
for c = 1, #gone, 1024 do
  redis.call('HDEL', key, unpack(gone, c, math.min(c + 1023, #gone)))
end
return #gone
