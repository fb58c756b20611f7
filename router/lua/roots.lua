-- The replicas that may hold each root block (a prompt's first block), shared by route.lua,
-- record_predicted.lua and apply_events.lua (router/redis_keys.py load_lua puts this file
-- where a script says "--! include roots.lua", after the includes of sweep.lua and
-- exact.lua). Hash
-- <base>:roots: root block (8 bytes) -> its holders, each replica id followed by a zero
-- byte, after a leading zero byte.
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
-- Lists ``id`` among the holders of ``root``; returns whether it was not listed yet.
local function add_holder(rkey, root, id)
  local v = redis.call('HGET', rkey, root)
  if holds(v, id) then return false end
  if not v then as_table(rkey) end  -- sweep.lua
  redis.call('HSET', rkey, root, (v or '\0') .. id .. '\0')
  return true
end
-- A holder is dropped only once its root has been gone for ROOTS_SLACK_MS by the dropping
-- router's clock: routers whose clocks differ by less then never hide from each other a
-- predicted root that one of them still sees live (the list is shared; a holder kept a
-- little longer costs only its walk).
local ROOTS_SLACK_MS = 1000
-- Whether replica ``id`` may still hold ``root`` at ``now`` (ms): an exact entry, or a
-- predicted one that expired less than ROOTS_SLACK_MS ago (or not at all); the key names
-- are router/redis_keys.py RedisKeys.exact / .predicted of the base that <base>:roots names.
local function still_holds(base, id, root, now)
  if held_entry(redis.call('HGET', base .. ':x:' .. id, root)) then return true end
  local e = tonumber(redis.call('HGET', base .. ':p:' .. id, root))
  return e ~= nil and e > now - ROOTS_SLACK_MS
end
-- Continue the pass over <base>:roots (sweep.lua's ``sweep``: cursor, pause), about ``count``
-- entries: each keeps only its holders that may still hold its root, and goes when none
-- does. A write that listed k new holders sweeps about 2k entries, so the list cannot grow
-- faster than the sweep removes what has gone stale.
local function sweep_roots(rkey, now, count)
  local base = string.sub(rkey, 1, -7)  -- without ':roots'
  sweep(rkey, now, count, function(root, v)
    local keep = '\0'
    for id in string.gmatch(v, '%z([^%z]+)') do
      if still_holds(base, id, root, now) then keep = keep .. id .. '\0' end
    end
    return keep ~= '\0' and keep
  end)
end
