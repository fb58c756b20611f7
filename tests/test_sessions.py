"""Session affinity (router/routing/sessions.py) in the routing core: in one process, and
shared by several routers through Redis."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from router.config import Settings
from router.index.memory import MemoryPrefixIndex
from router.index.redis import RedisConnections, RedisPrefixIndex
from router.load.memory import MemoryLoadTracker
from router.load.redis import RedisLoadTracker
from router.policy.prefix_aware import PrefixAware
from router.routing.atomic import AtomicRoute
from router.routing.core import RoutingCore
from router.routing.replica import ReplicaInfo
from router.routing.sessions import MemorySessionStore, RedisSessionStore, session_key

REDIS_URL = "redis://127.0.0.1:6379/0"
BS = 32
REPS = [ReplicaInfo(r, {}, {}) for r in ("a", "b", "c", "d")]


def _prompt(seed: int) -> tuple[int, list[int]]:
    """A prompt of its own blocks: nothing cached anywhere, so only the pin can keep it."""
    return 5 * BS + 3, [seed * 1000 + i for i in range(5)]


@pytest.fixture(params=["memory", "redis"])
def routers(request):
    """A factory of routing cores that share one index, load and session store."""
    settings = Settings(block_size=BS, index_namespace=f"t-{uuid.uuid4().hex[:8]}")
    if request.param == "memory":
        index, load, store = MemoryPrefixIndex(), MemoryLoadTracker(), MemorySessionStore()
        return lambda k: RoutingCore(settings, index, load, PrefixAware(random.Random(k)),
                                     sessions=store)
    conn = RedisConnections(REDIS_URL, 2.0)
    ns = settings.index_namespace
    index = RedisPrefixIndex(REDIS_URL, ns, connections=conn)

    def make(k):
        load = RedisLoadTracker(conn, ns)
        return RoutingCore(settings, index, load, PrefixAware(random.Random(k)),
                           atomic=AtomicRoute(index, load), sessions=RedisSessionStore(conn, ns))
    return make


async def test_a_session_stays_on_its_replica_without_any_cache_to_hold_it(routers):
    core = routers(0)
    key = session_key("t", "conv-1")
    first = await core.decide("r0", *_prompt(0), REPS, session=key)
    await core.load.release("r0")
    for turn in range(1, 6):
        d = await core.decide(f"r{turn}", *_prompt(turn), REPS, session=key)
        assert d.replica == first.replica and d.reason == "session"
        await core.load.release(f"r{turn}")
    others = set()
    for k in range(12):  # sessions of their own spread by load, not onto one replica
        d = await core.decide(f"o{k}", *_prompt(100 + k), REPS, session=session_key("t", k))
        others.add(d.replica)
    assert len(others) >= 3


async def test_the_pin_yields_to_a_dead_or_overloaded_replica_and_follows_the_request(
        routers):
    core = routers(0)
    key = session_key("t", "conv-2")
    first = (await core.decide("r0", *_prompt(0), REPS, session=key)).replica
    await core.load.release("r0")
    alive = [r for r in REPS if r.replica_id != first]
    moved = (await core.decide("r1", *_prompt(1), alive, session=key)).replica
    assert moved != first
    await core.load.release("r1")
    d = await core.decide("r2", *_prompt(2), REPS, session=key)
    assert d.replica == moved and d.reason == "session"  # pinned to where it went
    await core.load.release("r2")
    for i in range(8):  # the session's replica gets far busier than the rest
        await core.load.reserve(f"busy{i}", moved, 10)
    d = await core.decide("r3", *_prompt(3), REPS, session=key)
    assert d.replica != moved and d.reason != "session"


async def test_first_turns_on_two_routers_at_once_land_on_one_replica(routers):
    """Each router would choose by load alone (empty caches); the first pin wins and the
    other router's request joins it."""
    for trial in range(6):
        cores = [routers(1), routers(2)]
        for i, c in enumerate(cores):  # background load on two replicas
            await c.load.reserve(f"bg{trial}-{i}", REPS[i].replica_id, 10)
        key = session_key("t", f"race-{trial}")
        d1, d2 = await asyncio.gather(
            cores[0].decide(f"x{trial}", *_prompt(200 + trial), REPS, session=key),
            cores[1].decide(f"y{trial}", *_prompt(300 + trial), REPS, session=key))
        assert d1.replica == d2.replica, (trial, d1, d2)
        loads = await cores[0].load.loads([r.replica_id for r in REPS])
        assert loads[d1.replica].inflight >= 2  # both reservations where they go
        # each first turn is a new prefix: a placement counted for it went with it, joined
        # or not (a turn that found the other's pin already there was decided by the pin,
        # which counts none)
        placed = [p and p[0] for p in (cores[0].load.placement_of(f"x{trial}"),
                                       cores[1].load.placement_of(f"y{trial}"))]
        assert set(placed) <= {d1.replica, None} and placed != [None, None], placed


async def test_a_failing_session_store_leaves_routing_as_without_sessions():
    settings = Settings(block_size=BS)
    dead = RedisConnections("redis://127.0.0.1:1/0", 0.05)
    core = RoutingCore(settings, MemoryPrefixIndex(), MemoryLoadTracker(),
                       PrefixAware(random.Random(0)), sessions=RedisSessionStore(dead, "t"))
    d = await core.decide("r0", *_prompt(0), REPS, session=session_key(None, "s"))
    assert d.replica in {r.replica_id for r in REPS}


def test_session_keys_part_tenants_and_hide_the_id():
    assert session_key("a", "s1") != session_key("b", "s1")
    assert session_key("a", "s1") == session_key("a", "s1") != session_key("a", "s2")
    assert "s1" not in session_key("a", "s1") and len(session_key("a", "s1")) == 24
