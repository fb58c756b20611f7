"""A long prompt is tokenized only as far as any replica's match can reach
(``Settings.route_head_chars``, ``IngressCore.prepare``, ``route_request``): a new prompt is
routed on its head's blocks with its length estimated; one whose head a replica holds is
tokenized whole and routed on all its blocks."""

from __future__ import annotations

import contextlib
import json
import uuid

import pytest

from router.config import Settings
from router.index.base import IndexUnavailable
from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH
from router.routing.core import route_request
from router.serve import state
from router.routing.replica import ReplicaInfo
from router.serve.errors import OpenAIError
from router.serve.ingress import IngressCore
from tests.conftest import REDIS_URL, make_text


@pytest.fixture
def replicas():
    state.put("replica_infos", (ReplicaInfo("replica-a"), ReplicaInfo("replica-b")))
    yield
    state.put("replica_infos", None)


async def routed(ingress: IngressCore, path: str, body: bytes, release: bool = True):
    """``prepare``, then the routing step of a first attempt (``route_request``, as both
    data paths run it); the reservation is released unless ``release`` is false. Returns
    the request as routed."""
    req = await ingress.prepare(path, body)
    core = ingress.routing_core()
    await route_request(core, req, list(state.replica_infos()), ingress.policies.get(None))
    if release:
        with contextlib.suppress(IndexUnavailable):
            await core.load.release(req.request_id)
    return req


def _body(path: str, doc: str, question: str) -> bytes:
    if path == CHAT_PATH:
        return json.dumps({"model": "m", "messages": [
            {"role": "system", "content": "You answer questions about the document."},
            {"role": "user", "content": doc + "\n\n" + question}]}).encode()
    return json.dumps({"model": "m", "prompt": doc + "\n\n" + question}).encode()


@pytest.mark.parametrize("index", ["memory", "redis"])
@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
async def test_a_long_prompt_is_tokenized_past_its_head_only_where_a_replica_holds_it(
        model_dir, replicas, path, index):
    """In memory the policy decides in this process (``RoutingCore._decide_here``); with
    Redis the route script decides on the head (``route.lua``'s ``route_head`` mode) and
    answers without deciding when a candidate holds the whole head."""
    settings = Settings(model=str(model_dir), index_namespace=f"head-{uuid.uuid4().hex[:6]}",
                        redis_url=REDIS_URL if index == "redis" else None)
    lazy = IngressCore(settings, engine_handle=None)
    whole = IngressCore(settings.model_copy(update={"route_head_chars": 0}), engine_handle=None)
    body = _body(path, make_text(20_000, "document"), "What is S0042 about?")
    ref = await whole.prepare(path, body)
    assert ref.rest is None

    # nothing held anywhere: decided on the head's blocks, the length estimated, the rest
    # never tokenized
    req = await routed(lazy, path, body)
    n = len(req.block_hashes)
    assert 0 < n < len(ref.block_hashes) // 2 and req.rest is None
    assert req.block_hashes == ref.block_hashes[:n]
    assert abs(req.prompt_tokens - ref.prompt_tokens) <= 0.05 * ref.prompt_tokens
    assert req.predicted_cached_tokens[req.routed_replica] == 0

    # its decision wrote the head's predicted entries where it went: the same prompt again
    # finds the whole head held there, so it is tokenized whole and decided on every block
    again = await routed(lazy, path, body)
    assert again.block_hashes == ref.block_hashes and again.prompt_tokens == ref.prompt_tokens
    assert again.routed_replica == req.routed_replica
    assert again.predicted_cached_tokens[again.routed_replica] == n * settings.block_size

    # a replica holds another prompt's head but its last block: no match can pass the head
    other_body = _body(path, make_text(20_000, "second"), "?")
    head = (await lazy.prepare(path, other_body)).block_hashes
    await state.make_index(settings).record_predicted("replica-a", head[:-1], 60.0)
    other = await routed(lazy, path, other_body)
    assert other.block_hashes == head
    assert other.predicted_cached_tokens["replica-a"] == (len(head) - 1) * settings.block_size
    if index == "redis":
        await state.make_index(settings).flush()

    # other policies get the whole prompt (they read its length and block count)
    lb = IngressCore(settings.model_copy(update={"policy": "least_loaded"}), None)
    assert (await lb.prepare(path, _body(path, make_text(6000, "other"), "?"))
            ).block_hashes == (await whole.prepare(path, _body(path, make_text(6000, "other"),
                                                              "?"))).block_hashes


async def test_the_warm_up_records_a_long_prompt_on_the_ingress_loop(model_dir, replicas):
    """On the handle data path the routing step runs on Serve's router loop, a thread of its
    own: the warm-up's record of a long prompt (``_Rest.done``; the record has no lock) is
    still written on the ingress's loop, as every other use of it is."""
    import asyncio
    import threading

    settings = Settings(model=str(model_dir), index_namespace=f"wu-{uuid.uuid4().hex[:6]}",
                        warmup_enabled=True)
    ingress = IngressCore(settings, engine_handle=None)
    seen = []
    ingress.warmup.observe = lambda *args: seen.append(threading.current_thread().name)
    req = await ingress.prepare(CHAT_PATH, _body(CHAT_PATH, make_text(20_000, "wu"), "?"))
    assert req.rest is not None
    core, policy = ingress.routing_core(), ingress.policies.get(None)
    router = threading.Thread(target=lambda: asyncio.run(route_request(
        core, req, list(state.replica_infos()), policy)), name="serve-router")
    router.start()
    while router.is_alive():
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)
    assert seen == [threading.current_thread().name]
    await core.load.release(req.request_id)


def test_a_request_leaves_its_rest_behind_when_serialised(model_dir, replicas):
    """``RoutedRequest.rest`` holds the tokenizer's state: the Ray handle path serialises
    the request without it (Serve does so once the router has chosen)."""
    import asyncio
    import pickle

    settings = Settings(model=str(model_dir), index_namespace=f"pk-{uuid.uuid4().hex[:6]}")
    req = asyncio.run(IngressCore(settings, engine_handle=None).prepare(
        CHAT_PATH, _body(CHAT_PATH, make_text(20_000, "pickled"), "?")))
    assert req.rest is not None
    copy = pickle.loads(pickle.dumps(req))
    assert copy.rest is None and copy.block_hashes == req.block_hashes
    assert req.rest is not None  # the original keeps it


async def test_an_index_that_fails_leaves_the_prompt_at_its_head(model_dir, replicas):
    """Redis down: the decision fails fast and falls back to load, so the rest is not
    tokenized for nothing."""
    settings = Settings(model=str(model_dir), redis_url="redis://127.0.0.1:1/0",
                        redis_timeout_s=0.05)
    lazy = IngressCore(settings, engine_handle=None)
    req = await routed(lazy, CHAT_PATH, _body(CHAT_PATH, make_text(20_000, "x"), "?"))
    assert req.routing_reason == "fallback"
    assert 0 < len(req.block_hashes) < 20_000 // settings.block_size // 2
    assert req.prompt_tokens > 19_000


async def test_a_burst_is_rendered_in_arrival_order_with_the_index_answers_in_between(
        model_dir, replicas):
    """``IngressCore._cpu_turn`` (no render threads, ``render_threads=0``): 8 long prompts
    arrive at once. The first is decided (its route script answered by Redis) before the
    last is rendered: the renders take turns with the loop's I/O instead of all running
    before any decision is answered (all eight would run in the loop's first iteration)."""
    import asyncio

    from tests.conftest import REDIS_URL
    settings = Settings(model=str(model_dir), redis_url=REDIS_URL, redis_timeout_s=5.0,
                        index_namespace=f"turn-{uuid.uuid4().hex[:6]}", render_threads=0)
    ingress = IngressCore(settings, engine_handle=None)
    bodies = [_body(CHAT_PATH, make_text(6000, f"burst-{i}"), "?") for i in range(9)]
    await routed(ingress, CHAT_PATH, bodies[8])  # warm: template, Redis connection
    events = []
    render = ingress._prepare

    def logged(path, raw, *args):
        events.append(("render", bodies.index(raw)))
        return render(path, raw, *args)
    ingress._prepare = logged

    async def one(i):
        req = await routed(ingress, CHAT_PATH, bodies[i], release=False)
        events.append(("done", i))
        await ingress.routing_core().load.release(req.request_id)
    await asyncio.gather(*(one(i) for i in range(8)))
    assert [i for e, i in events if e == "render"] == list(range(8))
    assert events.index(("done", 0)) < events.index(("render", 7)), events


async def test_long_bodies_are_rendered_on_the_render_threads_in_arrival_order(
        model_dir, replicas):
    """``Settings.render_threads``: bodies over 16 KiB are rendered off the event loop, on
    the render threads, in arrival order (one thread here), with the hashes an inline
    render gives. The loop runs while a render does: a render that waits for the loop to
    set an event finishes (rendered on the loop, it would wait for ever)."""
    import asyncio
    import threading

    settings = Settings(model=str(model_dir), index_namespace=f"rt-{uuid.uuid4().hex[:6]}",
                        render_threads=1)
    ingress = IngressCore(settings, engine_handle=None)
    inline = IngressCore(settings.model_copy(update={"render_threads": 0}), None)
    assert inline._render_pool is None
    bodies = [_body(CHAT_PATH, make_text(6000, f"threads-{i}"), "?") for i in range(6)]
    assert all(len(b) > 16 * 1024 for b in bodies)
    seen, gate, render = [], threading.Event(), ingress._prepare

    def logged(path, raw, *args):
        seen.append((bodies.index(raw), threading.current_thread().name))
        if raw is bodies[0]:
            assert gate.wait(5), "the event loop stood still while a body was rendered"
        return render(path, raw, *args)
    ingress._prepare = logged

    async def open_gate():
        await asyncio.sleep(0.05)
        gate.set()
    got = await asyncio.gather(*(ingress.prepare(CHAT_PATH, b) for b in bodies), open_gate())
    assert [i for i, _ in seen] == list(range(6))
    assert all(name.startswith("render") for _, name in seen), seen
    for body, req in zip(bodies, got):
        assert req.block_hashes == (await inline.prepare(CHAT_PATH, body)).block_hashes
    pool = ingress._render_pool
    await ingress.close()
    with pytest.raises(RuntimeError):  # stopped with the ingress
        pool.submit(print)
    assert (await ingress.prepare(CHAT_PATH, bodies[1])).block_hashes == got[1].block_hashes


def test_render_threads_default_to_half_the_cores_at_most_four_none_below_four(
        monkeypatch):
    from router.serve import ingress as ingress_mod
    monkeypatch.setattr(ingress_mod, "cgroup_cpu_limit", lambda: None)
    for cores, threads in ((16, 4), (6, 3), (4, 2), (2, 0), (1, 0)):
        monkeypatch.setattr(ingress_mod.os, "sched_getaffinity",
                            lambda pid, n=cores: set(range(n)), raising=False)
        assert ingress_mod.render_threads(Settings()) == threads, cores
    # a container limited to 2 cores sees the host's 16 in its affinity: none
    monkeypatch.setattr(ingress_mod, "cgroup_cpu_limit", lambda: 2.0)
    assert ingress_mod.render_threads(Settings()) == 0
    assert ingress_mod.render_threads(Settings(render_threads=0)) == 0
    assert ingress_mod.render_threads(Settings(render_threads=7)) == 7


def test_the_cgroup_cpu_limit_is_read_from_cpu_max(tmp_path):
    from router.serve.ingress import cgroup_cpu_limit
    f = tmp_path / "cpu.max"
    f.write_text("200000 100000\n")
    assert cgroup_cpu_limit(str(f)) == 2.0
    f.write_text("max 100000\n")
    assert cgroup_cpu_limit(str(f)) is None
    assert cgroup_cpu_limit(str(tmp_path / "absent")) is None


async def test_text_the_tokenizer_refuses_past_a_held_head_is_routed_by_load(
        model_dir, replicas, monkeypatch):
    """Found by a break test: a lone surrogate after the head of a prompt whose head a
    replica held raised TypeError while the rest was encoded (a 500). Such text is now
    refused with the body (``json_object``); text the tokenizer refuses past a held head
    for any other reason is routed by load, as when rendering fails, and the engine
    answers."""
    settings = Settings(model=str(model_dir), index_namespace=f"head-{uuid.uuid4().hex[:6]}")
    ingress = IngressCore(settings, engine_handle=None)
    doc = make_text(20_000, "refused")
    clean = await ingress.prepare(COMPLETIONS_PATH, _body(COMPLETIONS_PATH, doc, "?"))
    await state.make_index(settings).record_predicted("replica-a", clean.block_hashes, 60.0)
    raw = ('{"model": "m", "prompt": "%s\\ud800 %s"}' % (doc[:30_000], doc[30_000:])).encode()
    with pytest.raises(OpenAIError) as err:
        await ingress.prepare(COMPLETIONS_PATH, raw)
    assert err.value.status == 400 and err.value.body()["error"]["param"] == "body.prompt"

    segments = ingress.renderer.segments
    encode = segments._encode_chunks

    def refuse_the_rest(chunks):  # what the tokenizer binding raised for the surrogate
        if any("refused-rest" in c for c in chunks):
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        return encode(chunks)

    monkeypatch.setattr(segments, "_encode_chunks", refuse_the_rest)
    raw = _body(COMPLETIONS_PATH, doc[:30_000] + " refused-rest " + doc[30_000:], "?")
    req = await routed(ingress, COMPLETIONS_PATH, raw)
    assert req.block_hashes == [] and req.prompt_tokens > 0
    assert req.routing_reason == "load"


def test_the_rests_length_is_estimated_per_byte(model_dir):
    """An English head and a rest of another kind: the estimate, per UTF-8 byte of the
    head, is within 50 % for CJK, code and base64 (per character it was 80 % low on CJK,
    whose characters take 3 bytes and several tokens of a byte-level vocabulary)."""
    import base64
    import random

    from router.prompt.render import PromptRenderer
    renderer = PromptRenderer(str(model_dir))
    rng = random.Random(0)
    rests = {"cjk": "".join(chr(rng.randrange(0x4E00, 0x9FFF)) for _ in range(6000)),
             "code": "\n".join(f"def f{i}(x, y):\n    return {{'k{i}': [x * {i}, y - {i}]}}"
                               for i in range(400)),
             "base64": base64.b64encode(rng.randbytes(15_000)).decode()}
    for kind, rest in rests.items():
        text = make_text(2000, "english") + " " + rest
        info = renderer.render(COMPLETIONS_PATH, {"model": "m", "prompt": text}, head_chars=2048)
        assert info.rest is not None, kind
        estimate = info.num_tokens
        info.finish()
        assert abs(estimate - len(info.token_ids)) <= 0.5 * len(info.token_ids), \
            (kind, estimate, len(info.token_ids))
