-- Predicted entries of one replica deleted before they expire (router/index/redis.py
-- forget_predicted: a request its engine refused, a decision that moved elsewhere).
-- KEYS[1]: the replica's predicted hash; ARGV[1]: the block hashes, 8 bytes each
-- (router/redis_keys.py pack_hashes). Returns how many entries went.
-- The deleted blocks' children (blocks of other prompts past them) may stay, live without
-- their parent: the hash is marked out of order (sweep.lua) until the latest expiry among
-- the deleted entries, past which no child of theirs lives (a hash in order: no child
-- expires later than its parent; one out of order: those that do expire before its mark).
--! include sweep.lua

local key, packed = KEYS[1], ARGV[1]
local hs = {}
for i = 1, #packed, 8 do hs[#hs + 1] = string.sub(packed, i, i + 7) end
local latest, gone = 0, 0
-- in chunks: unpack takes at most about 8,000 values
for c = 1, #hs, 1024 do
  local part = {unpack(hs, c, math.min(c + 1023, #hs))}
  local v = redis.call('HMGET', key, unpack(part))
  local del = {}
  for k = 1, #part do
    local e = tonumber(v[k])
    if e then
      del[#del + 1] = part[k]
      if e > latest then latest = e end
    end
  end
  if #del > 0 then
    redis.call('HDEL', key, unpack(del))
    gone = gone + #del
  end
end
if latest > 0 then mark_unordered(key, latest) end
return gone
