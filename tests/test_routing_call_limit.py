"""The adaptive bound on a process's routing calls in flight to Redis
(``router.index.redis.RoutingCallLimit``): a Redis that answers late gets fewer calls, the
requests beyond the bound are routed at once without the index, and the bound comes back
as Redis answers in time again."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest

from router.config import Settings
from router.index.base import IndexBusy
from router.index.redis import LateCall, RedisConnections, RedisPrefixIndex, RoutingCallLimit
from router.load.redis import RedisLoadTracker
from router.policy.prefix_aware import PrefixAware
from router.routing.atomic import AtomicRoute
from router.routing.core import RoutingCore
from router.routing.replica import ReplicaInfo


def test_the_bound_falls_to_half_the_calls_in_flight_at_a_late_call_and_grows_back():
    limit = RoutingCallLimit(ceiling=16, deadline_s=0.05)
    assert all(limit.admit() for _ in range(16)) and not limit.admit()
    limit.late()  # 16 in flight at the deadline: 8 allowed, 15 still counted
    assert limit.bound == 8 and limit.inflight == 15 and not limit.admit()
    for _ in range(8):
        limit.answered(0.001)
    assert limit.inflight == 7 and limit.admit()  # 8 in flight again: the bound's
    assert not limit.admit()
    limit.late()
    limit.late()  # late calls of one stall: half of those then in flight, not halved twice
    assert limit.bound == 3.5 and limit.inflight == 6
    for _ in range(6):
        limit.answered(0.001)
    limit.late() if limit.admit() else None
    assert limit.bound == 1.0  # never below one call: the next call probes Redis
    assert limit.admit() and not limit.admit()
    limit.answered(0.04)  # in time, but past half the deadline: the bound holds
    assert limit.bound == 1.0
    for _ in range(40):
        assert limit.admit()
        limit.answered(0.001)
    # one more per bound's worth of timely answers: about sqrt(2 x 40) from 1
    assert 8 <= limit.bound <= 10
    for _ in range(10_000):
        limit.admit()
        limit.answered(0.0)
    assert limit.bound == 16  # up to the ceiling, no further


async def test_a_redis_that_answers_late_gets_fewer_calls_and_the_rest_are_not_sent(own_redis):
    """Calls that reach the deadline lower the bound; while the bound's calls are in flight
    the next one raises ``IndexBusy`` at once instead of waiting its deadline; once Redis
    answers in time the bound grows again."""
    import redis as sync_redis

    conn = RedisConnections(own_redis.url, 0.05)
    admin = sync_redis.Redis.from_url(own_redis.url)

    async def incr(client):
        return await client.incr("n")

    assert await conn.call(incr) == 1
    admin.execute_command("CLIENT", "PAUSE", 400, "WRITE")
    lates = await asyncio.gather(*(conn.call_or_leave(incr) for _ in range(8)),
                                 return_exceptions=True)
    assert all(isinstance(e, LateCall) for e in lates), lates
    limit = conn.routing_limit()
    assert limit.bound == 1 and limit.inflight == 0  # half of 8, of 7, ... of 1 in flight
    # Redis still paused: one call at a time reaches it, the others are not sent
    t0 = time.perf_counter()
    out = await asyncio.gather(conn.call(incr), conn.call(incr), conn.call_or_leave(incr),
                               return_exceptions=True)
    assert [type(e) for e in out[1:]] == [IndexBusy, IndexBusy], out
    assert isinstance(out[0], Exception)  # the one sent: late (the pause goes on)
    assert time.perf_counter() - t0 < 0.2
    await asyncio.sleep(0.45)  # the pause is over: timely answers raise the bound again
    for _ in range(500):  # about 32 in time suffice (a loaded machine answers some late)
        await conn.call(incr)
        if limit.bound >= 8:
            break
    assert limit.bound >= 8
    out = await asyncio.gather(*(conn.call(incr) for _ in range(8)), return_exceptions=True)
    assert not any(isinstance(o, IndexBusy) for o in out), out
    await conn.close()


async def test_decisions_beyond_the_bound_go_by_the_fallback_without_an_index_error(own_redis):
    """A routing decision whose script is not sent is routed by this router's own counts at
    once, counted as shed (not as an index error), and does not mark the index unavailable."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=own_redis.url, index_namespace=ns, redis_timeout_s=0.05)
    conn = RedisConnections(own_redis.url, 0.05)
    index, load = RedisPrefixIndex(own_redis.url, ns, connections=conn), \
        RedisLoadTracker(conn, ns)
    errors: list = []
    core = RoutingCore(settings, index, load, PrefixAware(
        random.Random(0), **settings.policy_kwargs("prefix_aware")),
        atomic=AtomicRoute(index, load), on_index_error=lambda exc, op: errors.append(op))
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    hashes = [random.getrandbits(63) for _ in range(4)]
    first = await core.decide("r0", 64, hashes, reps)
    assert first.reason == "load" and core.index_available
    limit = conn.routing_limit()
    limit.bound = 1.0
    assert limit.admit()  # one routing call already in flight: the bound's
    t0 = time.perf_counter()
    shed = await core.decide("r1", 64, hashes, reps)
    assert time.perf_counter() - t0 < 0.05
    assert shed.reason == "fallback" and core.index_available and errors == []
    limit.answered(0.0)
    again = await core.decide("r2", 64, hashes, reps)
    assert again.reason == "cache"  # the script runs again, and finds r0's prefix
    for rid in ("r0", "r1", "r2"):
        await load.release(rid)
    await load.close()
    await index.flush()
    await conn.close()
