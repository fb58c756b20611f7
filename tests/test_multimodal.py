"""docs/fault-cases.md 4.4: multimodal requests must not be hashed on their text alone.

vLLM mixes each image's hash into the blocks that touch its tokens, so two requests with the
same text and different images share no cache. The router cannot reproduce image hashes, so
it declares any request with a non-text part non-cacheable and routes it by load: it must
never predict a hit for it, while text-only requests keep predicting theirs."""

from __future__ import annotations

import json
import random

import pytest

from router.config import Settings
from router.index.memory import MemoryPrefixIndex
from router.load.memory import MemoryLoadTracker
from router.policy import PrefixAware
from router.prompt.render import CHAT_PATH
from router.routing.core import RoutingCore, route_request
from router.routing.replica import ReplicaInfo
from router.serve.ingress import IngressCore
from tests.conftest import make_text

PNG_1 = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk"
PNG_2 = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"


@pytest.fixture
def router_parts(model_dir):
    settings = Settings(model=str(model_dir))
    core = RoutingCore(settings, MemoryPrefixIndex(), MemoryLoadTracker(),
                       PrefixAware(random.Random(0)))
    return IngressCore(settings, engine_handle=None), core


def _chat(*parts) -> bytes:
    content = [{"type": "image_url", "image_url": {"url": p}} if p.startswith("data:")
               else {"type": "text", "text": p} for p in parts]
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": content}]}).encode()


async def _route(ingress, core, body: bytes, replicas):
    req = await ingress.prepare(CHAT_PATH, body)
    decision = await route_request(core, req, replicas, core.policy)
    await core.load.release(req.request_id)
    return req, decision


async def test_same_text_with_other_images_predicts_no_hit(router_parts, tokenizer):
    ingress, core = router_parts
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    text = make_text(400, "multimodal", tokenizer)

    # the text alone, twice: the second predicts reuse of its blocks (the index works)
    _, first = await _route(ingress, core, _chat(text), reps)
    req, again = await _route(ingress, core, _chat(text), reps)
    assert again.reason == "cache" and again.replica == first.replica
    assert again.predicted_cached_tokens[first.replica] >= 320

    # R1 = [image1, T], R2 = [image2, T], R3 = [T, image1] twice: never a predicted hit,
    # although T's blocks are in the index; each is routed by load
    for body in (_chat(PNG_1, text), _chat(PNG_2, text), _chat(text, PNG_1), _chat(text, PNG_1)):
        req, d = await _route(ingress, core, body, reps)
        assert req.block_hashes == []
        assert d.reason == "load"
        assert all(v == 0 for v in d.predicted_cached_tokens.values()), d
