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
