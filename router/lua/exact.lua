-- The exact hash's entries (a replica's blocks held by its engine, from KV events), shared
-- by apply_events.lua, route.lua and roots.lua (router/redis_keys.py load_lua puts this
-- file where a script says "--! include exact.lua", after sweep.lua's include).
--
-- Entry: block (8 bytes) -> "<copies>,<children>,<parent>": the physical copies the engine
-- holds; its held children (the held blocks whose recorded parent it is, UNKNOWN_PARENT
-- ones not counted); and its parent's 8 bytes, '' for a prompt's first block, or
-- UNKNOWN_PARENT: stored after a block that this replica did not hold then (a lost event),
-- or after a parent the writer did not say. An entry of 0 copies is a placeholder that keeps
-- the children count of a block evicted before its children (it holds nothing).
--
-- The orphan count: the held blocks whose parent is not held (or unknown), kept in the
-- value of the hash's TABLE_FIELD (sweep.lua): its digits before the '~'s, none at 0. While
-- it is 0 the held blocks are closed under parents: a held block's whole prefix is held, so
-- a prompt's held blocks are a leading run, found by a search of a few reads (route.lua)
-- where a walk reads every block of it; and no placeholder exists (one has held children,
-- each an orphan). vLLM stores a block only after its parent and evicts a request's blocks
-- tail first (vllm/v1/core/single_type_kv_cache_manager.py free_blocks: reversed), so an
-- engine's own events keep it at 0; an eviction that leaves a hole raises it until the
-- hole's children go, and route.lua then walks as before (docs/fault-cases.md 2.4).
local UNKNOWN_PARENT = '?'
-- the orphan count in TABLE_FIELD's value ``v`` (false: no hash), and the value for a count
local orphans_in, orphans_value = number_in, with_number
local function parse_entry(v)
  if not v then return false end
  local c, k, t = string.match(v, '^(%d+),(%d+),(.*)$')
  return {c = tonumber(c), k = tonumber(k), t = t}
end
-- the stored text of entry ``e``; nil: the field goes (no copy and no held child)
local function format_entry(e)
  if not e or (e.c == 0 and e.k == 0) then return nil end
  return e.c .. ',' .. e.k .. ',' .. e.t
end
-- whether an entry read from the exact hash holds its block (not a placeholder: "0,...")
local function held_entry(v)
  return v and string.byte(v) ~= 48
end
