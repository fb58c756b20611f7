-- Matched prefix length per candidate replica, in one round trip.
-- KEYS[i]  : block key of the i-th block of the request (prompt order)
-- ARGV[1]  : now, in milliseconds (the router's clock)
-- ARGV[2..]: candidate replica ids
-- Each block key is a hash: field <replica> = physical copies the engine holds (exact entry),
-- field "~"<replica> = expiry in ms of a predicted entry.
-- Returns one integer per candidate: the number of leading blocks it holds. A replica drops
-- out at the first block it lacks; the walk stops when no candidate is left.
local now = tonumber(ARGV[1])
local n = #ARGV - 1
local alive, matched = {}, {}
for j = 1, n do alive[j] = true; matched[j] = #KEYS end
local left = n
for i = 1, #KEYS do
  local fields, idx = {}, {}
  for j = 1, n do
    if alive[j] then
      fields[#fields + 1] = ARGV[j + 1]
      fields[#fields + 1] = '~' .. ARGV[j + 1]
      idx[#idx + 1] = j
    end
  end
  local vals = redis.call('HMGET', KEYS[i], unpack(fields))
  for k, j in ipairs(idx) do
    local c = tonumber(vals[2 * k - 1])
    local e = tonumber(vals[2 * k])
    if not ((c and c > 0) or (e and e > now)) then
      alive[j] = false
      matched[j] = i - 1
      left = left - 1
    end
  end
  if left == 0 then break end
end
return matched
