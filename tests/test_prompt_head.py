"""A long prompt is tokenized only as far as any replica's match can reach
(``Settings.route_head_chars``, ``IngressCore.prepare``): a new prompt is routed on its
head's blocks with its length estimated; one whose head a replica holds is tokenized whole."""

from __future__ import annotations

import json
import uuid

import pytest

from router.config import Settings
from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH
from router.serve import state
from router.routing.replica import ReplicaInfo
from router.serve.ingress import IngressCore
from tests.conftest import make_text


@pytest.fixture
def replicas():
    state.put("replica_infos", (ReplicaInfo("replica-a"), ReplicaInfo("replica-b")))
    yield
    state.put("replica_infos", None)


def _body(path: str, doc: str, question: str) -> bytes:
    if path == CHAT_PATH:
        return json.dumps({"model": "m", "messages": [
            {"role": "system", "content": "You answer questions about the document."},
            {"role": "user", "content": doc + "\n\n" + question}]}).encode()
    return json.dumps({"model": "m", "prompt": doc + "\n\n" + question}).encode()


@pytest.mark.parametrize("path", [CHAT_PATH, COMPLETIONS_PATH])
async def test_a_long_prompt_is_tokenized_past_its_head_only_where_a_replica_holds_it(
        model_dir, replicas, path):
    settings = Settings(model=str(model_dir), index_namespace=f"head-{uuid.uuid4().hex[:6]}")
    lazy = IngressCore(settings, engine_handle=None)
    whole = IngressCore(settings.model_copy(update={"route_head_chars": 0}), engine_handle=None)
    body = _body(path, make_text(20_000, "document"), "What is S0042 about?")
    ref = await whole.prepare(path, body)

    # nothing held anywhere: the head's blocks only, the length estimated
    req = await lazy.prepare(path, body)
    n = len(req.block_hashes)
    assert 0 < n < len(ref.block_hashes) // 2
    assert req.block_hashes == ref.block_hashes[:n]
    assert abs(req.prompt_tokens - ref.prompt_tokens) <= 0.05 * ref.prompt_tokens

    # a replica holds the head but its last block: still no match can pass the head
    index = state.make_index(settings)
    await index.record_predicted("replica-a", req.block_hashes[:-1], 60.0)
    assert (await lazy.prepare(path, body)).block_hashes == req.block_hashes

    # a replica holds the whole head: the prompt is tokenized whole
    await index.record_predicted("replica-b", req.block_hashes, 60.0)
    full = await lazy.prepare(path, body)
    assert full.block_hashes == ref.block_hashes and full.prompt_tokens == ref.prompt_tokens

    # other policies get the whole prompt (they read its length and block count)
    other = IngressCore(settings.model_copy(update={"policy": "least_loaded"}), None)
    assert (await other.prepare(path, _body(path, make_text(6000, "other"), "?"))
            ).block_hashes == (await whole.prepare(path, _body(path, make_text(6000, "other"),
                                                              "?"))).block_hashes


async def test_an_index_that_fails_leaves_the_prompt_at_its_head(model_dir, replicas):
    """Redis down: the head lookup fails fast and routing falls back to load, so the rest
    is not tokenized for nothing."""
    settings = Settings(model=str(model_dir), redis_url="redis://127.0.0.1:1/0",
                        redis_timeout_s=0.05)
    lazy = IngressCore(settings, engine_handle=None)
    req = await lazy.prepare(CHAT_PATH, _body(CHAT_PATH, make_text(20_000, "x"), "?"))
    assert 0 < len(req.block_hashes) < 20_000 // settings.block_size // 2
    assert req.prompt_tokens > 19_000


async def test_a_burst_is_rendered_in_arrival_order_with_the_index_answers_in_between(
        model_dir, replicas):
    """``IngressCore._cpu_turn`` (no render threads, ``render_threads=0``): 8 long prompts
    arrive at once. The first is dispatched (its head lookup answered by Redis) before the
    fifth is rendered: the renders take turns with the loop's I/O instead of all running
    before any lookup is answered."""
    import asyncio

    from tests.conftest import REDIS_URL
    settings = Settings(model=str(model_dir), redis_url=REDIS_URL, redis_timeout_s=5.0,
                        index_namespace=f"turn-{uuid.uuid4().hex[:6]}", render_threads=0)
    ingress = IngressCore(settings, engine_handle=None)
    bodies = [_body(CHAT_PATH, make_text(6000, f"burst-{i}"), "?") for i in range(9)]
    await ingress.prepare(CHAT_PATH, bodies[8])  # warm: template, Redis connection
    events = []
    render = ingress._prepare

    def logged(path, raw, *args):
        events.append(("render", bodies.index(raw)))
        return render(path, raw, *args)
    ingress._prepare = logged

    async def one(i):
        await ingress.prepare(CHAT_PATH, bodies[i])
        events.append(("done", i))
    await asyncio.gather(*(one(i) for i in range(8)))
    assert [i for e, i in events if e == "render"] == list(range(8))
    assert events.index(("done", 0)) < events.index(("render", 4)), events


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
        model_dir, replicas):
    """Found by a break test: a lone surrogate after the head of a prompt whose head a
    replica held raised TypeError while the rest was encoded (a 500). It is routed by load,
    as when rendering fails, and the engine answers with its own 400."""
    settings = Settings(model=str(model_dir), index_namespace=f"head-{uuid.uuid4().hex[:6]}")
    ingress = IngressCore(settings, engine_handle=None)
    doc = make_text(20_000, "surrogate")
    clean = await ingress.prepare(COMPLETIONS_PATH, _body(COMPLETIONS_PATH, doc, "?"))
    await state.make_index(settings).record_predicted("replica-a", clean.block_hashes, 60.0)
    raw = ('{"model": "m", "prompt": "%s\\ud800 %s"}' % (doc[:30_000], doc[30_000:])).encode()
    req = await ingress.prepare(COMPLETIONS_PATH, raw)
    assert req.block_hashes == [] and req.prompt_tokens > 0


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
