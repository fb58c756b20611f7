"""The direct data path's failure handling, with the engines' HTTP answered by an in-process
transport (a fault at an exact moment: the headers came, the body broke before its first
byte), no Ray: the ingress decides and dispatches itself."""

from __future__ import annotations

import json

import httpx
import pytest

from router.config import Settings
from router.prompt.render import COMPLETIONS_PATH
from router.routing.replica import ReplicaInfo
from router.serve import state
from router.serve.ingress import IngressCore

OK = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x"}],
      "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


class _Broken(httpx.AsyncByteStream):
    async def __aiter__(self):
        raise httpx.ReadError("connection reset after the headers")
        yield b""  # pragma: no cover - an async generator that fails at once


def _engine(request: httpx.Request) -> httpx.Response:
    if request.url.host in _Engines.broken:
        return httpx.Response(200, headers={"content-type": "application/json"},
                              stream=_Broken())
    return httpx.Response(200, headers={"content-type": "application/json"},
                          stream=httpx.ByteStream(json.dumps(OK).encode()))


class _Engines:
    broken: set[str] = set()


@pytest.fixture
def core(model_dir, monkeypatch):
    monkeypatch.setattr(_Engines, "broken", set())
    infos = tuple(ReplicaInfo(r, {"engine_url": f"http://{r}"}, {"engine_alive": True})
                  for r in ("a", "b"))
    state.put("replica_infos", infos)
    c = IngressCore(Settings(model=str(model_dir), index_namespace="direct-path-test",
                             policy="round_robin"), engine_handle=None)
    c._engine_client = httpx.AsyncClient(transport=httpx.MockTransport(_engine))
    c.health.forget("a")
    c.health.forget("b")
    yield c
    state.put("replica_infos", None)


def _body() -> bytes:
    return json.dumps({"model": "tiny-qwen2", "prompt": "hello there", "max_tokens": 1}).encode()


async def test_a_body_broken_before_its_first_byte_is_retried_and_opens_the_circuit(core):
    _Engines.broken = {"a"}
    for _ in range(6):
        r = await core.handle(COMPLETIONS_PATH, _body(), 0.0)
        assert r.status_code == 200 and r.headers["x-routed-replica"] == "b"
    # every attempt on "a" counted as a failure (and none as a success): its circuit is open
    assert core.health.is_open("a") and not core.health.is_open("b")
    assert all(v.inflight == 0 for v in (await core.load.loads(["a", "b"])).values())


async def test_two_broken_bodies_get_an_openai_502_not_a_500(core):
    _Engines.broken = {"a", "b"}
    r = await core.handle(COMPLETIONS_PATH, _body(), 0.0)
    assert r.status_code == 502
    err = json.loads(r.body)["error"]
    assert err["code"] == 502 and "ReadError" in err["message"]
    assert all(v.inflight == 0 for v in (await core.load.loads(["a", "b"])).values())


async def test_a_stream_whose_answer_loses_its_cancellation_still_releases_its_load(
        core, monkeypatch):
    """The client leaves while its streaming request waits; the answer task loses the
    cancellation (as ``asyncio.wait_for`` loses one on Python 3.11, python/cpython#86296)
    and goes on to route, reserve and open the engine call. Nobody sends its response, so
    the ingress closes it: the load returns to 0 (CI once kept such a lease forever)."""
    import asyncio

    admit, entered, calls = core.admission.admit, asyncio.Event(), []

    async def stubborn_admit(*args, **kwargs):
        entered.set()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            pass  # lost
        return await admit(*args, **kwargs)

    monkeypatch.setattr(core.admission, "admit", stubborn_admit)
    core._engine_client = httpx.AsyncClient(transport=httpx.MockTransport(
        lambda request: calls.append(request.url.host) or _engine(request)))
    body = json.dumps({"model": "tiny-qwen2", "prompt": "hello there", "max_tokens": 1,
                       "stream": True}).encode()
    task = asyncio.ensure_future(core.handle(COMPLETIONS_PATH, body, 0.0))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(1000):  # up to 10 s on a loaded machine
        loads = await core.load.loads(["a", "b"])
        if calls and all(v.inflight == 0 for v in loads.values()):
            break
        await asyncio.sleep(0.01)
    assert calls, "the answer went on to the engine"
    assert all(v.inflight == 0 for v in loads.values()), loads
