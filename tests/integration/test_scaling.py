"""Scaling with the project's simulated engines: autoscaling 1 -> 2 -> 1 under load through
Ray Serve's own autoscaler, on the engines' load (``router.serve.autoscaling``), where no
request fails and no stream is cut on the direct data path (which Serve's own request counts
do not see); and an operator's drain through the admin API (``router.routing.drain``).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.conftest import run_app, wait_until

pytestmark = pytest.mark.integration

STEP = "0.02,0.00002,0.0005,0"  # 20 ms a step: a 100-token answer streams for about 2 s


def _stream_once(url: str, i: int, max_tokens: int = 100,
                 on_head=None) -> tuple[int, bool, str]:
    """One streaming chat request: (status, whether it ended as a whole stream ends, the
    replica it went to); ``on_head(replica)`` is called once its headers came."""
    body = {"model": "tiny-qwen2", "max_tokens": max_tokens, "stream": True,
            "messages": [{"role": "user", "content": f"autoscale load {i} " + "x " * 40}]}
    with httpx.Client(base_url=url, timeout=60) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            replica = r.headers.get("x-routed-replica", "")
            if on_head is not None:
                on_head(replica)
            data = r.read().decode()
    events = [e[6:] for e in data.split("\n\n") if e.startswith("data: ")]
    finished = bool(events) and events[-1] == "[DONE]" and any(
        '"finish_reason":"' in e.replace(" ", "") and '"error"' not in e for e in events)
    return r.status_code, finished, replica


class _Load:
    """``workers`` threads that stream requests one after another until stopped."""

    def __init__(self, url: str, max_tokens: int):
        self.url, self.results, self.stop = url, [], threading.Event()
        self.max_tokens = max_tokens
        self.spans: list[tuple[str, float, float]] = []  # (replica, start, end), monotonic
        self.threads: list[threading.Thread] = []

    def add(self, workers: int) -> list[threading.Event]:
        stops = []
        for w in range(workers):
            stop = threading.Event()
            t = threading.Thread(target=self._run, args=(len(self.threads), stop), daemon=True)
            self.threads.append(t)
            stops.append(stop)
            t.start()
        return stops

    def _run(self, w: int, stop: threading.Event) -> None:
        i = 0
        while not stop.is_set() and not self.stop.is_set():
            try:
                t0 = time.monotonic()
                self.results.append(_stream_once(self.url, w * 10_000 + i, self.max_tokens))
                self.spans.append((self.results[-1][2], t0, time.monotonic()))
            except httpx.HTTPError as exc:
                self.results.append((0, False, type(exc).__name__))
            i += 1

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(90)


def test_autoscale_out_and_in_under_load_loses_no_request(serve_http_port, model_dir):
    from ray import serve

    svc = run_app(serve_http_port, "autoscale", "/autoscale", model=str(model_dir),
                  engine="sim", replica_num_cpus=0.1, ingress_num_cpus=0.1, drain_timeout_s=30,
                  extra_engine_args=["--step-model", STEP],
                  autoscaling_config={"min_replicas": 1, "max_replicas": 2,
                                      "initial_replicas": 1, "target_ongoing_requests": 2,
                                      "upscale_delay_s": 1, "downscale_delay_s": 4,
                                      "metrics_interval_s": 0.5, "look_back_period_s": 2})

    def alive_replicas() -> set[str]:
        try:
            reps = svc.client.get("/replicas").json()["replicas"]
        except (httpx.HTTPError, ValueError, KeyError):
            return set()
        return {r["replica_id"] for r in reps if r["routing_stats"].get("engine_alive")}

    # streams of about 5 s: longer than Serve's own wait before it stops a replica
    # (graceful_shutdown_wait_loop_s, 2 s), so only the replica's drain lets them finish
    load = _Load(svc.url, max_tokens=250)
    try:
        first = wait_until(lambda: alive_replicas() if len(alive_replicas()) == 1 else None,
                           120, 0.5, "one replica")
        heavy = load.add(6)  # 6 streams at once against a target of 2 per replica
        both = wait_until(lambda: alive_replicas() if len(alive_replicas()) == 2 else None,
                          120, 0.5, "a second replica under load")
        (added,) = both - first
        n = len(load.results)
        wait_until(lambda: any(r[2] == added for r in load.results[n:]), 60, 0.5,
                   "requests on the new replica")
        # two streams at a time: 2 requests, one replica's target, so Serve scales in while
        # the replica it stops most likely serves one of them (its drain lets it finish)
        for stop in heavy[2:]:
            stop.set()
        wait_until(lambda: len(alive_replicas()) == 1, 120, 0.5, "the scale-in to one replica")
        t_in = time.monotonic()
        (kept,) = alive_replicas()
        time.sleep(3)  # the survivor keeps serving
        load.join()
        status = svc.client.get("/health").json()
    finally:
        load.join()
        serve.delete("autoscale")
    (removed,) = both - {kept}
    bad = [r for r in load.results if r[0] != 200 or not r[1]]
    # the requests that were on the removed replica as it went (run with drain_timeout_s=0,
    # one such stream was cut: the engine aborts what it runs when it is stopped)
    across = [(round(a - t_in, 1), round(b - t_in, 1)) for r, a, b in load.spans
              if r == removed and b > t_in - 2]
    assert not bad, (len(bad), bad[:5], len(load.results), across)
    assert len(load.results) >= 20, len(load.results)
    assert {r[2] for r in load.results} >= first | both, json.dumps(status)


def test_an_operators_drain_moves_new_requests_and_lets_streams_finish(serve_http_port,
                                                                      model_dir):
    from ray import serve

    svc = run_app(serve_http_port, "drain", "/drain", model=str(model_dir), engine="sim",
                  num_replicas=2, replica_num_cpus=0.1, ingress_num_cpus=0.1,
                  extra_engine_args=["--step-model", STEP])
    try:
        reps = wait_until(lambda: (lambda ids: ids if len(ids) == 2 else None)(
            [r["replica_id"] for r in svc.client.get("/replicas").json()["replicas"]
             if r["routing_stats"].get("engine_alive")]), 120, 0.5, "two replicas")
        r = svc.client.post("/admin/replicas/nope/drain")
        assert r.status_code == 404 and r.json()["error"]["param"] == "replica_id"
        # a stream in flight on the replica that is drained while it runs
        results, heads = [], []
        t = threading.Thread(target=lambda: results.append(
            _stream_once(svc.url, 1, max_tokens=300, on_head=heads.append)))  # about 6 s
        t.start()
        (target,) = wait_until(lambda: heads, 30, 0.05, "the stream to start")
        r = svc.client.post(f"/admin/replicas/{target}/drain")
        assert r.status_code == 200 and r.json()["drained_replicas"] == [target], r.text
        other = next(x for x in reps if x != target)
        # short answers: all six are routed while the drained replica's stream still runs
        routed = [_stream_once(svc.url, 100 + i, max_tokens=4)[2] for i in range(6)]
        assert routed == [other] * 6, routed
        t.join(60)
        assert results and results[0][:2] == (200, True), results
        why = svc.client.post("/admin/explain", params={"route": "chat"}, json={
            "model": "tiny-qwen2", "messages": [{"role": "user", "content": "why " * 50}]})
        assert why.status_code == 200, why.text
        assert why.json()["choice"] == other and {
            c["replica"]: c["drained"] for c in why.json()["candidates"]} == {
            target: True, other: False}, why.text
        bad = svc.client.post("/admin/explain", params={"route": "embeddings"}, json={})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "route"
        listed = {x["replica_id"]: x["drained"]
                  for x in svc.client.get("/replicas").json()["replicas"]}
        assert listed == {target: True, other: False}
        assert svc.client.post(f"/admin/replicas/{target}/undrain").json()[
            "drained_replicas"] == []
        routed = [_stream_once(svc.url, 200 + i, max_tokens=4)[2] for i in range(8)]
        assert target in routed, routed
    finally:
        serve.delete("drain")
