-- Load leases: reserve or release a request, mark its prefill done, or sweep leases of
-- dead routers; and the replicas' counts of new-prefix placements.
-- KEYS[1]: load hash; KEYS[2]: lease hash; reserve only: KEYS[3] the router's heartbeat key
-- (with shard groups, all three carry the group's hash tag: one slot)
-- ARGV[1]: op ("reserve" | "release" | "prefill_done" | "sweep" | "purge" | "placed" |
--   "unplaced"); then
--   reserve: ARGV[2] request id, ARGV[3] replica, ARGV[4] prefill tokens, ARGV[5] now (ms),
--          ARGV[6] the owner ("router id|attempt"), ARGV[7] heartbeat TTL (ms): any
--          earlier lease of the id is released, the replica's counts grow, its last
--          assignment is now, the lease is written, and the heartbeat refreshed (no lease
--          without a live heartbeat: another router's sweep would release it)
--   release / prefill_done: ARGV[2] request id, ARGV[3] the owner ("router id|attempt")
--          it acts for (empty: whichever lease the id holds); a lease of a later attempt,
--          or of another router, is left as it is, so a late retry of an earlier attempt's
--          release cannot end a later reservation
--   sweep: ARGV[2] key prefix of router heartbeats (a lease whose router has no heartbeat
--          key is released)
--   purge: ARGV[2] replica id (it left: drop its load and leases)
--   placed: ARGV[2] replica id, ARGV[3] now (ms), ARGV[4] window (ms): a prefix no replica
--          held was placed there; its decaying count (<replica>:k as of <replica>:kt, time
--          constant the window, as route.lua) grows by one
--   unplaced: the same arguments: a placement counted there went elsewhere; the count
--          shrinks by one (never below 0)
-- A lease is "replica|prefill tokens|prefill done (0/1)|router id|attempt" (route.lua and
-- router/load/redis.py write it; a lease without the attempt field is read as attempt "").
-- Idempotent: a lease is removed once, and only a present lease changes the counters.
-- A lease is deleted before its counters change, and a zero change is never sent: Redis
-- refuses HINCRBY by -0 (the negation of a 0-token lease), and a script stopped between
-- the two would decrement again at every retry or sweep (CI saw counts at -8 and -20).
local load, leases, op = KEYS[1], KEYS[2], ARGV[1]
--! include placements.lua
local function parse(v)
  local r, p, done, tail = string.match(v, '^(.-)|(%d+)|(%d)|(.*)$')
  if not r then return nil end
  local router, attempt = string.match(tail, '^([^|]*)|?(.*)$')
  return r, tonumber(p), done, router, attempt
end
-- the lease of ARGV[2] if ARGV[3] ("router|attempt") may act on it: a lease of that router
-- and of that attempt or an earlier one (a stale write of an earlier attempt, say a route
-- script that ran after its caller timed out, goes with the later attempt's release); never
-- a later attempt's. Any lease when ARGV[3] is empty.
local function lease_of_owner()
  local v = redis.call('HGET', leases, ARGV[2])
  if not v then return nil end
  local want = ARGV[3] or ''
  if want ~= '' then
    local r, p, done, router, attempt = parse(v)
    local wrouter, wattempt = string.match(want, '^([^|]*)|(%d+)$')
    if r and wrouter then
      if router ~= wrouter then return nil end
      if (tonumber(attempt) or 0) > tonumber(wattempt) then return nil end
    elseif r and router .. '|' .. attempt ~= want then
      return nil
    end
  end
  return v
end
local function add(field, delta)
  if delta ~= 0 then redis.call('HINCRBY', load, field, delta) end
end
local function release(req, v)
  local r, p, done = parse(v)
  redis.call('HDEL', leases, req)
  if not r then return end  -- not a lease this script wrote: dropped, no counter touched
  add(r .. ':n', -1)
  if done == '0' then add(r .. ':p', -p) end
end
if op == 'reserve' then
  local old = redis.call('HGET', leases, ARGV[2])
  if old then release(ARGV[2], old) end
  local r = ARGV[3]
  redis.call('HINCRBY', load, r .. ':n', 1)
  redis.call('HINCRBY', load, r .. ':p', ARGV[4])  -- a count >= 0, never '-0'
  redis.call('HSET', load, r .. ':t', ARGV[5])
  redis.call('HSET', leases, ARGV[2], r .. '|' .. ARGV[4] .. '|0|' .. ARGV[6])
  redis.call('SET', KEYS[3], 1, 'PX', tonumber(ARGV[7]))
  return 1
elseif op == 'release' then
  local v = lease_of_owner()
  if v then release(ARGV[2], v); return 1 end
  return 0
elseif op == 'prefill_done' then
  local v = lease_of_owner()
  if not v then return 0 end
  local r, p, done, router, attempt = parse(v)
  if not r or done == '1' then return 0 end
  local tail = router
  if attempt ~= '' then tail = router .. '|' .. attempt end
  redis.call('HSET', leases, ARGV[2], r .. '|' .. p .. '|1|' .. tail)
  add(r .. ':p', -p)
  return 1
elseif op == 'sweep' then
  local all = redis.call('HGETALL', leases)
  local n = 0
  for k = 1, #all, 2 do
    local r, p, done, router = parse(all[k + 1])
    if not r or redis.call('EXISTS', ARGV[2] .. router) == 0 then
      release(all[k], all[k + 1]); n = n + 1
    end
  end
  return n
elseif op == 'purge' then
  local all = redis.call('HGETALL', leases)
  for k = 1, #all, 2 do
    local r = parse(all[k + 1])
    if r == ARGV[2] then redis.call('HDEL', leases, all[k]) end
  end
  redis.call('HDEL', load, ARGV[2] .. ':n', ARGV[2] .. ':p', ARGV[2] .. ':t',
             ARGV[2] .. ':k', ARGV[2] .. ':kt')
  return 1
elseif op == 'placed' or op == 'unplaced' then
  local r, now, window = ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
  local v = redis.call('HMGET', load, r .. ':k', r .. ':kt')
  place(load, r, decayed_placements(v[1], v[2], now, window), now,
        op == 'placed' and 1 or -1)
  return 1
end
return redis.error_reply('unknown op ' .. tostring(op))
