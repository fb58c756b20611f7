-- Predicted entries of one replica deleted before they expire (router/index/redis.py
-- forget_predicted: a request its engine refused, a decision that moved elsewhere).
-- KEYS[1]: the replica's predicted hash; ARGV[1]: the block hashes, 8 bytes each
-- (router/redis_keys.py pack_hashes). Returns how many entries went.
-- The deleted blocks' children (blocks of other prompts past them) may stay, live without
-- their parent: the hash is marked out of order (sweep.lua) until the latest expiry among
-- the deleted entries, past which no child of theirs lives (a hash in order: no child
-- expires later than its parent; one out of order: those that do expire before its mark).
--! include sweep.lua

local key = KEYS[1]
local hs = unpack_hashes(ARGV[1])  -- sweep.lua
local v = hmget_all(key, hs)  -- sweep.lua
local latest, gone, del = 0, 0, {}
for k = 1, #hs do
  local e = tonumber(v[k])
  if e then
    del[#del + 1] = hs[k]; gone = gone + 1
    if e > latest then latest = e end
    if #del >= 1024 then redis.call('HDEL', key, unpack(del)); del = {} end
  end
end
if #del > 0 then redis.call('HDEL', key, unpack(del)) end
if latest > 0 then mark_unordered(key, latest) end
return gone
