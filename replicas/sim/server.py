"""The simulated engine in real time: an HTTP server speaking the subset of vLLM's OpenAI API
that the router uses, with vLLM's KV events over ZMQ, and faults on command.

Run by the replica deployment in place of vLLM (``Settings.engine = "sim"``) or directly::

    python -m replicas.sim.server --port 8100 --model models/tiny-qwen2 \\
        --kv-events-config '{"endpoint": "tcp://*:5600", "replay_endpoint": "tcp://*:5601"}'

API: ``POST /v1/chat/completions``, ``POST /v1/completions`` (streaming or not, ``usage``
with ``prompt_tokens_details.cached_tokens``), ``GET /v1/models``, ``GET /health``,
``GET /metrics`` (vLLM's metric names), ``POST /tokenize``, ``POST /reset_prefix_cache``.
Test hooks under ``/sim/``: ``POST /sim/faults`` (see ``Faults``), ``GET /sim/requests``
(every body received, verbatim), ``GET /sim/headers`` (the headers of each of those
requests, in the same order), ``GET /sim/state``.

The engine (``replicas.sim.engine.SimEngine``) runs one step at a time and sleeps each
step's modelled duration; tokens go to the requests' queues at the end of their step.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any, AsyncIterator

import msgspec
import uvicorn
import zmq
import zmq.asyncio
from fastapi import FastAPI, Request
from fastapi.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)

from replicas.sim.engine import EngineConfig, SimEngine, SimRequest
from replicas.sim.step_model import StepTimeModel
from router.hashing import HashSettings
from router.kv_events.wire import EventKind, KVEvent
from router.logs import get_logger
from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH, PromptRenderer

logger = get_logger(__name__)


@dataclass
class Faults:
    """Faults to inject, set with ``POST /sim/faults`` (fields omitted keep their value).

    Attributes:
        error_status: answer generate calls with this HTTP status (0 = off).
        error_count: how many calls get it (-1 = all until changed).
        hang: generate calls never answer (until the client leaves).
        drop_after_chunks: a streamed answer's connection is dropped after k chunks (-1 off).
        extra_ttft_s: added before the first token of each request.
        withhold_events: KV events are not published (the engine keeps them).
        unhealthy: ``/health`` answers 503.
    """

    error_status: int = 0
    error_count: int = -1
    hang: bool = False
    drop_after_chunks: int = -1
    extra_ttft_s: float = 0.0
    withhold_events: bool = False
    unhealthy: bool = False


class _ClientGone(Exception):
    """The client of a non-streaming request disconnected while it was generated."""


_SHUT_DOWN = -1  # put in a stream's queue when the engine shuts down with it unfinished


class _Stream:
    """Per-request queue of (token id | None at the end) filled by the engine loop."""

    def __init__(self, req: SimRequest):
        self.req = req
        self.queue: asyncio.Queue = asyncio.Queue()


class EventPublisher:
    """vLLM's ZMQ KV-event publisher: PUB (3 frames: topic, 8-byte seq, msgpack batch) and a
    ROUTER replay socket answering ``[identity, b"", start_seq]`` with the buffered batches
    and an end marker (``vllm/distributed/kv_events.py``)."""

    def __init__(self, endpoint: str | None, replay_endpoint: str | None, topic: str,
                 buffer_steps: int = 10000):
        self.topic = topic.encode()
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # the process's shared context, never terminated: a context of its own, collected
        # while its sockets were still open, blocked the collecting thread in term()
        self.ctx = zmq.asyncio.Context.instance()
        self.pub = None
        self.replay = None
        self._enc = msgspec.msgpack.Encoder()
        if endpoint:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.setsockopt(zmq.LINGER, 0)
            self.pub.bind(endpoint)
        if replay_endpoint:
            self.replay = self.ctx.socket(zmq.ROUTER)
            self.replay.setsockopt(zmq.LINGER, 0)
            self.replay.bind(replay_endpoint)

    @staticmethod
    def to_wire(ev: KVEvent, block_size: int) -> dict:
        if ev.kind is EventKind.STORED:
            return {"type": "BlockStored", "block_hashes": ev.block_hashes,
                    "parent_block_hash": ev.parent_block_hash, "token_ids": [],
                    "block_size": block_size, "lora_id": None, "medium": "GPU",
                    "lora_name": None}
        if ev.kind is EventKind.REMOVED:
            return {"type": "BlockRemoved", "block_hashes": ev.block_hashes, "medium": "GPU"}
        return {"type": "AllBlocksCleared"}

    async def publish(self, events: list[KVEvent], block_size: int) -> None:
        if not events or self.pub is None:
            return
        payload = self._enc.encode([time.time(), [self.to_wire(e, block_size) for e in events],
                                    0])
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])

    def close(self) -> None:
        """Close the publisher and replay sockets (their endpoints are free again)."""
        for sock in (self.pub, self.replay):
            if sock is not None:
                sock.close(linger=0)

    async def serve_replay(self) -> None:
        if self.replay is None:
            return
        end = (-1).to_bytes(8, "big", signed=True)
        while True:
            frames = await self.replay.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.replay.send_multipart(
                        [ident, b"", self.topic, seq.to_bytes(8, "big"), payload])
            await self.replay.send_multipart([ident, b"", b"", end, b""])


class SimServer:
    """The engine loop plus the HTTP handlers."""

    def __init__(self, engine: SimEngine, renderer: PromptRenderer, model_name: str,
                 publisher: EventPublisher, max_model_len: int = 131072,
                 root: str | None = None):
        self.engine = engine
        self.root = root  # the model's folder, as vLLM's model card names it
        self.renderer = renderer
        self.model_name = model_name
        self.publisher = publisher
        self.max_model_len = max_model_len
        self.faults = Faults()
        self.received: list[Any] = []
        self.received_headers: list[dict[str, str]] = []
        self.withheld: list[KVEvent] = []
        self.streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self.requests_total = 0
        self.aborted_total = 0
        self.tokenize_calls = 0  # docs/fault-cases.md 10.1: routing must never call /tokenize

    async def run_engine(self) -> None:
        """Step while there is work; sleep each step's duration."""
        while True:
            if not self.engine.has_work:
                self._wake.clear()
                await self._wake.wait()
            result = self.engine.step()
            if result.duration_s > 0:
                await asyncio.sleep(result.duration_s)
            for req, tok in result.new_tokens:
                stream = self.streams.get(req.request_id)
                if stream is not None:
                    stream.queue.put_nowait(tok)
            for req in result.finished:
                stream = self.streams.get(req.request_id)
                if stream is not None:
                    stream.queue.put_nowait(None)
            events = self.engine.take_events()
            if self.faults.withhold_events:
                self.withheld.extend(events)
            else:
                await self.publisher.publish(self.withheld + events, self.engine.config.block_size)
                self.withheld = []
            if not result.new_tokens and not result.prefill_tokens and self.engine.has_work:
                await asyncio.sleep(0.001)  # blocked on capacity: let aborts arrive

    def submit(self, req: SimRequest) -> _Stream:
        stream = _Stream(req)
        self.streams[req.request_id] = stream
        self.engine.add_request(req)
        self.requests_total += 1
        self._wake.set()
        return stream

    def abort_all(self) -> int:
        """vLLM's shutdown with ``--shutdown-timeout 0`` (its default: "abort" mode): every
        unfinished request is aborted, and its stream breaks off. Returns how many."""
        streams = list(self.streams.values())
        for stream in streams:
            stream.queue.put_nowait(_SHUT_DOWN)
        return len(streams)

    def abort(self, request_id: str) -> None:
        if request_id in self.streams:
            self.streams.pop(request_id, None)
            self.engine.abort(request_id)
            self.aborted_total += 1

    # --- HTTP --------------------------------------------------------------------------
    def error(self, status: int, message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message, "type": "BadRequestError"
                                       if status < 500 else "InternalServerError",
                                       "param": None, "code": status}}, status_code=status)

    async def generate(self, path: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            return self.error(400, "invalid JSON")
        self.received.append(body)
        self.received_headers.append(dict(request.headers))
        f = self.faults
        if f.error_status and f.error_count != 0:
            if f.error_count > 0:
                f.error_count -= 1
            return self.error(f.error_status, "injected fault")
        if f.hang:
            while not await request.is_disconnected():
                await asyncio.sleep(0.1)
            return Response(status_code=499)
        if not isinstance(body, dict):
            return self.error(400, "request body must be a JSON object")
        info = self.renderer.render(path, body)
        if not info.token_ids:
            return self.error(400, f"cannot process the prompt: {info.reason or 'empty'}")
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        req = SimRequest(uuid.uuid4().hex, info.token_ids, max(max_tokens, 1),
                         cache_salt=info.cache_salt)
        stream = self.submit(req)
        kind = "chat.completion" if path == CHAT_PATH else "text_completion"
        rid = ("chatcmpl-" if path == CHAT_PATH else "cmpl-") + req.request_id[:16]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(self._sse(stream, path, rid, kind, include_usage),
                                     media_type="text/event-stream")
        try:
            tokens = [tok async for tok in self._tokens(stream, request)]
        except _ClientGone:
            return Response(status_code=499)
        text = self.renderer.tokenizer.decode(tokens)
        choice = ({"index": 0, "message": {"role": "assistant", "content": text},
                   "finish_reason": "length"} if path == CHAT_PATH else
                  {"index": 0, "text": text, "finish_reason": "length"})
        return JSONResponse({"id": rid, "object": kind, "created": int(time.time()),
                             "model": self.model_name, "choices": [choice],
                             "usage": self._usage(req)})

    def _usage(self, req: SimRequest) -> dict:
        return {"prompt_tokens": req.prompt_tokens, "completion_tokens": len(req.output_token_ids),
                "total_tokens": req.prompt_tokens + len(req.output_token_ids),
                "prompt_tokens_details": {"cached_tokens": max(req.num_cached_tokens, 0)}}

    async def _tokens(self, stream: _Stream, request: Request | None = None
                      ) -> AsyncIterator[int]:
        """The request's output token ids as the engine loop produces them, the first after
        the injected extra TTFT (``Faults.extra_ttft_s``). However the consumer stops, an
        unfinished request is aborted in the engine (and counted). With ``request`` (the
        non-streaming path, where no body write would notice), a client that disconnects
        while a token is awaited raises ``_ClientGone``."""
        req = stream.req
        try:
            first = True
            while True:
                tok = await self._next_token(stream, request)
                if first and self.faults.extra_ttft_s:
                    await asyncio.sleep(self.faults.extra_ttft_s)
                first = False
                if tok is None:
                    return
                if tok is _SHUT_DOWN:
                    raise ConnectionAbortedError("the engine shut down")
                yield tok
        finally:
            self.streams.pop(req.request_id, None)
            if not req.finished:
                self.engine.abort(req.request_id)
                self.aborted_total += 1

    @staticmethod
    async def _next_token(stream: _Stream, request: Request | None) -> int | None:
        if request is None:
            return await stream.queue.get()
        get = asyncio.ensure_future(stream.queue.get())
        while not get.done():
            done, _ = await asyncio.wait({get}, timeout=0.2)
            if not done and await request.is_disconnected():
                get.cancel()
                raise _ClientGone()
        return get.result()

    async def _sse(self, stream: _Stream, path: str, rid: str, kind: str, include_usage: bool):
        chunk_kind = kind + ".chunk" if path == CHAT_PATH else kind
        sent = 0

        def event(obj) -> bytes:
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        tokens = self._tokens(stream)
        try:
            async for tok in tokens:
                text = self.renderer.tokenizer.decode([tok])
                if path == CHAT_PATH:
                    delta = {"role": "assistant", "content": text} if sent == 0 \
                        else {"content": text}
                    choice = {"index": 0, "delta": delta, "finish_reason": None}
                else:
                    choice = {"index": 0, "text": text, "finish_reason": None}
                if 0 <= self.faults.drop_after_chunks <= sent:
                    raise ConnectionAbortedError("injected stream drop")
                yield event({"id": rid, "object": chunk_kind, "created": int(time.time()),
                             "model": self.model_name, "choices": [choice]})
                sent += 1
            # the end of the answer, as OpenAI's API ends a stream: an empty delta with the
            # finish reason (the simulator always generates max_tokens, as the whole body says)
            end = {"index": 0, "delta": {}, "finish_reason": "length"} if path == CHAT_PATH \
                else {"index": 0, "text": "", "finish_reason": "length"}
            yield event({"id": rid, "object": chunk_kind, "created": int(time.time()),
                         "model": self.model_name, "choices": [end]})
            if include_usage:
                yield event({"id": rid, "object": chunk_kind, "created": int(time.time()),
                             "model": self.model_name, "choices": [],
                             "usage": self._usage(stream.req)})
            yield b"data: [DONE]\n\n"
        finally:
            await tokens.aclose()

    def metrics_text(self) -> str:
        e = self.engine
        labels = f'{{engine="0",model_name="{self.model_name}"}}'
        lines = [
            f"vllm:num_requests_running{labels} {e.num_running}",
            f"vllm:num_requests_waiting{labels} {e.num_waiting}",
            f"vllm:kv_cache_usage_perc{labels} {e.pool.usage}",
            f"vllm:prompt_tokens_total{labels} {e.prompt_tokens_total}",
            f"vllm:prompt_tokens_cached_total{labels} {e.prompt_tokens_cached_total}",
            f"vllm:generation_tokens_total{labels} {e.generation_tokens_total}",
            f"vllm:prefix_cache_queries_total{labels} {e.prefix_cache_queries_total}",
            f"vllm:prefix_cache_hits_total{labels} {e.prefix_cache_hits_total}",
            f"vllm:request_prefill_time_seconds_sum{labels} {e.prefill_time_sum_s}",
            f"vllm:request_prefill_time_seconds_count{labels} {e.prompt_tokens_total and 1}",
            f"vllm:request_success_total{labels} {e.requests_finished_total}",
            # vLLM's info gauge of its CacheConfig (the fields the router reads)
            f'vllm:cache_config_info{{block_size="{e.config.block_size}",engine="0",'
            f'num_gpu_blocks="{e.config.num_blocks}"}} 1.0',
        ]
        types = {"vllm:num_requests_running": "gauge", "vllm:num_requests_waiting": "gauge",
                 "vllm:kv_cache_usage_perc": "gauge", "vllm:cache_config_info": "gauge"}
        out = [f"# TYPE {n} {t}" for n, t in types.items()] + lines
        return "\n".join(out) + "\n"


def build_app(server: SimServer) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(server.run_engine()),
                 loop.create_task(server.publisher.serve_replay())]
        yield
        for t in tasks:
            t.cancel()

    app = FastAPI(title="prefix-router simulated engine", lifespan=lifespan)

    @app.post(CHAT_PATH)
    async def chat(request: Request):
        return await server.generate(CHAT_PATH, request)

    @app.post(COMPLETIONS_PATH)
    async def completions(request: Request):
        return await server.generate(COMPLETIONS_PATH, request)

    @app.get("/health")
    async def health():
        return Response(status_code=503 if server.faults.unhealthy else 200)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(server.metrics_text())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model",
                                            "owned_by": "prefix-router-sim",
                                            "root": server.root or server.model_name,
                                            "max_model_len": server.max_model_len}]}

    @app.post("/tokenize")
    async def tokenize(request: Request):
        server.tokenize_calls += 1
        body = await request.json()
        path = CHAT_PATH if "messages" in body else COMPLETIONS_PATH
        ids = server.renderer.render(path, body).token_ids
        return {"count": len(ids), "tokens": ids, "max_model_len": server.max_model_len}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        ok = server.engine.reset_prefix_cache()
        return Response(status_code=200 if ok else 409)

    @app.post("/sim/faults")
    async def set_faults(request: Request):
        for k, v in (await request.json()).items():
            if not hasattr(server.faults, k):
                return server.error(400, f"unknown fault {k!r}")
            setattr(server.faults, k, type(getattr(server.faults, k))(v))
        return asdict(server.faults)

    @app.get("/sim/requests")
    async def received():
        return server.received

    @app.get("/sim/headers")
    async def received_headers():
        return server.received_headers

    @app.get("/sim/state")
    async def state():
        e = server.engine
        return {"running": e.num_running, "waiting": e.num_waiting,
                "free_blocks": e.pool.num_free_blocks, "requests_total": server.requests_total,
                "aborted_total": server.aborted_total, "steps": e.steps,
                "tokenize_calls": server.tokenize_calls,
                "kv_events_seq": server.publisher.seq}

    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--model", required=True, help="model directory (for its tokenizer)")
    ap.add_argument("--served-model-name", default="")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--hash-seed", default=None, help="default: $PYTHONHASHSEED or 0")
    ap.add_argument("--hash-algo", default="xxhash_cbor")
    ap.add_argument("--kv-events-config", default="{}")
    ap.add_argument("--step-model", default="0.002,0.00002,0.0002,0",
                    help="'a,b,c,d' seconds, or a profile name in replicas/sim/profiles")
    ap.add_argument("--num-blocks", type=int, default=32768)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--start-delay-s", type=float, default=0.0, help="slow start (fault)")
    ap.add_argument("--shutdown-timeout", type=float, default=0.0,
                    help="vLLM's: on SIGTERM, let unfinished requests run this long, then "
                         "abort them (0, vLLM's default: abort at once)")
    a = ap.parse_args(argv)
    import os
    if a.start_delay_s:
        time.sleep(a.start_delay_s)
    kv = json.loads(a.kv_events_config or "{}")
    seed = a.hash_seed if a.hash_seed is not None else os.environ.get("PYTHONHASHSEED", "0")
    # vLLM's request model is imported on the first request with tools, not at start: it
    # is 2.7 of the 6.4 s this server takes to start on the 2-core VM, and tests and
    # benchmarks start it dozens of times, mostly without tools
    renderer = PromptRenderer(a.model, preload_request_model=False)
    engine = SimEngine(EngineConfig(num_blocks=a.num_blocks, block_size=a.block_size,
                                    max_num_batched_tokens=a.max_num_batched_tokens,
                                    max_num_seqs=a.max_num_seqs,
                                    vocab_size=len(renderer.tokenizer)),
                       StepTimeModel.parse(a.step_model),
                       HashSettings(block_size=a.block_size, hash_algo=a.hash_algo, seed=seed))
    publisher = EventPublisher(kv.get("endpoint") if kv.get("enable_kv_cache_events", True)
                               else None, kv.get("replay_endpoint"), kv.get("topic", ""))
    server = SimServer(engine, renderer, a.served_model_name or a.model, publisher,
                       root=a.model)
    _ShuttingDownServer(server, a.shutdown_timeout, uvicorn.Config(
        build_app(server), host=a.host, port=a.port, log_level="warning")).run()


class _ShuttingDownServer(uvicorn.Server):
    """uvicorn, whose SIGTERM/SIGINT shut the engine down as vLLM 0.32's API server does
    (``vllm/entrypoints/launchers/launcher.py``, ``shutdown_timeout``: "abort" mode at 0,
    else "drain" for that long): unfinished requests are aborted, then the server exits.
    Plain uvicorn would instead wait for every open stream to end."""

    def __init__(self, sim: SimServer, shutdown_timeout_s: float, config: uvicorn.Config):
        super().__init__(config)
        self.sim, self.shutdown_timeout_s = sim, shutdown_timeout_s

    def handle_exit(self, sig, frame) -> None:
        loop = asyncio.get_event_loop()  # a signal handler: wake the loop to schedule it
        loop.call_soon_threadsafe(loop.call_later, self.shutdown_timeout_s, self.sim.abort_all)
        super().handle_exit(sig, frame)


if __name__ == "__main__":
    main()
