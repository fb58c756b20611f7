-- One routing decision in one round trip, atomically: prefix match per candidate, the
-- candidates' shared load, the prefix_aware cost, the choice, the load reservation and the
-- predicted entries. Several routers deciding at once are serialised by Redis, so a burst
-- does not pile onto one replica. The cost is router/policy/prefix_aware.py PrefixAware (the same
-- formula; tests/test_route_lua.py checks that both choose alike).
--
-- Per replica r: <ns>:x:<r> hash block -> copies (exact, from KV events) and <ns>:p:<r>
-- hash block -> expiry ms (predicted). A candidate's match is read with HMGETs of 1, 16,
-- then 64 hashes at a time that stop at its first missing block, so the cost grows with
-- the candidates' matched lengths, not with the prompt length times the replica count; the
-- predicted hash is read only past the end of the exact run, and past it the exact hash only
-- where a predicted entry does not decide a block.
--
-- KEYS (the key names are router/redis_keys.py's):
--   [1..2n]  per candidate, its exact hash then its predicted hash (n candidates)
--   route mode only: [2n+1] replicas set, [2n+2] load hash (<replica>:n in flight,
--   :p queued prefill tokens, :t last assignment ms, :k new prefixes placed there, a
--   decaying count as of :kt ms), [2n+3] lease hash (request id ->
--   "replica|prefill|done|router|attempt"), [2n+4] this router's heartbeat key
--   last (both modes): the root holders hash (roots.lua)
-- ARGV: 1 mode ("lookup" | "route" | "route_head"), 2 now_ms, 3 n, 4 the request's block
--   hashes in prompt order as one string of 8 bytes each (big-endian); lookup mode only:
--   5.. the n candidate ids; route mode only: 5 request_id, 6 lease owner
--   ("router_id|attempt", the lease's tail: a release names the attempt it ends),
--   7 prompt_tokens, 8 block_size, 9 prefill_rate (tokens/s), 10 work_weight,
--   11 decode_step_s_per_seq, 12 step_token_budget, 13 tie_abs_s, 14 tie_rel,
--   15 load_factor (bounded load), 16 u (uniform random in [0,1)), 17 heartbeat TTL (ms),
--   refreshed with the reservation so that no lease exists without a live heartbeat
--   (another router's sweep would otherwise release a new router's first leases),
--   18 max_inflight (the admission bound caps the bounded load; 0: none), 19 running_weight,
--   20 interference, 21 expected output tokens, 22 placement window (ms), 23 kv_pressure,
--   24 eviction (PrefixAware's parameters and RouteRequest.expected_output_tokens and
--   placement_window_s), then per candidate its predicted TTL (ms), then per candidate
--   its engine's free KV tokens (Candidate.kv_free_tokens; -1: unknown), then per
--   candidate its engine's KV that holds no block (Candidate.kv_empty_tokens; -1:
--   unknown), then the n candidate ids
--   ("route_head" is "route" for the blocks of a long prompt's head, whose rest the router
--   has not tokenized: when a candidate holds every one of them, its match may go on past
--   the head, and the script returns {-1, matched blocks per candidate...} having decided,
--   reserved and written nothing (but the root holders' upkeep of step 1, as every route),
--   so that the router tokenizes the rest and routes again on the whole prompt; otherwise
--   it routes as "route" does)
-- Returns: {chosen index (1-based, 0 in lookup mode), matched blocks per candidate...}, and
--   in route mode one more value: the candidates' requests in flight after the reservation
--   (the first level of the shard groups' choice reads it: router/routing/groups.py)
local mode = ARGV[1]
local now = tonumber(ARGV[2])
local nc = tonumber(ARGV[3])
-- the block hashes come as one argument of 8 bytes per block (router/redis_keys.py
-- pack_hashes); a block's hash is cut out only when a read or a write needs it, so a
-- candidate that misses at once costs what it reads, not the prompt's length
local S = ARGV[4] or ''
local nblocks = math.floor(#S / 8)
local H, parsed = {}, 0
local function upto(k)
  for i = parsed + 1, k do H[i] = string.sub(S, 8 * i - 7, 8 * i) end
  if k > parsed then parsed = k end
end
-- blocks(a, b): the hashes of blocks a..b as values, the arguments of a walk's read. They
-- come from H, cut there once for every walk that reads them; but the last walk cuts the
-- blocks that no walk has yet straight into its read with struct.unpack (in C, where the
-- server's Lua has the struct library: Redis and Valkey do), since only a write of
-- predicted entries would read them again. A follow-up turn, which one replica holds
-- whole, then costs Redis about 8 us less at 8k tokens x 8 replicas on the 2-core VM (122
-- against 131 us; docs/benchmarks.md); cutting every walk's blocks so cost 50 us more where
-- several replicas walk the same blocks. struct.unpack's last value, the offset past the
-- blocks, comes as one more argument: a number, a field name no hash has (every field is 8
-- bytes), whose nil reply follows the blocks' and is never read.
local struct_lib, FMT = rawget(_G, 'struct'), {}
local last_walk = false  -- set before the last candidate's walk
local function blocks(a, b)
  if last_walk and struct_lib and a > parsed then
    local n = b - a + 1
    local f = FMT[n]
    if not f then f = string.rep('c8', n); FMT[n] = f end
    return struct_lib.unpack(f, S, 8 * a - 7)
  end
  upto(b)
  return unpack(H, a, b)
end

--! include sweep.lua
--! include exact.lua
-- the hash of block k (k >= 1) for a read that does not go on from block 1 (a search's
-- probes): cut alone, not with every block before it
local function hash_at(k)
  if k <= parsed then return H[k] end
  return string.sub(S, 8 * k - 7, 8 * k)
end

-- 1. matched prefix per candidate: leading blocks held (exact or unexpired predicted). The
--    first read is the first block alone (most candidates do not hold a prompt's first
--    block, and the chained hashes mean they then hold none of it), with the candidate's
--    orphan count (exact.lua, in TABLE_FIELD's value). Without orphans the candidate's
--    exactly held blocks are a leading run of the prompt, found by a search that reads up
--    to 8 blocks per HMGET (the last unknown one among them, so a prompt held whole takes
--    one read; 8k tokens at block 16 take at most 3), and past it no block is held
--    exactly. Past that run, with the predicted hash in order (sweep.lua: no live entry
--    expires later than its parent), the predicted entries held are a leading run too, and
--    so are those fresh (below): both ends are found by the same search, so a fleet without
--    KV events (every block held so) reads a few blocks per candidate, not all of them. With
--    orphans the exact run is walked, 16 then 64 blocks per read, up to its first missing
--    block, and past it (or past a search's exact run in a predicted hash out of order) the
--    walk goes on over the predicted entries.
--    Also the leading blocks that need no new predicted entry ("fresh": held exactly, or
--    predicted with more than half of the candidate's TTL left, past ``half``): a prompt
--    sent again and again refreshes its entries once per half TTL, not on every request.
--    ``half`` >= ``now`` (a TTL is positive: Settings), so an entry past ``half`` is held.
--    Returns the matched and the fresh run (blocks), and the predicted expiry of the fresh
--    run's last block when it is held so past ``half`` (false otherwise): the bound of the
--    expiry of entries written past it (step 5).
--
-- run_end: the end of a run of the prompt's blocks in ``key``, by a search: ``lo`` a block
-- in the run, ``hi`` the first block known past it (nblocks + 1: past the prompt). In the
-- run: with ``thr`` nil, a block whose field is there (an exact entry: without orphans no
-- placeholder exists); with ``thr``, one whose value, an expiry, is past ``thr``. ``seen``
-- (optional) is called with each probe's block and expiry (or nil).
local function run_end(key, lo, hi, thr, seen)
  while hi - lo > 1 do
    local span = hi - lo - 1
    local m = math.min(span, 8)
    local probes, at = {}, {}
    for q = 1, m do
      at[q] = lo + math.floor(q * span / m)
      probes[q] = hash_at(at[q])
    end
    local v = redis.call('HMGET', key, unpack(probes))
    local q = 1
    if thr then
      for r = 1, m do v[r] = tonumber(v[r]) end
      while q <= m and v[q] and v[q] > thr do q = q + 1 end
      if seen then for r = 1, m do seen(at[r], v[r]) end end
    else
      while q <= m and v[q] do q = q + 1 end
    end
    if q > 1 then lo = at[q - 1] end
    if q <= m then hi = at[q] end
  end
  return lo
end
-- the predicted runs past an exact run of ``x`` blocks (the hash in order), ``e1`` block x +
-- 1's predicted expiry (nil: none); returns as held_prefix
local function predicted_runs(pkey, x, e1, half)
  if not (e1 and e1 > now) then return x, x, false end
  local val, live_lo, live_hi, fresh = {[x + 1] = e1}, x + 1, nblocks + 1, x
  if e1 > half then  -- the fresh run first; its probes bound the held run's search
    fresh = run_end(pkey, x + 1, nblocks + 1, half, function(k, e)
      val[k] = e  -- (the probes come in order: the run ends at the first not held)
      if k < live_hi then
        if e and e > now then live_lo = k else live_hi = k end
      end
    end)
  end
  local matched = run_end(pkey, math.max(live_lo, fresh), live_hi, now)
  return matched, fresh, fresh > x and val[fresh]
end
-- a predicted entry's value ``v``'s expiry (ms) if later than ``half``, else false
local function past_half(v, half)
  local e = tonumber(v)
  return e and e > half and e or false
end
local function held_prefix(xkey, pkey, half)
  local i, chunk, exact, fresh, bound = 0, 1, nil, nil, false
  local first, closed, pfirst = nil, false, nil
  if nblocks > 0 then
    first = redis.call('HMGET', xkey, TABLE_FIELD, blocks(1, 1))
    closed = orphans_in(first[1]) == 0
    if closed then
      exact = first[2] and run_end(xkey, 1, nblocks + 1) or 0
      if exact >= nblocks then return nblocks, nblocks, false end
      local p = redis.call('HMGET', pkey, TABLE_FIELD, hash_at(exact + 1))
      if unordered_until(p[1]) <= now then
        return predicted_runs(pkey, exact, tonumber(p[2]), half)
      end
      i, first, pfirst = exact, nil, p[2]  -- out of order: walked from block exact + 1
    end
  end
  local carry = false  -- the last block read's predicted expiry if past half
  while i < nblocks do
    local last = math.min(i + chunk, nblocks)
    local n = last - i
    -- ex[m], pr[m]: block i + m's exact and predicted entries (false or nil: none, or not
    -- read because the other entry decides the block); blocks k..n are checked below
    local ex, pr, k = {}, {}, 1
    if not exact then
      -- inside the exact run: the exact entries first (with KV events an engine's served
      -- prefix is held exactly), the predicted ones from the first block not held exactly
      if first then
        ex = {first[2]}; first = nil
      else
        ex = redis.call('HMGET', xkey, blocks(i + 1, last))
      end
      for m = 1, n do ex[m] = held_entry(ex[m]) end  -- a placeholder holds nothing
      while k <= n and ex[k] do k = k + 1 end
      if k <= n then
        exact = i + k - 1
        local p = redis.call('HMGET', pkey, blocks(i + k, last))
        for m = k, n do pr[m] = p[m - k + 1] end
      end
    else
      -- past the exact run: the predicted entries first (a fleet without KV events holds
      -- every block so), the exact ones only from the first block that its predicted entry
      -- does not decide: not held, or held but not fresh while the fresh run is still open
      if pfirst ~= nil then
        pr = {pfirst}; pfirst = nil
      else
        pr = redis.call('HMGET', pkey, blocks(i + 1, last))
      end
      k = n + 1
      for m = 1, n do
        local e = pr[m] and tonumber(pr[m])
        if not (e and (e > half or (fresh and e > now))) then k = m; break end
      end
      if k <= n and not closed then  -- closed: no block past the exact run is held so
        local x = redis.call('HMGET', xkey, blocks(i + k, last))
        for m = k, n do ex[m] = held_entry(x[m - k + 1]) end
      end
    end
    for m = k, n do
      local e = pr[m]
      e = e and tonumber(e)
      if not fresh and not (ex[m] or (e and e > half)) then
        fresh = i + m - 1
        if m > 1 then bound = past_half(pr[m - 1], half) else bound = carry end
      end
      if not (ex[m] or (e and e > now)) then return i + m - 1, fresh, bound end
    end
    carry = past_half(pr[n], half)
    i = last
    if chunk == 1 then chunk = 16 else chunk = 64 end
  end
  return nblocks, fresh or nblocks, bound
end
-- route mode: the fixed arguments before the per-candidate ones (TTLs, free KV, empty KV, ids)
local F = 24
--! include roots.lua
-- Only the candidates among the prompt's root holders are walked: the others hold none of
-- it (roots.lua's invariant). A holder found holding nothing is dropped from the list (once
-- its root has been gone for ROOTS_SLACK_MS).
local roots = KEYS[#KEYS]
local ids = {}
for j = 1, nc do ids[j] = mode == 'lookup' and ARGV[4 + j] or ARGV[F + 3 * nc + j] end
local holders = false
if nblocks > 0 then
  upto(1)
  holders = redis.call('HGET', roots, H[1])
end
local matched, fresh_run, bounds = {}, {}, {}
local stale = false
local walks, holder = 0, {}
for j = 1, nc do
  holder[j] = holds(holders, ids[j])
  if holder[j] then walks = walks + 1 end
end
for j = 1, nc do
  if holder[j] then
    walks = walks - 1
    last_walk = walks == 0
    local half = mode ~= 'lookup' and now + tonumber(ARGV[F + j]) / 2 or now
    matched[j], fresh_run[j], bounds[j] = held_prefix(KEYS[2 * j - 1], KEYS[2 * j], half)
    if matched[j] == 0 then stale = true end
  else
    matched[j], fresh_run[j], bounds[j] = 0, 0, false
  end
end
if stale and mode ~= 'lookup' then
  -- dropped only once gone for ROOTS_SLACK_MS (roots.lua): another router whose clock is
  -- behind this one's may still see the root's predicted entry live
  local keep, base = holders, string.sub(roots, 1, -7)
  for j = 1, nc do
    if matched[j] == 0 and holds(keep, ids[j]) and not still_holds(base, ids[j], H[1], now) then
      local a = string.find(keep, '\0' .. ids[j] .. '\0', 1, true)
      keep = string.sub(keep, 1, a) .. string.sub(keep, a + #ids[j] + 2)
    end
  end
  if keep == '\0' then
    redis.call('HDEL', roots, H[1])
  elseif keep ~= holders then
    redis.call('HSET', roots, H[1], keep)
  end
end
local whole_head = false
if mode == 'route_head' and nblocks > 0 then
  for j = 1, nc do
    if matched[j] >= nblocks then whole_head = true; break end
  end
end
if mode == 'lookup' or whole_head then
  local out = {whole_head and -1 or 0}
  for j = 1, nc do out[#out + 1] = matched[j] end
  return out
end

-- 2. load and cost per candidate
local req = ARGV[5]; local owner = ARGV[6]
local P = tonumber(ARGV[7]); local bs = tonumber(ARGV[8]); local rate = tonumber(ARGV[9])
local ww = tonumber(ARGV[10]); local dstep = tonumber(ARGV[11]); local budget = tonumber(ARGV[12])
local tie_abs = tonumber(ARGV[13]); local tie_rel = tonumber(ARGV[14])
local load_factor = tonumber(ARGV[15]); local u = tonumber(ARGV[16])
local heartbeat_ttl = tonumber(ARGV[17])
local max_inflight = tonumber(ARGV[18])
local running_weight = tonumber(ARGV[19]); local interference = tonumber(ARGV[20])
local out_tokens = tonumber(ARGV[21])
local window = tonumber(ARGV[22])
local kv_pressure = tonumber(ARGV[23])
local eviction = tonumber(ARGV[24])
local cands, ttls, kv_free, kv_empty = {}, {}, {}, {}
for j = 1, nc do
  ttls[j] = tonumber(ARGV[F + j])
  kv_free[j] = tonumber(ARGV[F + nc + j])
  kv_empty[j] = tonumber(ARGV[F + 2 * nc + j])
  cands[j] = ids[j]
end
local replicas_set = KEYS[2 * nc + 1]; local load = KEYS[2 * nc + 2]
local leases = KEYS[2 * nc + 3]; local heartbeat = KEYS[2 * nc + 4]

-- counters never change by 0: Redis refuses HINCRBY by -0 (see lease.lua)
local function add(field, delta)
  if delta ~= 0 then redis.call('HINCRBY', load, field, delta) end
end
-- an earlier reservation of this request (Serve may ask again) is released first
local old = redis.call('HGET', leases, req)
if old then
  local r, p, done = string.match(old, '^(.-)|(%d+)|(%d)|')
  redis.call('HDEL', leases, req)
  if r then
    add(r .. ':n', -1)
    if done == '0' then add(r .. ':p', -tonumber(p)) end
  end
end

--! include placements.lua
local cost, cached, last, inflight, placed, ttft = {}, {}, {}, {}, {}, {}
local best = nil
local total = 0
-- a new prefix (no candidate holds its first block)
local new_prefix = nblocks > 0
for j = 1, nc do
  if matched[j] > 0 then new_prefix = false end
end
local fields = {}
for j = 1, nc do
  local r = cands[j]
  fields[3 * j - 2] = r .. ':n'; fields[3 * j - 1] = r .. ':p'; fields[3 * j] = r .. ':t'
end
local v = redis.call('HMGET', load, unpack(fields))  -- every candidate's load in one read
-- for a new prefix only: the decaying count of new prefixes placed on each candidate
-- (router/load/base.py decayed_placements), read apart so that a prompt some candidate
-- holds, the common case, reads 3 fields per candidate and not 5
local kv = {}
if new_prefix then
  for j = 1, nc do
    fields[2 * j - 1] = cands[j] .. ':k'; fields[2 * j] = cands[j] .. ':kt'
  end
  kv = redis.call('HMGET', load, unpack(fields, 1, 2 * nc))
end
local sum_k = 0
for j = 1, nc do
  local k = 0
  if new_prefix then k = decayed_placements(kv[2 * j - 1], kv[2 * j], now, window) end
  placed[j] = k
  sum_k = sum_k + k
  local n = tonumber(v[3 * j - 2] or '0')
  inflight[j] = math.max(n, 0)  -- as the Python policy: a count below zero counts as zero
  total = total + math.max(n, 0)
end
-- the requests expected beside this one: n, or for a new prefix max(n, mean(n) * k / mean(k)),
-- mean(n) counting this request (PrefixAware.expected_inflight)
-- (the test is on mean(k) itself: counts decayed to subnormals can sum above 0 and average
-- to 0)
local expected = {}
local mean_k = sum_k / nc
for j = 1, nc do
  expected[j] = inflight[j]
  if new_prefix and window > 0 and mean_k > 0 then
    expected[j] = math.max(inflight[j], ((total + 1) / nc) * placed[j] / mean_k)
  end
end
for j = 1, nc do
  local q = tonumber(v[3 * j - 1] or '0')
  last[j] = tonumber(v[3 * j] or '0')
  local hit = 0
  if P > 0 then hit = math.min(matched[j], math.floor((P - 1) / bs)) * bs end
  cached[j] = hit
  local unc = math.max(P - hit, 1)
  local work = math.max(q, 0) + unc
  local steps = math.ceil(work / budget)
  local nr = inflight[j]
  local m = expected[j]
  ttft[j] = work / rate + steps * dstep * nr  -- PrefixAware.expected_ttft_s
  cost[j] = ttft[j] + (ww + running_weight * m) * unc / rate
            + interference * 2 * dstep * out_tokens * m
  -- its KV that will not fit (PrefixAware.kv_overflow_tokens)
  if kv_free[j] >= 0 then
    local over = math.max(unc + out_tokens - math.max(kv_free[j] - math.max(q, 0), 0), 0)
    cost[j] = cost[j] + kv_pressure * (1 + ww + m) * over / rate
  end
  -- the cached prefixes it evicts (PrefixAware.evicted_tokens)
  if kv_empty[j] >= 0 then
    local evicted = math.max(unc - math.max(kv_empty[j] - math.max(q, 0), 0), 0)
    cost[j] = cost[j] + eviction * evicted / rate
  end
end
-- bounded load: candidates that would exceed the bound are passed over while any is within
local mean = (total + 1) / nc
local lbound = math.max(load_factor * mean, mean + 2)
if max_inflight > 0 then lbound = math.min(lbound, max_inflight) end
local within = {}
local any_within = false
for j = 1, nc do
  within[j] = inflight[j] + 1 <= lbound
  if within[j] then any_within = true end
end
for j = 1, nc do
  if not any_within then within[j] = true end
  if within[j] and (not best or cost[j] < best) then best = cost[j] end
end

-- 3. near-ties: most cached, then the soonest first token, then the fewest in flight, then
--    the oldest last assignment (within 1 ms), then u over candidate order
local bound = best + math.max(tie_abs, tie_rel * best)
-- keeps, in order, the indices of ``ties`` whose ``sign * key[j]`` is within ``slack`` of
-- the lowest among them (sign -1: the highest key)
local function narrow(ties, key, sign, slack)
  local low = nil
  for i = 1, #ties do
    local v = sign * key[ties[i]]
    if not low or v < low then low = v end
  end
  local n = 0
  for i = 1, #ties do
    local j = ties[i]
    if sign * key[j] <= low + slack then n = n + 1; ties[n] = j end
  end
  for i = #ties, n + 1, -1 do ties[i] = nil end
end
local finalists = {}
for j = 1, nc do
  if within[j] and cost[j] <= bound then finalists[#finalists + 1] = j end
end
narrow(finalists, cached, -1, 0)
narrow(finalists, ttft, 1, 0)
narrow(finalists, inflight, 1, 0)
narrow(finalists, last, 1, 1)
local pick = finalists[math.floor(u * #finalists) + 1]
local chosen = cands[pick]

-- 4. reserve
local unc = math.max(P - cached[pick], 0)
-- one write of the three load fields: the counts were read above, after any release of an
-- earlier reservation of this request, and nothing runs between (a script is atomic)
redis.call('HSET', load, chosen .. ':n', tonumber(v[3 * pick - 2] or '0') + 1,
           chosen .. ':p', tonumber(v[3 * pick - 1] or '0') + unc, chosen .. ':t', now)
if new_prefix then  -- one more new prefix placed there (LoadTracker.placed)
  place(load, chosen, placed[pick], now, 1)
end
redis.call('HSET', leases, req, chosen .. '|' .. unc .. '|0|' .. owner)
redis.call('SET', heartbeat, 1, 'PX', heartbeat_ttl)

-- 5. predicted entries for the chosen replica (as record_predicted.lua), for the blocks past
--    its exact run only: the engine already holds the run, and its KV events keep those
--    entries true (a block it evicts then leaves the index, not a prediction behind it).
--    Past its fresh run, too (step 1): an entry with half its TTL left is not written again.
--    A write also sweeps a few fields of the hash, twice as many as it writes, so expired
--    entries go while the hash keeps being refreshed (without the sweep a replica taking
--    new prompts all the time kept every expired field: the hash only expires whole). A
--    pass of the sweep ends when its cursor comes back to 0; the next pass starts
--    SWEEP_PAUSE_MS later (sweep.lua).
--    The entries expire at most when the fresh run's last block's predicted entry does,
--    which keeps the hash in order (sweep.lua): with one TTL for every write, a TTL from
--    when that entry was written, and more than half a TTL from now (it is fresh), as the
--    fresh run's own entries, so every block of a routed prompt lives at least half a TTL
--    past its route, as before. Past a last block held exactly with no such entry, the new
--    entries get a whole TTL and mark the hash out of order.
local first = fresh_run[pick] + 1  -- the fresh run holds the exact run
if first <= nblocks then
  local pkey = KEYS[2 * pick]
  local expiry = now + ttls[pick]
  local args = {}
  as_table(pkey)  -- sweep.lua
  if first > 1 then
    local b = bounds[pick]
    if not b then
      mark_unordered(pkey, expiry)  -- sweep.lua
    elseif b < expiry then
      expiry = b
    end
  end
  local e = string.format('%d', expiry)
  for i = first, nblocks do  -- the blocks before ``first`` are not cut for it
    args[#args + 1] = hash_at(i); args[#args + 1] = e
    if #args >= 512 then redis.call('HSET', pkey, unpack(args)); args = {} end
  end
  if #args > 0 then redis.call('HSET', pkey, unpack(args)) end
  expire_later(pkey, expiry)  -- sweep.lua
  sweep(pkey, now, 2 * (nblocks - first + 1) + 16)
  if first == 1 then  -- the root itself is written: the chosen replica now holds it
    -- (past the root, the replica held an entry already, so it is in the set: every
    -- write of an entry adds it, and only a purge of its entries takes it out)
    redis.call('SADD', replicas_set, chosen)
    add_holder(roots, H[1], chosen)
    sweep_roots(roots, now, 2)
  end
end

local out = {pick}
for j = 1, nc do out[#out + 1] = matched[j] end
out[#out + 1] = total + 1
return out
