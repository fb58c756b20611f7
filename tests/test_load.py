"""One test suite for every load tracker, as ``tests/test_index.py`` is for the indexes: the
in-process tracker, the Redis tracker on fakeredis, and on the real Redis."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest

from router.clock import ManualClock
from router.index.redis import RedisConnections
from router.load.memory import MemoryLoadTracker
from router.load.redis import RedisLoadTracker

REDIS_URL = "redis://127.0.0.1:6379/0"


@pytest.fixture(params=["memory", "fakeredis", "redis", "redis-cluster"])
async def load(request):
    """Every tracker; ``redis-cluster``: on a local Redis Cluster of three masters
    (``conftest.redis_cluster``), the keys in three shard groups (``A`` and ``B`` in one,
    tests/test_redis_cluster.py moves requests across groups)."""
    clock = ManualClock(time.time())
    if request.param == "memory":
        yield MemoryLoadTracker(clock=clock)
        return
    groups = None
    if request.param == "redis-cluster":
        url, groups = request.getfixturevalue("redis_cluster").url, 3
        conn = RedisConnections(url, 2.0, cluster=True)
    else:
        conn = RedisConnections(REDIS_URL, 2.0)
    if request.param == "fakeredis":
        import fakeredis
        fake = fakeredis.FakeAsyncRedis()
        conn.client = lambda *timeout: fake  # the fake server stands in for the URL
    tracker = RedisLoadTracker(conn, f"test-load-{uuid.uuid4().hex[:8]}", clock=clock,
                               shard_groups=groups)
    yield tracker
    client = conn.client()
    for g in range(tracker.groups.count):
        for key in tracker.group_keys(g):
            await client.delete(key)
    await tracker.close()


async def _load(tracker, replica="A"):
    return (await tracker.loads([replica]))[replica]


async def test_unknown_replicas_have_no_load(load):
    got = await load.loads(["A", "B"])
    assert {r: (v.inflight, v.prefill_tokens) for r, v in got.items()} == {"A": (0, 0),
                                                                          "B": (0, 0)}


async def test_a_reservation_counts_a_request_and_its_queued_prefill(load):
    await load.reserve("q1", "A", 500)
    await load.reserve("q2", "A", 300)
    await load.reserve("q3", "B", 100)
    a, b = (await load.loads(["A", "B"])).values()
    assert (a.inflight, a.prefill_tokens, b.inflight, b.prefill_tokens) == (2, 800, 1, 100)
    assert a.last_assigned_s > 0


async def test_prefill_done_takes_its_tokens_off_the_queue_once(load):
    await load.reserve("q1", "A", 500)
    await load.prefill_done("q1")
    await load.prefill_done("q1")  # a second first byte changes nothing
    a = await _load(load)
    assert (a.inflight, a.prefill_tokens) == (1, 0)


async def test_a_first_byte_not_waited_for_reaches_the_shared_counts_or_goes_with_the_release(
        load):
    """``prefill_done_soon``: the shared counts learn of the first byte within
    ``PREFILL_DONE_DELAY_S``; a release before then ends the prefill itself, and no write
    for the first byte is left pending."""
    await load.reserve("q1", "A", 500)
    load.prefill_done_soon("q1")
    load.prefill_done_soon("q1")  # a second first byte changes nothing
    await asyncio.sleep(0.2)  # past the delay, and the write it starts
    a = await _load(load)
    assert (a.inflight, a.prefill_tokens) == (1, 0)
    await load.reserve("q2", "A", 300)
    load.prefill_done_soon("q2")
    await load.release("q2")  # before the delay: the release takes its prefill off
    assert not getattr(load, "_prefill_timers", None)
    await load.release("q1")
    await asyncio.sleep(0.2)
    a = await _load(load)
    assert (a.inflight, a.prefill_tokens) == (0, 0)
    assert not getattr(load, "_writes", None)


async def test_a_failed_release_after_a_deferred_first_byte_leaves_no_prefill_in_view():
    """The first byte's write was deferred and the release's Redis call fails: Redis still
    counts the prefill as queued, and this router's corrected view takes it off too."""
    from router.index.base import IndexUnavailable
    conn = RedisConnections(REDIS_URL, 2.0)
    t = RedisLoadTracker(conn, f"test-load-{uuid.uuid4().hex[:8]}",
                         clock=ManualClock(time.time()))
    await t.reserve("q", "A", 500)
    t.prefill_done_soon("q")
    real = t._release

    async def failing(*args):
        raise IndexUnavailable("timeout")

    t._release = failing  # the heartbeat's retries too, until the view is checked
    await t.release("q")  # within the delay: the first byte never reached Redis
    a = await _load(t)
    assert (a.inflight, a.prefill_tokens) == (0, 0) and t.pending_releases == {"q"}
    t._release = real
    await t.retry_releases()
    a = await _load(t)
    assert (a.inflight, a.prefill_tokens) == (0, 0) and not t.pending_releases
    for key in t.group_keys(0):
        await conn.client().delete(key)
    await t.close()


async def test_the_load_hash_is_a_hash_table_from_a_routers_first_heartbeat():
    """A listpack's fields are found by a scan: the heartbeat makes the load hash a hash
    table (``TABLE_FIELD``), which the readers pass over."""
    conn = RedisConnections(REDIS_URL, 2.0)
    t = RedisLoadTracker(conn, f"test-load-{uuid.uuid4().hex[:8]}")
    client = conn.client()
    try:
        await t.reserve("q", "A", 500)  # starts the heartbeat
        for _ in range(100):
            if await client.object("encoding", t.redis_keys.load) == b"hashtable":
                break
            await asyncio.sleep(0.02)
        assert await client.object("encoding", t.redis_keys.load) == b"hashtable"
        a = await _load(t)
        assert (a.inflight, a.prefill_tokens) == (1, 500)
        await t.release("q")
        a = await _load(t)
        assert (a.inflight, a.prefill_tokens) == (0, 0)
    finally:
        for key in t.group_keys(0):
            await client.delete(key)
        await t.close()


async def test_release_is_idempotent_and_never_goes_negative(load):
    await load.reserve("q1", "A", 500)
    await load.reserve("q2", "A", 0)  # a lease of no prefill tokens (fully cached)
    for rid in ("q1", "q1", "q2", "q2", "never-reserved"):
        await load.release(rid)
    a = await _load(load)
    assert (a.inflight, a.prefill_tokens) == (0, 0)


async def test_release_after_prefill_done_returns_to_zero(load):
    await load.reserve("q1", "A", 500)
    await load.prefill_done("q1")
    await load.release("q1")
    a = await _load(load)
    assert (a.inflight, a.prefill_tokens) == (0, 0)


async def test_reserving_again_moves_the_request_instead_of_counting_it_twice(load):
    await load.reserve("q1", "A", 500)
    await load.reserve("q1", "B", 200)  # Serve sent it elsewhere, or a retry
    a, b = (await load.loads(["A", "B"])).values()
    assert (a.inflight, a.prefill_tokens, b.inflight, b.prefill_tokens) == (0, 0, 1, 200)
    await load.release("q1")
    b = await _load(load, "B")
    assert (b.inflight, b.prefill_tokens) == (0, 0)


async def test_a_removed_replica_has_no_load_and_its_requests_release_cleanly(load):
    await load.reserve("q1", "A", 500)
    await load.reserve("q2", "B", 100)
    await load.remove_replica("A")
    a, b = (await load.loads(["A", "B"])).values()
    assert (a.inflight, a.prefill_tokens, b.inflight) == (0, 0, 1)
    await load.release("q1")  # its ingress finishes it later: nothing goes negative
    a = await _load(load)
    assert (a.inflight, a.prefill_tokens) == (0, 0)


async def test_new_prefix_placements_decay_over_the_window():
    """``MemoryLoadTracker.placed``: a count that decays with the window as time constant,
    read back with the time it was written at."""
    import math
    from router.load.base import decayed_placements
    clock = ManualClock(10.0)
    t = MemoryLoadTracker(clock)
    await t.placed("a", 2.0)
    clock.advance(2.0)
    await t.placed("a", 2.0)
    load = (await t.loads(["a"]))["a"]
    assert load.placements == pytest.approx(1 + math.exp(-1))
    assert load.placements_at_s == 12.0
    assert decayed_placements(load, 14.0, 2.0) == pytest.approx((1 + math.exp(-1)) / math.e)
    assert decayed_placements(load, 14.0, 0.0) == 0.0
    assert (await t.loads(["b"]))["b"].placements == 0.0


async def test_a_placement_follows_its_request_and_is_forgotten_at_its_release(load):
    """``placed`` with a request id: ``placement_moved`` takes the count off the replica
    the decision put it on and counts it where the request went (a session join, Serve's
    own choice), once; ``unplaced`` never goes below 0; the release forgets the request
    (across shard groups too: ``A`` and ``C`` lie in different groups on the cluster)."""
    await load.reserve("q", "A", 10)
    await load.placed("A", 5.0, "q")
    assert load.placement_of("q") == ("A", True)
    await load.placement_moved("q", "C", 5.0)
    assert (await _load(load, "A")).placements == 0.0
    assert (await _load(load, "C")).placements == pytest.approx(1.0)
    await load.placement_moved("q", "C", 5.0)  # already there
    assert (await _load(load, "C")).placements == pytest.approx(1.0)
    await load.placed("C", 5.0)  # another request's, without its id
    await load.unplaced("C", 5.0)
    await load.unplaced("C", 5.0)
    await load.unplaced("C", 5.0)
    assert (await _load(load, "C")).placements == 0.0
    await load.release("q")
    assert load.placement_of("q") is None
    await load.placement_moved("q", "A", 5.0)  # released: nothing follows it any more
    assert (await _load(load, "A")).placements == 0.0
    # a replica that left takes its placements' records along: no later move writes it back
    await load.reserve("r", "A", 10)
    await load.placed("A", 5.0, "r")
    await load.remove_replica("A")
    assert load.placement_of("r") is None
    await load.placement_moved("r", "C", 5.0)
    assert (await _load(load, "C")).placements == 0.0
    await load.release("r")


async def test_a_request_decided_again_takes_its_earlier_placement_back(load):
    """``retract_placement``: the count a first decision made goes (where it was kept),
    the record with it; a request with none, or retracted twice, changes nothing."""
    await load.placed("C", 5.0)  # another request's
    assert load.retract_placement("nobody", 5.0) is None
    await load.reserve("q", "A", 10)
    await load.placed("A", 5.0, "q")
    undo = load.retract_placement("q", 5.0)
    assert load.placement_of("q") is None  # forgotten at once
    await undo
    assert (await _load(load, "A")).placements == 0.0
    assert load.retract_placement("q", 5.0) is None
    await load.placed("A", 5.0, "r", local_only=True)  # a fallback's: its router's only
    await load.retract_placement("r", 5.0)
    local = load.local if hasattr(load, "local") else load
    assert local.loads_now(["A"])["A"].placements == 0.0
    assert (await _load(load, "C")).placements == pytest.approx(1.0)
    await load.release("q")


async def test_a_placement_counted_while_the_store_fails_stays_in_this_routers_counts(load):
    """``placed(local_only=True)`` (a decision made while the index fails): counted in the
    router's own counts, with no call to the shared store that would wait once more."""
    shared = not isinstance(load, MemoryLoadTracker)
    await load.placed("A", 5.0)  # another router's count, shared
    await load.placed("A", 5.0, "q", local_only=True)
    assert load.placement_of("q") == ("A", not shared)
    local = load if not shared else load.local
    assert local.loads_now(["A"])["A"].placements == pytest.approx(2.0)
    if shared:
        assert (await _load(load, "A")).placements == pytest.approx(1.0)  # not written
    # the request goes elsewhere: its count moves in this router's counts only, and the
    # shared one, another router's, stays
    await load.placement_moved("q", "C", 5.0)
    assert load.placement_of("q") == ("C", not shared)
    assert local.loads_now(["A", "C"])["A"].placements == pytest.approx(1.0)
    assert local.loads_now(["C"])["C"].placements == pytest.approx(1.0)
    if shared:
        assert (await _load(load, "A")).placements == pytest.approx(1.0)
        assert (await _load(load, "C")).placements == 0.0


async def test_mean_request_life_counts_the_requests_still_in_flight():
    """``MemoryLoadTracker.mean_request_life_s``: Little's law, the area under the
    in-flight count over the releases; before any release the area so far (the requests
    in flight count with their time so far); 0 before any request."""
    clock = ManualClock(0.0)
    t = MemoryLoadTracker(clock)
    assert t.mean_request_life_s() == 0.0
    await t.reserve("a", "r", 10)
    await t.reserve("b", "r", 10)
    clock.advance(3.0)
    assert t.mean_request_life_s() == pytest.approx(6.0)  # 3 + 3, none released yet
    await t.release("a")
    assert t.mean_request_life_s() == pytest.approx(6.0, rel=1e-2)  # 6 s of area, 1 release
    await t.release("a")  # twice: once counted
    await t.release("b")
    assert t.mean_request_life_s() == pytest.approx(3.0, rel=1e-2)
    await t.reserve("c", "r", 10)
    await t.reserve("c", "r", 10)  # asked again: still one request in flight
    clock.advance(1.0)
    await t.release("c")
    assert t.mean_request_life_s() == pytest.approx(7 / 3, rel=1e-2)


async def test_two_moves_of_one_request_at_once_move_its_count_once(load):
    """Two ``placement_moved`` of one request started together: one count leaves ``A``
    and one arrives, not two."""
    import asyncio
    await load.reserve("q", "A", 10)
    await load.placed("A", 5.0, "q")
    await load.placed("A", 5.0)  # another request's
    await asyncio.gather(load.placement_moved("q", "C", 5.0), load.placement_moved("q", "C", 5.0))
    assert (await _load(load, "A")).placements == pytest.approx(1.0)
    assert (await _load(load, "C")).placements == pytest.approx(1.0)
    await load.release("q")


async def test_a_release_in_flight_is_left_out_of_the_loads_read_meanwhile(own_redis):
    """A review: the answer no longer waits for a slow Redis to take the release, so a
    release still in flight must not count as load in the decisions made meanwhile (the
    same client's next turn would see its replica busier than it is)."""
    import asyncio

    import redis as sync_redis

    from router.index.redis import RedisConnections

    conn = RedisConnections(own_redis.url, 0.05)
    t = RedisLoadTracker(conn, f"test-load-{uuid.uuid4().hex[:8]}")
    admin = sync_redis.Redis.from_url(own_redis.url)
    try:
        await conn.open_connections(4)  # before the pause (a handshake then would fail)
        await t.reserve("r", "A", 100)
        assert (await t.loads(["A"]))["A"].inflight == 1
        admin.execute_command("CLIENT", "PAUSE", 500, "WRITE")  # reads still answer
        release = asyncio.ensure_future(t.release("r"))
        await asyncio.sleep(0.1)
        assert not release.done()  # the release waits for the pause
        seen = (await t.loads(["A"]))["A"]
        assert seen.inflight == 0 and seen.prefill_tokens == 0, seen
        await release
        assert (await t.loads(["A"]))["A"].inflight == 0 and not t.pending_releases
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        await t.close()
        await conn.close()
