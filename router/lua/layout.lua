-- The key layouts in use in a namespace (router/index/layout.py LayoutGuard).
-- KEYS[1]: <ns>:layouts, hash layout version -> expiry (ms) of the presence of routers
--   that read and write the namespace in that layout; and the field "clearing" -> expiry
--   (ms) of a clear under way (the process that runs it renews it, and deletes it when
--   done)
-- ARGV: 1 this router's layout version, 2 now (ms), 3 presence TTL (ms), 4 "renew" from
--   the process that clears, while it clears; "done" when it has cleared (the field
--   "clearing" deleted); else ""
-- Renews this layout's presence and drops the expired presences of other layouts. When it
-- drops one, or finds a clear whose process stopped renewing it (its expiry passed), the
-- namespace still holds that layout's keys: once no other layout is present, this caller
-- is to clear them, and "clearing" is set for it. Returns {the other layouts present, and "clearing" while a clear is
-- under way (this caller's included): a list; 1 when this caller is to clear, else 0}.
local key, mine = KEYS[1], ARGV[1]
local now, ttl = tonumber(ARGV[2]), tonumber(ARGV[3])
if ARGV[4] == 'done' then redis.call('HDEL', key, 'clearing') end
if ARGV[4] == 'renew' then redis.call('HSET', key, 'clearing', now + ttl) end
local all = redis.call('HGETALL', key)
local live, others, stale = {}, 0, false
for k = 1, #all, 2 do
  local v, e = all[k], tonumber(all[k + 1])
  if v == 'clearing' then
    if e and e > now then live[#live + 1] = v else stale = true end
  elseif v ~= mine then
    if e and e > now then
      live[#live + 1] = v
      others = others + 1
    else
      redis.call('HDEL', key, v)
      stale = true
    end
  end
end
local clear = 0
if stale and others == 0 then
  -- no other layout is present any more, and its keys are still here: this caller clears
  -- them; the others wait ("clearing") until it is done or stops renewing it
  clear = 1
  redis.call('HSET', key, 'clearing', now + ttl)
  if #live == 0 or live[#live] ~= 'clearing' then live[#live + 1] = 'clearing' end
end
redis.call('HSET', key, mine, now + ttl)
return {live, clear}
