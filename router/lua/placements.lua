-- The decaying count of new prefixes placed on a replica, shared by route.lua and lease.lua
-- (router/redis_keys.py load_lua puts this file where a script says "--! include
-- placements.lua"); the same rule as router/load/base.py decayed_placements, which the
-- parity test in tests/test_route_lua.py holds it to. ``k`` and ``kt`` are the load hash's
-- <replica>:k and <replica>:kt fields as read (strings or false), ``now`` and ``window``
-- milliseconds: the count k as of kt, decayed by exp(-(now - kt) / window); 0 with no window.
local function decayed_placements(k, kt, now, window)
  k = tonumber(k or '0')
  if window > 0 and k > 0 then
    return k * math.exp(-math.max(now - tonumber(kt or '0'), 0) / window)
  end
  return 0
end
-- Replica ``r``'s count in load hash ``load``, decayed to ``now`` as ``k``, changed by
-- ``delta`` (1: LoadTracker.placed; -1: LoadTracker.unplaced), never below 0.
local function place(load, r, k, now, delta)
  redis.call('HSET', load, r .. ':k', string.format('%.17g', math.max(k + delta, 0)),
             r .. ':kt', now)
end
