"""Engines reached by URL (``replicas.external``), against real simulated engines (their own
processes, KV events on TCP) and the real Redis: the engines file, an engine that hashes
otherwise (its events ignored), and the one feeder per engine with a shared index."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import pytest
import redis

from replicas.engine import free_ports
from replicas.external import ExternalFleet, read_engines_file
from router.config import ExternalEngine, Settings
from router.index.base import IndexUnavailable
from router.index.memory import MemoryPrefixIndex
from router.index.redis import RedisPrefixIndex
from tests.conftest import REDIS_URL, EngineServer


def sims_with_tcp_events(model_dir, *hash_seeds: str) -> list[tuple[EngineServer,
                                                                     ExternalEngine]]:
    """Simulated engines in processes of their own (one per hash seed, started at once),
    publishing KV events on TCP, and how the router lists each."""
    free = free_ports(3 * len(hash_seeds))  # one call: HTTP and event ports all distinct
    ports = list(zip(free[::3], free[1::3]))
    engines = EngineServer.sims(model_dir, *(
        ["--hash-seed", seed, "--kv-events-config",
         json.dumps({"endpoint": f"tcp://*:{pub}", "replay_endpoint": f"tcp://*:{rep}"})]
        for seed, (pub, rep) in zip(hash_seeds, ports)), ports=free[2::3])
    return [(e, ExternalEngine(url=e.url, kv_events_endpoint=f"tcp://127.0.0.1:{pub}",
                               kv_replay_endpoint=f"tcp://127.0.0.1:{rep}"))
            for e, (pub, rep) in zip(engines, ports)]


@pytest.fixture(scope="module")
def sims(model_dir):
    same, other = sims_with_tcp_events(model_dir, "0", "7")
    yield {"same": same[1], "other": other[1]}
    same[0].stop()
    other[0].stop()


def _fleet(settings: Settings, index, published: list, **kw) -> ExternalFleet:
    async def removed(rid: str) -> None:
        published.append(("removed", rid))
    return ExternalFleet(settings, index, removed, published.append, **kw)


async def test_an_engine_that_hashes_otherwise_is_routed_on_predicted_entries_only(
        sims, model_dir):
    index = MemoryPrefixIndex()
    published: list = []
    settings = Settings(model=str(model_dir), external_engines=[sims["same"],
                                                                sims["other"]])
    fleet = _fleet(settings, index, published)
    try:
        t0 = time.monotonic()
        infos = {i.replica_id: i for i in await fleet.poll()}
        polled_s = time.monotonic() - t0
        watch = fleet.replicas[sims["same"].replica_id].watch
        # the poll scraped (the autoscaler reuses that scrape): it is no older than the poll
        assert watch.scrape_age_s() <= polled_s
        again = {i.replica_id: i for i in await fleet.poll()}  # scraped after the probe
    finally:
        await fleet.stop()
    same, other = sims["same"].replica_id, sims["other"].replica_id
    assert infos[same].metadata.hash_probe == "ok"
    assert infos[other].metadata.hash_probe == "no_events"
    assert infos[other].stats.kv_events_live is False  # the long predicted TTL applies
    assert infos[same].stats.engine_alive and infos[other].stats.engine_alive
    assert infos[other].metadata.engine_url == sims["other"].url
    # the probe's blocks are indexed for the engine that hashes alike, none for the other
    assert index.exact_entries(same) and not index.exact_entries(other)
    assert published and published[-1] == tuple(again.values())
    # the cached KV the cost model's eviction term reads: the blocks the engine's events
    # hold; unknown without live events
    assert again[same].stats.kv_events_live is True
    assert again[same].stats.kv_cached_tokens == (len(index.exact_entries(same))
                                                  * settings.block_size)
    assert again[other].stats.kv_cached_tokens is None


async def test_polls_through_the_data_paths_client_keep_a_connection_to_each_engine_open(
        sims, model_dir):
    """A fleet given the ingress's engine client polls through it: after a poll its pool
    holds an idle keep-alive connection to each engine (a request then opens none), and
    stopping the fleet leaves the client, the caller's, open."""
    from router.serve.engine_client import EngineClient

    client = EngineClient(30.0)
    settings = Settings(model=str(model_dir), external_engines=[sims["same"],
                                                                sims["other"]])
    fleet = _fleet(settings, MemoryPrefixIndex(), [], client=client)
    try:
        await fleet.poll()
        idle = {key.port: len(conns) for key, conns in client.session.connector._conns.items()}
        ports = {int(e.url.rsplit(":", 1)[1]) for e in settings.external_engines}
        assert set(idle) == ports and all(n >= 1 for n in idle.values())
    finally:
        await fleet.stop()
    assert not client.session.closed
    status, _, _ = await client.call("GET", sims["same"].url + "/health", timeout_s=5.0)
    assert status == 200
    await client.close()


async def test_one_router_writes_an_engines_events_to_redis_and_another_takes_over(
        sims, model_dir):
    ns = f"test-external-{uuid.uuid4().hex[:6]}"
    spec = sims["same"]
    settings = Settings(model=str(model_dir), external_engines=[spec], redis_url=REDIS_URL,
                        index_namespace=ns)
    a = _fleet(settings, RedisPrefixIndex(REDIS_URL, namespace=ns), [], lease_s=1.0)
    b = _fleet(settings, RedisPrefixIndex(REDIS_URL, namespace=ns), [], lease_s=1.0)
    rc = redis.Redis.from_url(REDIS_URL)
    try:
        await a.poll()
        await b.poll()
        writers = [f for f in (a, b) if f.replicas[spec.replica_id].feed.index is not None]
        assert writers == [a]  # the first to poll holds the lease; the other only watches
        assert rc.get(f"{ns}:feeder:{spec.replica_id}") == a._me.encode()
        await asyncio.sleep(0.5)  # the probe's events written by a alone
        held = rc.hlen(f"{ns}:x:{spec.replica_id}")
        assert held > 0
        await a.stop()  # a's router goes away without a word
        await asyncio.sleep(1.2)  # its lease runs out
        await b.poll()
        assert b.replicas[spec.replica_id].feed.index is not None
        async with httpx.AsyncClient(base_url=spec.url) as c:  # new blocks: b writes them
            r = await c.post("/v1/completions", json={
                "model": "tiny-qwen2", "prompt": list(range(100, 300)), "max_tokens": 1})
            assert r.status_code == 200
        await asyncio.sleep(0.5)
        assert rc.hlen(f"{ns}:x:{spec.replica_id}") > held
    finally:
        await a.stop()
        await b.stop()
        for key in rc.scan_iter(f"{ns}:*"):
            rc.delete(key)


async def test_the_engines_file_is_followed_and_a_broken_edit_keeps_the_last_list(
        sims, model_dir, tmp_path):
    path = tmp_path / "engines.yaml"
    path.write_text(f"engines:\n  - {sims['same'].url}\n")
    published: list = []
    fleet = _fleet(Settings(model=str(model_dir), external_engines_file=str(path)),
                   MemoryPrefixIndex(), published)
    try:
        first = await fleet.poll()
        assert [i.metadata.engine_url for i in first] == [sims["same"].url]
        assert first[0].metadata.hash_probe == "no_events"  # listed without its events
        path.write_text("- {url: nope}\n")
        assert [i.replica_id for i in await fleet.poll()] == [first[0].replica_id]
        path.write_text(json.dumps([sims["other"].url]))
        now = await fleet.poll()
        assert [i.metadata.engine_url for i in now] == [sims["other"].url]
        assert ("removed", first[0].replica_id) in published
    finally:
        await fleet.stop()


def test_an_engines_file_is_checked(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps(["http://a:1", {"url": "http://b:2", "name": "b",
                                               "kv_events_endpoint": "tcp://b:5557"}]))
    engines = read_engines_file(str(path))
    assert [e.replica_id for e in engines][1] == "b"
    assert engines[0].replica_id.startswith("ext-")
    assert engines[0].replica_id == ExternalEngine(url="http://a:1/").replica_id
    for bad in (["ftp://a"], [{"url": "http://a:1", "kv_events_endpoint": "ipc://x"}],
                ["http://a:1", "http://a:1"], [{"url": "http://a:1", "extra": 1}]):
        path.write_text(json.dumps(bad))
        with pytest.raises(ValueError):
            read_engines_file(str(path))
    with pytest.raises(ValueError, match="direct data path"):
        Settings(external_engines=["http://a:1"], data_path="serve")


async def test_a_removed_engines_entries_are_cleared_even_when_the_index_misses_a_call(
        sims, model_dir, tmp_path):
    """The clear of an engine that left is not lost to one unanswered index call (CI, under
    load, once left a removed engine's 138 exact entries in Redis): it is tried again on the
    next poll, and an engine listed again before that keeps its entries."""

    class FlakyIndex(MemoryPrefixIndex):
        refusals = 1

        async def clear_replica(self, replica: str) -> None:
            if self.refusals:
                self.refusals -= 1
                raise IndexUnavailable("no answer within the timeout")
            await super().clear_replica(replica)

    path = tmp_path / "engines.json"
    path.write_text(json.dumps([sims["same"].model_dump(mode="json")]))
    index = FlakyIndex()
    fleet = _fleet(Settings(model=str(model_dir), external_engines_file=str(path)), index, [])
    rid = sims["same"].replica_id
    try:
        assert (await fleet.poll())[0].metadata.hash_probe == "ok"
        for _ in range(100):  # the probe's blocks, written by the feed's writer task
            if index.exact_entries(rid):
                break
            await asyncio.sleep(0.05)
        assert index.exact_entries(rid)
        path.write_text("[]")
        assert await fleet.poll() == ()
        assert index.exact_entries(rid)  # the index missed the clear ...
        await fleet.poll()
        assert not index.exact_entries(rid)  # ... and the next poll made it
    finally:
        await fleet.stop()
