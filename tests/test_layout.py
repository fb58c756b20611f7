"""Routers of two key layouts on one namespace (router.index.layout): both leave Redis alone
while the other is present; once one is gone, the other clears what is left and goes back
to the shared index. Against the real Redis of the tests."""

from __future__ import annotations

import asyncio
import uuid

import pytest
import redis

from router.index.base import IndexUnavailable
from router.index.layout import LayoutConflict, LayoutGuard
from router.index.redis import RedisConnections, RedisPrefixIndex
from router.kv_events.wire import KVEvent
from tests.conftest import REDIS_URL


def _conn(ns: str, version: int, url: str = REDIS_URL, cluster: bool = False):
    conn = RedisConnections(url, 2.0, cluster=cluster)
    conn.layout = LayoutGuard(ns, version=version, presence_s=0.6, check_s=0.1)
    return conn


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
async def test_two_layouts_leave_the_namespace_alone_until_one_is_gone_then_it_is_cleared(
        backend, request):
    """On one Redis, and on a Redis Cluster (the clear scans every master)."""
    ns = f"layout-{uuid.uuid4().hex[:8]}"
    if backend == "redis-cluster":
        url = request.getfixturevalue("redis_cluster").url
        admin = redis.RedisCluster.from_url(url)
    else:
        url, admin = REDIS_URL, redis.Redis.from_url(REDIS_URL)
    cluster = backend == "redis-cluster"
    new, old = _conn(ns, 2, url, cluster), _conn(ns, 1, url, cluster)
    groups = {"shard_groups": 3} if cluster else {}
    new_index = RedisPrefixIndex(url, ns, connections=new, **groups)
    old_index = RedisPrefixIndex(url, ns, connections=old, **groups)
    try:
        # the old layout alone: it reads and writes as always
        await old_index.apply_events("a", [KVEvent("stored", [1, 2, 3], None)])
        admin.sadd(f"{ns}:drained", "a")  # an operator's drain: kept through the clear
        admin.set(f"{ns}:canary:load", 1)  # another namespace that begins with this one
        assert (await old_index.lookup([1, 2, 3], ["a"]))["a"] == 3
        # a router of the new layout comes: it refuses at its first call...
        with pytest.raises(LayoutConflict, match="layout 1"):
            await new_index.lookup([1, 2, 3], ["a"])
        assert new.layout.others == ["1"]
        # ...and the old one at its next check (the call that starts it still passes)
        await asyncio.sleep(0.15)
        try:
            await old_index.lookup([1], ["a"])
        except LayoutConflict:
            pass
        await asyncio.sleep(0.05)
        with pytest.raises(IndexUnavailable):
            await old_index.lookup([1, 2, 3], ["a"])
        assert old.layout.others == ["2"]
        # the old router stops; once its presence has expired, the new one's check drops it
        # and deletes the keys it left; the new layout then uses the namespace alone
        await old_index.close()
        await asyncio.sleep(0.7)
        for _ in range(20):
            try:
                assert (await new_index.lookup([1, 2, 3], ["a"]))["a"] == 0
                break
            except LayoutConflict:
                await asyncio.sleep(0.1)
        assert new.layout.others == [] and new.layout.cleared > 0
        assert sorted(set(admin.scan_iter(match=f"{ns}:*"))) == [
            f"{ns}:canary:load".encode(), f"{ns}:drained".encode(), f"{ns}:layouts".encode()]
        assert list(admin.hgetall(f"{ns}:layouts")) == [b"2"]
        await new_index.apply_events("a", [KVEvent("stored", [1, 2], None)])
        assert (await new_index.lookup([1, 2, 3], ["a"]))["a"] == 2
    finally:
        await new_index.flush()  # every key of the namespace, none of the canary's
        left = set(admin.scan_iter(match=f"{ns}:*")) - {f"{ns}:layouts".encode()}
        # (the layouts' hash is written again by the guards' checks still running)
        assert left == {f"{ns}:canary:load".encode()}
        admin.delete(f"{ns}:canary:load")
        await new_index.close()
        await old_index.close()
        admin.close()


async def test_the_same_layout_shares_the_namespace_and_a_first_check_that_fails_is_retried():
    ns = f"layout-{uuid.uuid4().hex[:8]}"
    one, two = _conn(ns, 1), _conn(ns, 1)
    a = RedisPrefixIndex(REDIS_URL, ns, connections=one)
    b = RedisPrefixIndex(REDIS_URL, ns, connections=two)
    flaky = _conn(ns, 1)
    real, tries = flaky.layout._script, []

    async def fails_once(client, op=""):
        tries.append(op)
        if len(tries) == 1:
            raise redis.ConnectionError("connection reset")
        return await real(client, op)
    flaky.layout._script = fails_once
    try:
        await a.apply_events("a", [KVEvent("stored", [7, 8], None)])
        assert (await b.lookup([7, 8], ["a"]))["a"] == 2
        assert one.layout.others == [] == two.layout.others
        # the first check fails: that call is refused, no verdict is kept; the next call
        # checks again, and goes through
        with pytest.raises(IndexUnavailable, match="key layout check"):
            await flaky.call(lambda c: c.ping())
        assert flaky.layout.others is None
        assert await flaky.call(lambda c: c.ping()) is True
        assert len(tries) == 2 and flaky.layout.others == []
    finally:
        await a.flush()
        await a.close()
        await b.close()
        await flaky.close()


def test_two_event_loops_of_one_process_wait_each_for_their_own_first_check():
    """A Serve ingress process runs two loops (its own, Serve's router's) on one set of
    connections: a call on the second loop while the first loop's first check is slow
    neither fails nor waits on the other loop's task."""
    import threading

    ns = f"layout-{uuid.uuid4().hex[:8]}"
    conn = _conn(ns, 1)
    real = conn.layout._script

    async def slow(client, op=""):
        await asyncio.sleep(0.3)
        return await real(client, op)
    conn.layout._script = slow
    results: dict[str, object] = {}

    def on_loop(name: str, delay: float) -> None:
        async def go():
            await asyncio.sleep(delay)
            try:
                results[name] = await conn.call(lambda c: c.ping())
            except Exception as exc:  # noqa: BLE001 - the test reports what it was
                results[name] = exc
            finally:
                await conn.close()
        asyncio.run(go())

    threads = [threading.Thread(target=on_loop, args=("first", 0.0)),
               threading.Thread(target=on_loop, args=("second", 0.1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {"first": True, "second": True}
    redis.Redis.from_url(REDIS_URL).delete(f"{ns}:layouts")


def test_a_clear_whose_process_stopped_is_taken_over_and_the_others_wait_meanwhile():
    """``lua/layout.lua``: while a clear is marked (and renewed), the others see
    "clearing"; once its mark has expired (its process stopped), the next check clears."""
    from router.redis_keys import load_lua

    ns = f"layout-{uuid.uuid4().hex[:8]}"
    r = redis.Redis.from_url(REDIS_URL)
    script = r.register_script(load_lua("layout"))
    key = f"{ns}:layouts"
    try:
        r.hset(key, mapping={"1": 1000, "2": 50_000})  # layout 1 left at t=1 s
        assert script(keys=[key], args=["2", 10_000, 30_000, ""]) == [[b"clearing"], 1]
        # the clearer renews its mark at t=20 s; another router of layout 2 checks at
        # t=45 s: it waits
        assert script(keys=[key], args=["2", 20_000, 30_000, "renew"]) == [[b"clearing"], 0]
        assert script(keys=[key], args=["2", 45_000, 30_000, ""]) == [[b"clearing"], 0]
        # the clearer stopped: at t=60 s its mark has expired; this check clears
        assert script(keys=[key], args=["2", 60_000, 30_000, ""]) == [[b"clearing"], 1]
        assert script(keys=[key], args=["2", 61_000, 30_000, "done"]) == [[], 0]
        # a live other layout: no clear, whatever expired
        r.hset(key, mapping={"3": 100_000, "4": 1})
        assert script(keys=[key], args=["2", 62_000, 30_000, ""]) == [[b"3"], 0]
    finally:
        r.delete(key)
        r.close()


def test_a_key_s_kind_is_its_namespace_s_word_and_a_longer_namespace_owns_its_own():
    from router.redis_keys import RedisKeys

    keys = RedisKeys("a*b")
    assert keys.pattern() == "a\\*b:*"
    assert keys.kind(b"a*b:x:replica-1") == "x"
    assert keys.kind(b"a*b:{g0.3}:load") == "group"
    assert keys.kind(b"a*b:layouts") == "layouts"
    assert keys.kind(b"a*b:canary:x:replica-1") is None  # the namespace "a*b:canary"
    assert keys.kind(b"a*bc:x:replica-1") is None
    assert keys.kind(b"a*b") is None
    assert RedisKeys("a*b:canary").kind(b"a*b:canary:x:replica-1") == "x"
