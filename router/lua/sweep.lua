-- The upkeep of a predicted hash, its expiry and the amortised sweep of its expired entries
-- (the sweep also serves the root holders, roots.lua), shared by route.lua,
-- record_predicted.lua, forget_predicted.lua and apply_events.lua (router/redis_keys.py
-- load_lua puts this file where a script says "--! include sweep.lua"). Continue the pass
-- whose cursor is kept beside the hash (<pkey>:cursor), ``count`` fields, deleting the
-- entries expired at ``now`` (the router's time, ms). A finished pass leaves in
-- <pkey>:swept the time at which the next may start; the cursor
-- itself stays an HSCAN cursor, so a router of an earlier version sharing the namespace
-- reads it as before. A mark more than SWEEP_SKEW_MS ahead (written by a router whose clock
-- runs far ahead) is due at once; within it, routers whose clocks differ by less keep the
-- pause. Without the pause a small hash (a listpack: up to hash-max-listpack-entries
-- fields, 128 by default), which HSCAN returns whole, was read whole on every write.
local SWEEP_PAUSE_MS, SWEEP_SKEW_MS = 1000, 10000
-- A predicted entry is swept only once it has been expired for SWEEP_SLACK_MS by the
-- sweeping router's clock: a router whose clock is behind by less still sees it live, and
-- a hash in order stays in order by its clock too (a sweep of a parent that a router behind
-- sees live, its child kept, let that router's search count blocks no longer held). As
-- roots.lua's ROOTS_SLACK_MS.
local SWEEP_SLACK_MS = 1000
-- Every hash of the index (a replica's exact and predicted hashes, the root holders) is made
-- with one field more, TABLE_FIELD (a name of 1 byte: a block's is 8), whose value is longer
-- than hash-max-listpack-value (64 bytes by default): Redis then keeps the hash as a hash
-- table from its start, not as a listpack, whose HMGET finds each field by a linear scan
-- (a walk of 512 blocks in a listpack of 512 fields cost Redis 1.9 ms, against 0.31 ms in
-- a hash table; docs/benchmarks.md). Readers pass over it: it is no block.
-- TABLE_FIELD's value may begin with a number (digits, then '~'s to the same length; no
-- digits: 0): an exact hash's orphan count (exact.lua), a predicted hash's time until which
-- it may be out of order (below).
local TABLE_FIELD, TABLE_VALUE = '~', string.rep('~', 128)
local function as_table(key)
  if redis.call('EXISTS', key) == 0 then redis.call('HSET', key, TABLE_FIELD, TABLE_VALUE) end
end
-- the number that TABLE_FIELD's value ``v`` begins with (false or nil: no hash): 0 if none
local function number_in(v)
  return v and tonumber(string.match(v, '^%d+')) or 0
end
-- TABLE_FIELD's value that begins with the number ``n`` (as long as TABLE_VALUE)
local function with_number(n)
  if n <= 0 then return TABLE_VALUE end
  local d = string.format('%d', n)
  return d .. string.rep('~', #TABLE_VALUE - #d)
end

-- The block hashes packed 8 bytes each in ``packed`` from its byte ``from`` (default 1)
-- (router/redis_keys.py pack_hashes), as a list.
local function unpack_hashes(packed, from)
  local hs = {}
  for k = from or 1, #packed - 7, 8 do hs[#hs + 1] = string.sub(packed, k, k + 7) end
  return hs
end
-- HMGET of every field of the list ``fields`` of hash ``key`` in chunks of 1,024 (unpack
-- takes at most about 8,000 values: a 128k-token prompt has 8,192 blocks of 16 tokens);
-- the values in the fields' order (false: no field).
local function hmget_all(key, fields)
  local vals = {}
  for a = 1, #fields, 1024 do
    local part = redis.call('HMGET', key, unpack(fields, a, math.min(a + 1023, #fields)))
    for k = 1, #part do vals[a + k - 1] = part[k] end
  end
  return vals
end

-- A predicted hash's order. While no live entry expires later than its block's parent
-- (the block before it in every prompt that holds it: the hashes are chained), the blocks
-- of a prompt held by live predicted entries are a leading run, so route.lua finds its end
-- by a search of a few reads instead of walking every block. The writes keep that order:
-- route.lua gives the blocks it writes past a prompt's fresh run at most the expiry of the
-- run's last block, record_predicted.lua writes a prompt's blocks from its first, each to
-- at least one expiry, and a sweep deletes only expired entries. Two things may break it,
-- and mark the hash out of order until every entry they may have put out of order has
-- expired (the time, ms, that TABLE_FIELD's value begins with; none: in order): a write
-- past a fresh run whose last block is held exactly with no predicted entry to bound the
-- new ones (a fleet with KV events), and deleted entries whose children stay
-- (forget_predicted.lua). Until then route.lua walks the predicted entries. An entry that
-- route.lua writes lower than it was (only in a hash out of order: in order, an entry past
-- the fresh run expires no later than the run's first block that is not fresh, at most
-- half a TTL from now) can only put out of order children that expire before the mark.
-- (Routers' clocks differ: a sweep deletes an entry only SWEEP_SLACK_MS after it expired,
-- so a router whose clock is behind by less never sees a hole that a sweep made; one
-- further behind may count, until its clock catches up, blocks whose entries were swept.)
local function unordered_until(v)  -- v: TABLE_FIELD's value
  return number_in(v)
end
local function mark_unordered(pkey, until_ms)
  if number_in(redis.call('HGET', pkey, TABLE_FIELD)) < until_ms then
    redis.call('HSET', pkey, TABLE_FIELD, with_number(until_ms))
  end
end
-- ``keep`` (optional): for another hash than a predicted one (roots.lua), the value a
-- field keeps (false: the field goes), from its name and value; by default a field whose
-- value is an expiry (ms) goes once it is past.
local function sweep(pkey, now, count, keep)
  local ckey, skey = pkey .. ':cursor', pkey .. ':swept'
  local resume = tonumber(redis.call('GET', skey))
  if resume and now < resume and resume <= now + SWEEP_SKEW_MS then return end
  local res = redis.call('HSCAN', pkey, redis.call('GET', ckey) or '0', 'COUNT', count)
  for k = 1, #res[2], 2 do
    local field, v = res[2][k], res[2][k + 1]
    local kept
    if field == TABLE_FIELD then kept = v
    elseif keep then kept = keep(field, v) else kept = tonumber(v) > now - SWEEP_SLACK_MS and v end
    if not kept then
      redis.call('HDEL', pkey, field)
    elseif kept ~= v then
      redis.call('HSET', pkey, field, kept)
    end
  end
  redis.call('SET', ckey, res[1], 'PX', 3600000)
  if res[1] == '0' then
    redis.call('SET', skey, string.format('%d', now + SWEEP_PAUSE_MS), 'PX', 3600000)
  end
end

-- The predicted hash ``pkey`` expires with its latest entry (``expiry``, ms): its expiry
-- moves only later, and a hash without one (new) gets this one (its PTTL is read only when
-- GT did not move it).
local function expire_later(pkey, expiry)
  if redis.call('PEXPIREAT', pkey, expiry, 'GT') == 0 and redis.call('PTTL', pkey) == -1 then
    redis.call('PEXPIREAT', pkey, expiry)
  end
end
