"""Aggregation of Ray's per-process metric export into the router's /metrics."""

from router.metrics import aggregate_ray_export

EXPORT = """# HELP ray_router_decision_total Decisions.
# TYPE ray_router_decision_total counter
ray_router_decision_total{Component="core_worker",WorkerId="w1",reason="cache",policy="p"} 3.0
ray_router_decision_total{Component="core_worker",WorkerId="w2",reason="cache",policy="p"} 4.0
ray_router_decision_total{Component="core_worker",WorkerId="w2",reason="load",policy="p"} 1.0
# HELP ray_router_replicas_without_kv_events Silent replicas.
# TYPE ray_router_replicas_without_kv_events gauge
ray_router_replicas_without_kv_events{WorkerId="w1"} 1.0
ray_router_replicas_without_kv_events{WorkerId="w2"} 1.0
# HELP ray_router_inflight In flight.
# TYPE ray_router_inflight gauge
ray_router_inflight{WorkerId="w1",replica="a"} 10.0
ray_router_inflight{WorkerId="w2",replica="a"} 20.0
# HELP ray_other_metric Not ours.
# TYPE ray_other_metric counter
ray_other_metric_total 5.0
"""


def test_counters_and_inflight_sum_over_processes_fleet_views_do_not():
    text = aggregate_ray_export([EXPORT])
    assert 'router_decision_total{policy="p",reason="cache"} 7.0' in text
    assert 'router_decision_total{policy="p",reason="load"} 1.0' in text
    assert 'router_inflight{replica="a"} 30.0' in text
    assert "router_replicas_without_kv_events 1.0" in text
    assert "other_metric" not in text and "WorkerId" not in text


def test_nodes_add_up():
    text = aggregate_ray_export([EXPORT, EXPORT])
    assert 'router_decision_total{policy="p",reason="cache"} 14.0' in text


def test_engine_load_is_exported_per_replica_and_state(monkeypatch):
    """record_engine_load sets the engine's running and waiting requests and KV-cache usage
    under its replica's label."""
    from collections import defaultdict

    from router import metrics

    class Gauge:
        def __init__(self):
            self.values = {}

        def set(self, value, tags=None):
            self.values[tuple(sorted((tags or {}).items()))] = value

    gauges = defaultdict(Gauge)
    gauges["requests"]  # non-empty: metrics.get does not make the Ray metrics
    monkeypatch.setattr(metrics, "_metrics", gauges)
    metrics.record_engine_load("r1", 3, 2, 0.25)
    assert gauges["engine_requests"].values == {
        (("replica", "r1"), ("state", "running")): 3,
        (("replica", "r1"), ("state", "waiting")): 2}
    assert gauges["engine_kv_cache_usage"].values == {(("replica", "r1"),): 0.25}


def test_counter_increments_and_gauge_values_reach_ray_coalesced():
    """Increments of one counter and tags become one record of their sum, a gauge keeps its
    latest value, other tags stay apart; nothing reaches the metric before the flush."""
    from collections import defaultdict

    from router.metrics import Coalesced

    class Metric:
        def __init__(self):
            self.records = []

        def inc(self, value, tags=None):
            self.records.append(("inc", value, tags))

        def set(self, value, tags=None):
            self.records.append(("set", value, tags))

    made = defaultdict(Metric)
    held = Coalesced(made.__getitem__, interval_s=None)  # flushed by hand only
    for _ in range(3):
        held.inc("decisions", 1.0, {"reason": "cache", "policy": "p"})
    held.inc("decisions", 2.0, {"reason": "load", "policy": "p"})
    for n in (1, 2, 1):
        held.set("inflight", n, {"replica": "a"})
    assert made["decisions"].records == [] and made["inflight"].records == []
    held.flush()
    assert sorted(made["decisions"].records, key=str) == [
        ("inc", 2.0, {"reason": "load", "policy": "p"}),
        ("inc", 3.0, {"reason": "cache", "policy": "p"})]
    assert made["inflight"].records == [("set", 1, {"replica": "a"})]
    held.flush()  # nothing new: nothing sent again
    assert len(made["decisions"].records) == 2


async def test_a_scrape_fails_as_a_whole_when_a_nodes_exporter_does_not_answer():
    """Found by a break test: a scrape whose exporters failed or were slow came back as a
    200 with an empty body, which Prometheus reads as every series gone. All nodes' exports
    are read at once; one that fails, answers other than 200 or is late fails the scrape
    (``MetricsUnavailable``, a 503 at ``/metrics``): a partial sum would read as a counter
    reset."""
    import asyncio

    import pytest
    from aiohttp import web

    from router.metrics import MetricsUnavailable, fetch_exports
    from tests.conftest import free_port

    async def export(request):
        return web.Response(text=EXPORT)

    async def broken(request):
        return web.Response(status=500, text="boom")

    async def slow(request):
        await asyncio.sleep(2.0)
        return web.Response(text=EXPORT)

    app = web.Application()
    app.router.add_get("/metrics", export)
    app.router.add_get("/broken", broken)
    app.router.add_get("/slow", slow)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    base, dead = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{free_port()}/metrics"
    try:
        texts = await fetch_exports([f"{base}/metrics", f"{base}/metrics"], timeout_s=1.0)
        assert 'router_decision_total{policy="p",reason="cache"} 14.0' in \
            aggregate_ray_export(texts)
        for bad in (dead, f"{base}/broken", f"{base}/slow"):
            with pytest.raises(MetricsUnavailable) as err:
                await fetch_exports([f"{base}/metrics", bad], timeout_s=0.5)
            assert bad in str(err.value)
        with pytest.raises(MetricsUnavailable):
            await fetch_exports([])
    finally:
        await runner.cleanup()


def test_gauges_are_handed_on_again_until_forgotten():
    """Found by a break test: ``router_index_available`` and
    ``router_replicas_without_kv_events``, set only when a request was routed, vanished from
    ``/metrics`` on an idle router (Ray drops a gauge not reported for two export
    periods), and an alert on their value saw nothing. Every gauge series set is handed on
    again at each refresh, until forgotten; counters are not (they are totals)."""
    from router.metrics import Coalesced

    records = []

    class Metric:
        def __init__(self, name):
            self.name = name

        def set(self, value, tags=None):
            records.append(("set", self.name, value, tags))

        def inc(self, value, tags=None):
            records.append(("inc", self.name, value, tags))

    c = Coalesced(Metric, interval_s=None)
    c.set("index_available", 1, None)
    c.set("inflight", 2, {"replica": "a"})
    c.set("inflight", 3, {"replica": "a"})  # the latest value wins
    c.inc("decisions", 1, {"reason": "cache"})
    c.flush()
    assert sorted(records, key=str) == sorted([
        ("set", "index_available", 1, None), ("set", "inflight", 3, {"replica": "a"}),
        ("inc", "decisions", 1, {"reason": "cache"})], key=str)
    records.clear()
    c.flush()
    assert records == []  # nothing new, no refresh asked
    c.flush(refresh=True)
    assert sorted(records, key=str) == sorted([
        ("set", "index_available", 1, None), ("set", "inflight", 3, {"replica": "a"})],
        key=str)
    records.clear()
    c.set("inflight", 0, {"replica": "a"})
    c.forget("inflight", {"replica": "a"})  # its last value still goes, once
    c.flush(refresh=True)
    assert sorted(records, key=str) == sorted([
        ("set", "index_available", 1, None), ("set", "inflight", 0, {"replica": "a"})],
        key=str)
    records.clear()
    c.flush(refresh=True)
    assert records == [("set", "index_available", 1, None)]


async def test_the_index_probe_sets_availability_and_size_on_an_idle_router(monkeypatch):
    """Found by a review: ``router_index_available``, set only by decisions, kept the last
    one's value however long the router was idle (0 after Redis was back, or 1 during an
    outage). ``RoutingCore.probe_index``, which the routers' periodic loops call, sets it
    from a read of the index, with ``router_index_entries``."""
    from router import metrics
    from router.index.base import IndexUnavailable
    from router.index.memory import MemoryPrefixIndex
    from router.kv_events.wire import KVEvent
    from tests.test_policies import make_core

    gauges = {}
    monkeypatch.setattr(metrics, "set_gauge",
                        lambda name, value, tags=None: gauges.__setitem__(name, value))

    class Flaky(MemoryPrefixIndex):
        down = False

        async def stats(self):
            if self.down:
                raise IndexUnavailable("redis down")
            return await super().stats()

    index = Flaky()
    core, _ = make_core(index=index)
    await index.apply_events("r1", [KVEvent("stored", [1, 2, 3], None)])
    await core.probe_index()
    assert gauges == {"index_available": 1, "index_entries": 3}
    index.down = True
    await core.probe_index()
    assert gauges["index_available"] == 0
    index.down = False
    await core.probe_index()
    assert gauges["index_available"] == 1


async def test_each_round_sets_the_fleet_gauges_and_forgets_replicas_that_left(
        model_dir, monkeypatch):
    """``IngressCore._set_gauges``, every 5 s, idle or not: a hash mismatch per replica
    known now, the replicas without KV events, the index's probe; a replica that left has
    its series forgotten (its in-flight count once it is 0)."""
    from router import metrics
    from router.config import Settings
    from router.routing.replica import ReplicaInfo
    from router.serve import state
    from router.serve.ingress import IngressCore

    gauges, forgotten = {}, []
    monkeypatch.setattr(metrics, "set_gauge", lambda name, value, tags=None: gauges.__setitem__(
        (name, tuple(sorted((tags or {}).items()))), value))
    monkeypatch.setattr(metrics, "forget_gauge",
                        lambda name, tags=None: forgotten.append((name, tags)))
    ours = {"hash_algo": "xxhash_cbor", "block_size": 32, "seed": "0",
            "extra_key_encoding": "vllm-0.32", "kv_events_endpoint": "tcp://x:1"}
    other = dict(ours, hash_algo="sha256_cbor")
    a = ReplicaInfo("a", ours, {"kv_events_live": False})
    b = ReplicaInfo("b", other, {"kv_events_live": True})
    state.put("replica_infos", (a, b))
    try:
        core = IngressCore(Settings(model=str(model_dir), index_namespace="gauges"),
                           engine_handle=None)
        core.routing_core()
        core.inflight.update({"a": 0, "gone": 0, "busy": 2})
        seen = await core._set_gauges({"gone"})
        assert seen == {"a", "b"}
        assert gauges[("hash_mismatch", (("replica", "a"),))] == 0
        assert gauges[("hash_mismatch", (("replica", "b"),))] == 1
        assert gauges[("replicas_without_kv_events", ())] == 1
        assert gauges[("index_available", ())] == 1
        assert ("hash_mismatch", {"replica": "gone"}) in forgotten
        assert ("inflight", {"replica": "gone"}) in forgotten
        assert "busy" in core.inflight and "gone" not in core.inflight  # 2 still in flight
    finally:
        state.put("replica_infos", None)
