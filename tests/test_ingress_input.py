"""Bodies the ingress refuses before routing, with an OpenAI-style 400 (never a 500)."""

from __future__ import annotations

import pytest

from router.config import Settings
from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH
from router.serve.errors import OpenAIError
from router.serve.ingress import IngressCore, decode_json_body


@pytest.fixture(scope="module")
def ingress(model_dir):
    return IngressCore(Settings(model=str(model_dir)), engine_handle=None)


# what json.loads accepts beyond RFC 8259 (msgspec refuses it), what both refuse, and what
# both accept; decode_json_body must answer each exactly as json.loads does
JSON_EDGES = [
    b'{"a": NaN, "b": Infinity, "c": -Infinity}', b'{"a": 1e400, "b": -1e400, "c": 1.5e-400}',
    b'{"a": "\\ud800 lone", "b": "\\udfff"}', b'\xef\xbb\xbf{"a": 1}',
    '{"a": "\u00e9"}'.encode("utf-16"), '{"a": 1}'.encode("utf-32"),
    b'{"a": 123456789012345678901234567890, "b": -0.0, "c": 1, "c": 2}',
    b'{"a": "\\ud83d\\ude00", "b": "\xc3\xa9", "c": "\\u0000"}', b' [1, 2.50, true, null] ',
    b'{"a": "x\ny"}', b'{"a": tru}', b'{"a": 1}x', b'{"a": 01}', b'{"a": .5}', b'{"a": "\\x"}',
    b'{"a": "\xff"}', b"", b"[" * 3000 + b"]" * 3000, b'{"a": ' + b"7" * 5000 + b"}",
]


@pytest.mark.parametrize("raw", JSON_EDGES)
def test_bodies_are_decoded_exactly_as_json_loads_decodes_them(raw):
    """msgspec decodes first and ``json.loads`` takes what it refuses: the same value, or
    the same error, as ``json.loads`` alone."""
    import json
    try:
        want = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        with pytest.raises(type(exc)):
            decode_json_body(raw)
        return
    assert repr(decode_json_body(raw)) == repr(want)  # nan == nan is false; its repr is not


@pytest.mark.parametrize("depth", [1_500, 100_000])
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
async def test_deeply_nested_json_is_a_400(ingress, path, depth):
    """Found by a break test: an extra field nested 1,500 levels deep raised RecursionError
    in the JSON decoder and came back as a 500."""
    raw = (b'{"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}], '
           b'"x": ' + b"[" * depth + b"]" * depth + b"}")
    with pytest.raises(OpenAIError) as err:
        await ingress.prepare(path, raw)
    assert err.value.status == 400 and "nested" in err.value.body()["error"]["message"]


LONE_SURROGATES = [  # (path, body, the field named in the 400's param)
    (CHAT_PATH, b'{"model": "m", "stop": ["ok", "\\ud800"], "messages": '
                b'[{"role": "user", "content": "hi"}]}', "body.stop.1"),
    (CHAT_PATH, b'{"model": "m", "messages": [{"role": "user", "content": '
                b'[{"type": "text", "text": "a\\udfffb"}]}]}', "body.messages.0.content.0.text"),
    (COMPLETIONS_PATH, b'{"model": "m", "prompt": "x", "stop": "\\udc00"}', "body.stop"),
    (COMPLETIONS_PATH, b'{"model": "m", "prompt": "x", "\\ud83d": 1}', "body.\\ud83d"),
    (CHAT_PATH, b'{"model": "m", "messages": [], "x": {"b\\udc00": 1}}', "body.x.b\\udc00"),
]


@pytest.mark.parametrize("path,raw,param", LONE_SURROGATES)
async def test_a_lone_surrogate_anywhere_in_the_body_is_a_400_naming_its_field(
        ingress, path, raw, param):
    """Found by a break test: a lone surrogate in ``stop`` was forwarded, vLLM answered a
    500 with an empty message, and the router retried it on a second replica (both
    replicas' circuit breakers counting a failure); in a message's content vLLM's 400
    carried the tokenizer binding's type error. It is refused before routing."""
    from fastapi.responses import JSONResponse

    with pytest.raises(OpenAIError) as err:
        await ingress.prepare(path, raw)
    assert err.value.status == 400
    assert err.value.body()["error"]["param"] == param
    assert "lone UTF-16 surrogate" in err.value.body()["error"]["message"]
    # the answer encodes (a surrogate in a key's path failed to: a plain-text 500)
    assert JSONResponse(err.value.body(), status_code=400).body


async def test_escaped_surrogate_pairs_and_other_lenient_json_are_accepted(model_dir):
    """A surrogate pair spelled in escapes is one character (msgspec decodes it); a body
    only ``json.loads`` accepts (a byte order mark, NaN) is still read, and checked."""
    # an ingress of its own: the module's would keep this loop's last render turn
    ingress = IngressCore(Settings(model=str(model_dir)), engine_handle=None)
    for raw in (b'{"model": "m", "prompt": "smile \\ud83d\\ude00"}',
                b'\xef\xbb\xbf{"model": "m", "prompt": "with a BOM"}',
                b'{"model": "m", "prompt": "x", "temperature": NaN}'):
        req = await ingress.prepare(COMPLETIONS_PATH, raw)
        assert req.prompt_tokens > 0


async def test_bodies_beyond_the_tokenize_limit_are_routed_by_load(model_dir):
    """Found by a break test: a 20 MB prompt was tokenized for 25 s before the engine
    refused it, holding up every other request. Beyond ``route_tokenize_max_bytes`` the
    prompt is not tokenized: it is routed by load and the engine answers."""
    import json
    ingress = IngressCore(Settings(model=str(model_dir), route_tokenize_max_bytes=10_000),
                          engine_handle=None)
    small = json.dumps({"model": "m", "prompt": "word " * 100}).encode()
    big = json.dumps({"model": "m", "prompt": "word " * 10_000}).encode()
    assert (await ingress.prepare(COMPLETIONS_PATH, small)).block_hashes
    req = await ingress.prepare(COMPLETIONS_PATH, big)
    assert req.block_hashes == [] and req.prompt_tokens == 0


def test_unknown_paths_and_methods_get_the_openai_error_shape():
    """Found by a break test: FastAPI's ``{"detail": "Not Found"}`` instead of an OpenAI
    error body."""
    from fastapi.testclient import TestClient

    from router.serve.ingress import build_fastapi_app
    app = build_fastapi_app()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": []}

    client = TestClient(app)
    for r, status in ((client.get("/v1/nope"), 404), (client.post("/v1/models"), 405),
                      (client.get("/v1/models/", follow_redirects=False), 404)):
        assert r.status_code == status
        assert r.json()["error"]["code"] == status and r.json()["error"]["message"]


async def test_a_huge_completion_prompt_does_not_stall_the_event_loop(ingress):
    """Found by a break test: a 3.8 MB completion prompt (under the tokenize limit) was
    encoded with the tokenizer's ``encode`` under the renderer's lock, and every other
    request (rendered on the event loop, waiting for that lock) waited about 4 s. It is now
    encoded like chat pieces, outside the lock: small requests keep being prepared while it
    runs. Ratio in one run, not a time bound."""
    import asyncio
    import json
    import time
    raw = json.dumps({"model": "m", "prompt": "hello world, quick brown fox " * 40_000}).encode()
    gaps: list[float] = []
    done = asyncio.Event()

    small = [json.dumps({"model": "m", "prompt": f"small request {i} " * 20}).encode()
             for i in range(2)]
    chat = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi " * 50}]})

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.005)
            await ingress.prepare(COMPLETIONS_PATH, small[len(gaps) % 2])
            await ingress.prepare("/v1/chat/completions", chat.encode())
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.ensure_future(ticker())
    await asyncio.sleep(0.02)
    t0 = time.perf_counter()
    req = await ingress.prepare(COMPLETIONS_PATH, raw)
    if req.rest is not None:  # the rest, as routing encodes it when a replica holds the head
        await req.rest.finish(req)
    total = time.perf_counter() - t0
    done.set()
    await tick
    assert len(req.block_hashes) > 1000
    assert max(gaps) < 0.5 * total, (max(gaps), total)


def test_completion_ids_equal_the_tokenizers_with_and_without_special_tokens(ingress):
    renderer = ingress.renderer
    tok = renderer.tokenizer
    texts = ["hello", "word " * 3000, "a<|im_start|>b<|endoftext|> c", " lead and trail "]
    for text in texts:
        for special in (True, False):
            info = renderer.render(COMPLETIONS_PATH, {"prompt": text,
                                                      "add_special_tokens": special})
            assert info.token_ids == tok.encode(text, add_special_tokens=special)


def test_prompts_the_engine_changes_are_routed_by_load(ingress):
    """Found by a break test: ``truncate_prompt_tokens`` requests were hashed on the whole
    prompt (832 cached tokens predicted where the engine kept 300); a request's own chat
    template is not the one the router renders with."""
    renderer = ingress.renderer
    msgs = [{"role": "user", "content": "word " * 500}]
    assert renderer.render(CHAT_PATH, {"messages": msgs}).cacheable
    for body in ({"messages": msgs, "truncate_prompt_tokens": 300},
                 {"messages": msgs, "chat_template": "{{ messages[0]['content'] }}"}):
        assert not renderer.render(CHAT_PATH, body).cacheable
    assert not renderer.render(COMPLETIONS_PATH, {"prompt": "word " * 500,
                                                  "truncate_prompt_tokens": 300}).cacheable


@pytest.mark.parametrize("extra", [
    {}, {"echo": True}, {"echo": "true"}, {"echo": "Yes"}, {"echo": "ON"}, {"echo": 1.0},
    {"echo": "off"}, {"echo": True, "top_logprobs": None},
    {"echo": True, "top_logprobs": 2, "logprobs": True}, {"echo": False, "logprobs": 3},
    {"prompt_logprobs": 0}, {"prompt_logprobs": 1, "echo": False}, {"echo": 0},
    {"echo": True, "logprobs": 1}, {"echo": True, "logprobs": None}])
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
def test_requests_the_engine_reads_no_cache_for_are_routed_by_load(ingress, path, extra):
    """Found by a break test: a chat request with ``echo`` was predicted 288 cached tokens
    where the engine reported 0 (echo asks for prompt logprobs, and vLLM then skips
    reading its prefix cache). Checked against vLLM's own request models: the router's
    rule and ``SamplingParams.skip_reading_prefix_cache`` agree."""
    from router.prompt.render import reads_no_cache
    if path == CHAT_PATH:
        from vllm.entrypoints.openai.chat_completion.protocol import \
            ChatCompletionRequest as Model
        body = {"model": "m", "messages": [{"role": "user", "content": "word " * 500}]}
        if "logprobs" in extra and extra["logprobs"] is not None and \
                not isinstance(extra["logprobs"], bool):
            pytest.skip("chat's logprobs is a bool")
    else:
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest as Model
        body = {"model": "m", "prompt": "word " * 500}
        if "top_logprobs" in extra or isinstance(extra.get("logprobs"), bool):
            pytest.skip("a chat field")
    body.update(extra)
    skips = Model.model_validate(body).to_sampling_params(16, {}).skip_reading_prefix_cache
    assert reads_no_cache(path, body) == skips
    assert ingress.renderer.render(path, body).cacheable == (not skips)


async def test_a_body_that_stops_arriving_is_a_408(model_dir):
    """Found by a break test: a client that declared 100 bytes, sent 12 and stalled held
    its request open with no end. After ``body_idle_timeout_s`` without a byte it is a 408
    (a body that keeps coming, however slowly, is read)."""
    import asyncio

    from starlette.requests import Request

    from router.app import _read_body

    def request(chunks: list[bytes], stall: bool) -> Request:
        messages = [{"type": "http.request", "body": c, "more_body": True} for c in chunks]

        async def receive():
            if messages:
                await asyncio.sleep(0.05)
                return messages.pop(0)
            if stall:
                await asyncio.sleep(3600)
            return {"type": "http.request", "body": b"", "more_body": False}
        scope = {"type": "http", "method": "POST", "path": "/v1/completions",
                 "headers": [(b"content-length", b"100")]}
        return Request(scope, receive)

    settings = Settings(model=str(model_dir), body_idle_timeout_s=0.2)
    with pytest.raises(OpenAIError) as err:
        await asyncio.wait_for(_read_body(request([b"x" * 12], stall=True), settings), 5)
    assert err.value.status == 408 and "body_idle_timeout_s" in err.value.body()["error"][
        "message"]
    # found by a new-user review: the connection stayed open after the 408, its unread body
    # making it useless (a request sent next on it waited for nothing); the server closes
    # a connection whose answer says so
    assert err.value.response_headers()["connection"] == "close"
    # ten chunks 50 ms apart: 0.5 s in all, never 0.2 s without a byte
    assert await _read_body(request([b"y" * 10] * 10, stall=False), settings) == b"y" * 100


def test_token_endpoint_bodies_past_the_models_context_are_refused(model_dir):
    """Found by a new user's break test: a 10 MB text sent to /tokenize held one engine for
    10.8 s and delayed a chat request routed to it as long (vLLM bounds an inference
    prompt's characters before tokenizing it, not these endpoints). The router applies
    vLLM's bound: the context length times the vocabulary's longest token."""
    core = IngressCore(Settings(model=str(model_dir), max_model_len=64), engine_handle=None)
    per = core.renderer.max_chars_per_token
    assert per == max(len(t) for t in core.renderer.tokenizer.get_vocab()) > 1
    limit = 64 * per
    # at the bound, and text spread over messages and tools: the engine's to answer
    core.check_tokens_body("/tokenize", {"prompt": "a" * limit})
    core.check_tokens_body("/tokenize", {"messages": [{"role": "user", "content": "a" * 10}],
                                         "tools": [{"function": {"name": "b" * 10}}]})
    core.check_tokens_body("/detokenize", {"tokens": list(range(64))})
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * limit}}
    core.check_tokens_body("/tokenize", {"messages": [  # an image's data URL is not text
        {"role": "user", "content": [image, {"type": "text", "text": "a" * (limit - 10)}]}]})
    over = [({"prompt": "a" * (limit + 1)}, "prompt"),
            ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a" * limit}]},
                           {"role": "user", "content": "b"}]}, "messages"),
            ({"messages": [{"role": "user", "content": "a" * (limit - 5)}],
              "tools": [{"function": {"name": "f", "description": "d" * 10}}]}, "messages")]
    for body, param in over:
        with pytest.raises(OpenAIError) as err:
            core.check_tokens_body("/tokenize", body)
        e = err.value
        assert (e.status, e.param) == (400, param), body
        assert f"more than {limit} characters" in e.message and "64 tokens" in e.message
    with pytest.raises(OpenAIError) as err:
        core.check_tokens_body("/detokenize", {"tokens": list(range(65))})
    assert (err.value.status, err.value.param) == (400, "tokens")
    assert "65 tokens" in err.value.message
    core.context_tokens = None  # a model whose context length is unknown: no bound
    core.check_tokens_body("/tokenize", {"prompt": "a" * (limit + 1)})
    core.check_tokens_body("/detokenize", {"tokens": list(range(65))})


def test_text_chars_counts_every_string_at_any_depth():
    from router.serve.ingress import text_chars
    deep = "x"
    for _ in range(100_000):  # deeper than Python's recursion: walked without it
        deep = [deep, {"k": "yy"}]
    assert text_chars(deep) == 1 + 2 * 100_000
    assert text_chars({"a": ["bc", 3, None, True, {"d": "é"}], "key-not-counted": 1.5}) == 3
    assert text_chars(None) == 0


def test_message_chars_counts_what_the_prompt_holds_as_text():
    from router.serve.ingress import message_chars
    messages = [{"role": "user", "content": [
                    {"type": "text", "text": "abc"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,QUJD"}},
                    "not a part", {"type": "text", "text": 5}]},
                {"role": "assistant", "content": "de", "tool_calls": [
                    {"id": "c", "type": "function",
                     "function": {"name": "f", "arguments": "{}"}}]},
                "not a message"]
    assert message_chars(messages) == len("user") + 3 + len("assistant") + 2 + len(
        "c" + "function" + "f" + "{}")
    assert message_chars("not a list") == 0 and message_chars(None) == 0
