"""Admission through Ray Serve and the router, with the simulated engine (real time, slowed
down): every replica at its bound gives fast 429s, never long queues or 5xx; the priority
reaches the engine's body."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import REDIS_URL, metric_sum, run_app, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bounded(serve_http_port, model_dir):
    # each decode step 40 ms: a 100-token answer holds its slot for about 4 s, longer than
    # the burst takes to arrive on a loaded machine (no slot frees during it)
    svc = run_app(serve_http_port, "bounded", "/bounded", model=str(model_dir), engine="sim",
                  num_replicas=2, replica_num_cpus=0.1, ingress_num_cpus=0.1,
                  redis_url=REDIS_URL, redis_timeout_s=1.0,  # a healthy Redis: the
                  # bound is exact then (a reservation that misses Redis's 50 ms default
                  # on a loaded machine is this process's alone, and the bound soft)
                  max_inflight_per_replica=2, queue_timeout_s=0.3, sse_keepalive_s=0.1,
                  retry_after_s=2, engine_priority_scheduling=True,
                  extra_engine_args=["--step-model", "0.04,0.00002,0.0002,0"])
    # both replicas up before the first burst: with one, every request goes to it
    wait_until(lambda: svc.client.get("/health").json().get("replicas") == 2, 300, 1.0,
               "both engine replicas")
    yield svc
    from ray import serve
    serve.delete("bounded")


def test_a_stream_that_waits_in_the_queue_gets_keep_alives_then_its_refusal_as_an_event(
        bounded):
    """Every slot taken: a streaming request that waits past sse_keepalive_s has its 200
    and SSE comments while it waits, then the admission's 429 as an error event and
    [DONE], within about the queue timeout. First in this module: the admission's drain
    rate then knows only this test's 4 grants, so the request waits (about 0.1 s ahead of
    it) instead of being refused on arrival as one that could not get a slot in time."""
    body = {"model": "tiny-qwen2", "max_tokens": 100, "ignore_eos": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=bounded.url, timeout=60) as client:
            holders = [asyncio.create_task(client.post("/v1/chat/completions", json=dict(
                body, messages=[{"role": "user", "content": f"{i} hold a slot"}])))
                for i in range(4)]
            await asyncio.sleep(1.0)  # the 4 slots are taken (their answers take 4 s)
            import redis  # the shared load, for the message should the stream not wait
            load = redis.Redis.from_url(REDIS_URL).hgetall(f"{bounded.namespace}:load")
            t0 = time.monotonic()
            async with client.stream("POST", "/v1/chat/completions", json=dict(
                    body, stream=True, messages=[{"role": "user", "content": "wait"}])) as r:
                status = r.status_code
                text = "".join([c async for c in r.aiter_text()])
            elapsed = time.monotonic() - t0
            held = await asyncio.gather(*holders)
            return status, text, elapsed, [h.status_code for h in held], load

    status, text, elapsed, held, load = asyncio.run(scenario())
    assert held == [200] * 4
    assert status == 200 and text.startswith(": keep-alive\n\n"), (load, text[:300])
    events = [e for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 2, text
    import json
    error = json.loads(events[0][len("data: "):])["error"]
    assert error["code"] == 429 and error["type"] == "RateLimitError", error
    assert elapsed < 1.5, elapsed


def test_overload_is_refused_fast_with_retry_after_and_admitted_requests_finish(bounded):
    """12 long requests at once on 2 replicas bounded at 2 each: 4 are served (200, whole
    answers), the other 8 get a 429 with Retry-After within about the queue timeout, none
    a 5xx; then the fleet serves again."""
    body = {"model": "tiny-qwen2", "max_tokens": 100, "ignore_eos": True,
            "messages": [{"role": "user", "content": "write a long answer"}]}

    async def one(client, i):
        # prompts of their own: placed by load, 2 per replica (one prompt for all would be
        # drawn to one replica by its cache, and the other's free slots admit more: the
        # fleet admits while any replica is below its bound)
        t0 = time.monotonic()
        mine = dict(body, messages=[{"role": "user", "content": f"{i} write a long answer"}])
        r = await client.post("/v1/chat/completions", json=mine)
        return r, time.monotonic() - t0

    async def burst():
        async with httpx.AsyncClient(base_url=bounded.url, timeout=60) as client:
            return await asyncio.gather(*(one(client, i) for i in range(12)))

    results = asyncio.run(burst())
    statuses = sorted(r.status_code for r, _ in results)
    assert statuses == [200] * 4 + [429] * 8, [(r.status_code, r.text[:200]) for r, _ in results]
    for r, elapsed in results:
        if r.status_code == 429:
            assert r.headers["retry-after"] == "2"
            assert r.json()["error"]["type"] == "RateLimitError"
            assert elapsed < 1.5  # the queue timeout and a routing step, not an answer's 4 s
        else:
            assert r.json()["usage"]["completion_tokens"] == 100
    wait_until(lambda: metric_sum(bounded.client.get("/metrics").text,
                                  "router_admission_refused_total") >= 8, 60, 2.0,
               "the refusals in /metrics")
    ok = bounded.client.post("/v1/chat/completions", json=dict(body, max_tokens=2))
    assert ok.status_code == 200


def test_the_priority_header_reaches_the_engine_and_a_bad_one_is_a_400(bounded):
    body = {"model": "tiny-qwen2", "max_tokens": 1,
            "messages": [{"role": "user", "content": "priority please"}]}
    r = bounded.client.post("/v1/chat/completions", json=body, headers={"x-priority": "-4"})
    assert r.status_code == 200, r.text
    replicas = bounded.client.get("/replicas").json()["replicas"]
    url = next(x["metadata"]["engine_url"] for x in replicas
               if x["replica_id"] == r.headers["x-routed-replica"])
    received = httpx.get(url + "/sim/requests").json()
    assert received[-1]["priority"] == -4
    assert {k: v for k, v in received[-1].items() if k != "priority"} == body
    bad = bounded.client.post("/v1/chat/completions", json=body, headers={"x-priority": "top"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-priority"

