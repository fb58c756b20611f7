"""OpenAI API behaviour through the router: odd inputs (FAULTS.md 9), fields passed through
untouched (FAULTS.md 13), errors in OpenAI's format, 503 without replicas (FAULTS.md 7.2a)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import make_text, run_app, wait_until

pytestmark = pytest.mark.integration


def engine_url(service, replica_id: str) -> str:
    replicas = service.client.get("/replicas").json()["replicas"]
    return next(r["metadata"]["engine_url"] for r in replicas if r["replica_id"] == replica_id)


def any_engine_url(service) -> str:
    return service.client.get("/replicas").json()["replicas"][0]["metadata"]["engine_url"]


def assert_openai_error(resp: httpx.Response, status: int):
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert err["code"] == status
    assert "type" in err


ODD_COMPLETIONS = {
    "empty_string": {"prompt": ""},
    "empty_list": {"prompt": []},
    "token_ids": {"prompt": [1, 2, 3]},
    "number": {"prompt": 123},
}
ODD_CHATS = {
    "empty_content_list": {"messages": [{"role": "user", "content": []}]},
    "only_image": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}]}]},
    "no_messages": {"messages": []},
    "multibyte": {"messages": [{"role": "user", "content": "日本語 中文 한국어 😀🚀 Ünïcödé"}]},
    "control_chars": {"messages": [{"role": "user", "content": "a\u0000b\u200bc\ud7ff"}]},
}


ODD_CASES = [("/v1/completions", c, body) for c, body in sorted(ODD_COMPLETIONS.items())] + \
    [("/v1/chat/completions", c, body) for c, body in sorted(ODD_CHATS.items())]


@pytest.mark.parametrize("path,case,fields", ODD_CASES,
                         ids=[("chat-" if "chat" in p else "completions-") + c
                              for p, c, _ in ODD_CASES])
def test_odd_inputs_get_200_or_the_engines_own_400(service, path, case, fields):
    """FAULTS.md 9.1: the router answers as vLLM answers directly, never a 500."""
    body = {"model": "tiny-qwen2", "max_tokens": 2, **fields}
    via_router = service.client.post(path, json=body)
    direct = httpx.post(any_engine_url(service) + path, json=body, timeout=60)
    assert via_router.status_code in (200, 400), via_router.text
    assert via_router.status_code == direct.status_code, (via_router.text, direct.text)
    if via_router.status_code == 400:
        assert_openai_error(via_router, 400)


def test_multibyte_prompt_is_routed_on_its_prefix(service, tokenizer):
    system = "Système: 日本語のテキスト 中文字符 한국어 😀 " + make_text(300, "mb", tokenizer)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "¿Qué tal? 🚀"}]
    first = service.chat(msgs)
    second = service.chat(msgs)
    assert first.status_code == second.status_code == 200
    assert second.headers["x-routed-replica"] == first.headers["x-routed-replica"]
    assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 288


@pytest.mark.parametrize("raw", [b"{not json", b"[1, 2]", b"\xff\xfe", b""])
def test_malformed_bodies_get_an_openai_400(service, raw):
    r = service.client.post("/v1/chat/completions", content=raw,
                            headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize("body", [{"messages": "hi"}, {"messages": [{"content": "x"}]},
                                  {"messages": [{"role": "user", "content": "x"}],
                                   "stream": "maybe"}])
def test_wrong_field_types_get_an_openai_400_naming_the_field(service, body):
    r = service.client.post("/v1/chat/completions", json={"model": "tiny-qwen2", **body})
    assert_openai_error(r, 400)
    assert r.json()["error"]["param"]


def test_streaming_chat_passes_sse_through_with_usage(service):
    body = {"model": "tiny-qwen2", "messages": [{"role": "user", "content": "stream please"}],
            "max_tokens": 5, "stream": True, "stream_options": {"include_usage": True}}
    with service.client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-routed-replica"]
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[0]["completion_tokens"] == 5
    assert "cached_tokens" in usage[0]["prompt_tokens_details"]


def test_models_lists_the_served_model(service):
    data = service.client.get("/v1/models").json()["data"]
    assert data[0]["id"] == "tiny-qwen2"


def test_unknown_routing_policy_header_is_a_400(service):
    r = service.client.post("/v1/chat/completions",
                            json={"model": "tiny-qwen2",
                                  "messages": [{"role": "user", "content": "x"}]},
                            headers={"x-routing-policy": "nonsense"})
    assert_openai_error(r, 400)


def test_body_over_the_limit_gets_a_413(service):
    r = service.client.post("/v1/completions", content=b"x" * (101 * 1024 * 1024),
                            headers={"content-type": "application/json"})
    assert_openai_error(r, 413)


# --- the simulated engine echoes what it received ------------------------------------------
@pytest.fixture(scope="session")
def sim_service(serve_http_port, model_dir):
    return run_app(serve_http_port, "sim", "/sim", model=str(model_dir), engine="sim",
                   num_replicas=1, replica_num_cpus=0.1, ingress_num_cpus=0.1)


FULL_BODY = {
    "model": "tiny-qwen2",
    "messages": [{"role": "system", "content": "Be exact."},
                 {"role": "user", "content": "What is the weather in Paris?"}],
    "chat_template_kwargs": {"enable_thinking": False},
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_completion_tokens": 7,
    "top_k": 5,
    "min_p": 0.05,
    "logprobs": True,
    "top_logprobs": 3,
    "n": 2,
    "stop": ["\n\n", "END"],
    "seed": 1234,
    "response_format": {"type": "json_schema", "json_schema": {
        "name": "w", "schema": {"type": "object", "properties": {"t": {"type": "number"}}}}},
    "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}],
    "tool_choice": "auto",
    "return_token_ids": True,
    "vendor_extension": {"nested": [1, "two", None, 3.5]},
}


def test_every_field_reaches_the_engine_unchanged(sim_service):
    """FAULTS.md 13.1: the body the engine receives equals the body sent, key for key."""
    with sim_service.client.stream("POST", "/v1/chat/completions", json=FULL_BODY) as r:
        assert r.status_code == 200, r.read()
        assert r.read().endswith(b"data: [DONE]\n\n")
    url = engine_url(sim_service, r.headers["x-routed-replica"])
    received = httpx.get(url + "/sim/requests").json()
    assert received[-1] == FULL_BODY


def test_no_replicas_gives_503_with_retry_after(serve_http_port, model_dir):
    """FAULTS.md 7.2 (a): zero engine replicas → 503 in OpenAI's format, never a hang/500."""
    from ray import serve
    svc = run_app(serve_http_port, "empty", "/empty", model=str(model_dir), engine="sim",
                  num_replicas=1, replica_num_cpus=0.1, ingress_num_cpus=0.1)
    try:
        from router.app import build_app
        serve.run(build_app({"model": str(model_dir), "engine": "sim", "num_replicas": 0,
                             "replica_num_cpus": 0.1, "ingress_num_cpus": 0.1,
                             "index_namespace": svc.namespace}),
                  name="empty", route_prefix="/empty", blocking=False)
        wait_until(lambda: svc.client.get("/health").status_code == 503, 120, 1.0,
                   "the router to see zero replicas")
        r = svc.client.post("/v1/chat/completions", json={
            "model": "tiny-qwen2", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
        assert_openai_error(r, 503)
        assert int(r.headers["retry-after"]) > 0
    finally:
        serve.delete("empty")
