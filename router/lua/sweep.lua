-- The amortised sweep of a predicted hash, shared by route.lua and record_predicted.lua
-- (router/redis_keys.py load_lua puts this file where a script says "--! include
-- sweep.lua"). Continue the pass whose cursor is kept beside the hash (<pkey>:cursor),
-- ``count`` fields, deleting the entries expired at ``now`` (the router's time, ms). A
-- finished pass leaves in <pkey>:swept the time at which the next may start; the cursor
-- itself stays an HSCAN cursor, so a router of an earlier version sharing the namespace
-- reads it as before. A mark more than SWEEP_SKEW_MS ahead (written by a router whose clock
-- runs far ahead) is due at once; within it, routers whose clocks differ by less keep the
-- pause. Without the pause a small hash (a listpack: up to hash-max-listpack-entries
-- fields, 128 by default), which HSCAN returns whole, was read whole on every write.
local SWEEP_PAUSE_MS, SWEEP_SKEW_MS = 1000, 10000
local function sweep(pkey, now, count)
  local ckey, skey = pkey .. ':cursor', pkey .. ':swept'
  local resume = tonumber(redis.call('GET', skey))
  if resume and now < resume and resume <= now + SWEEP_SKEW_MS then return end
  local res = redis.call('HSCAN', pkey, redis.call('GET', ckey) or '0', 'COUNT', count)
  for k = 1, #res[2], 2 do
    if tonumber(res[2][k + 1]) <= now then redis.call('HDEL', pkey, res[2][k]) end
  end
  redis.call('SET', ckey, res[1], 'PX', 3600000)
  if res[1] == '0' then
    redis.call('SET', skey, string.format('%d', now + SWEEP_PAUSE_MS), 'PX', 3600000)
  end
end
