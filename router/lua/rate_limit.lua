-- Per-tenant rate limits over a sliding minute, requests and tokens in one atomic check.
-- The window is approximated from two fixed windows (the previous one weighted by the
-- share of it still inside the sliding window), as Cloudflare's rate limiter counts:
-- blog.cloudflare.com/counting-things-a-lot-of-different-things.
-- KEYS: per limited kind, its current window's counter then its previous window's.
-- ARGV: 1 window ms, 2 now ms, then per kind: its limit, this request's cost; then
--   optionally "peek": check only, count nothing.
-- Returns: {0} when admitted (every kind's counter grew by its cost, unless peeking), else
--   {k, retry_ms, used} for the first kind k (1-based) over its limit: nothing is counted
--   then.
local window = tonumber(ARGV[1]); local now = tonumber(ARGV[2])
local elapsed = now % window
local kinds = #KEYS / 2
for k = 1, kinds do
  local limit = tonumber(ARGV[1 + 2 * k]); local cost = tonumber(ARGV[2 + 2 * k])
  local curr = tonumber(redis.call('GET', KEYS[2 * k - 1]) or '0')
  local prev = tonumber(redis.call('GET', KEYS[2 * k]) or '0')
  local used = prev * (window - elapsed) / window + curr
  if used + cost > limit then
    local retry = window - elapsed
    if cost > limit then retry = -1 end  -- a single request over the whole limit
    return {k, retry, math.floor(used)}
  end
end
if ARGV[3 + 2 * kinds] == 'peek' then return {0} end
for k = 1, kinds do
  local cost = tonumber(ARGV[2 + 2 * k])
  if cost > 0 then
    redis.call('INCRBY', KEYS[2 * k - 1], cost)
    redis.call('PEXPIRE', KEYS[2 * k - 1], 2 * window)
  end
end
return {0}
