"""OpenTelemetry traces of each request (``router.tracing``): the ingress's FastAPI app and
its real request path (``IngressCore``, direct data path) in front of two real simulated
engines (``replicas.sim.server``, served by uvicorn on loopback in a thread), with the
SDK's in-memory exporter in place of the OTLP one."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import Request
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from loadtest.service import free_port
from replicas.sim.engine import EngineConfig, SimEngine
from replicas.sim.server import EventPublisher, SimServer, build_app
from replicas.sim.step_model import StepTimeModel
from router import tracing
from router.config import Settings
from router.hashing import HashSettings
from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH, PromptRenderer
from router.routing.replica import ReplicaInfo
from router.serve import state
from router.serve.ingress import IngressCore, build_fastapi_app
from tests.conftest import make_text, wait_until

SERVER_SPAN = f"POST {CHAT_PATH}"
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"


class SimEngineServer:
    """One simulated engine on a loopback port, served by uvicorn in a thread of its own."""

    def __init__(self, model_dir):
        renderer = PromptRenderer(str(model_dir))
        engine = SimEngine(EngineConfig(num_blocks=4096, vocab_size=len(renderer.tokenizer)),
                           StepTimeModel.parse("0.001,0,0,0"),
                           HashSettings(block_size=32, hash_algo="xxhash_cbor", seed="0"))
        self.sim = SimServer(engine, renderer, "tiny-qwen2", EventPublisher(None, None, ""))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.sim), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, 0.05, "the simulated engine to start")

    def faults(self, **faults) -> None:
        """Set faults (``replicas.sim.server.Faults``) through the engine's own HTTP hook."""
        httpx.post(self.url + "/sim/faults", json=faults, timeout=5).raise_for_status()

    def headers(self) -> list[dict[str, str]]:
        """The headers of every generate request the engine received, in order."""
        return httpx.get(self.url + "/sim/headers", timeout=5).json()

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def engines(model_dir):
    servers = {"a": SimEngineServer(model_dir), "b": SimEngineServer(model_dir)}
    yield servers
    for s in servers.values():
        s.stop()


@pytest.fixture
def spans():
    """Tracing on, into an in-memory exporter (off again afterwards)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.install(provider)
    yield exporter
    tracing.uninstall()
    provider.shutdown()


@pytest.fixture
async def router(engines, model_dir, monkeypatch, request):
    """The ingress's app over a fresh ``IngressCore`` routing among both engines (direct
    data path), and an HTTP client speaking to it in process; faults reset afterwards."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    policy = getattr(request, "param", "prefix_aware")
    infos = tuple(ReplicaInfo(r, {"engine_url": s.url}, {"engine_alive": True})
                  for r, s in engines.items())
    state.put("replica_infos", infos)
    core = IngressCore(Settings(model=str(model_dir), policy=policy,
                                index_namespace=f"tracing-{time.monotonic_ns()}"),
                       engine_handle=None)
    for r in engines:
        core.health.forget(r)
    app = build_fastapi_app()

    def route(path):
        async def infer(request: Request):
            return await core.handle(path, await request.body(), time.perf_counter(),
                                     policy=request.headers.get("x-routing-policy"))
        return infer

    for path in (CHAT_PATH, COMPLETIONS_PATH):
        app.add_api_route(path, route(path), methods=["POST"])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://router.test", timeout=30) as client:
        client.core, client.app = core, app
        yield client
    if core._engine_client is not None:
        await core._engine_client.close()
    for s in engines.values():
        s.faults(error_status=0, error_count=-1)
    state.put("replica_infos", None)


def chat(text: str, **extra) -> dict:
    return {"model": "tiny-qwen2", "messages": [{"role": "user", "content": text}],
            "max_tokens": 4, **extra}


def by_name(exporter) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in exporter.get_finished_spans():
        out.setdefault(s.name, []).append(s)
    return out


def traceparent_of(headers: dict[str, str]) -> tuple[str, str]:
    """(trace id, parent span id) of a W3C ``traceparent`` header (sampled)."""
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert version == "00" and int(flags, 16) & 1  # the sampled flag
    return trace_id, span_id


async def test_the_span_tree_and_its_attributes(router, engines, spans, tokenizer):
    body = chat(make_text(200, "tracing-tree", tokenizer))
    first = await router.post(CHAT_PATH, json=body)
    assert first.status_code == 200
    tree = by_name(spans)
    assert sorted(tree) == sorted([SERVER_SPAN, "prepare", "route", "dispatch"])
    assert all(len(v) == 1 for v in tree.values())
    server = tree[SERVER_SPAN][0]
    assert server.kind is SpanKind.SERVER and server.parent is None
    trace_id = server.context.trace_id
    for name in ("prepare", "route", "dispatch"):
        child = tree[name][0]
        assert child.context.trace_id == trace_id
        assert child.parent.span_id == server.context.span_id, name
    dispatch, route = tree["dispatch"][0], tree["route"][0]
    assert dispatch.kind is SpanKind.CLIENT
    # the steps in order, within the request's span
    assert server.start_time <= tree["prepare"][0].start_time <= tree["prepare"][0].end_time \
        <= route.start_time <= route.end_time <= dispatch.start_time \
        <= dispatch.end_time <= server.end_time
    usage = first.json()["usage"]
    replica = first.headers["x-routed-replica"]
    a = server.attributes
    assert a["http.request.method"] == "POST" and a["http.route"] == CHAT_PATH
    assert a["http.response.status_code"] == 200 and a["server.address"] == "router.test"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "tiny-qwen2"
    assert a["gen_ai.request.max_tokens"] == 4 and a["gen_ai.request.stream"] is False
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"]
    assert a[tracing.ATTR_REPLICA] == replica and a[tracing.ATTR_REASON] == "load"
    assert a[tracing.ATTR_POLICY] == "prefix_aware" and a[tracing.ATTR_DATA_PATH] == "direct"
    assert a[tracing.ATTR_PREDICTED] == 0 and a[tracing.ATTR_ATTEMPT] == 1
    assert server.status.status_code is StatusCode.UNSET
    assert tree["prepare"][0].attributes[tracing.ATTR_PROMPT_TOKENS] == usage["prompt_tokens"]
    assert route.attributes[tracing.ATTR_REPLICA] == replica
    assert dispatch.attributes[tracing.ATTR_REPLICA] == replica
    assert dispatch.attributes["http.response.status_code"] == 200
    assert dispatch.attributes["url.full"] == engines[replica].url + CHAT_PATH
    assert [e.name for e in dispatch.events] == ["first_byte"]
    # the engine got the dispatch's context: its spans sit under the dispatch
    assert traceparent_of(engines[replica].headers()[-1]) == (
        f"{trace_id:032x}", f"{dispatch.context.span_id:016x}")

    spans.clear()  # the same prompt again: routed by the cache the first one left there
    second = await router.post(CHAT_PATH, json=body)
    assert second.headers["x-routed-replica"] == replica
    server = by_name(spans)[SERVER_SPAN][0]
    predicted = int(second.headers["x-predicted-cached-tokens"])
    assert predicted >= 32 and second.headers["x-routing-reason"] == "cache"
    assert server.attributes[tracing.ATTR_REASON] == "cache"
    assert server.attributes[tracing.ATTR_PREDICTED] == predicted
    assert server.attributes["gen_ai.usage.cache_read.input_tokens"] == \
        second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert server.context.trace_id != trace_id  # a request of its own


async def test_a_stream_has_its_first_byte_and_ends_with_its_last(router, engines, spans):
    r = await router.post(CHAT_PATH, json=chat("stream me", stream=True, max_tokens=8,
                                                stream_options={"include_usage": True}))
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    tree = by_name(spans)
    server, dispatch = tree[SERVER_SPAN][0], tree["dispatch"][0]
    first_byte = dispatch.events[0]
    assert first_byte.name == "first_byte"
    assert dispatch.start_time < first_byte.timestamp < dispatch.end_time <= server.end_time
    assert server.attributes["gen_ai.request.stream"] is True
    assert server.attributes["gen_ai.usage.output_tokens"] == 8
    assert 0 < server.attributes["gen_ai.response.time_to_first_chunk"] < 30
    assert tracing.ATTR_CLIENT_CLOSED not in server.attributes
    assert tracing.ATTR_ABORTED not in dispatch.attributes


@pytest.mark.parametrize("router", ["round_robin"], indirect=True)
async def test_a_retry_is_a_second_dispatch(router, engines, spans):
    """Round robin sends the first request to replica a, which refuses it once with a 503;
    the retry on b succeeds."""
    engines["a"].faults(error_status=503, error_count=1)
    r = await router.post(CHAT_PATH, json=chat("retry me"))
    assert r.status_code == 200 and r.headers["x-routed-replica"] == "b"
    tree = by_name(spans)
    server = tree[SERVER_SPAN][0]
    first, second = sorted(tree["dispatch"], key=lambda s: s.start_time)
    assert len(tree["route"]) == 2
    assert [s.parent.span_id for s in (first, second)] == [server.context.span_id] * 2
    assert (first.attributes[tracing.ATTR_ATTEMPT], second.attributes[tracing.ATTR_ATTEMPT]) \
        == (1, 2)
    assert first.attributes[tracing.ATTR_REPLICA] == "a"
    assert first.attributes["http.response.status_code"] == 503
    assert first.attributes[tracing.ATTR_RETRIED] is True
    assert first.status.status_code is StatusCode.ERROR
    assert second.attributes[tracing.ATTR_REPLICA] == "b"
    assert second.status.status_code is StatusCode.UNSET
    assert server.status.status_code is StatusCode.UNSET
    assert server.attributes[tracing.ATTR_REPLICA] == "b"
    assert server.attributes[tracing.ATTR_ATTEMPT] == 2
    # each engine saw its own attempt's context, in the one trace
    trace_id = f"{server.context.trace_id:032x}"
    assert traceparent_of(engines["a"].headers()[-1]) == (trace_id,
                                                          f"{first.context.span_id:016x}")
    assert traceparent_of(engines["b"].headers()[-1]) == (trace_id,
                                                          f"{second.context.span_id:016x}")


async def test_an_error_sets_the_error_status(router, engines, spans):
    for s in engines.values():
        s.faults(error_status=500, error_count=-1)
    r = await router.post(CHAT_PATH, json=chat("fail me"))
    assert r.status_code == 500
    tree = by_name(spans)
    server = tree[SERVER_SPAN][0]
    assert server.status.status_code is StatusCode.ERROR
    assert server.attributes["http.response.status_code"] == 500
    assert server.attributes["error.type"] == "500"
    assert len(tree["dispatch"]) == 2
    assert all(d.status.status_code is StatusCode.ERROR for d in tree["dispatch"])


async def test_a_refused_body_is_a_traced_400(router, spans):
    r = await router.post(CHAT_PATH, content=b"{not json", headers={
        "content-type": "application/json"})
    assert r.status_code == 400
    tree = by_name(spans)
    assert sorted(tree) == sorted([SERVER_SPAN, "prepare"])
    assert tree["prepare"][0].status.status_code is StatusCode.ERROR
    server = tree[SERVER_SPAN][0]
    assert server.attributes["http.response.status_code"] == 400
    assert server.status.status_code is StatusCode.UNSET  # a client error, not the server's


async def test_an_incoming_traceparent_is_the_parent(router, engines, spans):
    r = await router.post(CHAT_PATH, json=chat("child of the caller"), headers={
        "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert r.status_code == 200
    tree = by_name(spans)
    server = tree[SERVER_SPAN][0]
    assert f"{server.context.trace_id:032x}" == CLIENT_TRACE
    assert server.parent is not None and server.parent.is_remote
    assert f"{server.parent.span_id:016x}" == CLIENT_SPAN
    assert all(f"{s.context.trace_id:032x}" == CLIENT_TRACE
               for s in spans.get_finished_spans())
    engine_trace, _ = traceparent_of(engines[r.headers["x-routed-replica"]].headers()[-1])
    assert engine_trace == CLIENT_TRACE


async def test_a_client_that_leaves_mid_stream_ends_the_spans(router, engines, spans):
    """A long answer (1,500 tokens at 1 ms a step); the client leaves 0.3 s into it."""
    raw = json.dumps(chat("a long answer", stream=True, max_tokens=1500)).encode()
    sent, calls = [], 0

    async def receive():
        nonlocal calls
        calls += 1
        if calls == 1:
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.sleep(0.3)
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "path": CHAT_PATH,
             "raw_path": CHAT_PATH.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"content-type", b"application/json"), (b"host", b"router.test")],
             "scheme": "http", "client": ("127.0.0.1", 50000), "server": ("router.test", 80)}
    await asyncio.wait_for(router.app(scope, receive, send), 20)
    assert sent[0]["status"] == 200 and any(m.get("more_body") for m in sent[1:])
    assert not any(m["type"] == "http.response.body" and not m.get("more_body")
                   for m in sent)  # it never got the end
    tree = by_name(spans)
    server, dispatch = tree[SERVER_SPAN][0], tree["dispatch"][0]
    assert server.attributes[tracing.ATTR_CLIENT_CLOSED] is True
    assert server.attributes["client.address"] == "127.0.0.1"
    assert dispatch.attributes[tracing.ATTR_ABORTED] is True
    assert server.end_time - server.start_time < 5e9  # not the whole answer's time
    assert server.status.status_code is StatusCode.UNSET


async def test_tracing_off_records_nothing_and_sends_no_traceparent(router, engines):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    assert tracing.tracer() is None  # Settings without an endpoint: off
    assert not tracing.configure(router.core.settings)
    r = await router.post(CHAT_PATH, json=chat("untraced"), headers={
        "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
    assert r.status_code == 200
    received = engines[r.headers["x-routed-replica"]].headers()[-1]
    assert "traceparent" not in received and received["content-type"] == "application/json"
    assert exporter.get_finished_spans() == ()
    assert tracing.span("prepare") is tracing.NO_SPAN and tracing.current_span() is None


class OtlpReceiver:
    """An OTLP/HTTP traces receiver on a loopback port: keeps each export request."""

    def __init__(self):
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        received = self.received = []

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers["content-length"]))
                received.append((self.path, self.headers["content-type"], body))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1/traces"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[str, str]]:
        """(service.name, span name) of every span received."""
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
        )
        out = []
        for _, _, body in self.received:
            req = ExportTraceServiceRequest.FromString(body)
            for rs in req.resource_spans:
                service = next(a.value.string_value for a in rs.resource.attributes
                               if a.key == "service.name")
                out += [(service, sp.name) for ss in rs.scope_spans for sp in ss.spans]
        return out


def test_an_endpoint_turns_tracing_on_and_spans_reach_it(monkeypatch):
    """``configure`` exports to the endpoint of the settings or of the standard variable
    (OTLP/HTTP protobuf), and is off without one or with ``OTEL_SDK_DISABLED``."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_SDK_DISABLED", raising=False)
    assert tracing.endpoint_of(Settings()) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4318/v1/traces")
    assert tracing.endpoint_of(Settings()) == "http://collector:4318/v1/traces"
    receiver = OtlpReceiver()
    s = Settings(otlp_traces_endpoint=receiver.url)
    assert tracing.endpoint_of(s) == receiver.url  # the setting wins over the variable
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert tracing.endpoint_of(s) is None and not tracing.configure(s)
    assert tracing.tracer() is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "router-eu-1")
    try:
        assert tracing.configure(s) and tracing.tracer() is not None
        with tracing.span("prepare"):
            pass
        assert tracing._provider.force_flush(10_000)
        wait_until(lambda: receiver.received, 10, 0.05, "the export")
        assert receiver.received[0][:2] == ("/v1/traces", "application/x-protobuf")
        assert receiver.spans() == [("router-eu-1", "prepare")]
    finally:
        provider = tracing._provider
        tracing.uninstall()
        provider.shutdown()
        receiver.http.shutdown()


def test_engines_export_their_spans_to_the_same_endpoint_over_http():
    from replicas.engine import EnginePorts, EngineProcess

    ports = EnginePorts(8100, "ipc:///tmp/a", "ipc:///tmp/b")
    on = EngineProcess(Settings(otlp_traces_endpoint="http://c:4318/v1/traces"), ports, "t",
                       "cpu")
    cmd = on.command()
    assert cmd[cmd.index("--otlp-traces-endpoint") + 1] == "http://c:4318/v1/traces"
    assert on.env()["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] == "http/protobuf"
    assert "--otlp-traces-endpoint" not in EngineProcess(Settings(), ports, "t",
                                                         "cpu").command()
