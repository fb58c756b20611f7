"""The router-throughput kit (``loadtest.router_throughput``) run for about two seconds at one
ingress process, so that it cannot rot: the real ingress app behind uvicorn, the shared
Redis (a namespace of its own), zero-time engines, a client process."""

from __future__ import annotations

from tests.conftest import REDIS_URL


def test_the_kit_counts_routed_200s_that_the_engines_answered(model_dir):
    from loadtest.router_throughput import Stack, measure_burst, measure_throughput, tables

    with Stack(REDIS_URL, ingress=1, engines=2) as stack:
        row = measure_throughput(stack, 1, concurrency=4, clients=1, warmup_s=0.5,
                                 window_s=1.5)
        burst = measure_burst(stack, 1, tokens=2048, concurrency=4, rounds=1, singles=2)
        # the same burst sent by two client processes released together
        split = measure_burst(stack, 1, tokens=2048, concurrency=4, rounds=2, singles=1,
                              clients=2)
    assert row["ok"] > 0, row
    assert row["failed"] == 0, row
    assert row["rps"] == row["ok"] / 1.5
    # every routed 200 was a generate call one of the engines answered (the engines also
    # answered the warm-up's and the window's unfinished requests)
    assert row["engine_calls"] >= row["ok"], row
    assert 0 < row["ingress_cpu"] and row["p50_ms"] > 0
    assert row["redis_us_per_request"] > 0, row  # the decision and the release, at least
    assert " us |" in tables([row], [], 2000.0)
    # the burst: every request routed and complete; its time splits into the router's own
    # (server-timing) and the rest, both measured per request
    assert burst["failed"] == 0 and burst["ok"] == 2 + 4, burst
    assert 0 < burst["routing_p50_ms"] <= burst["routing_p99_ms"], burst
    assert 0 < burst["single_routing_p50_ms"] < burst["single_p50_ms"], burst
    assert 0 < burst["rest_p50_ms"] <= burst["rest_p99_ms"] < burst["burst_p99_ms"], burst
    # and the router's own time into its parts (server-timing's body, prepare, decide)
    assert all(0 < burst[f"{p}_p50_ms"] <= burst[f"{p}_p99_ms"] <= burst["routing_p99_ms"]
               for p in ("body", "prepare", "decide")), burst
    assert split["failed"] == 0 and split["ok"] == 1 + 2 * 4 and split["clients"] == 2, split
    assert 0 < split["routing_p50_ms"] < split["burst_p99_ms"], split
    # its rounds apart: the first also opened the pools' connections
    assert 0 < split["first_round_p99_ms"] and 0 < split["later_rounds_p99_ms"], split
    assert max(split["first_round_p99_ms"], split["later_rounds_p99_ms"]) \
        == split["burst_p99_ms"], split
    text = tables([], [burst], 0.0)  # --burst-only: no throughput rows
    assert "not measured here (`--burst-only`)" in text and "| 1 | " in text, text
