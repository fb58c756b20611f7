-- The replicas that may hold each root block (a prompt's first block), shared by route.lua,
-- record_predicted.lua and apply_events.lua (router/redis_keys.py load_lua puts this file
-- where a script says "--! include roots.lua"). Hash <base>:roots: root block (8 bytes) ->
-- its holders, each replica id followed by a zero byte, after a leading zero byte.
-- Invariant: a replica that holds a root, exactly (KV events) or by a live predicted entry,
-- is among its holders. Every write that can make a replica hold a root adds it
-- (``add_holder``: a BlockStored from block 0, a predicted write from block 0); nothing
-- needs to remove it on time: the list may name replicas that no longer hold the root
-- (evicted, expired, cleared, purged), which only costs their walk. So a candidate not
-- among a prompt's root holders holds none of the prompt (block hashes chain from the
-- root), and the route script reads nothing for it. Holders that no longer hold are
-- dropped when a route finds them so, and by an amortised sweep (``sweep_roots``).
local function holds(v, id)
  return v and string.find(v, '\0' .. id .. '\0', 1, true) ~= nil
end
local function add_holder(rkey, root, id)
  local v = redis.call('HGET', rkey, root)
  if not holds(v, id) then redis.call('HSET', rkey, root, (v or '\0') .. id .. '\0') end
end
-- Whether replica ``id`` still holds ``root`` at ``now`` (ms): an exact entry, or a predicted
-- one not expired; the key names are router/redis_keys.py RedisKeys.exact / .predicted of the
-- base that <base>:roots names.
local function still_holds(base, id, root, now)
  if redis.call('HGET', base .. ':x:' .. id, root) then return true end
  local e = tonumber(redis.call('HGET', base .. ':p:' .. id, root))
  return e ~= nil and e > now
end
-- Continue the pass over <base>:roots (cursor in <base>:roots:cursor, as sweep.lua), about
-- ``count`` entries: each keeps only its holders that still hold its root, and goes when
-- none does. A finished pass pauses ROOTS_PAUSE_MS (<base>:roots:swept), as sweep.lua's.
local ROOTS_PAUSE_MS, ROOTS_SKEW_MS = 1000, 10000
local function sweep_roots(rkey, now, count)
  local ckey, skey = rkey .. ':cursor', rkey .. ':swept'
  local resume = tonumber(redis.call('GET', skey))
  if resume and now < resume and resume <= now + ROOTS_SKEW_MS then return end
  local base = string.sub(rkey, 1, -7)  -- without ':roots'
  local res = redis.call('HSCAN', rkey, redis.call('GET', ckey) or '0', 'COUNT', count)
  for k = 1, #res[2], 2 do
    local root, v = res[2][k], res[2][k + 1]
    local keep = '\0'
    for id in string.gmatch(v, '%z([^%z]+)') do
      if still_holds(base, id, root, now) then keep = keep .. id .. '\0' end
    end
    if keep == '\0' then
      redis.call('HDEL', rkey, root)
    elseif keep ~= v then
      redis.call('HSET', rkey, root, keep)
    end
  end
  redis.call('SET', ckey, res[1], 'PX', 3600000)
  if res[1] == '0' then
    redis.call('SET', skey, string.format('%d', now + ROOTS_PAUSE_MS), 'PX', 3600000)
  end
end
