"""The OpenAI-compatible HTTP front door, deployed with Ray Serve.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming SSE or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Per request the ingress reads what routing needs through pydantic models that mirror the
OpenAI schema (malformed JSON or wrong types → OpenAI-style 400), renders and tokenizes the
prompt with the served model's tokenizer, computes the block hashes, and calls the engine
deployment through its handle; the Ray ``RequestRouter`` picks the replica. The client's
body is forwarded byte for byte. A failure before the first byte (engine down, 5xx, replica
actor died) is retried once on another replica; after the first byte never (FAULTS.md 6.3).
The load reservation is released in a ``finally`` on every path: success, error, retry,
client disconnect (FAULTS.md 1.2, 5.1).

Response headers: ``x-routed-replica`` (the replica that served), ``x-predicted-cached-tokens``
(the index's prediction for it), ``x-routing-reason`` (cache, load or fallback) and
``server-timing: routing;dur=<ms>`` (W3C Server Timing: arrival at the ingress to dispatch).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from pydantic import BaseModel, ConfigDict, ValidationError

from router import metrics, state
from router.config import Settings
from router.errors import OpenAIError, bad_request, no_replicas
from router.hashing import BlockHasher
from router.index.base import IndexUnavailable
from router.policies import LIVE_POLICIES
from router.prompts import CHAT_PATH, COMPLETIONS_PATH, PromptInfo, PromptRenderer
from router.protocol import ReplicaHead, RoutedRequest, route_label

logger = logging.getLogger("ray.serve")

# Larger bodies are rendered off the event loop. When a long prompt's tokenization stops at
# its head (``Settings.route_head_chars``), rendering a body of up to 1 MiB costs about 2 ms
# (parsing is linear and fast) and threads would cost more in GIL hand-overs under load.
_RENDER_INLINE_MAX_BYTES = 16 * 1024
_RENDER_HEAD_INLINE_MAX_BYTES = 1024 * 1024


class _ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: Union[str, list, None] = None


class _StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: Optional[bool] = None


class _ChatRequest(BaseModel):
    """The fields of a chat request the router reads; every other field passes through."""

    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    messages: list[_ChatMessage]
    stream: Optional[bool] = False
    stream_options: Optional[_StreamOptions] = None
    tools: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    cache_salt: Optional[str] = None


class _CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: Optional[str] = None
    prompt: Union[str, list[str], list[int], list[list[int]], None] = None
    stream: Optional[bool] = False
    stream_options: Optional[_StreamOptions] = None
    cache_salt: Optional[str] = None


_SCHEMAS = {CHAT_PATH: _ChatRequest, COMPLETIONS_PATH: _CompletionRequest}


def _validation_message(exc: ValidationError) -> tuple[str, str | None]:
    err = exc.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    return f"invalid request: {loc}: {err.get('msg')}", loc or None


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


def _sse_error(message: str) -> bytes:
    body = {"error": {"message": message, "type": "InternalServerError", "param": None,
                      "code": 502}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"


class IngressCore:
    """The request path of the ingress, independent of FastAPI wiring (tested directly).

    Args:
        settings: the deployment's settings.
        engine_handle: ``DeploymentHandle`` of the engine deployment.
    """

    def __init__(self, settings: Settings, engine_handle):
        self.settings = settings
        self.engine = engine_handle
        self.renderer = PromptRenderer(settings.tokenizer or settings.model)
        self.hasher = BlockHasher(settings.hash_settings)
        self.load = state.make_load_tracker(settings)
        self.health = state.replica_health()
        self.inflight: dict[str, int] = {}  # this process's own dispatches, per replica
        self._index = None  # made on first use, on the ingress's loop (a Redis client's own)
        self._turn: asyncio.Lock | None = None  # see _cpu_turn

    async def forget_predictions(self, req: RoutedRequest, replica: str) -> None:
        """The engine refused ``req`` (an error status): drop the predicted entries that its
        routing wrote on ``replica``, the blocks past the prefix the index already matched
        there, or they would draw the prefix to an engine that never computed it (for
        ``predicted_ttl_s`` when the engine publishes no KV events). Index errors are
        counted, never raised."""
        start = req.predicted_cached_tokens.get(replica, 0) // self.settings.block_size
        if start >= len(req.block_hashes):
            return
        try:
            await self._prefix_index().forget_predicted(replica, req.block_hashes[start:])
        except IndexUnavailable:
            metrics.inc("index_errors", tags={"op": "forget_predicted"})

    def _prefix_index(self):
        """The index, made on first use: on the ingress's own loop (a Redis client belongs
        to the loop that made it)."""
        if self._index is None:
            self._index = state.make_index(self.settings)
        return self._index

    def _count_inflight(self, replica: str, delta: int) -> None:
        n = self.inflight.get(replica, 0) + delta
        self.inflight[replica] = n
        metrics.get("inflight").set(n, tags={"replica": replica})

    # --- helpers -----------------------------------------------------------------------
    def _replica_count(self) -> int | None:
        return state.replica_count()

    def _prepare(self, path: str, raw: bytes,
                 head_chars: int = 0) -> tuple[RoutedRequest, PromptInfo]:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise bad_request(f"request body is not valid JSON: {exc}") from None
        except RecursionError:
            raise bad_request("request body is nested too deeply") from None
        if not isinstance(body, dict):
            raise bad_request("request body must be a JSON object")
        try:
            parsed = _SCHEMAS[path].model_validate(body)
        except RecursionError:
            raise bad_request("request body is nested too deeply") from None
        except ValidationError as exc:
            msg, param = _validation_message(exc)
            raise bad_request(msg, param) from None
        if len(raw) > self.settings.route_tokenize_max_bytes:
            info = PromptInfo(cacheable=False, reason="too long to tokenize for routing")
        else:
            info = self.renderer.render(path, body, head_chars)
        req = RoutedRequest(request_id=uuid.uuid4().hex, path=path, body=raw,
                            stream=bool(parsed.stream))
        self._hash(req, info)
        return req, info

    def _hash(self, req: RoutedRequest, info: PromptInfo) -> None:
        req.prompt_tokens = info.num_tokens
        req.block_hashes = self.hasher.block_hashes(
            info.token_ids, cache_salt=info.cache_salt,
            lora_name=info.lora_name) if info.cacheable else []

    def _finish(self, req: RoutedRequest, info: PromptInfo) -> None:
        """Encode the rest of a prompt whose head a replica holds, and hash it all. Text the
        tokenizer refuses (a lone surrogate...) leaves the request routed by load, as
        ``PromptRenderer.render`` does: the engine gives the authoritative 400."""
        try:
            info.finish()
        except Exception as exc:
            logger.debug("prompt rest not encoded (%s): routing by load", exc)
            req.block_hashes = []
            return
        self._hash(req, info)

    async def prepare(self, path: str, raw: bytes, policy: str | None = None) -> RoutedRequest:
        """Validate, render, tokenize and hash; long prompts off the event loop.

        Under ``prefix_aware``, a prompt longer than ``Settings.route_head_chars`` is first
        encoded up to about that many characters. Its blocks past the head can match a
        replica only if that replica holds every block of the head (a match is a prefix), so
        the rest is encoded only then: one index lookup of the head decides. Otherwise the
        request is routed on the head's hashes (the same decision) with the prompt's length
        estimated from the head's tokens per UTF-8 byte, and predicted entries are written
        for the head only (a burst sharing the new prefix still finds them and lands
        together; the engine's events then bring every block).

        Args:
            policy: the request's own policy (``x-routing-policy``), or None.
        Raises:
            OpenAIError: 400 for malformed bodies.
        """
        prefix_aware = self.settings.policy_for(policy) == "prefix_aware"
        head = self.settings.route_head_chars if prefix_aware else 0
        inline = _RENDER_HEAD_INLINE_MAX_BYTES if head and self.renderer.segments.chunked \
            else _RENDER_INLINE_MAX_BYTES
        if len(raw) > inline:
            req, info = await asyncio.to_thread(self._prepare, path, raw, head)
        else:
            async with self._cpu_turn():
                req, info = self._prepare(path, raw, head)
        if info.rest is not None:
            held = await self._head_held(req.block_hashes)
            if held:
                await asyncio.to_thread(self._finish, req, info)
            metrics.inc("long_prompts", tags={"tokenized": "whole" if held else "head"})
        return req

    @contextlib.asynccontextmanager
    async def _cpu_turn(self):
        """One request's render on the event loop at a time, in arrival order, with the
        loop's I/O between two of them: the lock is handed on at the loop's next iteration,
        not at once. Without it, a burst of N requests runs all N renders before any of them
        gets its index lookup's answer, so the first is dispatched after the whole burst's
        work; with it, the k-th is dispatched after about k renders (FIFO, not processor
        sharing). Free when there is no burst: an uncontended lock is taken at once."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        await self._turn.acquire()
        try:
            yield
        finally:
            asyncio.get_running_loop().call_soon(self._turn.release)

    async def _head_held(self, head_hashes: list[int]) -> bool:
        """Whether some replica holds every block of a prompt's head (exact or predicted
        entries), so that its match may go on past the head. True when the replicas are not
        known yet; False when the index fails (routing then falls back to load anyway)."""
        replicas = state.peek("replica_ids")
        if not replicas or not head_hashes:
            return True
        try:
            matched = await self._prefix_index().lookup(head_hashes, sorted(replicas))
        except IndexUnavailable:
            return False
        return max(matched.values(), default=0) >= len(head_hashes)

    async def _first_item(self, gen) -> Any:
        """The replica's head, or 503 when no replica exists (a Serve handle would wait
        forever with zero replicas, DESIGN.md decision 6)."""
        task = asyncio.ensure_future(gen.__anext__())
        # a cancelled request's pending head ends in an exception nobody awaits: take it
        # here, or asyncio logs "Task exception was never retrieved" for every disconnect
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    return task.result()
                if self._replica_count() == 0:
                    task.cancel()
                    gen.cancel()
                    raise no_replicas()
        except asyncio.CancelledError:
            task.cancel()
            gen.cancel()
            raise

    # --- the request path --------------------------------------------------------------
    async def handle(self, path: str, raw: bytes, t_arrival: float,
                     policy: str | None = None) -> Response:
        """Serve one inference request; returns the response to send.

        Raises:
            OpenAIError: 400 (malformed body), 503 (no replica), 502 (two replicas failed).
        """
        if self._replica_count() == 0:
            raise no_replicas()
        if policy and policy not in LIVE_POLICIES:
            raise bad_request(f"unknown routing policy {policy!r}; choose from "
                              f"{sorted(LIVE_POLICIES)}", "x-routing-policy")
        req = await self.prepare(path, raw, policy)
        req.policy = policy or None
        route = route_label(path)
        req.t_arrival = t_arrival
        for attempt in (1, 2):
            dispatch = _Dispatch(self, req, route)
            try:
                head = await dispatch.start()
                self.health.record(dispatch.replica, not head.retryable)
                if head.retryable and attempt == 1:
                    logger.warning("replica %s failed before the first byte (%s %s); retrying "
                                   "on another replica", dispatch.replica, head.status,
                                   head.error)
                    metrics.inc("retries", tags={"reason": f"status_{head.status}"})
                    req.excluded_replicas.append(dispatch.replica)
                    await dispatch.close()
                    continue
                if head.error:  # no engine answer to pass on (second failure)
                    await dispatch.close()
                    err = OpenAIError(head.status, head.error, "ServiceUnavailableError")
                    return JSONResponse(err.body(), status_code=head.status)
                headers = dict(head.headers)
                headers.update({"x-routed-replica": dispatch.replica,
                                "x-predicted-cached-tokens": str(head.predicted_cached_tokens),
                                "x-routing-reason": req.routing_reason or "load"})
                if req.routing_s is not None:  # W3C Server-Timing: the router's own time
                    headers["server-timing"] = f"routing;dur={req.routing_s * 1e3:.3f}"
                if req.stream and head.status == 200:
                    headers.pop("content-type", None)
                    return _GuardedStreamingResponse(dispatch, status_code=head.status,
                                                     headers=headers,
                                                     media_type="text/event-stream")
                try:
                    content = b"".join([c async for c in dispatch.body()])
                finally:
                    await dispatch.close()
                return Response(content, status_code=head.status, headers=headers)
            except (OpenAIError, asyncio.CancelledError):
                await dispatch.close()
                raise
            except Exception as exc:  # replica actor died or the call failed before any byte
                await dispatch.close()
                if dispatch.started_body:
                    raise
                replica = dispatch.replica
                if replica:
                    self.health.record(replica, False)
                if attempt == 1:
                    logger.warning("dispatch to replica %s failed before the first byte (%s); "
                                   "retrying on another replica", replica, exc)
                    metrics.inc("retries", tags={"reason": type(exc).__name__})
                    if replica:
                        req.excluded_replicas.append(replica)
                    continue
                logger.error("request %s failed on two replicas: %s", req.request_id, exc)
                raise OpenAIError(502, f"engine replicas failed: {type(exc).__name__}",
                                  "InternalServerError") from None
        raise OpenAIError(502, "engine replicas failed", "InternalServerError")


class _Dispatch:
    """One attempt of one request on one replica. ``close`` is idempotent and is called on
    every path (it cancels the replica call if unfinished and releases the reservation)."""

    def __init__(self, core: IngressCore, req: RoutedRequest, route: str):
        self.core = core
        self.req = req
        self.route = route
        self.gen = None
        self.head: ReplicaHead | None = None
        self.replica = ""
        self.started_body = False
        self.exhausted = False
        self.closed = False
        self.scanner = UsageScanner(req.stream)

    async def start(self) -> ReplicaHead:
        # A new attempt is open: the router keeps its reservation (the previous attempt's
        # close, awaited before this one starts, set the flag and released its own).
        self.req.closed = False
        self.gen = self.core.engine.options(stream=True).generate.remote(self.req)
        try:
            self.head = await self.core._first_item(self.gen)
        finally:
            self.replica = (self.head.replica_id if self.head else None) \
                or self.req.routed_replica or ""
            if self.replica:
                metrics.inc("dispatched", tags={"replica": self.replica})
                self.core._count_inflight(self.replica, +1)
        return self.head

    async def body(self) -> AsyncIterator[bytes]:
        """The engine's body bytes. A failure after the first byte is never retried: a
        stream ends with an SSE error event (FAULTS.md 6.3), a plain body raises."""
        try:
            async for chunk in self.gen:
                if not self.started_body:
                    self.started_body = True
                    await self.core.load.prefill_done(self.req.request_id)
                    metrics.get("ttft").observe(time.perf_counter() - self.req.t_arrival,
                                                tags={"route": self.route})
                self.scanner.feed(chunk)
                yield chunk
            self.exhausted = True
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.error("stream from replica %s broke after the first byte: %s",
                         self.replica, exc)
            self.exhausted = True
            if not self.req.stream:
                raise
            yield _sse_error(f"engine stream interrupted: {type(exc).__name__}")

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.req.closed = True  # before the release: see RoutedRequest.closed
        if self.gen is not None and not self.exhausted:
            self.gen.cancel()
        # Shielded: a second cancellation of a request that is already going away must not
        # stop the release half-way (the reservation would outlive the request).
        await asyncio.shield(asyncio.ensure_future(self._close()))

    async def _close(self) -> None:
        await self.core.load.release(self.req.request_id)
        if self.head is not None and self.head.status >= 400 and self.replica:
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


class _GuardedStreamingResponse(StreamingResponse):
    """A streaming response that closes its dispatch however the response ends, even when
    the client leaves before the first chunk (the body generator would then never start
    and its ``finally`` never run)."""

    def __init__(self, dispatch: _Dispatch, **kwargs):
        super().__init__(dispatch.body(), **kwargs)
        self.dispatch = dispatch

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.dispatch.close()


def build_fastapi_app() -> FastAPI:
    """The FastAPI app; its routes delegate to ``Ingress`` (set as ``app.state.ingress``)."""
    app = FastAPI(title="prefix-router", version="0.1.0")

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """Unknown paths and methods in the OpenAI error shape, not FastAPI's ``detail``."""
        err = OpenAIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                          "NotFoundError" if exc.status_code == 404 else "InvalidRequestError",
                          headers=dict(exc.headers or {}))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=err.headers)

    return app
