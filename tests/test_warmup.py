"""Warm-up and re-homing (``router.routing.warmup``): the hot-prefix record (decay, the
shared part split off, bounds and eviction), the pacer's rate bound, the planner (which
prefixes, to which replica, the lease) over the real in-process index and load tracker,
the Redis lease, and the simulator: a warmed new replica's first requests hit the cache
where an unwarmed one's do not."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from router.clock import ManualClock
from router.config import Settings
from router.hashing import BlockHasher, HashSettings
from router.index.memory import MemoryPrefixIndex
from router.load.memory import MemoryLoadTracker
from router.policy import make_policy
from router.routing.core import RoutingCore
from router.routing.replica import ReplicaInfo, ReplicaMetadata, RoutingStats
from router.routing.warmup import (ExtraKeys, HotPrefixes, MemoryWarmupLease,
                                   RedisWarmupLease, Warmer, WarmupPacer)

BS = 16
HASHER = BlockHasher(HashSettings(block_size=BS))


def toks(rng: random.Random, n: int) -> list[int]:
    return [100 + rng.randrange(30000) for _ in range(n)]


def record(clock=None, max_tokens=1_000_000, max_prefixes=10_000, half_life_s=60.0):
    return HotPrefixes(BS, half_life_s, max_tokens, max_prefixes, clock or ManualClock())


def observe(rec: HotPrefixes, ids: list[int], extra: ExtraKeys = ExtraKeys()) -> list[int]:
    hashes = HASHER.block_hashes(ids, cache_salt=extra.cache_salt, lora_name=extra.lora_name,
                                 lora_path=extra.lora_path)
    rec.observe(hashes, ids, extra)
    return hashes


def test_count_decays_with_its_half_life():
    clock = ManualClock()
    rec = record(clock, half_life_s=10.0)
    hashes = observe(rec, toks(random.Random(1), 4 * BS))
    node = rec.get(hashes[-1])
    assert rec.count_now(node) == pytest.approx(1.0)
    clock.advance(10.0)
    assert rec.count_now(node) == pytest.approx(0.5)
    clock.advance(10.0)
    observe(rec, toks(random.Random(1), 4 * BS))  # the same prompt again
    assert rec.count_now(node) == pytest.approx(1.25)


def test_shared_part_becomes_a_prefix_and_is_hottest():
    rng = random.Random(2)
    rec = record()
    system = toks(rng, 8 * BS)
    tails = [observe(rec, system + toks(rng, 3 * BS)) for _ in range(5)]
    shared = rec.get(tails[0][7])
    assert shared is not None and shared.blocks == 8
    assert rec.count_now(shared) == pytest.approx(5.0)
    assert {rec.get(t[-1]).parent for t in tails} == {shared.key}
    hot = rec.hottest(3, 1.2)
    # the system prompt alone: the requests diverge after it (each tail seen once)
    assert [(n.key, c) for n, c in hot] == [(shared.key, pytest.approx(5.0))]
    assert rec.token_ids(shared) == system


def test_a_conversation_is_warmed_as_its_latest_turn():
    rng = random.Random(3)
    clock = ManualClock()
    rec = record(clock)
    prompt = toks(rng, 4 * BS)
    hashes = []
    for _ in range(4):  # each turn's prompt is the last one's, an answer and a question
        hashes = observe(rec, prompt)
        prompt = prompt + toks(rng, 3 * BS)
        clock.advance(20.0)
    [(node, count)] = rec.hottest(5, 1.2)
    assert node.key == hashes[-1] and node.blocks == len(hashes)
    assert count > 2.0  # the first turn's count: every later turn began with it


def test_record_is_bounded_and_keeps_the_hot_prefix():
    rng = random.Random(4)
    clock = ManualClock()
    rec = record(clock, max_tokens=60 * BS, max_prefixes=20)
    hot_prompt = toks(rng, 4 * BS)
    for i in range(200):
        if i % 4 == 0:
            observe(rec, hot_prompt)
        observe(rec, toks(rng, 5 * BS))  # a cold, unique prompt
        clock.advance(0.5)
        assert rec.tokens_held <= 60 * BS and len(rec) <= 20
    hot_key = HASHER.block_hashes(hot_prompt)[-1]
    assert rec.get(hot_key) is not None
    assert rec.hottest(1, 1.2)[0][0].key == hot_key


def test_warm_prefix_hashes_as_the_request_did():
    """A warm-up request's token ids and extra keys give the request's own hashes, so the
    engine's blocks hash the same."""
    rng = random.Random(5)
    rec = record()
    extra = ExtraKeys(cache_salt="tenant-a", lora_name="sql", lora_path="/adapters/sql")
    ids = toks(rng, 6 * BS + 5)
    hashes = observe(rec, ids, extra)
    observe(rec, ids, extra)
    node, count = rec.hottest(1, 1.2)[0]
    wp = rec.warm_prefix(node, count)
    assert list(wp.token_ids) == ids[:6 * BS]
    assert HASHER.block_hashes(list(wp.token_ids), cache_salt=wp.extra.cache_salt,
                               lora_name=wp.extra.lora_name,
                               lora_path=wp.extra.lora_path) == hashes
    assert HASHER.block_hashes(list(wp.token_ids)) != hashes  # the salt matters


def test_observe_refuses_too_few_tokens():
    with pytest.raises(ValueError):
        record().observe([1, 2, 3], list(range(2 * BS)))


def test_pacer_bounds_tokens_per_second_and_concurrency():
    clock = ManualClock()
    pacer = WarmupPacer(tokens_per_s=1000.0, concurrency=2, clock=clock)
    assert pacer.try_start(600) and pacer.try_start(300)
    assert pacer.wait_s(10) == float("inf")  # both slots taken
    assert not pacer.try_start(10)
    pacer.done()
    assert pacer.wait_s(600) == pytest.approx(0.5)  # 100 left, 500 more at 1000/s
    # over a long run with free slots, the tokens granted stay within rate x time + burst
    started = 0
    for _ in range(1000):
        clock.advance(0.01)
        while pacer.try_start(250):
            started += 250
            pacer.done()
    assert started <= 1000.0 * 10.0 + 1000
    assert started >= 1000.0 * 10.0 - 1000


def _replicas(*names: str) -> list[ReplicaInfo]:
    return [ReplicaInfo(n, ReplicaMetadata(), RoutingStats()) for n in names]


class _Fleet:
    """A RoutingCore over the in-process index and load tracker, and a Warmer whose sender
    records what it was asked to send."""

    def __init__(self, names, top=8, tokens_per_s=1e9, concurrency=4, lease=None):
        self.clock = ManualClock(1000.0)
        self.infos = _replicas(*names)
        self.index = MemoryPrefixIndex(clock=self.clock)
        self.load = MemoryLoadTracker(clock=self.clock)
        settings = Settings(block_size=BS)
        self.core = RoutingCore(settings, self.index, self.load,
                                make_policy("prefix_aware", random.Random(0)))
        self.rec = record(self.clock)
        self.sent: list[tuple[str, str, list[int], ExtraKeys]] = []
        self.warmer = Warmer(self.core, self.rec,
                             WarmupPacer(tokens_per_s, concurrency, self.clock),
                             lease or MemoryWarmupLease(self.clock), self._send, top)

    def _send(self, job, info, cached):
        self.sent.append((job.request_id, info.replica_id, list(job.prefix.token_ids),
                          job.prefix.extra))

    async def request(self, ids: list[int], replica: str, extra=ExtraKeys()):
        """A served request: recorded, routed to ``replica``, its blocks stored there."""
        from router.kv_events.wire import EventKind, KVEvent
        hashes = observe(self.rec, ids, extra)
        self.rec.routed(hashes, replica)
        self.index.apply_events_now(replica, [KVEvent(kind=EventKind.STORED,
                                                      block_hashes=hashes,
                                                      parent_block_hash=None)])
        return hashes


def test_scale_out_warms_the_hottest_prefixes_on_the_new_replica():
    async def main():
        rng = random.Random(6)
        fleet = _Fleet(["a", "b", "new"], top=2)
        systems = [toks(rng, 8 * BS) for _ in range(3)]
        for g, reps in ((0, 6), (1, 4), (2, 2)):
            for _ in range(reps):
                await fleet.request(systems[g] + toks(rng, 2 * BS), "a" if g else "b")
        assert await fleet.warmer.replica_joined("new") == 2
        assert await fleet.warmer.pump(fleet.infos) is None
        # the two hottest system prompts, hottest first, to the new replica
        assert [(s[1], s[2]) for s in fleet.sent] == [("new", systems[0]), ("new", systems[1])]
        # their blocks are predicted there at dispatch, and their load reserved
        for g in (0, 1):
            hashes = HASHER.block_hashes(systems[g])
            assert (await fleet.index.lookup(hashes, ["new"]))["new"] == 8
        assert (await fleet.load.loads(["new"]))["new"].inflight == 2
        for rid, *_ in fleet.sent:
            await fleet.warmer.finished(rid, True)
        assert (await fleet.load.loads(["new"]))["new"].inflight == 0
        assert fleet.warmer.stats.started["scale_out"] == 2
        assert fleet.warmer.stats.tokens["scale_out"] == 16 * BS
        # a second join of the same replica (another broadcast) is leased already
        assert await fleet.warmer.replica_joined("new") == 0

    asyncio.run(main())


def test_failed_warmup_drops_its_predicted_entries():
    async def main():
        rng = random.Random(7)
        fleet = _Fleet(["a", "new"])
        system = toks(rng, 4 * BS)
        for _ in range(3):
            await fleet.request(system + toks(rng, BS), "a")
        await fleet.warmer.replica_joined("new")
        await fleet.warmer.pump(fleet.infos)
        hashes = HASHER.block_hashes(system)
        assert (await fleet.index.lookup(hashes, ["new"]))["new"] == 4
        await fleet.warmer.finished(fleet.sent[0][0], False)
        assert (await fleet.index.lookup(hashes, ["new"]))["new"] == 0
        assert fleet.warmer.stats.failed["scale_out"] == 1

    asyncio.run(main())


def test_rehome_moves_only_what_the_leaver_alone_held_and_spreads_by_load():
    async def main():
        rng = random.Random(8)
        fleet = _Fleet(["gone", "b", "c"], top=8)
        only_gone = [toks(rng, 6 * BS) for _ in range(2)]
        both = toks(rng, 6 * BS)
        for ids in only_gone:
            for _ in range(3):
                await fleet.request(ids + toks(rng, BS), "gone")
        for _ in range(3):
            await fleet.request(both + toks(rng, BS), "gone")
            await fleet.request(both + toks(rng, BS), "b")
        await fleet.load.reserve("busy", "b", 50_000)  # b is loaded: the cost rule picks c
        survivors = ["b", "c"]
        await fleet.core.remove_replica("gone")  # purged first, as the Ray router does
        assert await fleet.warmer.replica_left("gone", survivors) == 2
        await fleet.warmer.pump(_replicas(*survivors))
        assert sorted(s[2] for s in fleet.sent) == sorted(only_gone)
        assert {s[1] for s in fleet.sent} == {"c"}

    asyncio.run(main())


def test_rate_bound_holds_back_the_queue():
    async def main():
        rng = random.Random(9)
        fleet = _Fleet(["a", "new"], top=4, tokens_per_s=8 * BS, concurrency=4)
        for _ in range(4):
            system = toks(rng, 8 * BS)
            for _ in range(2):
                await fleet.request(system + toks(rng, BS), "a")
        await fleet.warmer.replica_joined("new")
        wait = await fleet.warmer.pump(fleet.infos)
        assert len(fleet.sent) == 1 and wait == pytest.approx(1.0)  # one bucket's worth
        fleet.clock.advance(1.0)
        await fleet.warmer.pump(fleet.infos)
        assert len(fleet.sent) == 2

    asyncio.run(main())


def test_lease_lets_one_process_warm_a_replica():
    async def main():
        clock = ManualClock()
        lease = MemoryWarmupLease(clock)
        assert await lease.acquire("scale_out:r1", 10.0)
        assert not await lease.acquire("scale_out:r1", 10.0)
        assert await lease.acquire("rehome:r1", 10.0)
        clock.advance(11.0)
        assert await lease.acquire("scale_out:r1", 10.0)
        # a Warmer whose lease another process holds plans nothing
        fleet = _Fleet(["a", "new"], lease=lease)
        rng = random.Random(10)
        system = toks(rng, 4 * BS)
        for _ in range(3):
            await fleet.request(system + toks(rng, BS), "a")
        await lease.acquire("scale_out:new", 3600.0)
        assert await fleet.warmer.replica_joined("new") == 0

    asyncio.run(main())


def test_redis_lease_is_taken_once_across_processes():
    redis = pytest.importorskip("redis")
    from router.index.redis import RedisConnections
    try:
        redis.Redis.from_url("redis://127.0.0.1:6379/0", socket_timeout=1).ping()
    except redis.exceptions.ConnectionError:
        pytest.skip("no Redis on 127.0.0.1:6379")
    ns = f"test-warmup-{uuid.uuid4().hex[:8]}"

    async def main():
        a = RedisWarmupLease(RedisConnections("redis://127.0.0.1:6379/0", 1.0), ns)
        b = RedisWarmupLease(RedisConnections("redis://127.0.0.1:6379/0", 1.0), ns)
        assert await a.acquire("scale_out:r7", 5.0)
        assert not await b.acquire("scale_out:r7", 5.0)
        assert await b.acquire("rehome:r7", 5.0)
        client = a.conn.client()
        keys = sorted(k.decode() for k in await client.keys(f"{ns}:*"))
        assert keys == [f"{ns}:warmup:rehome:r7", f"{ns}:warmup:scale_out:r7"]
        assert 0 < await client.pttl(f"{ns}:warmup:scale_out:r7") <= 5000
        await client.delete(*keys)
        await a.conn.close()
        await b.conn.close()

    asyncio.run(main())


def _first_hits_on_new_replica(warmup: bool) -> list[int]:
    """The cached tokens of the first requests the added replica served, in order."""
    from loadtest.sim import ScaleEvent, SimConfig, simulate
    from loadtest.workloads import shared_prefix
    from replicas.sim.engine import EngineConfig
    from replicas.sim.step_model import StepTimeModel

    reqs = shared_prefix(groups=6, per_group=60, system=512, question=64, output=64,
                         rate=40.0, seed=1)
    engine = EngineConfig(num_blocks=20_000, block_size=BS, max_num_batched_tokens=2048,
                          max_num_seqs=64)
    res = simulate(SimConfig("prefix_aware", replicas=1, engine=engine,
                             step_model=StepTimeModel.load("h200-qwen2.5-7b"), seed=0,
                             scale_events=[ScaleEvent(3.0, "add")], warmup=warmup,
                             warmup_settings={"warmup_tokens_per_s": 1e6}), reqs)
    on_new = sorted((arr, rid) for rid, (rep, arr, _) in res.request_log.items()
                    if rep == "r1")
    return [res.by_request[rid][1] for _, rid in on_new[:5]]


def test_warmed_new_replica_hits_on_its_first_requests():
    """One replica under a shared-prefix load; a second joins at 3 s. Warmed, the first
    requests it serves find their system prompt cached there; unwarmed, its first request
    computes it."""
    cold, warm = _first_hits_on_new_replica(False), _first_hits_on_new_replica(True)
    assert len(cold) == 5 and len(warm) == 5
    assert cold[0] == 0
    assert all(c >= 512 for c in warm)
