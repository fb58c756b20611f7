"""The router-throughput kit (``loadtest.router_throughput``) run for about two seconds at one
ingress process, so that it cannot rot: the real ingress app behind uvicorn, the shared
Redis (a namespace of its own), zero-time engines, a client process."""

from __future__ import annotations

from tests.conftest import REDIS_URL


def test_the_kit_counts_routed_200s_that_the_engines_answered(model_dir):
    from loadtest.router_throughput import Stack, measure_throughput

    with Stack(REDIS_URL, ingress=1, engines=2) as stack:
        row = measure_throughput(stack, 1, concurrency=4, clients=1, warmup_s=0.5,
                                 window_s=1.5)
    assert row["ok"] > 0, row
    assert row["failed"] == 0, row
    assert row["rps"] == row["ok"] / 1.5
    # every routed 200 was a generate call one of the engines answered (the engines also
    # answered the warm-up's and the window's unfinished requests)
    assert row["engine_calls"] >= row["ok"], row
    assert 0 < row["ingress_cpu"] and row["p50_ms"] > 0
