-- Apply one replica's KV events to its exact entries, in order; also purges a replica.
-- KEYS[1]: the replica's exact hash; KEYS[2]: its predicted hash; KEYS[3]: replicas set;
-- KEYS[4]: its tombstone; KEYS[5]: the root holders hash (roots.lua)
-- ARGV[1]: replica id; ARGV[2..]: ops, each one of (<hashes>: block hashes as one argument,
-- 8 bytes each, big-endian: router/redis_keys.py pack_hashes)
--   "s" <parent><hashes> BlockStored after block <parent> (its first 8 bytes): one more
--                        physical copy of each hash; each block's parent is the one before
--   "S" <hashes>         BlockStored from block 0: one more copy of each hash not yet held
--                        (a run from block 0 over held blocks is a re-announcement); its
--                        first hash is a root: the replica is among its holders
--   "u" <hashes>         blocks stored after parents the writer does not say (the feed's
--                        rebuild, for the copies past a block's first): one more copy of
--                        each (a block not held yet counts as an orphan)
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
--
-- The exact hash's entries: block -> "<copies>,<children>,<parent>" (exact.lua), and the
-- orphan count (exact.lua: while it is 0, the held blocks are closed under parents, and
-- route.lua finds a prompt's held run by a search, not a walk). The writes
-- are gathered per call: each block's entry is read once (HMGET per op) and written once
-- at the end (HSET / HDEL in chunks).
--! include sweep.lua
--! include exact.lua
--! include roots.lua
local xkey, pkey = KEYS[1], KEYS[2]
if ARGV[2] ~= 'x' and redis.call('EXISTS', KEYS[4]) == 1 then return 0 end
local purged, listed, now = false, 0, nil
-- cache[h]: the entry of block h as read or changed in this call ({c, k, t}), false: none
local cache, dirty, order, orphans = {}, {}, {}, 0
local function load(list)
  local need = {}
  for _, h in ipairs(list) do
    if cache[h] == nil then need[#need + 1] = h; cache[h] = false end
  end
  local vals = hmget_all(xkey, need)  -- sweep.lua
  for m = 1, #need do cache[need[m]] = parse_entry(vals[m]) end
end
local function put(h, e)
  cache[h] = e
  if not dirty[h] then dirty[h] = true; order[#order + 1] = h end
end
-- Block h becomes held or gains a copy. ``tag``: its parent's 8 bytes, '' (a root) or
-- UNKNOWN_PARENT; ``again``: a re-announcement adds no copy to a held block.
local function store(h, tag, again)
  local e = cache[h]
  if e and e.c > 0 then
    if not again then e.c = e.c + 1; put(h, e) end
    return
  end
  local k = e and e.k or 0
  orphans = orphans - k  -- its held children have a held parent again
  if #tag == 8 then
    local p = cache[tag]
    if p and p.c > 0 then
      p.k = p.k + 1; put(tag, p)
    else
      tag = UNKNOWN_PARENT  -- stored after a block this replica does not hold
    end
  end
  if tag == UNKNOWN_PARENT then orphans = orphans + 1 end
  put(h, {c = 1, k = k, t = tag})
end
-- Block h loses a copy (its parent's entry is in the cache: an 'r' op reads the parents of
-- all its held blocks before it removes any, and a block stored in this call read its own).
local function remove(h)
  local e = cache[h]
  if not e or e.c == 0 then return end
  if e.c > 1 then e.c = e.c - 1; put(h, e); return end
  e.c = 0
  if e.t == UNKNOWN_PARENT then
    orphans = orphans - 1
  elseif #e.t == 8 then
    local p = cache[e.t]
    if p then
      p.k = p.k - 1
      if p.c == 0 then orphans = orphans - 1 end  -- h was an orphan: its parent had gone
      put(e.t, p)
    end
  end
  orphans = orphans + e.k  -- its held children lose their parent
  e.t = ''
  put(h, e)  -- kept as a placeholder (no copy) while it has held children
end
local function reset()
  cache, dirty, order, orphans = {}, {}, {}, 0
end
local i = 2
while i <= #ARGV do
  local op = ARGV[i]
  if op == 't' then
    now = tonumber(ARGV[i + 1]); i = i + 2
  elseif op == 'c' then
    redis.call('DEL', xkey, pkey); reset(); i = i + 1
  elseif op == 'x' then
    redis.call('DEL', xkey, pkey, pkey .. ':cursor', pkey .. ':swept'); redis.call('SREM', KEYS[3], ARGV[1])
    redis.call('SET', KEYS[4], 1, 'EX', tonumber(ARGV[i + 1]))
    reset(); purged = true; i = i + 2
  else
    local packed = ARGV[i + 1]
    local hs = unpack_hashes(packed, op == 's' and 9 or 1)  -- sweep.lua
    if op == 'r' then
      load(hs)
      local parents = {}
      for _, h in ipairs(hs) do
        local e = cache[h]
        if e and e.c > 0 and #e.t == 8 then parents[#parents + 1] = e.t end
      end
      load(parents)
      for _, h in ipairs(hs) do remove(h) end
    elseif #hs > 0 then
      local tag = ''
      if op == 's' then tag = string.sub(packed, 1, 8) end
      if op == 'u' then tag = UNKNOWN_PARENT end
      if #tag == 8 then hs[#hs + 1] = tag end  -- read with the blocks
      load(hs)
      if #tag == 8 then hs[#hs] = nil end
      if op == 'S' and add_holder(KEYS[5], hs[1], ARGV[1]) then listed = listed + 1 end
      for _, h in ipairs(hs) do
        store(h, tag, op == 'S')
        if op ~= 'u' then tag = h end
      end
    end
    i = i + 2
  end
end
-- the writes: one HSET and one HDEL per 512 entries
local sets, dels = {}, {}
for _, h in ipairs(order) do
  local v = format_entry(cache[h])
  if v then
    sets[#sets + 1] = h; sets[#sets + 1] = v
    if #sets >= 1024 then as_table(xkey); redis.call('HSET', xkey, unpack(sets)); sets = {} end
  else
    dels[#dels + 1] = h
    if #dels >= 512 then redis.call('HDEL', xkey, unpack(dels)); dels = {} end
  end
end
if #sets > 0 then as_table(xkey); redis.call('HSET', xkey, unpack(sets)) end
if #dels > 0 then redis.call('HDEL', xkey, unpack(dels)) end
if orphans ~= 0 then
  as_table(xkey)
  local n = orphans_in(redis.call('HGET', xkey, TABLE_FIELD)) + orphans
  redis.call('HSET', xkey, TABLE_FIELD, orphans_value(n))
end
if not purged then redis.call('SADD', KEYS[3], ARGV[1]) end
-- the holders listed by KV events alone (a policy that writes no predictions) are swept too,
-- twice as many entries as this call listed (a batch of events may list many first blocks)
if listed > 0 and now then sweep_roots(KEYS[5], now, 2 * listed) end
return 1
