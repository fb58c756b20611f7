-- Apply one replica's KV events to its exact entries, in order; also purges a replica.
-- KEYS[1]: the replica's exact hash (block -> physical copies the engine holds)
-- KEYS[2]: the replica's predicted hash; KEYS[3]: replicas set; KEYS[4]: its tombstone;
-- KEYS[5]: the root holders hash (roots.lua)
-- ARGV[1]: replica id; ARGV[2..]: ops, each one of (<hashes>: the event's block hashes as
-- one argument, 8 bytes each, big-endian: router/redis_keys.py pack_hashes)
--   "s" <hashes>         BlockStored with a parent: one more physical copy of each hash
--   "S" <hashes>         BlockStored from block 0: one more copy of each hash not yet held
--                        (a run from block 0 over held blocks is a re-announcement); its
--                        first hash is a root: the replica is among its holders
--   "r" <hashes>         BlockRemoved: one copy fewer; the entry goes at zero
--   "c"                  AllBlocksCleared: drop all entries of the replica (its predicted
--                        ones predate the clear too)
--   "t" <now ms>         the router's time (last): the root holders' sweep runs once at the
--                        end when first blocks were newly listed, over twice as many
--                        entries (roots.lua)
--   "x" <ttl s>          replica gone: drop its exact and predicted entries and leave a
--                        tombstone for <ttl s>: later ops of the replica are refused (its
--                        feed may still write during its shutdown, or rebuild what the
--                        routers purged); returns 0 when refused
-- Counting copies keeps an entry while the engine holds a second physical block with the
-- same hash (vLLM does not de-duplicate blocks).
--! include sweep.lua
--! include roots.lua
local xkey, pkey = KEYS[1], KEYS[2]
if ARGV[2] ~= 'x' and redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
local purged, listed, now = false, 0, nil
local i = 2
while i <= #ARGV do
  local op = ARGV[i]
  if op == 't' then
    now = tonumber(ARGV[i + 1]); i = i + 2
  elseif op == 'c' then
    redis.call('DEL', xkey, pkey); i = i + 1
  elseif op == 'x' then
    redis.call('DEL', xkey, pkey, pkey .. ':cursor', pkey .. ':swept'); redis.call('SREM', KEYS[3], ARGV[1])
    redis.call('SET', KEYS[4], 1, 'EX', tonumber(ARGV[i + 1]))
    purged = true; i = i + 2
  else
    local packed = ARGV[i + 1]
    if op ~= 'r' and #packed >= 8 then as_table(xkey) end  -- sweep.lua
    if op == 'S' and #packed >= 8 then
      if add_holder(KEYS[5], string.sub(packed, 1, 8), ARGV[1]) then listed = listed + 1 end
    end
    for k = 1, #packed, 8 do
      local h = string.sub(packed, k, k + 7)
      if op == 's' then
        redis.call('HINCRBY', xkey, h, 1)
      elseif op == 'S' then
        redis.call('HSETNX', xkey, h, 1)
      else
        local c = tonumber(redis.call('HGET', xkey, h))
        if c then
          if c <= 1 then redis.call('HDEL', xkey, h) else redis.call('HINCRBY', xkey, h, -1) end
        end
      end
    end
    i = i + 2
  end
end
if not purged then redis.call('SADD', KEYS[3], ARGV[1]) end
-- the holders listed by KV events alone (a policy that writes no predictions) are swept too,
-- twice as many entries as this call listed (a batch of events may list many first blocks)
if listed > 0 and now then sweep_roots(KEYS[5], now, 2 * listed) end
return 1
