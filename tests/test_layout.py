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
        assert sorted(set(admin.scan_iter(match=f"{ns}:*"))) == [f"{ns}:layouts".encode()]
        assert list(admin.hgetall(f"{ns}:layouts")) == [b"2"]
        await new_index.apply_events("a", [KVEvent("stored", [1, 2], None)])
        assert (await new_index.lookup([1, 2, 3], ["a"]))["a"] == 2
    finally:
        await new_index.flush()
        await new_index.close()
        await old_index.close()
        admin.close()


async def test_the_same_layout_shares_the_namespace_and_a_first_check_that_fails_is_retried():
    ns = f"layout-{uuid.uuid4().hex[:8]}"
    one, two = _conn(ns, 1), _conn(ns, 1)
    a = RedisPrefixIndex(REDIS_URL, ns, connections=one)
    b = RedisPrefixIndex(REDIS_URL, ns, connections=two)
    down = RedisConnections("redis://127.0.0.1:1/0", 0.05, layout_namespace=ns)
    try:
        await a.apply_events("a", [KVEvent("stored", [7, 8], None)])
        assert (await b.lookup([7, 8], ["a"]))["a"] == 2
        assert one.layout.others == [] == two.layout.others
        for _ in range(2):  # no answer: no verdict kept, each call tries again
            with pytest.raises(IndexUnavailable):
                await down.call(lambda c: c.ping())
            assert down.layout.others is None
    finally:
        await a.flush()
        await a.close()
        await b.close()
        await down.close()
