-- Load leases: release a request, mark its prefill done, or sweep leases of dead routers.
-- KEYS[1]: load hash; KEYS[2]: lease hash
-- ARGV[1]: op ("release" | "prefill_done" | "sweep" | "purge"); then
--   release / prefill_done: ARGV[2] request id
--   sweep: ARGV[2] key prefix of router heartbeats (a lease whose router has no heartbeat
--          key is released)
--   purge: ARGV[2] replica id (it left: drop its load and leases)
-- Idempotent: a lease is removed once, and only a present lease changes the counters.
-- A lease is deleted before its counters change, and a zero change is never sent: Redis
-- refuses HINCRBY by -0 (the negation of a 0-token lease), and a script stopped between
-- the two would decrement again at every retry or sweep (CI saw counts at -8 and -20).
local load, leases, op = KEYS[1], KEYS[2], ARGV[1]
local function parse(v)
  local r, p, done, router = string.match(v, '^(.-)|(%d+)|(%d)|(.*)$')
  return r, tonumber(p), done, router
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
if op == 'release' then
  local v = redis.call('HGET', leases, ARGV[2])
  if v then release(ARGV[2], v); return 1 end
  return 0
elseif op == 'prefill_done' then
  local v = redis.call('HGET', leases, ARGV[2])
  if not v then return 0 end
  local r, p, done, router = parse(v)
  if not r or done == '1' then return 0 end
  redis.call('HSET', leases, ARGV[2], r .. '|' .. p .. '|1|' .. router)
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
  redis.call('HDEL', load, ARGV[2] .. ':n', ARGV[2] .. ':p', ARGV[2] .. ':t')
  return 1
end
return redis.error_reply('unknown op ' .. tostring(op))
