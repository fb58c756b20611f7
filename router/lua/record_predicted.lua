-- Predicted entries for one replica, and amortised removal of its expired ones.
-- KEYS[1]: the replica's predicted hash (block -> expiry ms); KEYS[2]: replicas set;
-- KEYS[3]: the root holders hash (roots.lua): the hashes are a prompt's from its first
-- ARGV[1]: replica id; ARGV[2]: expiry (ms); ARGV[3]: now (ms); ARGV[4]: the block hashes,
-- 8 bytes each, big-endian (router/redis_keys.py pack_hashes)
-- An entry's expiry only moves later. The hash itself expires with its latest entry; while
-- it lives, each call also scans a few fields and deletes expired ones, so its size stays
-- bounded by the TTL times the rate of new blocks. A pass of that sweep ends when its
-- cursor comes back to 0, and the next starts SWEEP_PAUSE_MS later (sweep.lua).
--! include sweep.lua
--! include exact.lua
--! include roots.lua

local key, expiry, now = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local hs = unpack_hashes(ARGV[4])  -- sweep.lua
if #hs > 0 then
  local old = hmget_all(key, hs)  -- sweep.lua
  local args = {}
  as_table(key)  -- sweep.lua
  for k = 1, #hs do
    local o = tonumber(old[k])
    if not o or o < expiry then
      args[#args + 1] = hs[k]; args[#args + 1] = expiry
      if #args >= 512 then redis.call('HSET', key, unpack(args)); args = {} end
    end
  end
  if #args > 0 then redis.call('HSET', key, unpack(args)) end
end
expire_later(key, expiry)  -- sweep.lua
redis.call('SADD', KEYS[2], ARGV[1])
sweep(key, now, 64)  -- sweep.lua
if #hs > 0 then
  add_holder(KEYS[3], hs[1], ARGV[1])
  sweep_roots(KEYS[3], now, 2)
end
return #hs
