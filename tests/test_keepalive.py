"""SSE keep-alives of a stream whose answer is not ready yet
(``router.serve.dispatch.KeepAliveStreamingResponse``), run as the ASGI app it is."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import ClientDisconnect

from router.serve.dispatch import KEEPALIVE, KeepAliveStreamingResponse
from router.serve.errors import OpenAIError


def app_of(answer_fn, interval_s=0.1):
    """An ASGI app answering every request with the keep-alive response around a task of
    ``answer_fn()``; the task is kept in ``app.tasks``."""
    tasks = []

    async def app(scope, receive, send):
        task = asyncio.ensure_future(answer_fn())
        tasks.append(task)
        await KeepAliveStreamingResponse(task, interval_s)(scope, receive, send)

    app.tasks = tasks
    return app


async def get(app) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://t") as client:
        return await client.post("/v1/chat/completions")


async def test_keep_alives_until_the_answer_then_its_stream():
    async def answer():
        await asyncio.sleep(0.35)
        return StreamingResponse(iter([b"data: {\"x\": 1}\n\n", b"data: [DONE]\n\n"]),
                                 media_type="text/event-stream")

    r = await get(app_of(answer))
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    head, _, rest = r.content.rpartition(KEEPALIVE)
    assert head.replace(KEEPALIVE, b"") == b"" and r.content.count(KEEPALIVE) >= 2
    assert rest == b"data: {\"x\": 1}\n\ndata: [DONE]\n\n"


async def test_a_refusal_after_keep_alives_is_an_sse_error_event():
    async def answer():
        await asyncio.sleep(0.25)
        raise OpenAIError(429, "busy", "RateLimitError", headers={"retry-after": "2"})

    r = await get(app_of(answer))
    assert r.status_code == 200 and r.content.startswith(KEEPALIVE)
    events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) == 2
    assert json.loads(events[0][6:]) == {"error": {"message": "busy", "type": "RateLimitError",
                                                   "param": None, "code": 429}}


async def test_an_engine_error_answer_after_keep_alives_is_an_sse_error_event():
    body = {"error": {"message": "too long", "type": "BadRequestError", "param": None,
                      "code": 400}}

    async def answer():
        await asyncio.sleep(0.25)
        return JSONResponse(body, status_code=400)

    r = await get(app_of(answer))
    events = [e for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert json.loads(events[0][6:]) == body and events[1] == "data: [DONE]"


@pytest.mark.parametrize("spec", ["2.3", "2.4"])
async def test_a_client_that_leaves_during_keep_alives_cancels_the_answer(spec):
    """ASGI 2.3 servers tell a disconnect by ``receive`` (Starlette listens for it), 2.4
    servers by failing the next ``send`` (a keep-alive is such a send)."""
    started = asyncio.Event()
    loop = asyncio.get_running_loop()
    t0 = loop.time()

    async def answer():
        started.set()
        await asyncio.sleep(30)

    app = app_of(answer)
    sent = []
    calls = 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.sleep(0.3)
        return {"type": "http.disconnect"}

    async def send(message):
        if spec == "2.4" and loop.time() - t0 > 0.3:
            raise OSError("client gone")
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec},
             "http_version": "1.1", "method": "POST", "path": "/", "raw_path": b"/",
             "query_string": b"", "headers": [], "scheme": "http"}
    try:
        await asyncio.wait_for(app(scope, receive, send), 5)
    except ClientDisconnect:
        pass  # how a 2.4 server's response call ends when its client left
    assert started.is_set() and app.tasks[0].cancelled()
    assert any(m.get("body") == KEEPALIVE for m in sent)


class _Dispatch:
    """Stands in for an ``Attempt`` only as far as ``end_answer`` reads it: ``close``."""

    def __init__(self):
        self.closed = 0

    async def close(self):
        self.closed += 1


def _stubborn_answer(dispatch, started: asyncio.Event):
    """An answer whose cancellation is lost (as ``asyncio.wait_for`` loses one on Python
    3.11, python/cpython#86296): it goes on and returns a response nobody will send."""
    async def answer():
        started.set()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # it goes on routing and dispatching
        resp = StreamingResponse(iter([b"data: [DONE]\n\n"]))
        resp.dispatch = dispatch
        return resp
    return answer


async def test_an_abandoned_answer_that_loses_its_cancellation_still_closes_its_dispatch():
    from router.serve.dispatch import _ABANDONED, abandon

    dispatch, started = _Dispatch(), asyncio.Event()
    task = asyncio.ensure_future(_stubborn_answer(dispatch, started)())
    await started.wait()
    abandon(task)
    assert _ABANDONED  # the reaper is held until it is done
    await asyncio.wait_for(task, 2)
    for _ in range(500):
        if dispatch.closed:
            break
        await asyncio.sleep(0.01)
    assert dispatch.closed == 1 and not _ABANDONED


async def test_end_answer_does_not_close_what_a_cancelled_or_failed_answer_left():
    from router.serve.dispatch import end_answer

    async def fails():
        raise RuntimeError("boom")

    failed = asyncio.ensure_future(fails())
    await asyncio.sleep(0)
    assert await end_answer(failed) is None
    pending = asyncio.ensure_future(asyncio.sleep(5))
    assert await end_answer(pending) is None and pending.cancelled()

