"""One test suite for every prefix-index backend: memory, fakeredis and the real Redis."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import pytest

from router.clock import ManualClock
from router.index.base import IndexUnavailable
from router.index.memory import MemoryPrefixIndex
from router.index.redis import RedisConnections, RedisPrefixIndex
from router.kv_events.wire import KVEvent
from router.load.redis import RedisLoadTracker
from router.redis_keys import TABLE_FIELD, entries_in, pack_hashes
from router.routing.atomic import AtomicRoute

REDIS_URL = "redis://127.0.0.1:6379/0"
BS = 16
CLUSTER_GROUPS = 3


@pytest.fixture(params=["memory", "fakeredis", "redis", "redis-tls-acl", "redis-cluster"])
async def index(request):
    """Every backend; ``redis-tls-acl``: a Redis of the tests' own that takes TLS with
    client certificates only, as an ACL user allowed the router's commands alone
    (``router.redis_keys.acl_rules``), with its password in the URL; ``redis-cluster``: a
    local Redis Cluster of three masters (``conftest.redis_cluster``), the keys in three
    shard groups, one per master (``A`` and ``B`` fall in one group, ``C`` in another;
    tests/test_redis_cluster.py looks up across groups)."""
    clock = ManualClock(time.time())  # Redis expires keys by wall time: start there
    if request.param == "memory":
        idx = MemoryPrefixIndex(clock=clock)
        yield idx
        return
    ns = f"test-{uuid.uuid4().hex[:8]}"
    if request.param == "redis-tls-acl":
        secure = request.getfixturevalue("secure_redis")
        conn = RedisConnections(secure.url, 2.0, secure.connection_kwargs)
        idx = RedisPrefixIndex(secure.url, namespace=ns, clock=clock, connections=conn)
    elif request.param == "redis-cluster":
        cluster = request.getfixturevalue("redis_cluster")
        conn = RedisConnections(cluster.url, 2.0, cluster=True)
        idx = RedisPrefixIndex(cluster.url, namespace=ns, clock=clock, connections=conn,
                               shard_groups=CLUSTER_GROUPS)
        assert len({idx.groups.group_of(r) for r in "ABC"}) == 2
    else:
        idx = RedisPrefixIndex(REDIS_URL, namespace=ns, timeout_s=2.0, clock=clock)
    if request.param == "fakeredis":
        import fakeredis
        fake = fakeredis.FakeAsyncRedis()
        idx.conn.client = lambda *timeout: fake  # the fake server stands in for the URL
    # at wall time still once the servers are up (starting the cluster takes seconds: a
    # test that writes an entry of a second's TTL then found its hash expired by Redis)
    clock.advance(time.time() - clock.now())
    yield idx
    await idx.flush()
    await idx.close()


def stored(*hs, parent=0):
    """BlockStored of ``hs`` after block ``parent`` (None: a run from block 0, as the engine
    stores a prompt's first block: its hash is the root of the prompt's chain)."""
    return KVEvent("stored", list(hs), parent)


def removed(*hs):
    return KVEvent("removed", list(hs))


async def test_lookup_of_unknown_blocks_is_zero_for_every_candidate(index):
    assert await index.lookup([1, 2, 3], ["A", "B"]) == {"A": 0, "B": 0}
    assert await index.lookup([], ["A"]) == {"A": 0}
    assert await index.lookup([1], []) == {}


async def test_predicted_entries_match_until_they_expire(index):
    await index.record_predicted("A", [11, 12, 13], ttl_s=10)
    assert await index.lookup([11, 12, 13, 14], ["A", "B"]) == {"A": 3, "B": 0}
    index.clock.advance(9.9)
    assert (await index.lookup([11, 12], ["A"]))["A"] == 2
    index.clock.advance(0.2)
    assert (await index.lookup([11, 12], ["A"]))["A"] == 0


async def test_predicted_expiry_only_moves_later(index):
    await index.record_predicted("A", [1, 2], ttl_s=100)
    await index.record_predicted("A", [1, 2], ttl_s=1)
    index.clock.advance(50)
    assert (await index.lookup([1, 2], ["A"]))["A"] == 2


async def test_match_stops_at_first_missing_block(index):
    """docs/fault-cases.md 2.4: blocks 1..3 stored, block 1 evicted: nothing is reusable."""
    await index.apply_events("A", [stored(1, 2, 3, parent=None)])
    assert (await index.lookup([1, 2, 3], ["A"]))["A"] == 3
    await index.apply_events("A", [removed(1)])
    assert (await index.lookup([1, 2, 3], ["A"]))["A"] == 0
    await index.apply_events("B", [stored(2, 3)])
    assert await index.lookup([1, 2, 3], ["A", "B"]) == {"A": 0, "B": 0}


async def test_removing_one_physical_copy_keeps_the_other(index):
    """The engine can hold two blocks with one hash; one BlockRemoved leaves one copy."""
    await index.apply_events("A", [stored(7, 8, parent=None), stored(8, parent=7)])
    await index.apply_events("A", [removed(8)])
    assert (await index.lookup([7, 8], ["A"]))["A"] == 2
    await index.apply_events("A", [removed(8)])
    assert (await index.lookup([7, 8], ["A"]))["A"] == 1


async def test_reannounced_prefix_leaves_no_phantom_entry(index):
    """kv_cache_report_mode="full" republishes reused blocks from block 0: when the one
    physical copy goes, the entry goes."""
    await index.apply_events("A", [stored(1, 2, parent=None)])
    await index.apply_events("A", [stored(1, 2, parent=None)])  # re-announcement
    await index.apply_events("A", [removed(2), removed(1)])
    assert (await index.lookup([1, 2], ["A"]))["A"] == 0


async def test_new_blocks_after_a_reannounced_prefix_count_normally(index):
    await index.apply_events("A", [stored(1, parent=None), stored(1, 2, parent=None)])
    assert (await index.lookup([1, 2], ["A"]))["A"] == 2
    await index.apply_events("A", [removed(2)])
    assert (await index.lookup([1, 2], ["A"]))["A"] == 1


async def test_removal_of_unknown_block_is_ignored(index):
    await index.apply_events("A", [removed(99)])
    await index.apply_events("A", [stored(99, parent=None)])
    assert (await index.lookup([99], ["A"]))["A"] == 1


async def test_all_blocks_cleared_drops_only_that_replicas_entries(index):
    await index.apply_events("A", [stored(1, 2)])
    await index.apply_events("B", [stored(1, 2)])
    await index.record_predicted("A", [1, 2, 3], ttl_s=60)
    await index.record_predicted("B", [1, 2, 3], ttl_s=60)
    await index.apply_events("A", [KVEvent("cleared")])
    assert await index.lookup([1, 2, 3], ["A", "B"]) == {"A": 0, "B": 3}
    await index.apply_events("A", [stored(1)])  # learns again after the clear
    assert (await index.lookup([1, 2], ["A"]))["A"] == 1


async def test_events_of_other_media_are_ignored(index):
    await index.apply_events("A", [KVEvent("stored", [5], medium="CPU")])
    assert (await index.lookup([5], ["A"]))["A"] == 0


async def test_exact_and_predicted_entries_combine(index):
    await index.apply_events("A", [stored(1, 2)])
    await index.record_predicted("A", [1, 2, 3, 4], ttl_s=5)
    assert (await index.lookup([1, 2, 3, 4], ["A"]))["A"] == 4
    index.clock.advance(6)
    assert (await index.lookup([1, 2, 3, 4], ["A"]))["A"] == 2


async def test_exact_entry_outlives_a_predicted_ttl_on_the_same_block(index):
    await index.record_predicted("A", [1], ttl_s=1)
    await index.apply_events("B", [stored(1, parent=None)])
    index.clock.advance(5)
    assert await index.lookup([1], ["A", "B"]) == {"A": 0, "B": 1}


async def test_remove_replica_purges_exact_and_predicted_entries(index):
    await index.apply_events("A", [stored(1, 2)])
    await index.record_predicted("A", [1, 2, 3], ttl_s=60)
    await index.record_predicted("B", [1, 2, 3], ttl_s=60)
    await index.remove_replica("A")
    assert await index.lookup([1, 2, 3], ["A", "B"]) == {"A": 0, "B": 3}
    stats = await index.stats()
    assert stats.entries == 3
    if isinstance(index, RedisPrefixIndex):  # its sweep's cursor and pause mark go too
        pkey = index.keys_of("A").predicted("A")
        client = index.conn.client()
        assert not await client.exists(pkey + ":cursor", pkey + ":swept")
        assert await client.exists(index.keys_of("B").predicted("B") + ":swept")


async def test_a_removed_replicas_late_events_are_refused(index):
    """A replica that left stays purged: its feed, still running during its shutdown (or
    rebuilding what looks like a lost index), cannot bring its entries back."""
    await index.apply_events("A", [stored(1, 2, parent=None)])
    await index.remove_replica("A")
    await index.apply_events("A", [stored(1, 2, parent=None), stored(3, parent=2)])
    await index.apply_events("B", [stored(1, parent=None)])
    assert await index.lookup([1, 2, 3], ["A", "B"]) == {"A": 0, "B": 1}
    assert await index.exact_entry_count("A") == 0


async def test_forget_predicted_drops_only_that_replicas_predictions(index):
    """A request the engine refused: its predicted blocks go, exact entries and other
    replicas' predictions of the same blocks stay."""
    await index.apply_events("A", [stored(1, 2)])
    await index.record_predicted("A", [1, 2, 3, 4], ttl_s=60)
    await index.record_predicted("B", [1, 2, 3, 4], ttl_s=60)
    await index.forget_predicted("A", [2, 3, 4])
    assert await index.lookup([1, 2, 3, 4], ["A", "B"]) == {"A": 2, "B": 4}
    assert (await index.stats()).entries == 2 + 1 + 4
    await index.forget_predicted("A", [3, 4])  # idempotent
    await index.record_predicted("A", [3], ttl_s=60)  # and predictable again
    assert await index.lookup([1, 2, 3], ["A"]) == {"A": 3}


async def test_more_blocks_than_one_read_takes_are_recorded_stored_and_forgotten(index):
    """A 40k-token prompt at 16 tokens a block: 2,500 blocks, read by the scripts in
    ``HMGET``s of 1,024 (lua/sweep.lua ``hmget_all``; Lua's ``unpack`` takes at most about
    8,000 values). Every chunk is recorded, stored, removed and forgotten."""
    prompt = list(range(10**6, 10**6 + 2500))
    await index.record_predicted("A", prompt, ttl_s=60)
    await index.apply_events("B", [stored(*prompt, parent=None)])
    assert await index.lookup(prompt, ["A", "B"]) == {"A": 2500, "B": 2500}
    await index.forget_predicted("A", prompt[500:2000])
    await index.apply_events("B", [removed(*prompt[2200:])])
    assert await index.lookup(prompt, ["A", "B"]) == {"A": 500, "B": 2200}
    assert (await index.stats()).entries == 1000 + 2200
    await index.forget_predicted("A", prompt[500:2000])  # idempotent
    await index.record_predicted("A", prompt[:2000], ttl_s=60)  # and predictable again
    assert await index.lookup(prompt, ["A"]) == {"A": 2500}


async def test_stats_count_entries(index):
    await index.apply_events("A", [stored(1, 2)])
    await index.record_predicted("B", [1], ttl_s=60)
    assert (await index.stats()).entries == 3


async def test_unreachable_redis_raises_index_unavailable_within_timeout():
    idx = RedisPrefixIndex("redis://127.0.0.1:1/0", timeout_s=0.2)
    with pytest.raises(IndexUnavailable):
        await idx.lookup([1, 2], ["A"])
    with pytest.raises(IndexUnavailable):
        await idx.record_predicted("A", [1], 1)


async def test_exact_entry_count_per_replica(index):
    await index.apply_events("A", [stored(1, 2, 3)])
    await index.apply_events("B", [stored(1)])
    assert await index.exact_entry_count("A") == 3
    assert await index.exact_entry_count("C") == 0


async def test_the_index_hashes_are_hash_tables_from_their_first_entry(index):
    """A hash of a few hundred fields would be a listpack, whose HMGET scans it for each
    field: a walk of 512 blocks cost Redis 1.9 ms in a listpack of 512 fields, 0.31 ms in a
    hash table (docs/benchmarks.md). Every hash of the index is made a hash table at its
    first write (``TABLE_FIELD``), which no count, walk or sweep takes for a block."""
    if not isinstance(index, RedisPrefixIndex) or index.groups.tagged:
        pytest.skip("the Redis index's encoding (one Redis: its load tracker's keys)")
    await index.apply_events("A", [stored(1, 2, 3, parent=None)])
    await index.record_predicted("B", [1, 2], ttl_s=60)
    load = RedisLoadTracker(index.conn, index.keys.namespace)
    await AtomicRoute(index, load).route(
        "q", 5 * BS, [1, 2, 3, 4, 5], ["A", "B"], [60.0, 60.0], block_size=BS,
        prefill_rate=1e4, work_weight=1.0, decode_step_s_per_seq=0.0, step_token_budget=8192,
        tie_abs_s=0.0, tie_rel=0.0, u=0.0)
    keys = [index.keys.exact("A"), index.keys.predicted("A"), index.keys.predicted("B"),
            index.keys.roots]
    client = index.conn.client()
    # fakeredis keeps no encodings, and the ACL user may not ask (OBJECT is not the router's)
    if not type(client).__module__.startswith("fakeredis") and not index.conn.url.startswith("rediss:"):
        assert [await client.object("encoding", key) for key in keys] == [b"hashtable"] * 4
    assert await index.exact_entry_count("A") == 3
    assert (await index.lookup([1, 2, 3, 4, 5, 6], ["A", "B"])) == {"A": 5, "B": 2}
    assert (await index.stats()).entries == 3 + 2 + 2  # A's exact and predicted, B's
    await load.release("q")


async def test_a_prompt_longer_than_luas_unpack_limit_is_recorded_and_matched(index):
    """20,000 blocks (320k tokens at block 16): past the ~8,000 values one Lua unpack takes."""
    hashes = list(range(1, 20001))
    await index.record_predicted("A", hashes, ttl_s=60)
    assert (await index.lookup(hashes, ["A", "B"])) == {"A": 20000, "B": 0}


def test_commands_packed_by_hiredis_equal_redis_pys_own_packing():
    """``hiredis_packed``: the router's commands, multi-word commands, memoryviews and
    numbers give the bytes redis-py's pure-Python packer gives."""
    from redis.asyncio.connection import Connection

    from router.index.redis import hiredis_packed

    fast, plain = hiredis_packed(Connection)(), Connection()
    assert type(fast) is not Connection  # hiredis is a dependency
    for args in [("EVALSHA", "ab" * 20, 3, "k1", b"k2", "k3", 1.5, -7, "é"),
                 ("CLIENT SETNAME", "router"), ("SET", memoryview(b"k"), bytearray(b"v")),
                 ("HMGET", "h", *[str(i) for i in range(100)])]:
        assert b"".join(fast.pack_command(*args)) == b"".join(plain.pack_command(*args)), args


def test_a_fresh_predicted_entry_is_left_as_it_is_with_fresh_s():
    """``record_predicted_now(..., fresh_s)`` (the shard groups' summary) leaves an entry
    with more than ``fresh_s`` to live as it is and refreshes the others."""
    clock = ManualClock(0.0)
    index = MemoryPrefixIndex(clock)
    index.record_predicted_now("g", [1, 2], 10.0, fresh_s=5.0)
    clock.advance(3.0)
    index.record_predicted_now("g", [1, 2, 3], 10.0, fresh_s=5.0)  # 7 s left: kept at 10
    heap = len(index._expiry_heap)
    clock.advance(3.0)  # t = 6: 4 s left, less than fresh_s: refreshed to 16
    index.record_predicted_now("g", [1], 10.0, fresh_s=5.0)
    assert len(index._expiry_heap) == heap + 1
    clock.advance(4.5)  # t = 10.5: block 2 expired at 10, block 1 lives to 16
    assert index.lookup_now([1, 2, 3], ["g"]) == {"g": 1}
    index.record_predicted_now("g", [2], 10.0)  # without fresh_s: written again as before
    assert index.lookup_now([1, 2, 3], ["g"]) == {"g": 3}


def _connections(backend: str) -> RedisConnections:
    """Connections to the tests' Redis, or (``backend`` "fakeredis") to a fakeredis server
    of their own that stands in for its URL."""
    conn = RedisConnections(REDIS_URL, 2.0)
    if backend == "fakeredis":
        import fakeredis
        fake = fakeredis.FakeAsyncRedis()
        conn.client = lambda *timeout: fake
    return conn


def _prompts(rng, count: int, p_turn: float, turn_blocks: int, fresh) -> list[list[int]]:
    """``count`` prompts of block hashes: with probability ``p_turn`` (once one exists) a
    longer turn of an earlier prompt (a prefix of it and 1 to ``turn_blocks - 1`` new
    blocks), otherwise ``fresh(i)`` for the ``i``-th prompt."""
    prompts: list[list[int]] = []
    for i in range(count):
        if prompts and rng.random() < p_turn:
            base = rng.choice(prompts)
            prompts.append(base[:rng.randrange(1, len(base) + 1)]
                           + [rng.getrandbits(63) for _ in range(rng.randrange(1, turn_blocks))])
        else:
            prompts.append(fresh(i))
    return prompts


def _leading_run(prompt: list[int], held: Callable[[int], bool]) -> int:
    """How many leading blocks of ``prompt`` (block hashes) satisfy ``held``."""
    for i, h in enumerate(prompt):
        if not held(h):
            return i
    return len(prompt)


def _fresh_run(memory: MemoryPrefixIndex, replica: str, prompt: list[int], half: float) -> int:
    """The leading blocks of ``prompt`` that ``replica`` holds exactly or by a predicted
    entry that lives past ``half`` (s): those lua/route.lua writes no new entry for."""
    return _leading_run(prompt, lambda h: memory._exact.get(h, {}).get(replica, 0) > 0
                        or memory._predicted.get(h, {}).get(replica, 0.0) > half)


@pytest.mark.parametrize("backend", ["redis", "fakeredis"])
@pytest.mark.parametrize("seed", range(4))
async def test_the_redis_index_matches_as_the_memory_index_under_random_realistic_events(
        backend, seed):
    """The Redis index walks a candidate only if it is among the holders of the prompt's
    first block (lua/roots.lua); the memory index walks every candidate. Under random
    sequences of what engines and routers do (runs stored from block 0 and continued after
    a parent, removals, clears, predicted entries with random TTLs, forgotten predictions,
    atomic routes, which drop holders that hold nothing and list the chosen one, a replica
    purged and replaced by a new one, time passing), both must answer every lookup alike,
    and every route's matches are the memory index's: a holder the list missed would show
    as a Redis match below the memory one. Prompts share first blocks and prefixes, so a
    first block has several holders that come and go. Every replica also holds 600 exact
    and 600 predicted blocks of other prompts from the start, so its hashes are hash tables
    (their HSCAN, which the sweeps use, pages), as a serving engine's are."""
    import random

    rng = random.Random(seed)
    clock = ManualClock(time.time())
    memory = MemoryPrefixIndex(clock=clock)
    ns = f"t-{uuid.uuid4().hex[:8]}"
    conn = _connections(backend)
    redis_index = RedisPrefixIndex(REDIS_URL, namespace=ns, clock=clock, connections=conn)
    load = RedisLoadTracker(conn, ns, clock=clock)
    atomic = AtomicRoute(redis_index, load)
    route_ttl = 10.0  # no shorter than any record's TTL: a route's write (HSET) then never
    # shortens an entry, as a record's never does (the same TTL per replica in service)
    roots = [rng.getrandbits(63) for _ in range(4)]
    prompts = _prompts(rng, 10, 0.4, 20, lambda i: [roots[i % len(roots)]] + [
        rng.getrandbits(63) for _ in range(rng.randrange(0, 40))])
    replicas = ["A", "B", "C"]
    both = (memory, redis_index)

    async def background(r):
        others = [rng.getrandbits(63) for _ in range(600)]
        for index in both:
            await index.apply_events(r, [KVEvent("stored", others, None)])
            await index.record_predicted(r, others[::-1], ttl_s=86400.0)

    for r in replicas:
        await background(r)
    seen = {"lookups": 0, "matched": 0, "shared": 0, "routes": 0, "dropped": 0}
    try:
        for step in range(200):
            r, prompt = rng.choice(replicas), rng.choice(prompts)
            k = rng.randrange(1, len(prompt) + 1)
            op = rng.random()
            if op < 0.25:  # the engine computes a prompt's first k blocks
                start = rng.randrange(0, k)
                ev = KVEvent("stored", prompt[start:k], prompt[start - 1] if start else None)
                for index in both:
                    await index.apply_events(r, [ev])
            elif op < 0.4:  # it evicts some of them
                gone = rng.sample(prompt, rng.randrange(1, min(len(prompt), 8) + 1))
                for index in both:
                    await index.apply_events(r, [removed(*gone)])
            elif op < 0.55:
                ttl = rng.choice([0.5, 2.0, 10.0])
                for index in both:
                    await index.record_predicted(r, prompt[:k], ttl_s=ttl)
            elif op < 0.72:  # a router's atomic decision, then the request ends
                want = await memory.lookup(prompt, replicas)
                holders = sum(1 for h in (await redis_index.conn.client().hget(
                    redis_index.groups.keys[0].roots, pack_hashes(prompt[:1]))
                    or b"\0").split(b"\0") if h)
                chosen, matched = await atomic.route(
                    f"q{step}", len(prompt) * BS, prompt, replicas, [route_ttl] * 3,
                    block_size=BS, prefill_rate=20000.0, work_weight=1.0,
                    decode_step_s_per_seq=3e-5, step_token_budget=8192, tie_abs_s=0.002,
                    tie_rel=0.05, u=rng.random())
                assert matched == want, (step, "route")
                seen["routes"] += 1
                seen["dropped"] += holders > sum(1 for n in want.values() if n)
                half = clock.now() + route_ttl / 2
                fresh = _fresh_run(memory, chosen, prompt, half)
                # past a fresh run's last block predicted past half (past the exact run), its
                # expiry at most (lua/route.lua, step 5)
                exact = _fresh_run(memory, chosen, prompt, float("inf"))
                bound = memory._predicted.get(prompt[fresh - 1], {}).get(chosen, 0.0) \
                    if fresh > exact else 0.0
                ttl = min(route_ttl, bound - clock.now()) if bound > half else route_ttl
                memory.record_predicted_now(chosen, prompt[fresh:], ttl)
                await load.release(f"q{step}")
            elif op < 0.78:
                for index in both:
                    await index.forget_predicted(r, prompt[:k])
            elif op < 0.82:
                for index in both:
                    await index.apply_events(r, [KVEvent("cleared")])
            elif op < 0.84:  # the replica is gone; Serve starts a new one in its place
                for index in both:
                    await index.remove_replica(r)
                replicas[replicas.index(r)] = new = f"{r}{step}"
                await background(new)
            else:
                clock.advance(rng.choice([0.3, 1.0, 4.0]))
            for prompt in rng.sample(prompts, 3):
                want = await memory.lookup(prompt, replicas)
                assert await redis_index.lookup(prompt, replicas) == want, (step, op)
                seen["lookups"] += 1
                seen["matched"] += any(want.values())
                seen["shared"] += sum(1 for n in want.values() if n) >= 2
        # the sequences are not trivial: most lookups match somewhere, many on several
        # replicas at once, and routes found listed holders that held nothing
        assert seen["matched"] >= 0.5 * seen["lookups"], seen
        assert seen["shared"] >= 0.15 * seen["lookups"], seen
        assert seen["routes"] >= 20 and seen["dropped"] >= 1, seen
    finally:
        await load.close()
        await redis_index.flush()
        await redis_index.close()


async def test_the_root_holders_stay_bounded_as_predictions_expire(index):
    """A fleet without KV events: every request a new prompt, its predictions living 1 s.
    The holders of first blocks no replica holds any more are swept as new ones are
    written (lua/roots.lua), so the list stays about as large as what is live."""
    if not isinstance(index, RedisPrefixIndex):
        pytest.skip("the root holders are the Redis index's")
    import random

    rng = random.Random(5)
    for k in range(400):
        await index.record_predicted(rng.choice("AB"), [rng.getrandbits(63) for _ in range(3)],
                                     ttl_s=1.0)
        index.clock.advance(0.1)  # 10 new prompts a second
    client = index.conn.client()
    sizes = [entries_in(await client.hlen(k.roots)) for k in index.groups.keys]
    assert sum(sizes) <= 60, sizes  # about 10 live, and a sweep pass behind


async def test_root_holders_listed_by_kv_events_alone_stay_bounded(index):
    """Under a policy that writes no predictions, first blocks are listed by the engines'
    BlockStored events only; the engine evicts them again. The holders of first blocks no
    replica holds any more are swept as events list new ones (lua/apply_events.lua), so the
    list does not keep every first block ever cached (300 here, past a listpack's size)."""
    if not isinstance(index, RedisPrefixIndex):
        pytest.skip("the root holders are the Redis index's")
    import random

    rng = random.Random(7)
    for k in range(300):
        r = rng.choice("AB")
        blocks = [rng.getrandbits(63) for _ in range(3)]
        await index.apply_events(r, [stored(*blocks, parent=None)])
        await index.apply_events(r, [removed(*blocks)])
        index.clock.advance(0.1)
    client = index.conn.client()
    sizes = [entries_in(await client.hlen(k.roots)) for k in index.groups.keys]
    assert sum(sizes) <= 60, sizes


async def test_root_holders_listed_by_batches_of_events_stay_bounded(index):
    """A feed writes its events in batches, so one write may list many first blocks: 4 new
    prompts a batch, the engine keeping its last 600 and evicting the oldest. The sweep
    covers twice as many entries as a write lists (lua/apply_events.lua), so the list stays
    near what is live; with a fixed 2 entries a write it grew by about 2 a batch."""
    if not isinstance(index, RedisPrefixIndex):
        pytest.skip("the root holders are the Redis index's")
    import random

    rng = random.Random(3)
    live = []
    for k in range(1500):
        events = []
        for _ in range(4):
            live.append([rng.getrandbits(63) for _ in range(2)])
            events.append(stored(*live[-1], parent=None))
        while len(live) > 600:
            events.append(removed(*live.pop(0)))
        await index.apply_events("A", events)
        index.clock.advance(0.01)
    client = index.conn.client()
    sizes = [entries_in(await client.hlen(k.roots)) for k in index.groups.keys]
    # 600 live, and a sweep pass (and its pause) behind: over 4,000 such batches the list
    # went between 1,070 and 1,400 entries as passes and pauses took turns (a hash table's
    # HSCAN; it grew by about 2 a batch with a fixed 2 entries swept per write)
    assert sum(sizes) <= 1500, sizes


async def test_a_router_whose_clock_runs_ahead_does_not_hide_a_live_root(index):
    """Router 2's clock runs 20 ms ahead of router 1's. A route of router 2 that finds
    replica A's predicted root expired by its own clock must not drop A from the holders
    while router 1 still sees the entry live: router 1's lookups would read nothing for A
    until the entry expired. Once the root has been gone for ROOTS_SLACK_MS (1 s,
    lua/roots.lua), a route drops it."""
    if not isinstance(index, RedisPrefixIndex):
        pytest.skip("the root holders are the Redis index's")
    prompt = [31, 32, 33]
    await index.record_predicted("A", prompt, ttl_s=1.0)  # router 1's clock: expiry t0 + 1 s
    groups = index.groups.count if index.groups.tagged else None
    ahead = RedisPrefixIndex("unused", index.ns, connections=index.conn, shard_groups=groups,
                             clock=ManualClock(index.clock.now() + 1.010))
    load = RedisLoadTracker(index.conn, index.ns, clock=ahead.clock, shard_groups=groups)
    index.clock.advance(0.990)  # router 1: 10 ms before the expiry
    kwargs = dict(block_size=BS, prefill_rate=20000.0, work_weight=1.0,
                  decode_step_s_per_seq=3e-5, step_token_budget=8192, tie_abs_s=0.002,
                  tie_rel=0.05, u=0.99)
    try:
        # B is chosen (u; A and B share a shard group) and holds the prompt from then on
        chosen, matched = await AtomicRoute(ahead, load).route(
            "q", 3 * BS, prompt, ["A", "B"], [1.0, 10.0], **kwargs)
        assert matched["A"] == 0 and chosen == "B"  # A's entry expired by router 2's clock
        await load.release("q")
        assert (await index.lookup(prompt, ["A"]))["A"] == 3  # still live by router 1's
        ahead.clock.advance(1.0)  # gone for more than the slack: a route drops it
        chosen, _ = await AtomicRoute(ahead, load).route("q2", 3 * BS, prompt, ["A", "B"],
                                                         [1.0, 10.0], **kwargs)
        assert chosen == "B"
        await load.release("q2")
        holders = await index.conn.client().hget(index.keys_of("A").roots,
                                                 pack_hashes(prompt[:1]))
        assert b"\0B\0" in holders and b"\0A\0" not in holders, holders
    finally:
        await load.close()


async def test_a_replica_id_the_holders_list_cannot_hold_is_refused(index):
    """The root holders list ids each after a zero byte (lua/roots.lua): an empty id or one
    with a zero byte would be split or lost there, so the Redis index refuses them."""
    if not isinstance(index, RedisPrefixIndex):
        pytest.skip("the root holders are the Redis index's")
    for bad in ("", "a\0b"):
        with pytest.raises(ValueError, match="zero byte"):
            await index.apply_events(bad, [stored(1, 2, parent=None)])
        with pytest.raises(ValueError, match="zero byte"):
            await index.lookup([1, 2], ["ok", bad])


async def _orphan_count(index: RedisPrefixIndex, replica: str) -> int:
    """The orphan count of ``replica``'s exact hash (lua/exact.lua: the digits that open
    ``TABLE_FIELD``'s value)."""
    v = await index.conn.client().hget(index.keys_of(replica).exact(replica), TABLE_FIELD)
    digits = (v or b"").split(b"~")[0]
    return int(digits) if digits else 0


@pytest.mark.parametrize("backend", ["redis", "fakeredis"])
@pytest.mark.parametrize("seed", range(4))
async def test_the_held_run_search_matches_the_walk_under_engine_like_events(backend, seed):
    """lua/route.lua finds a candidate's exactly held run by a search (a few reads) while its
    orphan count is 0, and walks it block by block otherwise (lua/exact.lua). Under random
    sequences of what a vLLM engine publishes (a prompt's blocks stored after its held
    prefix, more than one copy of a block, evictions tail first), and of what it should not
    but the index must survive (a block evicted before its children, blocks stored after a
    parent not held, or after unknown parents as the feed's rebuild writes them, a clear),
    every lookup equals the memory index's walk; the count is positive whenever some held
    block's parent is not held (else the search would skip a hole), and it is 0 again once
    every block is evicted. The events go to the indexes one to a few per call, as a feed
    writes its batches (a call reads and writes each entry once)."""
    import random

    from router.kv_events.wire import UNKNOWN_PARENT

    rng = random.Random(seed)
    memory = MemoryPrefixIndex()
    redis_index = RedisPrefixIndex(REDIS_URL, namespace=f"t-{uuid.uuid4().hex[:8]}",
                                   connections=_connections(backend))
    prompts = _prompts(rng, 12, 0.6, 40, lambda i: [
        rng.getrandbits(63) for _ in range(rng.randrange(1, 60))])
    parent = {p[i]: (p[i - 1] if i else None) for p in prompts for i in range(len(p))}
    copies: dict[int, int] = {}  # the engine's blocks: hash -> physical copies
    seen = {"orphaned": 0, "searched": 0}
    pending: list[KVEvent] = []  # events not yet written: a feed writes them in batches

    async def apply(*events, flush: bool = True):
        pending.extend(events)
        for ev in events:
            for h in ev.block_hashes:
                if ev.kind == "stored" and not (ev.parent_block_hash is None and copies.get(h)):
                    copies[h] = copies.get(h, 0) + 1
                elif ev.kind == "removed" and copies.get(h):
                    copies[h] -= 1
                    if not copies[h]:
                        del copies[h]
            if ev.kind == "cleared":
                copies.clear()
        if flush:
            for index in (memory, redis_index):
                await index.apply_events("A", list(pending))
            pending.clear()

    def engine_like_step():
        prompt = rng.choice(prompts)
        if rng.random() < 0.55 or not copies:  # computes what it misses of prompt[:k]
            k = rng.randrange(1, len(prompt) + 1)
            start = 0
            while start < k and copies.get(prompt[start]):
                start += 1
            if rng.random() < 0.1 and start:  # recomputes a held block: one more copy
                start -= 1
            return [KVEvent("stored", prompt[start:k], prompt[start - 1] if start else None)]
        # evicts a held block none of whose children it holds, then maybe its parent...
        # (children before parents, as vLLM frees a request's blocks tail first)
        parents_held = {parent[c] for c in copies}
        h = rng.choice([h for h in copies if h not in parents_held])
        run = [h]
        while rng.random() < 0.7 and parent[run[-1]] is not None:
            up = parent[run[-1]]
            if copies.get(up) != 1 or any(parent[c] == up for c in copies if c not in run):
                break
            run.append(up)
        return [KVEvent("removed", run)]

    try:
        for step in range(300):
            engine_like = not (100 <= step < 200 and rng.random() < 0.15)
            if engine_like:
                events = engine_like_step()
            else:
                prompt = rng.choice(prompts)
                op = rng.random()
                if op < 0.4 and any(copies.get(h) for h in prompt):  # a hole
                    events = [KVEvent("removed", [rng.choice([h for h in prompt if copies.get(h)])])]
                elif op < 0.7:  # stored after a block it does not hold
                    a = rng.randrange(1, len(prompt)) if len(prompt) > 1 else 0
                    b = rng.randrange(a, len(prompt)) + 1
                    events = [KVEvent("stored", prompt[a:b], prompt[a - 1] if a else None)]
                elif op < 0.95:  # the feed's rebuild: parents unknown
                    events = [KVEvent("stored", rng.sample(prompt, min(len(prompt), 5)),
                                      UNKNOWN_PARENT)]
                else:
                    events = [KVEvent("cleared")]
            await apply(*events, flush=rng.random() < 0.5)  # one to a few events per call
            if pending:
                continue
            orphans = await _orphan_count(redis_index, "A")
            true_orphans = sum(1 for h in copies if parent[h] is not None
                               and not copies.get(parent[h]))
            assert orphans >= true_orphans and (orphans > 0) >= (true_orphans > 0), step
            seen["orphaned"] += orphans > 0
            seen["searched"] += orphans == 0
            for prompt in rng.sample(prompts, 4):
                want = await memory.lookup(prompt, ["A", "B"])
                assert await redis_index.lookup(prompt, ["A", "B"]) == want, (step, events)
        # once every block is evicted no orphan is counted; both modes ran
        await apply(KVEvent("removed", [h for h, n in copies.items() for _ in range(n)]))
        assert not copies and await _orphan_count(redis_index, "A") == 0
        assert seen["orphaned"] >= 20 and seen["searched"] >= 20, seen
    finally:
        await redis_index.flush()
        await redis_index.close()


async def test_copies_removed_together_leave_no_orphan_behind():
    """Found by a review: both copies of a block removed in one event (the second removal
    did not read the block's parent), so the parent kept a child it no longer had, stayed
    as a placeholder once evicted, and the replica's orphan count stayed at 1 with nothing
    held: its runs were walked from then on, not searched."""
    index = RedisPrefixIndex(REDIS_URL, namespace=f"t-{uuid.uuid4().hex[:8]}")
    try:
        await index.apply_events("A", [stored(1, 2, parent=None)])
        await index.apply_events("A", [stored(2, parent=1)])  # a second copy of block 2
        await index.apply_events("A", [removed(2, 2)])
        await index.apply_events("A", [removed(1)])
        assert await _orphan_count(index, "A") == 0
        assert await index.exact_entry_count("A") == 0
    finally:
        await index.flush()
        await index.close()


async def test_a_held_run_is_found_in_a_few_reads():
    """A replica that holds a 512-block prompt's first 300 blocks, from its engine's events:
    the lookup reads the root holders, the first block, then searches (3 reads of 8
    blocks), then reads the predicted entry past the run: 5 HMGETs, where the walk (1, 16,
    then 64 blocks per read) takes 8, and 6 to a hole at block 150. After such a hole (a
    block evicted before its children) the same lookup walks, and still matches."""
    index = RedisPrefixIndex(REDIS_URL, namespace=f"t-{uuid.uuid4().hex[:8]}")
    client = index.conn.client()
    prompt = list(range(1000, 1512))

    async def hmgets() -> int:
        return (await client.info("commandstats")).get("cmdstat_hmget", {}).get("calls", 0)

    try:
        await index.apply_events("A", [stored(*prompt[:100], parent=None),
                                       stored(*prompt[100:300], parent=prompt[99])])
        before = await hmgets()
        assert await index.lookup(prompt, ["A", "B"]) == {"A": 300, "B": 0}
        searched = await hmgets() - before
        assert searched <= 5, searched
        await index.apply_events("A", [removed(prompt[150])])
        before = await hmgets()
        assert await index.lookup(prompt, ["A", "B"]) == {"A": 150, "B": 0}
        assert await hmgets() - before > searched
        assert await _orphan_count(index, "A") == 1
        await index.apply_events("A", [removed(*reversed(prompt[151:300]))])
        assert await _orphan_count(index, "A") == 0
        assert await index.lookup(prompt, ["A", "B"]) == {"A": 150, "B": 0}
    finally:
        await index.flush()
        await index.close()


async def _raw_holdings(index: RedisPrefixIndex, replica: str
                        ) -> tuple[set[int], dict[int, int], int]:
    """A replica's exact blocks held (copies > 0), its predicted entries (block -> expiry,
    ms) and the time its predicted hash is marked out of order until (0: in order), read
    raw from Redis."""
    client = index.conn.client()
    x = await client.hgetall(index.keys_of(replica).exact(replica))
    p = await client.hgetall(index.keys_of(replica).predicted(replica))
    mark = (p.get(TABLE_FIELD) or b"").split(b"~")[0]
    return ({int.from_bytes(f, "big") for f, v in x.items()
             if f != TABLE_FIELD and not v.startswith(b"0")},
            {int.from_bytes(f, "big"): int(v) for f, v in p.items() if f != TABLE_FIELD},
            int(mark) if mark else 0)


def _held_run(prompt: list[int], exact: set[int], predicted: dict[int, int], now_ms: int) -> int:
    """The definition of a match: the leading blocks held exactly or by a predicted entry
    that expires after ``now_ms``."""
    return _leading_run(prompt, lambda h: h in exact or predicted.get(h, 0) > now_ms)


@pytest.mark.parametrize("backend", ["redis", "fakeredis"])
@pytest.mark.parametrize("seed", range(4))
async def test_the_predicted_run_search_matches_the_walk_under_the_routers_writes(
        backend, seed):
    """lua/route.lua finds a candidate's predicted run by a search while its predicted hash
    is in order (lua/sweep.lua: no live entry expires later than its parent), and walks it
    while the hash is marked out of order. Under random sequences of what routers write
    (atomic routes of new prompts and of later turns of earlier ones, with TTLs that differ
    between routes; ``record_predicted``; ``forget_predicted`` of a prompt's tail; on seeds
    2 and 3 also an engine's KV events, whose exactly held blocks the routes write past) and
    of time passing (expiries, sweeps), every lookup equals the definition read raw from
    Redis (leading blocks held exactly or by a live predicted entry), every route matches
    its chosen replica's whole prompt after it, and whenever a hash is not marked its live
    entries are in order. Both the search and the walk run."""
    import random

    rng = random.Random(seed)
    clock = ManualClock(time.time() + 3600)  # Redis expires whole hashes by its own clock
    conn = _connections(backend)
    index = RedisPrefixIndex(REDIS_URL, namespace=f"t-{uuid.uuid4().hex[:8]}", clock=clock,
                             connections=conn)
    load = RedisLoadTracker(conn, index.ns, clock=clock)
    atomic = AtomicRoute(index, load)
    replicas = ["A", "B"]
    with_events = seed >= 2
    prompts = _prompts(rng, 30, 0.7, 12, lambda i: [
        rng.getrandbits(63) for _ in range(rng.randrange(1, 90))])
    parent = {p[i]: (p[i - 1] if i else None) for p in prompts for i in range(len(p))}
    engine: set[int] = set()  # blocks A's engine holds (seeds 2, 3)
    seen = {"in order": 0, "out of order": 0}
    try:
        for step in range(160):
            prompt = rng.choice(prompts)
            op = rng.random()
            if op < 0.5:
                ttls = [rng.choice([4.0, 8.0, 12.0]) for _ in replicas]
                chosen, _ = await atomic.route(
                    f"q{step}", len(prompt) * BS, prompt, replicas, ttls, block_size=BS,
                    prefill_rate=20000.0, work_weight=1.0, decode_step_s_per_seq=3e-5,
                    step_token_budget=8192, tie_abs_s=0.002, tie_rel=0.05, u=rng.random())
                assert (await index.lookup(prompt, [chosen]))[chosen] == len(prompt), step
                await load.release(f"q{step}")
            elif op < 0.6:
                await index.record_predicted(rng.choice(replicas), prompt, rng.choice([4.0, 8.0]))
            elif op < 0.7:
                await index.forget_predicted(rng.choice(replicas),
                                             prompt[rng.randrange(len(prompt)):])
            elif op < 0.85 and with_events:  # A's engine stores a prompt's head, or evicts
                if rng.random() < 0.6:
                    k = rng.randrange(1, len(prompt) + 1)
                    start = 0
                    while start < k and prompt[start] in engine:
                        start += 1
                    if start < k:
                        await index.apply_events("A", [KVEvent(
                            "stored", prompt[start:k], prompt[start - 1] if start else None)])
                        engine.update(prompt[start:k])
                elif engine:  # a leaf, tail first
                    parents = {parent[h] for h in engine}
                    leaf = rng.choice([h for h in engine if h not in parents])
                    await index.apply_events("A", [KVEvent("removed", [leaf])])
                    engine.discard(leaf)
            else:
                clock.advance(rng.choice([0.5, 1.0, 2.0, 3.0]))
            now_ms = int(clock.now() * 1000)
            for r in replicas:
                exact, predicted, mark = await _raw_holdings(index, r)
                ordered = mark <= now_ms
                seen["in order" if ordered else "out of order"] += 1
                if ordered:
                    for h, e in predicted.items():
                        if e > now_ms and parent[h] is not None:
                            assert predicted.get(parent[h], 0) >= e, (step, r)
                for q in rng.sample(prompts, 4):
                    assert (await index.lookup(q, [r]))[r] == \
                        _held_run(q, exact, predicted, now_ms), (step, r, ordered)
        assert seen["in order"] >= 50, seen
        if with_events or seed == 1:
            assert seen["out of order"] >= 10, seen
    finally:
        await load.close()
        await index.flush()
        await index.close()


async def test_a_router_whose_clock_runs_ahead_sweeps_nothing_another_sees_live():
    """Found by a helper's fuzzer: a router whose clock ran 0.9 s ahead swept entries of a
    prompt that another router still saw live, children kept, and the one behind then
    searched the hash (in order by its clock) and matched all 200 blocks where 1 was held.
    A sweep now deletes an entry only a second after it expired (lua/sweep.lua
    SWEEP_SLACK_MS), so clocks that differ by less never see a hole a sweep made."""
    t0 = time.time() + 3600
    conn = RedisConnections(REDIS_URL, 2.0)
    ns = f"t-{uuid.uuid4().hex[:8]}"
    behind = RedisPrefixIndex(REDIS_URL, ns, clock=ManualClock(t0), connections=conn)
    ahead = RedisPrefixIndex(REDIS_URL, ns, clock=ManualClock(t0 + 0.9), connections=conn)
    prompt = list(range(1, 201))
    try:
        await behind.record_predicted("B", list(range(10_000, 10_600)), ttl_s=300.0)
        await behind.record_predicted("B", prompt, ttl_s=0.5)  # live until t0 + 0.5 s
        for k in range(5):  # each write sweeps 64 fields
            await ahead.record_predicted("B", [99_999 + k], ttl_s=10.0)
        assert (await behind.lookup(prompt, ["B"]))["B"] == 200
        assert (await ahead.lookup(prompt, ["B"]))["B"] == 0
        assert entries_in(await conn.client().hlen(behind.keys.predicted("B"))) == 805
    finally:
        await behind.flush()
        await behind.close()


async def test_a_predicted_run_is_found_in_a_few_reads():
    """A fleet without KV events: a replica's predicted entries of a 512-block prompt (a
    conversation's turns written one after another) are found by a search, a few reads,
    where the walk of the same run reads every block (1, 16, then 64 per read: 9 reads);
    once a tail of it is forgotten (the hash marked out of order) the lookup walks, and still
    matches."""
    clock = ManualClock(time.time() + 3600)
    conn = RedisConnections(REDIS_URL, 2.0)
    index = RedisPrefixIndex(REDIS_URL, namespace=f"t-{uuid.uuid4().hex[:8]}", clock=clock,
                             connections=conn)
    load = RedisLoadTracker(conn, index.ns, clock=clock)
    atomic = AtomicRoute(index, load)
    client = index.conn.client()
    prompt = list(range(5000, 5512))

    async def hmgets() -> int:
        return (await client.info("commandstats")).get("cmdstat_hmget", {}).get("calls", 0)

    try:
        for k, end in enumerate((100, 300, 450, 512)):  # four turns, a second apart
            await atomic.route(f"t{k}", end * BS, prompt[:end], ["A"], [60.0], block_size=BS,
                               prefill_rate=20000.0, work_weight=1.0,
                               decode_step_s_per_seq=3e-5, step_token_budget=8192,
                               tie_abs_s=0.002, tie_rel=0.05, u=0.0)
            await load.release(f"t{k}")
            clock.advance(1.0)
        before = await hmgets()
        assert await index.lookup(prompt, ["A", "B"]) == {"A": 512, "B": 0}
        searched = await hmgets() - before
        assert searched <= 4, searched  # the roots, the first blocks, one search read
        await index.forget_predicted("A", prompt[400:])
        before = await hmgets()
        assert await index.lookup(prompt, ["A", "B"]) == {"A": 400, "B": 0}
        assert await hmgets() - before > searched + 3
    finally:
        await load.close()
        await index.flush()
        await index.close()


async def test_connections_opened_at_start_serve_a_burst_without_opening_more():
    """``open_connections(n)`` leaves ``n`` connections in the loop's pool, and ``n`` calls
    at once afterwards take those (none opened on their path); a Redis that does not answer
    raises ``IndexUnavailable`` (the ingress logs it and opens connections on demand)."""
    import asyncio

    conn = RedisConnections(REDIS_URL, 2.0)
    try:
        assert await conn.open_connections(0) == 0
        assert await conn.open_connections(6) == 6
        pool = conn.client().connection_pool
        opened = set(map(id, pool._available_connections))
        assert len(opened) == 6 and not pool._in_use_connections

        async def slow_ping(client):  # held long enough that all six overlap
            return await client.execute_command("EVAL", "return redis.call('PING')", 0)
        await asyncio.gather(*(conn.call(slow_ping) for _ in range(6)))
        assert set(map(id, pool._available_connections)) == opened  # the same six
    finally:
        await conn.close()
    down = RedisConnections("redis://127.0.0.1:1/0", 0.05)
    with pytest.raises(IndexUnavailable):
        await down.open_connections(3)
    await down.close()
