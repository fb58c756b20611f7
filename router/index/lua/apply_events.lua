-- Apply one replica's KV events to its exact entries, in order; also purges a replica.
-- KEYS[1]: the replica's set of block hashes with exact entries
-- KEYS[2]: the replica's set of block hashes with predicted entries
-- ARGV[1]: replica id; ARGV[2]: key prefix of block keys; ARGV[3..]: ops, each one of
--   "s" <n> <hash x n>   BlockStored with a parent: one more physical copy of each hash
--   "S" <n> <hash x n>   BlockStored from block 0: one more copy of each hash not yet held
--                        (a run from block 0 over held blocks is a re-announcement)
--   "r" <n> <hash x n>   BlockRemoved: one copy fewer; the entry goes at zero
--   "c"                  AllBlocksCleared: drop all exact entries of the replica
--   "x"                  replica gone: drop its exact and predicted entries
-- Counting copies keeps an entry while the engine holds a second physical block with the
-- same hash (vLLM does not de-duplicate blocks).
local rep, prefix = ARGV[1], ARGV[2]
local exact_set, pred_set = KEYS[1], KEYS[2]
local function settle(key)
  -- a key left with only predicted fields expires with the latest of them; an empty one goes
  local flds = redis.call('HGETALL', key)
  if #flds == 0 then return end
  local maxe = nil
  for k = 1, #flds, 2 do
    if string.sub(flds[k], 1, 1) ~= '~' then return end
    local e = tonumber(flds[k + 1])
    if e and (not maxe or e > maxe) then maxe = e end
  end
  if maxe then redis.call('PEXPIREAT', key, maxe) end
end
local function drop_all(set, field)
  for _, h in ipairs(redis.call('SMEMBERS', set)) do
    local key = prefix .. h
    if redis.call('HDEL', key, field) == 1 then settle(key) end
  end
  redis.call('DEL', set)
end
local i = 3
while i <= #ARGV do
  local op = ARGV[i]
  if op == 'c' then
    drop_all(exact_set, rep); i = i + 1
  elseif op == 'x' then
    drop_all(exact_set, rep); drop_all(pred_set, '~' .. rep); i = i + 1
  else
    local n = tonumber(ARGV[i + 1])
    for k = i + 2, i + 1 + n do
      local h = ARGV[k]
      local key = prefix .. h
      if op == 's' or (op == 'S' and not redis.call('HGET', key, rep)) then
        redis.call('HINCRBY', key, rep, 1)
        redis.call('PERSIST', key)
        redis.call('SADD', exact_set, h)
      elseif op == 'r' then
        local c = tonumber(redis.call('HGET', key, rep))
        if c then
          if c <= 1 then
            redis.call('HDEL', key, rep)
            redis.call('SREM', exact_set, h)
            settle(key)
          else
            redis.call('HINCRBY', key, rep, -1)
          end
        end
      end
    end
    i = i + 2 + n
  end
end
return 1
