"""Bodies the ingress refuses before routing, with an OpenAI-style 400 (never a 500)."""

from __future__ import annotations

import pytest

from router.config import Settings
from router.errors import OpenAIError
from router.ingress import IngressCore
from router.prompts import CHAT_PATH, COMPLETIONS_PATH


@pytest.fixture(scope="module")
def ingress(model_dir):
    return IngressCore(Settings(model=str(model_dir)), engine_handle=None)


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

    from router.ingress import build_fastapi_app
    app = build_fastapi_app()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": []}

    client = TestClient(app)
    for r, status in ((client.get("/v1/nope"), 404), (client.post("/v1/models"), 405)):
        assert r.status_code == status
        assert r.json()["error"]["code"] == status and r.json()["error"]["message"]
