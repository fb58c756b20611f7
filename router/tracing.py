"""OpenTelemetry traces of each inference request (docs/operations.md, "Traces").

Off unless an OTLP endpoint is configured: ``Settings.otlp_traces_endpoint``, else the
standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` variable (``OTEL_SDK_DISABLED=true`` turns
both off). Then ``configure`` gives this process a tracer provider of its own (never the
global one) that exports over OTLP/HTTP in batches. While it is off, ``tracer()`` is None
and the request path does nothing more per request than that check: no span object, no
context, no ``traceparent``.

The spans of one request (``POST /v1/completions`` alike)::

    POST /v1/chat/completions   SERVER   arrival of the request's head to its last byte
                                         relayed, or the client leaving (TracingMiddleware)
      prepare                   INTERNAL validate, render, tokenize, hash
      admission                 INTERNAL the wait for a slot (only with
                                         max_inflight_per_replica)
      route                     INTERNAL the decision (direct data path), per attempt
      dispatch                  CLIENT   one attempt on one engine, per attempt: its head,
                                         a ``first_byte`` event, its end (last byte, abort)

An incoming W3C ``traceparent`` (the global propagator: ``OTEL_PROPAGATORS``, W3C trace
context and baggage by default) makes the server span its child; each dispatch passes its
own context on to the engine (``inject``), whose spans (vLLM's ``--otlp-traces-endpoint``)
then sit under it. Attribute names follow OpenTelemetry's HTTP and GenAI semantic
conventions where one exists (``http.*``, ``url.*``, ``server.*``, ``client.*``,
``gen_ai.*``); the router's own facts are ``prefix_router.*`` (``ATTR_*`` below).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Mapping

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from starlette.requests import ClientDisconnect

from router.logs import get_logger

logger = get_logger(__name__)

SERVICE_NAME = "prefix-router"  # the resource's service.name unless OTEL_SERVICE_NAME names one

ATTR_REPLICA = "prefix_router.replica"
ATTR_REASON = "prefix_router.routing.reason"
ATTR_POLICY = "prefix_router.routing.policy"
ATTR_PREDICTED = "prefix_router.predicted_cached_tokens"
ATTR_DATA_PATH = "prefix_router.data_path"
ATTR_REQUEST_ID = "prefix_router.request_id"
ATTR_ATTEMPT = "prefix_router.attempt"
ATTR_PROMPT_TOKENS = "prefix_router.prompt_tokens"
ATTR_BLOCKS = "prefix_router.block_hashes"
ATTR_CANDIDATES = "prefix_router.candidates"
ATTR_RETRIED = "prefix_router.retried"
ATTR_ABORTED = "prefix_router.aborted"
ATTR_CLIENT_CLOSED = "prefix_router.client_closed"
ATTR_PRIORITY = "prefix_router.priority"

_tracer: trace.Tracer | None = None
_provider = None  # the SDK TracerProvider behind _tracer


def tracer() -> trace.Tracer | None:
    """This process's tracer, or None while tracing is off (the one per-request check)."""
    return _tracer


def install(provider) -> None:
    """Trace this process's requests with ``provider`` (an SDK ``TracerProvider``, with its
    span processors and exporter set), replacing any provider installed before. Used by
    ``configure`` and by tests (an ``InMemorySpanExporter``)."""
    global _tracer, _provider
    _provider = provider
    _tracer = provider.get_tracer("prefix_router")


def uninstall() -> None:
    """Turn tracing off in this process (the provider is not shut down)."""
    global _tracer, _provider
    _tracer = _provider = None


def endpoint_of(settings) -> str | None:
    """The OTLP/HTTP traces endpoint (a full URL, such as
    ``http://otel-collector:4318/v1/traces``) that ``settings`` and the environment give:
    ``Settings.otlp_traces_endpoint``, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; None
    when neither is set or ``OTEL_SDK_DISABLED`` is ``true`` (tracing off)."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    return settings.otlp_traces_endpoint \
        or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None


def configure(settings) -> bool:
    """Start exporting this process's traces when an endpoint is configured
    (``endpoint_of``); returns whether tracing is on. Idempotent: a process keeps the first
    provider it installed. Spans are exported over OTLP/HTTP protobuf in batches (the SDK's
    ``BatchSpanProcessor``: its queue drops spans rather than block a request when the
    collector is slow or down), sampled at ``Settings.traces_sample_rate`` unless the
    incoming ``traceparent`` decides (parent-based sampling).

    Raises:
        ImportError: the OpenTelemetry SDK or its OTLP/HTTP exporter is not installed
            (``opentelemetry-sdk``, ``opentelemetry-exporter-otlp-proto-http``).
    """
    endpoint = endpoint_of(settings)
    if endpoint is None:
        return False
    if _tracer is not None:
        return True
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": os.environ.get("OTEL_SERVICE_NAME") or SERVICE_NAME}),
        sampler=ParentBased(TraceIdRatioBased(settings.traces_sample_rate)))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    install(provider)
    logger.info("OpenTelemetry traces exported to %s (sample rate %s)", endpoint,
                settings.traces_sample_rate)
    return True


# --- spans of the request path ---------------------------------------------------------
class _NoSpan:
    """``span()`` while tracing is off: a context manager that yields None."""

    __slots__ = ()

    def __enter__(self):
        return None

    def __exit__(self, *exc) -> bool:
        return False


NO_SPAN = _NoSpan()  # what ``span`` returns while tracing is off, for a step not traced


class _Child:
    """A child span of the current context, ended on exit; an exception marks it failed
    (``fail``). It is not made current: nothing runs under it."""

    __slots__ = ("span",)

    def __init__(self, span):
        self.span = span

    def __enter__(self):
        return self.span

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is not None:
            fail(self.span, exc)
        self.span.end()
        return False


def span(name: str, attributes: Mapping[str, Any] | None = None,
         kind: SpanKind = SpanKind.INTERNAL):
    """A context manager around one step of the request: it yields a span, a child of the
    current span, ended on exit (an exception sets its status, ``fail``); it yields None
    while tracing is off."""
    t = _tracer
    if t is None:
        return NO_SPAN
    return _Child(t.start_span(name, kind=kind, attributes=attributes))


def start_span(name: str, attributes: Mapping[str, Any] | None = None,
               kind: SpanKind = SpanKind.INTERNAL):
    """A span, child of the current span, that the caller ends (``span.end()``); None
    while tracing is off."""
    t = _tracer
    return None if t is None else t.start_span(name, kind=kind, attributes=attributes)


def current_span():
    """The current span (the request's server span on the request path), or None while
    tracing is off."""
    return None if _tracer is None else trace.get_current_span()


def fail(span, error: BaseException | str) -> None:
    """Mark ``span`` failed: an exception is recorded and sets the ERROR status with its
    type and message; a cancellation (the client left, or the task was abandoned) is an
    ``aborted`` attribute, not an error."""
    if isinstance(error, (asyncio.CancelledError, ClientDisconnect)):
        span.set_attribute(ATTR_ABORTED, True)
        return
    if isinstance(error, BaseException):
        span.record_exception(error)
        error = f"{type(error).__name__}: {error}"
    span.set_status(Status(StatusCode.ERROR, error))


def inject(span) -> dict[str, str]:
    """The headers that carry ``span``'s context to the next hop (``traceparent``, and
    ``tracestate`` and ``baggage`` when there are any), by the global propagator."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def request_attributes(path: str, body: dict) -> None:
    """Set the GenAI attributes of an inference request (``gen_ai.operation.name``,
    ``gen_ai.request.model``, ``gen_ai.request.max_tokens``, ``gen_ai.request.stream``)
    on the current span; nothing while tracing is off."""
    if _tracer is None:
        return
    s = trace.get_current_span()
    s.set_attribute("gen_ai.operation.name", "chat" if path.endswith("/chat/completions")
                    else "text_completion")
    model = body.get("model")
    if isinstance(model, str):
        s.set_attribute("gen_ai.request.model", model)
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(max_tokens, int) and not isinstance(max_tokens, bool):
        s.set_attribute("gen_ai.request.max_tokens", max_tokens)
    s.set_attribute("gen_ai.request.stream", bool(body.get("stream")))


def usage_attributes(spans, usage: dict | None) -> None:
    """Set the engine's reported usage (an OpenAI ``usage`` object) on each of ``spans``
    (None entries skipped) as ``gen_ai.usage.input_tokens``, ``output_tokens`` and
    ``cache_read.input_tokens``."""
    if not usage:
        return
    details = usage.get("prompt_tokens_details") or {}
    attrs = {}
    for key, value in (("gen_ai.usage.input_tokens", usage.get("prompt_tokens")),
                       ("gen_ai.usage.output_tokens", usage.get("completion_tokens")),
                       ("gen_ai.usage.cache_read.input_tokens",
                        details.get("cached_tokens") if isinstance(details, dict) else None)):
        if isinstance(value, int):
            attrs[key] = value
    for s in spans:
        if s is not None:
            s.set_attributes(attrs)


# --- the server span -------------------------------------------------------------------
class TracingMiddleware:
    """ASGI middleware: the server span of each request to ``paths`` (the route paths, the
    application's ``root_path`` stripped), while tracing is on; a plain call otherwise.

    The span is the parent of every span the request path makes (it is the current span
    while the application runs, and in the tasks it starts). Its status code is the
    response's; a 5xx or an exception sets the ERROR status. It ends when the last body
    byte has been sent (``more_body`` false) or, when the client left first, when the
    application returns (``prefix_router.client_closed``).

    Args:
        app: the ASGI application.
        paths: the route paths to trace, e.g. ``/v1/chat/completions``.
    """

    def __init__(self, app, paths):
        self.app = app
        self.paths = frozenset(paths)

    async def __call__(self, scope, receive, send) -> None:
        t = _tracer
        if t is None or scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        root = scope.get("root_path") or ""
        if root and path.startswith(root):
            path = path[len(root):]
        if path not in self.paths:
            return await self.app(scope, receive, send)
        headers = {}
        for k, v in scope.get("headers") or ():
            headers[k.decode("latin-1").lower()] = v.decode("latin-1")
        parent = propagate.extract(headers)
        method = scope.get("method", "GET")
        attrs: dict[str, Any] = {"http.request.method": method, "http.route": path,
                                 "url.path": scope["path"],
                                 "url.scheme": scope.get("scheme", "http"),
                                 "network.protocol.version": scope.get("http_version", "1.1")}
        host = headers.get("host")
        if host:
            name, _, port = host.rpartition(":") if host.rsplit(":", 1)[-1].isdigit() \
                else (host, "", "")
            attrs["server.address"] = name
            if port:
                attrs["server.port"] = int(port)
        elif scope.get("server"):
            attrs["server.address"], attrs["server.port"] = scope["server"][0], \
                scope["server"][1]
        if scope.get("client"):
            attrs["client.address"] = scope["client"][0]
            attrs["client.port"] = scope["client"][1]
        if headers.get("user-agent"):
            attrs["user_agent.original"] = headers["user-agent"]
        server = t.start_span(f"{method} {path}", context=parent, kind=SpanKind.SERVER,
                              attributes=attrs)
        token = otel_context.attach(trace.set_span_in_context(server, parent))
        status = 0
        last_byte_ns = None

        async def traced_send(message) -> None:
            nonlocal status, last_byte_ns
            if message["type"] == "http.response.start":
                status = message["status"]
                server.set_attribute("http.response.status_code", status)
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                last_byte_ns = time.time_ns()

        failed = False
        try:
            await self.app(scope, receive, traced_send)
        except (asyncio.CancelledError, ClientDisconnect):
            raise  # the client left: client_closed below, unless it had the last byte
        except BaseException as exc:
            failed = True
            fail(server, exc)
            raise
        finally:
            if status >= 500:
                server.set_attribute("error.type", str(status))
                if not failed:
                    server.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
            if last_byte_ns is None and not failed:
                server.set_attribute(ATTR_CLIENT_CLOSED, True)
            server.end(end_time=last_byte_ns)
            otel_context.detach(token)
