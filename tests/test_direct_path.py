"""The direct data path's failure handling, with the engines' HTTP served by real aiohttp
servers on loopback that fail at an exact moment (the headers came, the body broke before
its first byte: the connection is reset), no Ray: the ingress decides and dispatches
itself over its pooled connections (``router.serve.engine_client``)."""

from __future__ import annotations

import json
import time

import pytest
from aiohttp import web

from router.config import Settings
from router.prompt.render import COMPLETIONS_PATH
from router.redis_keys import LAYOUT_VERSION
from router.routing.replica import ReplicaInfo
from router.serve import state
from router.serve.ingress import IngressCore
from router.serve.protocol import parse_server_timing

OK = {"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": "x"}],
      "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}}


async def _serve(app: web.Application) -> tuple[web.AppRunner, int]:
    """Start ``app`` on a free loopback port: its runner (``cleanup()`` stops it) and port."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]


class _Engines:
    """Two engines, ``a`` and ``b``, each an aiohttp server on a loopback port; those in
    ``broken`` send their head and then reset the connection; ``calls`` lists who was
    called, in order."""

    def __init__(self):
        self.broken: set[str] = set()
        self.calls: list[str] = []
        self.runners: list[web.AppRunner] = []
        self.urls: dict[str, str] = {}

    async def start(self) -> None:
        for name in ("a", "b"):
            app = web.Application()
            app.router.add_post(COMPLETIONS_PATH, self._handler(name))
            runner, port = await _serve(app)
            self.runners.append(runner)
            self.urls[name] = f"http://127.0.0.1:{port}"

    def _handler(self, name: str):
        async def handle(request: web.Request) -> web.StreamResponse:
            await request.read()
            self.calls.append(name)
            if name in self.broken:
                resp = web.StreamResponse(headers={"content-type": "application/json"})
                await resp.prepare(request)  # the head goes out (chunked), then a reset
                request.transport.abort()
                return resp
            return web.json_response(OK)
        return handle

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()


@pytest.fixture
async def engines():
    e = _Engines()
    await e.start()
    yield e
    await e.stop()


@pytest.fixture
async def core(model_dir, engines):
    infos = tuple(ReplicaInfo(r, {"engine_url": engines.urls[r]}, {"engine_alive": True})
                  for r in ("a", "b"))
    state.put("replica_infos", infos)
    c = IngressCore(Settings(model=str(model_dir), index_namespace="direct-path-test",
                             policy="round_robin"), engine_handle=None)
    c.health.forget("a")
    c.health.forget("b")
    yield c
    await c.engine_client().close()
    state.put("replica_infos", None)


def _body() -> bytes:
    return json.dumps({"model": "tiny-qwen2", "prompt": "hello there", "max_tokens": 1}).encode()


async def test_a_body_broken_before_its_first_byte_is_retried_and_opens_the_circuit(
        core, engines):
    engines.broken = {"a"}
    for _ in range(6):
        r = await core.handle(COMPLETIONS_PATH, _body(), 0.0)
        assert r.status_code == 200 and r.headers["x-routed-replica"] == "b"
    # every attempt on "a" counted as a failure (and none as a success): its circuit is open
    assert core.health.is_open("a") and not core.health.is_open("b")
    assert all(v.inflight == 0 for v in (await core.load.loads(["a", "b"])).values())


async def test_two_broken_bodies_get_an_openai_502_not_a_500(core, engines):
    engines.broken = {"a", "b"}
    import time
    r = await core.handle(COMPLETIONS_PATH, _body(), time.perf_counter())
    assert r.status_code == 502
    assert r.headers["server-timing"].startswith("router;dur=")  # as every error answer
    err = json.loads(r.body)["error"]
    assert err["code"] == 502 and "engine replica failed" in err["message"], err
    assert all(v.inflight == 0 for v in (await core.load.loads(["a", "b"])).values())


async def test_a_stream_whose_answer_loses_its_cancellation_still_releases_its_load(
        core, engines, monkeypatch):
    """The client leaves while its streaming request waits; the answer task loses the
    cancellation (as ``asyncio.wait_for`` loses one on Python 3.11, python/cpython#86296)
    and goes on to route, reserve and open the engine call. Nobody sends its response, so
    the ingress closes it: the load returns to 0 (CI once kept such a lease forever)."""
    import asyncio

    admit, entered, calls = core.admission.admit, asyncio.Event(), engines.calls

    async def stubborn_admit(*args, **kwargs):
        entered.set()
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            pass  # lost
        return await admit(*args, **kwargs)

    monkeypatch.setattr(core.admission, "admit", stubborn_admit)
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


async def test_an_answer_that_stalls_past_the_read_timeout_closes_its_connection():
    """An engine that sends its head and then nothing: the read times out and the
    connection is closed at once, so the engine sees the client leave (vLLM then aborts
    the request) instead of generating on for nobody."""
    import asyncio

    from router.serve.engine_client import ENGINE_ERRORS, EngineClient

    left = asyncio.Event()

    async def stall(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await resp.prepare(request)
        for _ in range(200):  # up to 10 s
            if request.transport is None or request.transport.is_closing():
                left.set()
                break
            await asyncio.sleep(0.05)
        return resp

    app = web.Application()
    app.router.add_post(COMPLETIONS_PATH, stall)
    runner, port = await _serve(app)
    client = EngineClient(0.3)
    try:
        resp = await client.open("POST", f"http://127.0.0.1:{port}{COMPLETIONS_PATH}",
                                 _body(), {"content-type": "application/json"})
        assert resp.status == 200
        with pytest.raises(ENGINE_ERRORS):
            async for _ in resp.chunks():
                pass
        await asyncio.wait_for(left.wait(), 5.0)  # the engine saw the disconnect
    finally:
        await client.close()
        await runner.cleanup()


async def test_the_engine_client_relays_a_redirect_and_repeated_headers_as_the_engine_sent():
    """A 3xx is the engine's answer (not followed to its location), a header the engine
    sends twice arrives as one comma-joined value under its lower-case name, and the
    engine is not asked for a compressed body (the client relays it undecoded)."""
    from router.serve.engine_client import EngineClient

    seen: list[dict] = []

    async def redirect(request: web.Request) -> web.Response:
        seen.append(dict(request.headers))
        resp = web.Response(status=307, headers={"Location": "/elsewhere"})
        resp.headers.add("X-Engine-Note", "one")
        resp.headers.add("X-Engine-Note", "two")
        return resp

    async def elsewhere(request: web.Request) -> web.Response:
        seen.append({"followed": "yes"})
        return web.json_response(OK)

    app = web.Application()
    app.router.add_post(COMPLETIONS_PATH, redirect)
    app.router.add_route("*", "/elsewhere", elsewhere)
    runner, port = await _serve(app)
    client = EngineClient(5.0)
    try:
        status, headers, _ = await client.call(
            "POST", f"http://127.0.0.1:{port}{COMPLETIONS_PATH}", _body(),
            {"content-type": "application/json"})
    finally:
        await client.close()
        await runner.cleanup()
    assert status == 307 and headers["location"] == "/elsewhere", (status, headers)
    assert headers["x-engine-note"] == "one, two", headers
    assert len(seen) == 1 and "followed" not in seen[0], seen
    assert "accept-encoding" not in {k.lower() for k in seen[0]}, seen[0]


async def test_server_timing_names_the_parts_of_the_routers_own_time(core, engines):
    """``server-timing`` carries the arrival-to-dispatch time first, then its parts: the
    body's read (as the caller measured it), the render and the decision; the parts are
    disjoint pieces of the whole."""
    t0 = time.perf_counter() - 0.0004  # arrived 0.4 ms ago, the body read since
    r = await core.handle(COMPLETIONS_PATH, _body(), t0, body_s=0.0004)
    assert r.status_code == 200
    header = r.headers["server-timing"]
    timing = parse_server_timing(header)
    assert header.startswith("routing;dur=") and list(timing) == [
        "routing", "body", "prepare", "decide"]
    assert timing["body"] == pytest.approx(0.0004)
    assert all(v >= 0 for v in timing.values())
    assert timing["body"] + timing["prepare"] + timing["decide"] <= timing["routing"] + 3e-6
    assert timing["routing"] <= time.perf_counter() - t0


def test_parse_server_timing_reads_every_metric_and_skips_malformed_ones():
    assert parse_server_timing(None) == {}
    assert parse_server_timing('routing;dur=2.5, db;desc="x";dur="1.25", cache, x;dur=abc') \
        == {"routing": 0.0025, "db": 0.00125}


async def test_another_key_layout_in_the_namespace_routes_by_load_then_the_index_comes_back(
        model_dir, engines):
    """Routers of another key layout present in the namespace (``router.index.layout``):
    requests are answered, routed by load (``fallback``), never failed; once that layout's
    presence has expired, the namespace is cleared and the shared index is used again."""
    import asyncio
    import uuid

    import redis

    from tests.conftest import REDIS_URL, make_text

    ns = f"layout-direct-{uuid.uuid4().hex[:8]}"
    admin = redis.Redis.from_url(REDIS_URL)
    admin.hset(f"{ns}:layouts", "999", int(time.time() * 1000) + 60_000)
    state.put("replica_infos", tuple(
        ReplicaInfo(r, {"engine_url": engines.urls[r]}, {"engine_alive": True})
        for r in ("a", "b")))
    settings = Settings(model=str(model_dir), index_namespace=ns, redis_url=REDIS_URL,
                        redis_timeout_s=1.0)
    core = IngressCore(settings, engine_handle=None)
    guard = state.redis_connections(settings).layout
    body = json.dumps({"model": "tiny-qwen2", "prompt": make_text(300, "layout"),
                       "max_tokens": 1}).encode()
    try:
        r = await core.handle(COMPLETIONS_PATH, body, 0.0)
        assert r.status_code == 200 and r.headers["x-routing-reason"] == "fallback"
        assert guard.others == ["999"]
        # layout 999's routers are gone: its presence expires; the next check (forced
        # here instead of waiting its 5 s) drops it and clears the namespace
        admin.hset(f"{ns}:layouts", "999", int(time.time() * 1000) - 1)
        guard._checks.clear()
        reasons = []
        for _ in range(20):
            r = await core.handle(COMPLETIONS_PATH, body, 0.0)
            assert r.status_code == 200
            reasons.append(r.headers["x-routing-reason"])
            if reasons[-1] != "fallback":
                break
            await asyncio.sleep(0.05)
        assert reasons[-1] in ("cache", "load"), reasons
        assert guard.others == [] and list(admin.hgetall(f"{ns}:layouts")) == [str(LAYOUT_VERSION).encode()]
    finally:
        await core.engine_client().close()
        await state.redis_connections(settings).close()
        state.put("replica_infos", None)
        for key in admin.scan_iter(match=f"{ns}:*"):
            admin.delete(key)
        admin.close()


def _redis_ingress(model_dir, engines, redis_url: str):
    """An ingress of the two engines (round robin) on the Redis at ``redis_url``, in a
    namespace of its own: (the ingress, its namespace, a plain client of that Redis). The
    caller clears ``replica_infos`` from ``state`` when done."""
    import uuid

    import redis as sync_redis

    infos = tuple(ReplicaInfo(r, {"engine_url": engines.urls[r]}, {"engine_alive": True})
                  for r in ("a", "b"))
    state.put("replica_infos", infos)
    ns = f"t-{uuid.uuid4().hex[:8]}"
    c = IngressCore(Settings(model=str(model_dir), index_namespace=ns, policy="round_robin",
                             redis_url=redis_url), engine_handle=None)
    return c, ns, sync_redis.Redis.from_url(redis_url)


async def test_an_answer_does_not_wait_for_a_release_that_a_hanging_redis_holds(
        model_dir, engines, own_redis):
    """An operator's review: with Redis paused, every answer that is not streamed came
    2 s late, the release's maintenance timeout (the body is sent after the attempt
    closes). The answer now waits for the release at most the routing deadline; the
    release is taken in the background once Redis answers."""
    import asyncio

    from router.index.redis import RedisConnections

    c, ns, admin = _redis_ingress(model_dir, engines, own_redis.url)
    try:
        assert (await c.handle(COMPLETIONS_PATH, _body(), time.perf_counter())
                ).status_code == 200
        admin.execute_command("CLIENT", "PAUSE", 3000, "WRITE")
        t0 = time.perf_counter()
        r = await c.handle(COMPLETIONS_PATH, _body(), time.perf_counter())
        waited = time.perf_counter() - t0
        assert r.status_code == 200
        assert waited < RedisConnections.MAINTENANCE_TIMEOUT_S, waited
        assert c.load.pending_releases  # the release waits for the pause, in the background
        await asyncio.sleep(3.2 - (time.perf_counter() - t0))  # the pause is over
        # taken by then, or (past its 2 s maintenance bound) kept for the heartbeat's retry,
        # which tests/test_route_lua.py covers: retried here at once
        assert await c.load.retry_releases() == 0 and not c.load.pending_releases
        assert admin.hlen(f"{ns}:leases") == 0, admin.hgetall(f"{ns}:leases")
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        await c.engine_client().close()
        await c.load.close()
        state.put("replica_infos", None)


async def test_the_ingress_stop_waits_for_the_releases_still_running(model_dir, engines,
                                                                     own_redis):
    """A release that a slow Redis holds when the ingress stops is waited for (up to the
    maintenance bound): it is taken when ``close`` returns, not left for the other
    routers' sweep after this router's heartbeat expires."""
    c, ns, admin = _redis_ingress(model_dir, engines, own_redis.url)
    try:
        assert (await c.handle(COMPLETIONS_PATH, _body(), time.perf_counter())
                ).status_code == 200
        admin.execute_command("CLIENT", "PAUSE", 800, "WRITE")
        r = await c.handle(COMPLETIONS_PATH, _body(), time.perf_counter())
        assert r.status_code == 200
        assert c.load.pending_releases  # its release waits for the pause's end
        await c.close()
        assert admin.hlen(f"{ns}:leases") == 0, admin.hgetall(f"{ns}:leases")
        assert not c.load.pending_releases
    finally:
        admin.execute_command("CLIENT", "UNPAUSE")
        await c.load.close()
        state.put("replica_infos", None)
