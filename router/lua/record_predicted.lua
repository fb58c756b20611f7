-- Predicted entries for one replica, and amortised removal of its expired ones.
-- KEYS[1]: the replica's predicted hash (block -> expiry ms); KEYS[2]: replicas set
-- ARGV[1]: replica id; ARGV[2]: expiry (ms); ARGV[3]: now (ms); ARGV[4]: the block hashes,
-- 8 bytes each, big-endian (router/redis_keys.py pack_hashes)
-- An entry's expiry only moves later. The hash itself expires with its latest entry; while
-- it lives, each call also scans a few fields and deletes expired ones, so its size stays
-- bounded by the TTL times the rate of new blocks. A pass of that sweep ends when its
-- cursor comes back to 0, and the next starts SWEEP_PAUSE_MS later (route.lua's sweep).
local key, expiry, now = KEYS[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local hs = {}
local packed = ARGV[4]
for i = 1, #packed, 8 do hs[#hs + 1] = string.sub(packed, i, i + 7) end
if #hs > 0 then
  -- read in chunks: unpack takes at most about 8,000 values (a 128k-token prompt at block 16)
  local old = {}
  for c = 1, #hs, 1024 do
    local part = redis.call('HMGET', key, unpack(hs, c, math.min(c + 1023, #hs)))
    for k = 1, #part do old[c + k - 1] = part[k] end
  end
  local args = {}
  for k = 1, #hs do
    local o = tonumber(old[k])
    if not o or o < expiry then
      args[#args + 1] = hs[k]; args[#args + 1] = expiry
      if #args >= 512 then redis.call('HSET', key, unpack(args)); args = {} end
    end
  end
  if #args > 0 then redis.call('HSET', key, unpack(args)) end
end
redis.call('PEXPIREAT', key, expiry, 'GT')
if redis.call('PTTL', key) == -1 then redis.call('PEXPIREAT', key, expiry) end
redis.call('SADD', KEYS[2], ARGV[1])
-- amortised sweep: continue the pass whose cursor is kept beside the hash; a finished
-- pass leaves in <key>:swept the router's time at which the next may start (route.lua's
-- sweep: due at once when more than SWEEP_SKEW_MS ahead)
local SWEEP_PAUSE_MS, SWEEP_SKEW_MS = 1000, 10000
local ckey, skey = key .. ':cursor', key .. ':swept'
local resume = tonumber(redis.call('GET', skey))
if resume and now < resume and resume <= now + SWEEP_SKEW_MS then return #hs end
local res = redis.call('HSCAN', key, redis.call('GET', ckey) or '0', 'COUNT', 64)
for k = 1, #res[2], 2 do
  if tonumber(res[2][k + 1]) <= now then redis.call('HDEL', key, res[2][k]) end
end
redis.call('SET', ckey, res[1], 'PX', 3600000)
if res[1] == '0' then
  redis.call('SET', skey, string.format('%d', now + SWEEP_PAUSE_MS), 'PX', 3600000)
end
return #hs
