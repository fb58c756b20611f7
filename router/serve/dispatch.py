"""One attempt of one request on one replica, on either data path, and the streaming
response that relays it.

``DirectAttempt`` (the default data path) decides in the ingress and streams from the
chosen engine's HTTP server over pooled connections; ``ServeAttempt`` calls the engine
deployment through its handle and lets the Ray ``RequestRouter`` decide
(docs/architecture.md "The data path"). Both read usage from the body as it passes
(``UsageScanner``) and release the load reservation in ``close``, on every path.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, AsyncIterator

from fastapi.responses import Response, StreamingResponse
from ray.exceptions import TaskCancelledError
from starlette.requests import ClientDisconnect

from router import metrics, tracing
from router.logs import get_logger
from router.routing.core import release_soon, route_request
from router.serve.engine_client import ENGINE_ERRORS
from router.serve.errors import OpenAIError, no_replicas
from router.serve.protocol import ReplicaHead, RoutedRequest

if TYPE_CHECKING:
    from router.serve.ingress import IngressCore

logger = get_logger(__name__)


class UsageScanner:
    """Finds ``usage`` in a response body (JSON, or the SSE events of a stream).

    Fed raw chunks in order; keeps only the unfinished tail of the current SSE event.
    """

    def __init__(self, stream: bool):
        self.stream = stream
        self._buf = b""
        self.usage: dict | None = None
        self.error_event = False

    def feed(self, chunk: bytes) -> None:
        if not self.stream:
            self._buf += chunk
            return
        self._buf += chunk
        *events, self._buf = self._buf.split(b"\n\n")
        for ev in events:
            if b'"usage"' in ev or b'"error"' in ev:
                self._parse_event(ev)

    def _parse_event(self, ev: bytes) -> None:
        for line in ev.split(b"\n"):
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                continue
            try:
                obj = json.loads(data)
            except ValueError:
                continue
            if isinstance(obj, dict):
                if obj.get("usage"):
                    self.usage = obj["usage"]
                if "error" in obj:
                    self.error_event = True

    def finish(self) -> dict | None:
        if not self.stream and self._buf:
            try:
                obj = json.loads(self._buf)
                if isinstance(obj, dict) and isinstance(obj.get("usage"), dict):
                    self.usage = obj["usage"]
            except ValueError:
                pass
        return self.usage


def sse_error(message: str) -> bytes:
    """An SSE error event (OpenAI's shape, code 502) and ``[DONE]``: how a stream that broke
    after its first byte ends."""
    return sse_error_event({"error": {"message": message, "type": "InternalServerError",
                                      "param": None, "code": 502}})


class Attempt:
    """One attempt of one request on one replica. ``close`` is idempotent and is called on
    every path: it ends the engine call if unfinished and releases the reservation.

    Subclasses are the two data paths: ``_open`` routes and sends the request, returning
    the engine's status and headers before any body byte; ``_chunks`` yields the body;
    ``_abort`` ends an unfinished call (the engine then aborts the request).

    While tracing is on (``router.tracing``), ``parent`` is the request's span and ``span``
    this attempt's ``dispatch`` span, from the moment the request leaves for its engine
    (``_trace_dispatch``) to ``close``; both are None otherwise.

    Args:
        attempt: 1 for the first attempt, 2 for the retry.
    """

    def __init__(self, core: IngressCore, req: RoutedRequest, route: str, attempt: int = 1):
        self.core = core
        self.req = req
        self.route = route
        self.attempt = attempt
        self.span = None
        self.parent = tracing.current_span()
        self._last_byte_ns: int | None = None
        self.head: ReplicaHead | None = None
        self.replica = ""
        self.started_body = False
        self.exhausted = False
        self.closed = False
        self.release_task: asyncio.Task | None = None  # the lease's release, from close
        self.failed = False  # the engine's answer broke before its end
        self.scanner = UsageScanner(req.stream)

    async def _open(self) -> ReplicaHead:
        raise NotImplementedError

    def _chunks(self) -> AsyncIterator[bytes]:
        raise NotImplementedError

    async def _abort(self) -> None:
        raise NotImplementedError

    async def start(self) -> ReplicaHead:
        # A new attempt is open: the router keeps its reservation (the previous attempt's
        # close, awaited before this one starts, set the flag and released its own).
        self.req.closed = False
        self.req.routed_replica = None  # set again by this attempt's decision
        try:
            self.head = await self._open()
        except BaseException as exc:
            if self.span is not None:
                tracing.fail(self.span, exc)
            raise
        finally:
            self.replica = (self.head.replica_id if self.head else None) \
                or self.req.routed_replica or ""
            if self.replica:
                metrics.inc("dispatched", tags={"replica": self.replica})
                self.core._count_inflight(self.replica, +1)
            if self.span is not None:
                self._trace_head()
        return self.head

    def _trace_dispatch(self, attributes: dict) -> dict[str, str]:
        """Start this attempt's ``dispatch`` span (tracing on), a child of the request's;
        returns the headers that carry its context to the engine (``traceparent``)."""
        self.span = tracing.start_span("dispatch", {
            tracing.ATTR_ATTEMPT: self.attempt, "http.request.method": "POST",
            **attributes}, kind=tracing.SpanKind.CLIENT)
        return {} if self.span is None else tracing.inject(self.span)

    def _trace_head(self) -> None:
        """The engine's head on the dispatch span: its replica, status, and an error."""
        span, head = self.span, self.head
        if self.replica:
            span.set_attribute(tracing.ATTR_REPLICA, self.replica)
        if head is None:
            return
        span.set_attributes({"http.response.status_code": head.status,
                             tracing.ATTR_PREDICTED: head.predicted_cached_tokens})
        if self.req.routing_reason:
            span.set_attribute(tracing.ATTR_REASON, self.req.routing_reason)
        if head.error or head.status >= 500:
            span.set_attribute("error.type", str(head.status))
            tracing.fail(span, head.error or f"HTTP {head.status}")

    @property
    def streaming(self) -> bool:
        """Whether the answer goes to the client as it comes (an SSE stream of a 200)."""
        return self.req.stream and self.head is not None and self.head.status == 200

    async def whole_body(self) -> bytes:
        """The engine's whole body (answers that are not streamed), then closes the attempt.

        Raises:
            Exception: the body broke (``started_body`` tells whether before its first
                byte; the client has received nothing either way).
        """
        try:
            return b"".join([c async for c in self.body()])
        finally:
            await self.close()

    async def body(self) -> AsyncIterator[bytes]:
        """The engine's body bytes. A failure after the first byte is never retried: a
        stream ends with an SSE error event (docs/architecture.md, "Failures"), a whole body
        raises."""
        try:
            async for chunk in self._chunks():
                if not self.started_body:
                    self.started_body = True
                    self.core.load.prefill_done_soon(self.req.request_id)
                    ttft = time.perf_counter() - self.req.t_arrival
                    metrics.get("ttft").observe(ttft, tags={"route": self.route})
                    if self.span is not None:
                        self.span.add_event("first_byte")
                        self.parent.set_attribute("gen_ai.response.time_to_first_chunk",
                                                  ttft)
                self.scanner.feed(chunk)
                yield chunk
            self.exhausted = True
            if self.span is not None:  # the dispatch ends with its last byte relayed
                self._last_byte_ns = time.time_ns()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.error("answer from replica %s broke %s the first byte: %s", self.replica,
                         "after" if self.started_body else "before", exc)
            self.exhausted = True
            self.failed = True
            if self.span is not None:
                tracing.fail(self.span, exc)
                if self.started_body:  # the client's answer broke: the request failed
                    tracing.fail(self.parent, exc)
            if not self.streaming:
                raise
            yield sse_error(f"engine stream interrupted: {type(exc).__name__}")

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.req.closed = True  # before the release: see RoutedRequest.closed
        # Shielded: a second cancellation of a request that is already going away must not
        # stop the release half-way (the reservation would outlive the request).
        try:
            await asyncio.shield(asyncio.ensure_future(self._close()))
        finally:
            if self.span is not None:
                self._trace_end()

    def _released(self, task: asyncio.Task) -> None:
        """The release task ended: when Redis took it (late), the admission queue looks
        again (the shared count fell only then); an unexpected error is logged (a Redis
        failure is not one: the release is kept and retried)."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            logger.error("release of request %s failed: %r", self.req.request_id, exc)
            return
        self.core.admission.released(self.req.request_id)

    def _trace_end(self) -> None:
        """End the dispatch span: the engine's usage, and whether the answer was abandoned
        before its end (the client left, or the attempt was given up)."""
        span = self.span
        ok = self.head is not None and self.head.status == 200
        if ok and not self.exhausted:
            span.set_attribute(tracing.ATTR_ABORTED, True)
        if ok:
            tracing.usage_attributes((span, self.parent), self.scanner.usage)
        span.end(end_time=self._last_byte_ns)

    async def _close(self) -> None:
        try:
            if not self.exhausted:
                await self._abort()
        finally:
            # the answer (a whole body is sent after this) waits for the release at most
            # the routing deadline: a Redis that hangs takes it in the background, where it
            # is kept and retried until taken (LoadTracker.release), instead of holding every
            # answer for the maintenance timeout (2 s: an operator's review, CLIENT PAUSE)
            rid = self.req.request_id
            release = self.release_task = release_soon(self.core.load, rid)
            release.add_done_callback(self._released)
            await asyncio.wait((release,), timeout=self.core.settings.redis_timeout_s)
            self.core.admission.released(rid)  # a waiting request may take it
        refused = self.head is None or self.head.status >= 400
        if (refused or self.failed) and self.replica:  # the engine may not hold the prefix
            await self.core.forget_predictions(self.req, self.replica)
        if self.replica:
            metrics.inc("completed", tags={"replica": self.replica})
            self.core._count_inflight(self.replica, -1)
        usage = self.scanner.finish() if self.head and self.head.status == 200 else None
        if usage:
            details = usage.get("prompt_tokens_details") or {}
            tags = {"replica": self.replica}
            metrics.inc("prompt_tokens", int(usage.get("prompt_tokens") or 0), tags=tags)
            metrics.inc("engine_cached_tokens", int(details.get("cached_tokens") or 0),
                        tags=tags)
            metrics.inc("predicted_cached_tokens", self.head.predicted_cached_tokens,
                        tags=tags)
            error = self.head.predicted_cached_tokens - int(details.get("cached_tokens") or 0)
            metrics.get("prediction_error").observe(
                abs(error), tags={"direction": "exact" if error == 0 else
                                  "over" if error > 0 else "under"})


class ServeAttempt(Attempt):
    """Through Serve: a streaming handle call to the engine deployment, whose Ray
    ``RequestRouter`` (``router.serve.request_router``) decides; the replica actor proxies to its
    engine and yields a ``ReplicaHead`` and then the body's bytes."""

    gen = None

    async def _open(self) -> ReplicaHead:
        if self.parent is not None:  # the replica passes them on to its engine
            self.req.trace_headers = self._trace_dispatch({tracing.ATTR_DATA_PATH: "serve"})
        self.gen = self.core.engine.options(stream=True).generate.remote(self.req)
        return await self._first_item()

    async def _first_item(self) -> ReplicaHead:
        """The replica's head, or 503 when no replica exists (a Serve handle would wait
        forever with zero replicas: Serve's router waits for a replica set)."""
        gen = self.gen
        task = asyncio.ensure_future(gen.__anext__())
        # a cancelled request's pending head ends in an exception nobody awaits: take it
        # here, or asyncio logs "Task exception was never retrieved" for every disconnect
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if self.core._replica_count() == 0:
                    task.cancel()
                    gen.cancel()
                    raise no_replicas()
        except asyncio.CancelledError:
            task.cancel()
            gen.cancel()
            raise

    def _chunks(self) -> AsyncIterator[bytes]:
        return self.gen

    async def _abort(self) -> None:
        if self.gen is not None:
            self.gen.cancel()


class DirectAttempt(Attempt):
    """Direct: the ingress decides (``router.routing.core.route_request``, the same step the Ray
    router runs) and sends the client's body to the chosen engine's own HTTP server over
    the ingress's pooled connections; the engine's bytes stream straight back. Closing an
    unfinished response closes its connection, which makes vLLM abort the request."""

    resp = None

    async def _open(self) -> ReplicaHead:
        core, req = self.core, self.req
        infos = await core.replica_set()
        policy = core.policies.get(req.policy)
        route_span = tracing.start_span("route", {
            tracing.ATTR_ATTEMPT: self.attempt, tracing.ATTR_POLICY: policy.name,
            tracing.ATTR_CANDIDATES: len(infos)}) if self.parent is not None else None
        try:
            await route_request(core.routing_core(), req, infos, policy)
        except asyncio.CancelledError as exc:
            if route_span is not None:
                tracing.fail(route_span, exc)
                route_span.end()
            raise
        except Exception as exc:  # a bug: route by this process's own counts, never fail
            if route_span is not None:
                tracing.fail(route_span, exc)
            logger.exception("routing decision failed for request %s; routing by load",
                             req.request_id)
            metrics.inc("decisions", tags={"reason": "fallback", "policy": policy.name})
            pool = [i for i in infos if i.replica_id not in req.excluded_replicas] or infos
            req.routed_replica = min(pool, key=lambda i: core.inflight.get(i.replica_id, 0)
                                     ).replica_id
            req.routing_reason = "fallback"
            req.predicted_cached_tokens = {}
        replica = req.routed_replica
        predicted = req.predicted_cached_tokens.get(replica, 0)
        if route_span is not None:
            route_span.set_attributes({tracing.ATTR_REPLICA: replica,
                                       tracing.ATTR_REASON: req.routing_reason,
                                       tracing.ATTR_PREDICTED: predicted})
            route_span.end()
        info = next(i for i in infos if i.replica_id == replica)
        url = info.metadata.engine_url
        if not url:
            return ReplicaHead(replica, 503, {}, retryable=True, error="replica advertises "
                               "no engine endpoint yet", predicted_cached_tokens=predicted)
        client = core.engine_client()
        headers = {"content-type": "application/json"}
        if self.parent is not None:
            headers.update(self._trace_dispatch(_http_client_attributes(url + req.path)))
        try:
            self.resp = await client.open("POST", url + req.path, req.body, headers)
        except ENGINE_ERRORS as exc:
            return ReplicaHead(replica, 503, {}, retryable=True,
                               error=f"engine unreachable: {type(exc).__name__}",
                               predicted_cached_tokens=predicted)
        return ReplicaHead(replica, self.resp.status, self.resp.headers,
                           retryable=self.resp.status >= 500,
                           predicted_cached_tokens=predicted)

    def _chunks(self) -> AsyncIterator[bytes]:
        return self.resp.chunks()

    async def _abort(self) -> None:
        if self.resp is not None:
            await self.resp.close()


def _http_client_attributes(url: str) -> dict:
    """The HTTP client attributes of a dispatch to ``url`` (an engine's endpoint)."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    out = {"url.full": url, tracing.ATTR_DATA_PATH: "direct",
           "server.address": parts.hostname or ""}
    if parts.port:
        out["server.port"] = parts.port
    return out


class RelayResponse(StreamingResponse):
    """Starlette's ``StreamingResponse``, relayed in the calling task while one watcher task
    waits for the client's ``http.disconnect``; a disconnect cancels the relay, and the
    response then ends normally (the body generator's ``finally`` and the subclasses'
    ``close`` run as with Starlette's).

    Why not Starlette's own: under ASGI spec 2.3 (what uvicorn and Ray Serve report) it
    runs the relay and the watcher in an anyio task group, several times the CPU of this
    one per response (``loadtest.relay_bench``; docs/benchmarks.md, "The streamed answer"),
    a few percent of the ingress's CPU per request. Behaviour kept: the same messages are
    sent; a client that leaves stops the relay at once (the engine call is then closed, and
    vLLM aborts the request), whether or not a chunk is due; a failing ``receive`` stops it
    and raises; an ``OSError`` becomes ``ClientDisconnect`` under spec 2.4 only.
    """

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await super().__call__(scope, receive, send)
            return
        try:
            await relay_until_disconnect(lambda: self.stream_response(send), receive)
        except OSError as exc:  # a server of spec 2.4 raises on a send after a disconnect
            spec = scope.get("asgi", {}).get("spec_version", "2.0")
            if tuple(map(int, spec.split("."))) < (2, 4):
                raise
            raise ClientDisconnect() from exc
        if self.background is not None:
            await self.background()


RECUT_S = 0.01  # how often a disconnect cancels a relay again while it still runs (s)


async def relay_until_disconnect(relay, receive) -> None:
    """Await ``relay()`` in this task while a watcher awaits ``receive()`` (ASGI) until
    ``http.disconnect``; a disconnect during the relay cancels it (again every
    ``RECUT_S`` while it runs on, as anyio's cancel scopes do), and this returns normally.
    Cancellations from elsewhere propagate (``Task.uncancel``'s count).

    Serve's ``receive`` raises ``ray.exceptions.TaskCancelledError`` when Serve cancelled
    the request because its client left (the proxy cancels the replica's call): that is a
    disconnect too (raised, it ended as an exception that nobody retrieves, logged by
    asyncio as "Future exception was never retrieved" for each client that left).

    Raises:
        Exception: what ``receive()`` raised otherwise (the relay is cut first), as
            Starlette's task group raises it; and what ``relay()`` raises.
    """
    task = asyncio.current_task()
    state = {"relaying": True, "cuts": 0, "error": None}

    async def watch() -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except TaskCancelledError:  # Serve cancelled the request: its client left
            pass
        except Exception as exc:  # the server's receive failed: stop relaying, raise it
            state["error"] = exc
        while state["relaying"]:  # never after the relay ended: no stray cancellation
            state["cuts"] += 1
            task.cancel()
            await asyncio.sleep(RECUT_S)

    def drop_cuts() -> int:
        """Take back this watcher's cancellations; returns the others' still pending."""
        left = task.cancelling()
        for _ in range(state["cuts"]):
            left = task.uncancel()
        return left

    watcher = asyncio.get_running_loop().create_task(watch())
    try:
        await relay()
    except asyncio.CancelledError:
        if state["cuts"] and drop_cuts() == 0:
            if state["error"] is not None:
                raise state["error"]
            return  # the client left: the relay was cut on purpose
        raise
    except BaseException:
        if state["cuts"]:  # the relay turned the cut into another error
            drop_cuts()
        raise
    else:
        if state["cuts"]:  # the relay swallowed the cancellations; they are ours
            drop_cuts()
    finally:
        state["relaying"] = False
        watcher.cancel()


class GuardedStreamingResponse(RelayResponse):
    """A streaming response that closes its dispatch however the response ends, even when
    the client leaves before the first chunk (the body generator would then never start
    and its ``finally`` never run)."""

    def __init__(self, dispatch: Attempt, **kwargs):
        super().__init__(dispatch.body(), **kwargs)
        self.dispatch = dispatch

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.dispatch.close()


KEEPALIVE = b": keep-alive\n\n"  # an SSE comment: clients ignore it (WHATWG HTML 9.2.6)


def sse_error_event(body: bytes | dict) -> bytes:
    """An OpenAI-style error body (JSON bytes or dict) as an SSE event, then ``[DONE]``:
    how a refusal or an error reaches a client whose stream has started already."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return b"data: " + data.strip() + b"\n\ndata: [DONE]\n\n"


_ABANDONED: set[asyncio.Task] = set()  # reapers still running (the loop keeps weak refs)


async def end_answer(answer: asyncio.Future) -> Response | None:
    """Cancel ``answer`` (a task that admits, routes and dispatches a request and returns the
    response to send) if it is still running, wait for it to end, and close the dispatch
    of a streaming response it returned; returns that response, or None when it ended
    in an exception or cancelled.

    A cancelled answer can still return its response: a cancellation that arrives as an
    inner future completes is lost on Python 3.11 (``asyncio.wait_for``,
    python/cpython#86296), and the answer goes on to reserve a replica and open an engine
    call. Nobody sends that response, so its dispatch is closed here: the reservation is
    released and the engine aborts the request.
    """
    if not answer.done():
        answer.cancel()
        await asyncio.wait({answer})  # never cancels it further; our own cancel propagates
    if answer.cancelled() or answer.exception() is not None:
        return None
    resp = answer.result()
    dispatch = getattr(resp, "dispatch", None)
    if dispatch is not None:
        await dispatch.close()
    return resp


def abandon(answer: asyncio.Future) -> asyncio.Task:
    """The client left while ``answer`` ran (see ``end_answer``): cancel it and, in a task
    of its own that no cancellation of the caller stops, close whatever it still returns;
    returns that task."""
    reaper = asyncio.ensure_future(end_answer(answer))
    _ABANDONED.add(reaper)
    reaper.add_done_callback(_ABANDONED.discard)
    return reaper


class KeepAliveStreamingResponse(RelayResponse):
    """A streaming request's 200 sent before its answer exists, to keep idle proxies from
    cutting the connection while the request waits (``Settings.sse_keepalive_s``).

    ``answer`` is the task that admits, routes and dispatches the request and returns the
    response it would have sent. Until it is done, an SSE comment (``KEEPALIVE``) goes out
    every ``interval_s``; then the answer's stream follows (its headers, sent already, are
    lost: the router's ``x-routed-replica`` and its kind are absent from such a response;
    it carries ``x-data-path``).
    An answer that is an error (an ``OpenAIError``, such as the admission's 429, or an
    engine's non-200 body) becomes one SSE error event and ``[DONE]``. The comments are not
    the engine's bytes: the retry of a failed first attempt is still allowed after them.
    A client that leaves cancels the answer (its admission wait and reservation end) and
    closes its dispatch.
    """

    def __init__(self, answer: asyncio.Task, interval_s: float, **kwargs):
        self.answer = answer
        self.interval_s = interval_s
        super().__init__(self._body(), media_type="text/event-stream", **kwargs)

    async def _body(self) -> AsyncIterator[bytes]:
        while not self.answer.done():
            done, _ = await asyncio.wait({self.answer}, timeout=self.interval_s)
            if not done:
                yield KEEPALIVE
        try:
            inner = self.answer.result()
        except OpenAIError as exc:
            yield sse_error_event(exc.body())
            return
        except Exception as exc:  # a bug: the same error body as the ingress's 500
            logger.exception("streaming request failed after its keep-alives")
            yield sse_error_event(OpenAIError(500, f"internal router error: "
                                                   f"{type(exc).__name__}",
                                              "InternalServerError").body())
            return
        stream = inner if isinstance(inner, StreamingResponse) else None
        if inner.status_code == 200 and stream is not None:
            async for chunk in stream.body_iterator:
                yield chunk
            return
        if stream is not None:
            body = b"".join([c if isinstance(c, bytes) else c.encode()
                             async for c in stream.body_iterator])
        else:
            body = bytes(inner.body)
        yield sse_error_event(body)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:  # shielded: a second cancellation must not leave a late response open
            await asyncio.shield(abandon(self.answer))
