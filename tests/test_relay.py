"""The ingress's streamed answer (router/serve/dispatch.py ``RelayResponse``): relayed in the
calling task, cut at once by the client's disconnect, and never swallowing a cancellation
that came from elsewhere."""

from __future__ import annotations

import asyncio

import pytest

from router.serve.dispatch import RelayResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}


class Client:
    """An ASGI client: records what is sent; ``leave()`` makes ``receive`` report the
    disconnect."""

    def __init__(self):
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def receive(self):
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message):
        self.sent.append(message)

    def leave(self):
        self.gone.set()


async def test_a_finished_relay_sends_everything_and_leaves_no_task():
    client = Client()

    async def body():
        yield b"data: 1\n\n"
        yield b"data: [DONE]\n\n"

    before = len(asyncio.all_tasks())
    await RelayResponse(body(), media_type="text/event-stream")(SCOPE, client.receive,
                                                                 client.send)
    assert [m["type"] for m in client.sent] == ["http.response.start"] + \
        ["http.response.body"] * 3
    assert b"".join(m.get("body", b"") for m in client.sent[1:]) == \
        b"data: 1\n\ndata: [DONE]\n\n"
    await asyncio.sleep(0)  # the cancelled watcher ends
    assert len(asyncio.all_tasks()) == before
    client.leave()  # a disconnect after the end cancels nothing
    await asyncio.sleep(0.01)


async def test_a_disconnect_cuts_the_relay_between_chunks_and_ends_it_normally():
    client = Client()
    state = {"closed": False}

    async def body():
        try:
            yield b"data: 1\n\n"
            await asyncio.Event().wait()  # the engine's next token never comes
            yield b"data: 2\n\n"
        finally:
            state["closed"] = True

    async def leave_after_first_chunk():
        while len(client.sent) < 2:
            await asyncio.sleep(0.001)
        client.leave()

    leaver = asyncio.ensure_future(leave_after_first_chunk())
    await asyncio.wait_for(RelayResponse(body())(SCOPE, client.receive, client.send), 5)
    await leaver
    assert state["closed"]  # the body generator was closed: its engine call ends
    assert [m.get("body") for m in client.sent[1:]] == [b"data: 1\n\n"]
    assert asyncio.current_task().cancelling() == 0  # no cancellation left behind


@pytest.mark.parametrize("also_disconnect", [False, True])
async def test_a_cancellation_from_elsewhere_propagates(also_disconnect):
    client = Client()
    started = asyncio.Event()

    async def body():
        yield b"data: 1\n\n"
        started.set()
        await asyncio.Event().wait()
        yield b"never"

    task = asyncio.ensure_future(RelayResponse(body())(SCOPE, client.receive, client.send))
    await started.wait()
    if also_disconnect:  # the watcher cancels the relay first, and is overtaken
        client.leave()
        while task.cancelling() == 0:
            await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


@pytest.mark.parametrize("raised", ["RuntimeError", "TaskCancelledError"])
async def test_a_failing_receive_cuts_the_relay_and_raises_as_starlette_does(raised):
    """The server's ``receive`` fails (Serve's proxy went away): the relay stops, its body
    is closed, and the error is raised, not swallowed. Serve's ``TaskCancelledError`` is
    Serve cancelling the request because its client left: a disconnect, the relay cut and
    ended normally (found in a break test's logs: raised on, asyncio logged "Future
    exception was never retrieved" for every client that left)."""
    from ray.exceptions import TaskCancelledError
    state = {"closed": False}
    sent = []

    async def receive():
        await asyncio.sleep(0.01)
        raise RuntimeError("proxy gone") if raised == "RuntimeError" else TaskCancelledError()

    async def send(message):
        sent.append(message)

    async def body():
        try:
            while True:
                yield b"data: x\n\n"
                await asyncio.sleep(0.005)
        finally:
            state["closed"] = True

    relay = asyncio.wait_for(RelayResponse(body())(SCOPE, receive, send), 5)
    if raised == "RuntimeError":
        with pytest.raises(RuntimeError, match="proxy gone"):
            await relay
    else:
        await relay
    assert state["closed"] and len(sent) < 20
    assert asyncio.current_task().cancelling() == 0
