"""Replicas an operator drained (``router.routing.drain``): left out of every decision, in
process and through the real Redis, unless no other replica is left."""

from __future__ import annotations

import random
import uuid

import pytest

from router.clock import ManualClock
from router.config import Settings
from router.index.memory import MemoryPrefixIndex
from router.index.redis import RedisConnections
from router.load.memory import MemoryLoadTracker
from router.policy import PrefixAware
from router.routing.core import RoutingCore
from router.routing.drain import DrainedReplicas
from router.routing.replica import ReplicaInfo
from tests.conftest import REDIS_URL

REPS = [ReplicaInfo(r, {}, {}) for r in ("A", "B", "C")]


def core_with(drains: DrainedReplicas) -> RoutingCore:
    clock = ManualClock(100.0)
    return RoutingCore(Settings(), MemoryPrefixIndex(clock=clock),
                       MemoryLoadTracker(clock=clock), PrefixAware(random.Random(0)),
                       drains=drains)


async def decide_many(core: RoutingCore, n: int) -> list[str]:
    out = []
    for i in range(n):
        d = await core.decide(uuid.uuid4().hex, 100, [], REPS)
        out.append(d.replica)  # never released: loads grow, so decisions spread
    return out


async def test_a_drained_replica_takes_no_request_until_undrained():
    drains = DrainedReplicas()
    core = core_with(drains)
    await drains.set("B", True)
    assert "B" not in await decide_many(core, 12)
    await drains.set("B", False)
    assert "B" in await decide_many(core, 12)


async def test_with_every_replica_drained_requests_are_still_routed():
    drains = DrainedReplicas()
    core = core_with(drains)
    for r in REPS:
        await drains.set(r.replica_id, True)
    assert len(await decide_many(core, 3)) == 3


async def test_the_redis_set_is_shared_by_routers_and_read_at_most_every_refresh_s():
    ns = f"test-drain-{uuid.uuid4().hex[:6]}"
    a = DrainedReplicas(RedisConnections(REDIS_URL, 1.0), ns, refresh_s=0.0)
    b = DrainedReplicas(RedisConnections(REDIS_URL, 1.0), ns, refresh_s=3600.0)
    try:
        assert await b.refresh() == frozenset()  # b read once: its copy is now an hour "new"
        assert await a.set("A", True) == {"A"} and a.shared
        assert await b.refresh() == frozenset()  # not re-read before refresh_s
        b.refresh_s = 0.0
        assert await b.refresh() == {"A"}
        core = core_with(b)
        assert "A" not in await decide_many(core, 9)
        await core.remove_replica("A")  # a replica that left is no longer drained
        assert await a.refresh() == frozenset()
    finally:
        import redis
        redis.Redis.from_url(REDIS_URL).delete(f"{ns}:drained")
        await a.conn.close()
        await b.conn.close()


async def test_a_redis_that_lost_the_set_gets_it_back_and_an_undrain_is_kept(own_redis):
    """An operator's review: a Redis restart without persistence forgot every drain, and
    the drained replica took traffic again, silently. A router that finds the set gone
    whole (its marker too) writes its recent copy back; a set emptied by undrains keeps
    its marker and is left empty."""
    ns = f"test-drain-{uuid.uuid4().hex[:6]}"
    a = DrainedReplicas(RedisConnections(own_redis.url, 1.0), ns, refresh_s=0.0)
    b = DrainedReplicas(RedisConnections(own_redis.url, 1.0), ns, refresh_s=0.0)
    try:
        assert await a.set("A", True) == {"A"} and await a.set("B", True) == {"A", "B"}
        assert await b.refresh() == {"A", "B"}
        own_redis.stop()
        assert await b.refresh() == {"A", "B"}  # Redis down: the last copy (read failed)
        own_redis.restart()  # empty: no persistence
        assert own_redis.client().exists(f"{ns}:drained") == 0
        assert await b.refresh() == {"A", "B"}  # restored from b's copy
        fresh = DrainedReplicas(RedisConnections(own_redis.url, 1.0), ns, refresh_s=0.0)
        assert await fresh.refresh() == {"A", "B"}  # every router sees it again
        await fresh.conn.close()
        assert await a.set("A", False) == {"B"} and await a.set("B", False) == frozenset()
        assert await b.refresh() == frozenset()  # undrained: not brought back
        assert await b.refresh() == frozenset()
        assert own_redis.client().smembers(f"{ns}:drained") == {b""}  # the marker alone
    finally:
        await a.conn.close()
        await b.conn.close()


async def test_a_change_sent_while_the_set_is_lost_restores_it_first(own_redis):
    """A review of the restore: an undrain or a drain sent through a router while Redis has
    lost the set must neither bring the undrained replica back nor erase the others'
    drains; and a copy read long before the loss (another router may have undrained since)
    is not written back."""
    ns = f"test-drain-{uuid.uuid4().hex[:6]}"
    admin = own_redis.client()
    a = DrainedReplicas(RedisConnections(own_redis.url, 1.0), ns, refresh_s=0.0)
    b = DrainedReplicas(RedisConnections(own_redis.url, 1.0), ns, refresh_s=0.0)
    try:
        assert await a.set("X", True) == {"X"}
        admin.delete(f"{ns}:drained")  # lost (a flush)
        assert await a.set("X", False) == frozenset()  # the undrain is kept
        assert admin.smembers(f"{ns}:drained") == {b""}
        assert await a.set("X", True) == {"X"}
        admin.delete(f"{ns}:drained")
        assert await a.set("Y", True) == {"X", "Y"}  # X's drain restored, not erased
        assert await b.refresh() == {"X", "Y"}
        b._read_ok_at -= 60  # b's copy is a minute old when the loss shows
        admin.delete(f"{ns}:drained")
        assert await b.refresh() == frozenset()  # not trusted: not written back
        assert await a.refresh() == {"X", "Y"}  # a's recent copy is
    finally:
        await a.conn.close()
        await b.conn.close()


async def test_a_failed_read_keeps_the_last_copy_and_a_failed_write_raises():
    from router.index.base import IndexUnavailable

    d = DrainedReplicas(RedisConnections("redis://127.0.0.1:1/0", 0.2), "x", refresh_s=0.0)
    assert await d.refresh() == frozenset()
    with pytest.raises(IndexUnavailable):
        await d.set("A", True)
    assert d.current() == frozenset()


async def test_a_live_drained_replica_is_chosen_before_a_dead_one():
    """Drained B and dead A, C: the request goes to B (a drain never costs a request)."""
    drains = DrainedReplicas()
    core = core_with(drains)
    await drains.set("B", True)
    reps = [ReplicaInfo("A", {}, {"engine_alive": False}), ReplicaInfo("B", {}, {}),
            ReplicaInfo("C", {}, {"engine_alive": False})]
    for i in range(4):
        assert (await core.decide(uuid.uuid4().hex, 100, [], reps)).replica == "B"
