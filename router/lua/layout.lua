-- The key layouts in use in a namespace (router/index/layout.py LayoutGuard).
-- KEYS[1]: <ns>:layouts, hash layout version -> expiry (ms) of the presence of routers
--   that read and write the namespace in that layout
-- ARGV: 1 this router's layout version, 2 now (ms), 3 presence TTL (ms)
-- Renews this layout's presence, drops the expired presences of other layouts, and returns
-- {the other layouts present (a list of versions), 1 when this call dropped an expired
-- one of another layout, else 0}. A dropped layout's keys are still in the namespace: the
-- one caller told so clears them (its own layout's presence is already written, so a
-- router of the dropped layout that comes back sees this one).
local key, mine = KEYS[1], ARGV[1]
local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
local all = redis.call('HGETALL', key)
local live, dropped = {}, 0
for k = 1, #all, 2 do
  local v, e = all[k], tonumber(all[k + 1])
  if v ~= mine then
    if e and e > now then
      live[#live + 1] = v
    else
      redis.call('HDEL', key, v)
      dropped = 1
    end
  end
end
redis.call('HSET', key, mine, now + ttl)
return {live, dropped}
