"""OpenAI API behaviour through the router: odd inputs (docs/fault-cases.md 9), fields passed
through untouched (docs/fault-cases.md 13), errors in OpenAI's format, 503 without replicas
(docs/fault-cases.md 7.2a)."""

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
    """docs/fault-cases.md 9.1: the router answers as vLLM answers directly, never a 500."""
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


@pytest.mark.parametrize("body,param", [
    ({"messages": "hi"}, "body.messages"),
    ({"messages": [{"content": "x"}]}, None),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "maybe"}, "body.stream")])
def test_wrong_field_types_get_an_openai_400_naming_the_field(service, body, param):
    """In vLLM's dialect of schema errors: its type ("Bad Request") and ``param`` as the
    field's path from "body" (vLLM spells a union's branch into a message's path, the
    router the field alone, so the third case compares the shape only)."""
    body = {"model": "tiny-qwen2", **body}
    r = service.client.post("/v1/chat/completions", json=body)
    direct = httpx.post(any_engine_url(service) + "/v1/chat/completions", json=body,
                        timeout=60)
    assert_openai_error(r, 400)
    assert direct.status_code == 400
    mine, theirs = r.json()["error"], direct.json()["error"]
    assert mine["type"] == theirs["type"], (mine, theirs)
    assert mine["param"].startswith("body.") and theirs["param"].startswith("body.")
    if param:
        assert mine["param"] == theirs["param"] == param


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "application/jsonl"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_a_body_not_declared_json_gets_the_engines_own_400(service, path, content_type):
    """A JSON body sent without ``Content-Type: application/json`` is refused exactly as vLLM
    refuses it directly (same status and body); with the media type and a charset, served."""
    fields = {"messages": [{"role": "user", "content": "x"}]} if "chat" in path \
        else {"prompt": "x"}
    raw = json.dumps({"model": "tiny-qwen2", "max_tokens": 1, **fields}).encode()
    headers = {"content-type": content_type} if content_type else {}
    via_router = service.client.post(path, content=raw, headers=headers)
    direct = httpx.post(any_engine_url(service) + path, content=raw, headers=headers,
                        timeout=60)
    assert via_router.status_code == direct.status_code == 400, via_router.text
    assert via_router.json() == direct.json()
    ok = service.client.post(path, content=raw,
                             headers={"content-type": "Application/JSON; charset=utf-8"})
    assert ok.status_code == 200, ok.text


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
                   num_replicas=1, replica_num_cpus=0.1, ingress_num_cpus=0.1,
                   body_idle_timeout_s=2.0)


def test_a_body_that_stops_arriving_gets_a_408_through_serve(sim_service):
    """A client declares 100 bytes, sends 12 and stalls: through Serve's proxy the router
    answers a 408 in the OpenAI shape once ``body_idle_timeout_s`` (2 s here) passes
    without a byte, and serves the next request."""
    import socket
    import time
    from urllib.parse import urlsplit

    url = urlsplit(sim_service.url)
    with socket.create_connection((url.hostname, url.port), timeout=30) as s:
        s.sendall(f"POST {url.path}/v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                  "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n"
                  '{"model": "t'.encode())
        t0 = time.monotonic()
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
        waited = time.monotonic() - t0
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), answer[:300]
    assert 1.5 < waited < 20, waited
    assert b"body_idle_timeout_s" in body and b'"error"' in body
    ok = sim_service.client.post("/v1/chat/completions", json={
        "model": "tiny-qwen2", "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]})
    assert ok.status_code == 200


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
    """docs/fault-cases.md 13.1: the body the engine receives equals the body sent, key for key."""
    with sim_service.client.stream("POST", "/v1/chat/completions", json=FULL_BODY) as r:
        assert r.status_code == 200, r.read()
        assert r.read().endswith(b"data: [DONE]\n\n")
    url = engine_url(sim_service, r.headers["x-routed-replica"])
    received = httpx.get(url + "/sim/requests").json()
    assert received[-1] == FULL_BODY


def test_no_replicas_gives_503_with_retry_after(serve_http_port, model_dir):
    """docs/fault-cases.md 7.2 (a): zero engine replicas → 503 in OpenAI's format, never a
    hang/500."""
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


def test_tool_choice_auto_is_served_with_a_tool_call_parser(service):
    """With ``tool_call_parser`` set, the engines run with vLLM's --enable-auto-tool-choice;
    without it vLLM answers tool_choice "auto" with a 400."""
    r = service.chat([{"role": "user", "content": "What is the weather in Paris?"}],
                     max_tokens=8, tool_choice="auto", tools=FULL_BODY["tools"])
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "hello world"}),
                                       ("/tokenize", {"messages": [{"role": "user",
                                                                    "content": "hi"}]})])
def test_tokenize_is_answered_by_an_engine(service, tokenizer, path, body):
    """vLLM's benchmark client aligns its prompts through /tokenize and /detokenize."""
    r = service.client.post(path, json={"model": "tiny-qwen2", **body})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    if "prompt" in body:
        assert tokens == tokenizer.encode("hello world")
        d = service.client.post("/detokenize", json={"model": "tiny-qwen2", "tokens": tokens})
        assert d.status_code == 200 and d.json()["prompt"] == "hello world"


def test_a_tokenize_text_longer_than_any_prompt_is_refused_before_an_engine(service):
    """Found by a new user: a 10 MB text sent to /tokenize held an engine for 10.8 s (vLLM
    bounds an inference prompt's characters, not this endpoint's); the router refuses it
    with vLLM's own bound and wording."""
    r = service.client.post("/tokenize", json={"model": "tiny-qwen2", "prompt": "a" * 2_000_000})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "prompt" and "maximum context length is 8192 tokens" in err["message"]
    d = service.client.post("/detokenize", json={"model": "tiny-qwen2", "tokens": [1] * 9000})
    assert d.status_code == 400 and d.json()["error"]["param"] == "tokens", d.text


def test_a_policy_header_is_refused_where_overrides_are_off(sim_service):
    """A comparison must be what it says: a request asking for a policy the service does not
    apply gets a 400, never another policy's answer under its name."""
    body = {"model": "tiny-qwen2", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hello"}]}
    r = sim_service.client.post("/v1/chat/completions", json=body,
                                headers={"x-routing-policy": "round_robin"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "x-routing-policy"
    ok = sim_service.client.post("/v1/chat/completions", json=body)
    assert ok.status_code == 200 and ok.headers["x-routing-policy"] == "prefix_aware"


def test_the_applied_policy_and_data_path_are_named_in_the_response(service):
    for policy, path in (("round_robin", "serve"), ("least_loaded", "direct")):
        r = service.client.post("/v1/chat/completions", headers={
            "x-routing-policy": policy, "x-data-path": path}, json={
            "model": "tiny-qwen2", "max_tokens": 2,
            "messages": [{"role": "user", "content": "hello"}]})
        assert r.status_code == 200, r.text
        assert (r.headers["x-routing-policy"], r.headers["x-data-path"]) == (policy, path)


def test_health_says_ready_once_every_configured_replica_serves(service):
    wait_until(lambda: service.client.get("/health").json()["ready"], 120, 1.0,
               "every configured replica's engine to be up")
    body = service.client.get("/health").json()
    assert body["status"] == "ok"
    assert (body["replicas"], body["engines_alive"], body["configured_replicas"]) == (2, 2, 2)
    # found by a new-user review: load balancers' checks that send HEAD got a 405
    head = service.client.head("/health")
    assert head.status_code == 200 and head.content == b""


def test_a_session_header_that_is_not_utf8_is_a_400_not_a_500(service):
    """Found by a new-user review: Serve's proxy decodes ``x-session-id`` (and
    ``x-request-id``) as UTF-8 and answered a byte that is not with a plain-text 500, on
    every path; ``router.serve.header_guard`` answers it with a JSON 400 first."""
    import json
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(str(service.client.base_url))
    for header in (b"x-session-id", b"x-request-id"):
        with socket.create_connection((u.hostname, u.port), timeout=30) as sock:
            sock.sendall(b"GET " + (u.path.rstrip("/") + "/health").encode() +
                         b" HTTP/1.1\r\nHost: x\r\n" + header +
                         b": \xff\r\nConnection: close\r\n\r\n")
            raw = b""
            while chunk := sock.recv(65536):
                raw += chunk
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), raw[:300]
        assert json.loads(body)["error"]["param"] == header.decode()
    assert service.client.get("/health").status_code == 200  # and it goes on serving


def _router_series(text: str) -> set[str]:
    """The series (name and labels) of the router's own metrics in a /metrics text."""
    return {line.rsplit(" ", 1)[0] for line in text.splitlines()
            if line.startswith("router_")}


def test_client_chosen_values_add_no_metric_series(sim_service):
    """Every label value comes from a bounded set (served routes, status codes, replica ids,
    fixed reasons): 1,500 requests with random model names, session headers, users and
    policy headers add no series but those of such bounded values, and none of the values
    they sent appears in /metrics. (The scrape covers every application of the test
    cluster, so series of other tests' policies and replicas may arrive meanwhile: they
    are bounded values too.)"""
    import asyncio
    import re
    import uuid

    sent: list[str] = []

    async def burst(n: int) -> None:
        async with httpx.AsyncClient(base_url=sim_service.url, timeout=60) as client:
            sem = asyncio.Semaphore(16)

            async def one(i: int) -> None:
                value = f"v9{uuid.uuid4().hex[:12]}"  # a digit: never a fixed label word
                sent.append(value)
                body = {"model": value if i % 3 == 0 else "tiny-qwen2", "max_tokens": 1,
                        "user": value, "messages": [{"role": "user", "content": "hi"}]}
                headers = {"x-session-id": value}
                if i % 7 == 0:
                    headers["x-routing-policy"] = value
                async with sem:
                    r = await client.post("/v1/chat/completions", json=body, headers=headers)
                assert r.status_code in (200, 400, 404), r.text

            await asyncio.gather(*(one(i) for i in range(n)))

    def series_after(n: int) -> set[str]:
        asyncio.run(burst(n))
        seen: dict[str, set[str]] = {}

        def settled() -> bool:  # Ray exports every few seconds: wait for two equal scrapes
            s = _router_series(sim_service.client.get("/metrics", timeout=60).text)
            same = seen.get("last") == s
            seen["last"] = s
            return same and any("router_requests_total" in x for x in s)

        wait_until(settled, 60, 6.0, "the metrics export to settle")
        return seen["last"]

    replicas = {r["replica_id"] for r in sim_service.client.get("/replicas").json()["replicas"]}
    before = series_after(50)
    after = series_after(1_500)
    text = sim_service.client.get("/metrics", timeout=60).text
    assert not [v for v in sent if v in text]
    # fixed words, status codes, bucket bounds, Serve's 8-character replica ids
    fixed = re.compile(r"^([a-z_]+|\d{3}|status_\d{3}|[0-9.]+|\+Inf|[a-z0-9]{8})$")
    for series in after - before:
        values = re.findall(r'="([^"]*)"', series)
        assert all(fixed.match(v) or v in replicas for v in values), series
