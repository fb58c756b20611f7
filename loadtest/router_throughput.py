"""Router throughput: routed requests per second per ingress process, how it grows with
ingress processes sharing one Redis, and the 32-at-once burst of docs/fault-cases.md 10.1,
all through the same request path (issue 12, "Router throughput").

Definition. **Routed requests/s** is the number of chat requests answered with a 200 that
carries ``x-routed-replica`` and ends with ``data: [DONE]``, counted when the answer's last
byte arrives inside a measuring window (after a warm-up), divided by the window's seconds.
The load is a closed loop: ``--concurrency`` conversations per ingress process (default
32), each sending its next turn as soon as the previous answer has ended (no think time).
A conversation is a multi-turn chat: one of 8 system prompts of 1,200 tokens (each shared by
the conversations of its group, as a product's system prompt is), then per turn an MT-Bench
question (FastChat, Apache-2.0, ``loadtest/data/mt-bench``) and, once answered, a 100-token
assistant reply appended to the history, as the engine's answer would be; after 8 turns it
starts again from its system prompt. Turns are about 1.3k to 3k tokens, 2.1k on average (the
mean is measured with the model's chat template and printed). Requests stream
(``stream: true``) and ask for 1 output token. Latency is from sending a request to its
answer's last byte; p50 / p99 are over the window's requests (nearest rank,
``loadtest.report.percentile``), at the loop's concurrency, so they include queueing in the
ingress.

What a request costs the ingress here is everything the router does for it: HTTP/1.1 in
(uvicorn serving the real ingress FastAPI app of ``router.app``: its ``Ingress`` class,
instantiated outside Ray Serve, with the same routes, body limit and error handling, on the
event loop Ray gives its replicas: uvloop where it is installed), then
``IngressCore.handle``: validation, chat template, tokenization (with the shared segments'
caches), block hashes, the atomic decision in Redis (``lua/route.lua``: match, score, choose,
reserve the load, write the predicted entries), the dispatch to the chosen engine's HTTP
server over pooled keep-alive connections (the direct data path, ``DirectAttempt``),
relaying its streamed answer, and the release of the load reservation in Redis. The
engines are reached by URL (``Settings.external_engines``, so each ingress process runs the
real ``ExternalFleet``: health checks and ``/metrics`` scrapes every 2 s); they publish no KV
events, so routing is in predicted mode (the decision's own predicted entries). Not
included: Ray Serve's HTTP proxy and its hop to the ingress replica (Serve's work, not the
router's; ``loadtest.overhead_e2e`` measures them), and the engines' work: each engine is a
zero-service-time server (``ZeroEngine``) that answers every request at once with one
token, parsing its body but not tokenizing it, so the host's cores go to the router. (The
project's simulated engine, ``replicas.sim.server``, takes a zero step time, ``--step-model
0,0,0,0``, but tokenizes every prompt whole and keeps a block pool: its CPU per request is
of the router's order, and on one host it would take the cores being measured.)

Scaling: ``--processes 1 2 4 8`` ingress processes, each on a port of its own (as Serve's
ingress replicas), share one Redis namespace (index, load, drains); conversation ``i`` goes
to process ``i mod P``. Clients are separate processes (``--clients``, default one
per ingress process) using aiohttp keep-alive connections; engines are separate processes
(``--engines``, default 8). The ingress processes', clients' and Redis's CPU use over the
window is measured (``/proc/<pid>/stat``, Redis ``INFO cpu``) so a run shows which of them
ran out of CPU. ``--profile FILE`` runs ingress process 0 under cProfile and prints where its
time goes.

Burst (docs/fault-cases.md 10.1): 32 chat requests of about 32k tokens (each its own system
prompt) sent at once, request ``i`` to ingress process ``i mod P`` (Serve spreads them over
its ingress replicas), 3 rounds; time to the first SSE data line per request, p50 / p99 over
all rounds, against the single-request time (the p50 of 10 such requests sent one at a
time through the same path). Also each answer's ``server-timing``: the router's own
arrival-to-dispatch time and its parts (``body``, ``prepare``, ``decide``). The burst is sent
by one client process (its 32 requests on one event loop, whose own work on them is then
part of the measured time) or, with ``--burst-clients N``, by N client processes released
together by a barrier, as separate users would send it.

    python -m loadtest.router_throughput --processes 1 2 --doc
    python -m loadtest.router_throughput --processes 1 2 4 8 --redis-url redis://127.0.0.1:6390/0 \\
        --doc --suffix ", 16-core GPU host"
    python -m loadtest.router_throughput --processes 4 --burst-only --burst-clients 4
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import random
import sys
import time
import uuid
from dataclasses import dataclass

from loadtest.report import RESULTS, percentile, write_benchmark_doc
from loadtest.texts import mt_bench_turns, words_text
from router.serve.protocol import TIMING_PARTS, parse_server_timing

MODEL_NAME = "tiny-qwen2"
SYSTEM_TOKENS = 1200  # each group's system prompt
ANSWER_TOKENS = 100  # the assistant reply appended after each answered turn
TURNS = 8  # turns of a conversation before it starts again
GROUPS = 8  # system prompts, each shared by a group of conversations
TARGET_PER_PROCESS = 500.0  # routed requests/s per ingress process (issue 12)
LINEAR_EFFICIENCY = 0.9  # "linear": per-process rate at P >= 90 % of the 1-process rate
BURST_RATIO = 3.0  # docs/fault-cases.md 10.1: burst p99 at most 3 x the single-request time
PROFILE_AFTER_S = 5.0  # --profile starts this long after the ingress process serves
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


# --- the zero-service-time engine ----------------------------------------------------------

class _EngineProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive, requests with a ``content-length`` body (what httpx sends),
    answered in the order they arrive. Routes: ``POST /v1/chat/completions`` and ``POST
    /v1/completions`` (one token; an SSE stream with chunked transfer encoding, as vLLM's
    server sends it, when the body asks ``stream``; else a JSON body), ``GET /health``,
    ``GET /metrics`` (vLLM's gauge names, all zero), ``GET /v1/models``, ``GET /stats``
    (``{"requests": n}``: generate calls answered)."""

    count = 0  # generate calls answered by this process

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            lines = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            method, path = lines[0].split(" ")[:2]
            length = 0
            for line in lines[1:]:
                name, _, value = line.partition(":")
                if name.strip().lower() == "content-length":
                    length = int(value)
            if len(self.buf) < end + 4 + length:
                return
            body = bytes(self.buf[end + 4:end + 4 + length])
            del self.buf[:end + 4 + length]
            self.transport.write(self.answer(method, path.split("?")[0], body))

    def answer(self, method: str, path: str, body: bytes) -> bytes:
        if method == "POST" and path in ("/v1/chat/completions", "/v1/completions"):
            _EngineProtocol.count += 1
            return _generate(path, body, _EngineProtocol.count)
        if path == "/health":
            return _http(200, b"", "text/plain")
        if path == "/metrics":
            return _http(200, b'vllm:num_requests_running{engine="0"} 0\n'
                              b'vllm:num_requests_waiting{engine="0"} 0\n'
                              b'vllm:kv_cache_usage_perc{engine="0"} 0\n', "text/plain")
        if path == "/v1/models":
            return _http(200, json.dumps({"object": "list", "data": [
                {"id": MODEL_NAME, "object": "model", "owned_by": "zero-engine"}]}).encode())
        if path == "/stats":
            return _http(200, json.dumps({"requests": _EngineProtocol.count}).encode())
        return _http(404, b'{"error": {"message": "not found", "code": 404}}')


def _http(status: int, body: bytes, ctype: str = "application/json") -> bytes:
    reason = {200: "OK", 400: "Bad Request", 404: "Not Found"}.get(status, "")
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: {ctype}\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def _generate(path: str, raw: bytes, n: int) -> bytes:
    """The one-token answer to a generate call, in OpenAI's shape (``usage.prompt_tokens``
    is the body's bytes / 4, an estimate: this engine does not tokenize)."""
    try:
        body = json.loads(raw)
    except ValueError:
        return _http(400, b'{"error": {"message": "invalid JSON", "code": 400}}')
    chat = path == "/v1/chat/completions"
    rid = f"{'chatcmpl' if chat else 'cmpl'}-zero{n}"
    usage = {"prompt_tokens": len(raw) // 4, "completion_tokens": 1,
             "total_tokens": len(raw) // 4 + 1, "prompt_tokens_details": {"cached_tokens": 0}}
    model = body.get("model", MODEL_NAME)
    if not body.get("stream"):
        choice = ({"index": 0, "message": {"role": "assistant", "content": " ok"},
                   "finish_reason": "length"} if chat else
                  {"index": 0, "text": " ok", "finish_reason": "length"})
        return _http(200, json.dumps({"id": rid, "object": "chat.completion" if chat else
                                      "text_completion", "created": 0, "model": model,
                                      "choices": [choice], "usage": usage}).encode())
    kind = "chat.completion.chunk" if chat else "text_completion"
    first = ({"index": 0, "delta": {"role": "assistant", "content": " ok"},
              "finish_reason": None} if chat else {"index": 0, "text": " ok",
                                                    "finish_reason": None})
    last = ({"index": 0, "delta": {}, "finish_reason": "length"} if chat else
            {"index": 0, "text": "", "finish_reason": "length"})
    events = [{"id": rid, "object": kind, "created": 0, "model": model, "choices": [c]}
              for c in (first, last)]
    if (body.get("stream_options") or {}).get("include_usage"):
        events.append({"id": rid, "object": kind, "created": 0, "model": model,
                       "choices": [], "usage": usage})
    out = [b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
           b"transfer-encoding: chunked\r\n\r\n"]
    for data in [b"data: " + json.dumps(e).encode() + b"\n\n" for e in events] \
            + [b"data: [DONE]\n\n"]:
        out.append(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    out.append(b"0\r\n\r\n")
    return b"".join(out)


def _engine_main(port: int) -> None:
    """One zero-service-time engine process on 127.0.0.1:``port`` (runs until killed)."""
    async def serve() -> None:
        server = await asyncio.get_running_loop().create_server(
            _EngineProtocol, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()
    asyncio.run(serve())


# --- the ingress process -------------------------------------------------------------------

class _NoRayEngines:
    """Stands in for the engine deployment's handle: no engine runs in Ray here, every one
    is reached by URL. Its only call, the ingress's warm-up ping at start, answers at once."""

    class _Ping:
        @staticmethod
        def remote():
            done = asyncio.get_running_loop().create_future()
            done.set_result(None)
            return done

    ping = _Ping()


def _server_class():
    """uvicorn's ``Server`` that stops on SIGTERM without raising the signal again once
    stopped (uvicorn re-raises it, which would end the process before its cProfile stats
    are written)."""
    import signal

    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self.handle_exit, sig, None)
            yield

    return Server


class _ReplicaContext:
    """What Serve's routes read of a replica's context: the object serving them."""

    def __init__(self, servable_object):
        self.servable_object = servable_object


def _ingress_main(port: int, settings: dict, profile_path: str | None) -> None:
    """One ingress process: the ``Ingress`` class of ``router.app`` made outside Ray Serve
    (the object ``@serve.ingress`` wraps, with ``settings``), its FastAPI app served by
    uvicorn on 127.0.0.1:``port`` until SIGTERM. With ``profile_path``, the process runs
    under cProfile (with a Redis timeout of 1 s, see below) and writes its stats there
    when it stops."""
    import logging

    import uvicorn

    from router import app as router_app

    logging.getLogger("router").setLevel(logging.WARNING)
    profiler = None
    if profile_path:
        import cProfile
        profiler = cProfile.Profile()
        # cProfile slows the process about twofold: Redis answers would then miss the
        # default 50 ms deadline and requests fall back to load, off the path profiled
        settings = {**settings, "redis_timeout_s": 1.0}

    async def serve() -> None:
        import ray.serve

        cls = router_app.Ingress.func_or_class.__mro__[1]  # the class @serve.ingress wraps

        class _Ingress(cls):
            def __del__(self):
                """Serve's stop hook is the class's async ``__del__``, awaited below; the
                object's collection at exit then has nothing to do (calling the async one
                there only made a coroutine never awaited, and Python's warning)."""

        ingress = _Ingress(settings, _NoRayEngines())
        # Serve's class-based routes take ``self`` from the replica's context
        # (``serve.get_replica_context().servable_object``): here the one object made above
        ray.serve.get_replica_context = lambda: _ReplicaContext(ingress)
        fastapi_app = router_app.fastapi_app
        config = uvicorn.Config(fastapi_app, host="127.0.0.1", port=port, log_level="warning",
                                access_log=False, backlog=4096, timeout_keep_alive=60)
        if profiler is not None:  # from when the stack is up: start-up work left out
            asyncio.get_running_loop().call_later(PROFILE_AFTER_S, profiler.enable)
        try:
            await _server_class()(config).serve()
        finally:
            await cls.__del__(ingress)  # Serve's stop hook: the pooled connections close
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(profile_path)
    _run_like_ray(serve())


def _run_like_ray(main) -> None:
    """Run ``main`` on the event loop a Ray Serve replica has: uvloop where it is installed
    (Ray's workers install it unless ``RAY_USE_UVLOOP=0``, ``ray._private.async_compat``),
    else asyncio's own."""
    try:
        import uvloop
    except ImportError:
        uvloop = None
    use = uvloop is not None and os.environ.get("RAY_USE_UVLOOP", "1").lower() not in (
        "0", "false")
    loop = uvloop.new_event_loop() if use else asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(main)
    finally:
        loop.close()


# --- the clients ---------------------------------------------------------------------------

class Conversation:
    """One simulated user's chat: ``system`` then, per turn, an MT-Bench question; after an
    answer, ``ANSWER_TOKENS`` tokens of assistant reply (deterministic per conversation and
    turn); after ``TURNS`` turns it starts again with the same system prompt.

    Args:
        system: the group's system prompt.
        key: names this conversation (its questions' and replies' seed).
        tokenizer_dir: the model directory, for replies of exactly ``ANSWER_TOKENS`` tokens.
    """

    def __init__(self, system: str, key: str, tokenizer_dir: str | None):
        self.system = system
        self.key = key
        self.tokenizer_dir = tokenizer_dir
        self.rng = random.Random(key)
        self.round = 0
        self._restart()

    def _restart(self) -> None:
        self.messages = [{"role": "system", "content": self.system},
                         {"role": "user", "content": self.rng.choice(mt_bench_turns())}]
        self.turn = 0

    def body(self) -> bytes:
        """The next turn's request body (JSON bytes)."""
        return json.dumps({"model": MODEL_NAME, "messages": self.messages, "max_tokens": 1,
                           "stream": True}).encode()

    def answered(self) -> None:
        """The turn was answered: append the reply and the next question (or restart)."""
        self.turn += 1
        if self.turn >= TURNS:
            self.round += 1
            self._restart()
            return
        reply = words_text(ANSWER_TOKENS, f"{self.key}-{self.round}-{self.turn}",
                           self.tokenizer_dir).strip()
        self.messages = self.messages + [{"role": "assistant", "content": reply},
                                         {"role": "user",
                                          "content": self.rng.choice(mt_bench_turns())}]


def system_prompts(tag: str, tokenizer_dir: str | None) -> list[str]:
    """The ``GROUPS`` system prompts of a run (``SYSTEM_TOKENS`` tokens each, seeded by
    ``tag``, so another run's cached blocks never match)."""
    return [f"[{tag} group {g}] You are the assistant of a help desk." +
            words_text(SYSTEM_TOKENS, f"{tag}-system-{g}", tokenizer_dir) for g in range(GROUPS)]


@dataclass
class Sample:
    """One request answered inside the window: latency (s), whether it was a routed,
    complete 200 (``ok``), its status and its ``x-routing-reason`` (cache, load, fallback)."""
    latency_s: float
    ok: bool
    status: int
    reason: str = ""


async def _client_loop(urls: list[str], convs: list[tuple[int, Conversation]],
                       warmup_s: float, window_s: float) -> list[Sample]:
    """Drive ``convs`` (each with its ingress index into ``urls``) in a closed loop for
    ``warmup_s + window_s``; the samples whose answer ended inside the window."""
    import aiohttp

    out: list[Sample] = []
    t_start = time.perf_counter()
    t_measure, t_end = t_start + warmup_s, t_start + warmup_s + window_s
    headers = {"content-type": "application/json"}

    async def converse(session, url: str, conv: Conversation) -> None:
        while time.perf_counter() < t_end:
            body = conv.body()
            t0 = time.perf_counter()
            try:
                async with session.post(url, data=body, headers=headers) as r:
                    status, routed = r.status, "x-routed-replica" in r.headers
                    reason = r.headers.get("x-routing-reason", "")
                    data = await r.read()
                ok = status == 200 and routed and data.rstrip().endswith(b"data: [DONE]")
            except aiohttp.ClientError:
                status, ok, reason = -1, False, ""
            t1 = time.perf_counter()
            if t_measure <= t1 < t_end:
                out.append(Sample(t1 - t0, ok, status, reason))
            if ok:
                conv.answered()

    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        await asyncio.gather(*(converse(session, urls[k] + "/v1/chat/completions", c)
                               for k, c in convs))
    return out


def _client_main(urls: list[str], conv_ids: list[int], tag: str, tokenizer_dir: str | None,
                 warmup_s: float, window_s: float, ready, go, results) -> None:
    """One client process: builds its conversations (``conv_ids``; conversation ``i`` talks
    to ``urls[i % len(urls)]`` and belongs to group ``i % GROUPS``), puts ``"ready"`` on
    ``results``, waits for ``go``, runs the closed loop and puts ``(samples as tuples, cpu
    seconds of the loop)`` on ``results``."""
    systems = system_prompts(tag, tokenizer_dir)
    convs = [(i % len(urls), Conversation(systems[i % GROUPS], f"{tag}-c{i}", tokenizer_dir))
             for i in conv_ids]
    ready.put("ready")
    go.wait()
    cpu0 = time.process_time()
    samples = asyncio.run(_client_loop(urls, convs, warmup_s, window_s))
    results.put(([(s.latency_s, s.ok, s.status, s.reason) for s in samples],
                 time.process_time() - cpu0))


# --- the harness ---------------------------------------------------------------------------

def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system, all threads) process ``pid`` has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _redis_cpu_s(urls: list[str]) -> float:
    """CPU seconds the Redis servers at ``urls`` have used together (``INFO cpu``, their
    main threads and others): one URL for one Redis, every master's for a cluster."""
    import redis
    total = 0.0
    for url in urls:
        client = redis.Redis.from_url(url, socket_timeout=5)
        try:
            info = client.info("cpu")
        finally:
            client.close()
        total += float(info["used_cpu_user"]) + float(info["used_cpu_sys"])
    return total


class Stack:
    """The processes of a run: ``engines`` zero-service-time engines and ``ingress``
    ingress processes sharing ``redis_url``'s namespace ``namespace``. Use as a context
    manager: every process it started is stopped, and the namespace's keys deleted.

    Args:
        profile_path: run ingress process 0 under cProfile, its stats written there.
    Raises:
        RuntimeError: a process did not become ready within ``ready_timeout_s``.
    """

    def __init__(self, redis_url: str, ingress: int, engines: int = 8,
                 profile_path: str | None = None, ready_timeout_s: float = 120.0,
                 cluster_nodes: list[str] | None = None, shard_groups: int | None = None):
        from deploy.make_model import ensure_model
        from loadtest.service import free_ports
        from router.config import DEFAULT_MODEL_DIR

        ensure_model(DEFAULT_MODEL_DIR)
        self.model_dir = str(DEFAULT_MODEL_DIR)
        self.redis_url = redis_url
        # the Redis servers whose CPU a run reports: a cluster's masters, or the one Redis
        self.redis_nodes = cluster_nodes or [redis_url]
        self.cluster = cluster_nodes is not None
        self.namespace = f"rps-{uuid.uuid4().hex[:8]}"
        self.ctx = mp.get_context("spawn")
        ports = free_ports(engines + ingress)  # distinct: all are bound later
        self.engine_ports, self.ingress_ports = ports[:engines], ports[engines:]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ingress_ports]
        self.engine_urls = [f"http://127.0.0.1:{p}" for p in self.engine_ports]
        self.settings = {"model": self.model_dir, "redis_url": redis_url,
                         "index_namespace": self.namespace, "num_replicas": 0,
                         "data_path": "direct",
                         "external_engines": [{"url": u, "name": f"engine-{k}"}
                                              for k, u in enumerate(self.engine_urls)]}
        if self.cluster:  # the sharded mode: each decision's keys in one group's slot
            self.settings.update(redis_cluster=True, index_shard_groups=shard_groups)
        self.profile_path = profile_path
        self.ready_timeout_s = ready_timeout_s
        self.engines: list = []
        self.ingress: list = []

    def __enter__(self) -> "Stack":
        try:
            for port in self.engine_ports:
                p = self.ctx.Process(target=_engine_main, args=(port,), daemon=True)
                p.start()
                self.engines.append(p)
            for k, port in enumerate(self.ingress_ports):
                p = self.ctx.Process(target=_ingress_main, args=(
                    port, self.settings, self.profile_path if k == 0 else None), daemon=True)
                p.start()
                self.ingress.append(p)
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        """Until every ingress process answers ``/health`` with every engine up."""
        import httpx
        deadline = time.monotonic() + self.ready_timeout_s
        pending = list(self.urls)
        while pending:
            for p in self.engines + self.ingress:
                if not p.is_alive():
                    raise RuntimeError(f"process {p.pid} exited with {p.exitcode}")
            url = pending[0]
            try:
                h = httpx.get(url + "/health", timeout=2).json()
                if h.get("replicas") == len(self.engines) \
                        and h.get("engines_alive") == len(self.engines):
                    pending.pop(0)
                    continue
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} not ready after {self.ready_timeout_s} s")
            time.sleep(0.25)

    def __exit__(self, *exc) -> None:
        for p in self.ingress + self.engines:
            if p.is_alive():
                p.terminate()
        for p in self.ingress + self.engines:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        if self.cluster:
            return  # the cluster is the run's own, stopped with all its keys
        from router.index.redis import RedisPrefixIndex
        asyncio.run(RedisPrefixIndex(self.redis_url, self.namespace, timeout_s=5.0).flush())

    def engine_requests(self) -> int:
        """Generate calls the engines have answered so far, summed."""
        import httpx
        return sum(httpx.get(u + "/stats", timeout=5).json()["requests"]
                   for u in self.engine_urls)


def measure_throughput(stack: Stack, processes: int, concurrency: int = 32,
                       clients: int | None = None, warmup_s: float = 3.0,
                       window_s: float = 10.0) -> dict:
    """Routed requests/s of the first ``processes`` ingress processes of ``stack`` under a
    closed loop of ``concurrency`` conversations per process (module docstring), driven by
    ``clients`` client processes (default one per ingress process).

    Returns:
        ``rps`` (routed 200s per second, all processes), ``rps_per_process``, ``p50_ms`` /
        ``p99_ms`` (latency), ``ok`` / ``failed`` (requests in the window), ``engine_calls``
        (generate calls the engines answered over the whole run, warm-up included: at
        least ``ok``), ``cache_share`` (routed 200s decided by a cache match) and
        ``fallback`` (routed by this process's own counts: the index did not answer),
        CPU use over the run as a fraction of one core: ``ingress_cpu`` (mean per process),
        ``client_cpu`` (mean per client), ``redis_cpu``; ``redis_us_per_request``: Redis's
        CPU over the run per engine call (microseconds; every server summed), so one
        Redis core holds about ``1e6 / redis_us_per_request`` routed requests/s.
    Raises:
        RuntimeError: a client process did not report within the run's time plus 120 s.
    """
    clients = clients or processes
    urls = stack.urls[:processes]
    tag = f"{stack.namespace}-p{processes}"
    n_conv = concurrency * processes
    ctx = stack.ctx
    ready, go, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_client_main, args=(
        urls, list(range(k, n_conv, clients)), tag, stack.model_dir, warmup_s, window_s,
        ready, go, results), daemon=True) for k in range(clients)]
    for p in procs:
        p.start()
    try:
        for _ in procs:
            ready.get(timeout=120)
        calls0 = stack.engine_requests()
        cpu0 = [_cpu_s(p.pid) for p in stack.ingress[:processes]]
        redis0, t0 = _redis_cpu_s(stack.redis_nodes), time.perf_counter()
        go.set()
        got = [results.get(timeout=warmup_s + window_s + 120) for _ in procs]
        elapsed = time.perf_counter() - t0
        cpu = [_cpu_s(p.pid) - c for p, c in zip(stack.ingress[:processes], cpu0)]
        redis_cpu = _redis_cpu_s(stack.redis_nodes) - redis0
        calls = stack.engine_requests() - calls0
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
    samples = [s for got_samples, _ in got for s in got_samples]
    ok = [lat for lat, good, _, _ in samples if good]
    failed = [status for _, good, status, _ in samples if not good]
    reasons = [reason for _, good, _, reason in samples if good]
    return {"processes": processes, "concurrency": concurrency, "clients": clients,
            "window_s": window_s, "ok": len(ok), "failed": len(failed),
            "failed_statuses": sorted(set(failed)), "engines": len(stack.engines),
            "cache_share": reasons.count("cache") / max(len(reasons), 1),
            "fallback": reasons.count("fallback"),
            "rps": len(ok) / window_s, "rps_per_process": len(ok) / window_s / processes,
            "p50_ms": percentile(ok, 0.5, 0.0) * 1e3, "p99_ms": percentile(ok, 0.99, 0.0) * 1e3,
            "engine_calls": calls,
            "ingress_cpu": sum(cpu) / len(cpu) / elapsed,
            "client_cpu": sum(c for _, c in got) / len(got) / (warmup_s + window_s),
            "redis_cpu": redis_cpu / elapsed,
            "redis_us_per_request": redis_cpu / max(calls, 1) * 1e6}


async def _ttft(session, url: str, body: bytes) -> tuple[float, dict[str, float], bool]:
    """Seconds from sending ``body`` to the first SSE data line of its answer, the router's
    own time and its parts (s, by name) from ``server-timing``, and whether it was a
    routed, complete 200."""
    t0 = time.perf_counter()
    first = None
    async with session.post(url + "/v1/chat/completions", data=body,
                            headers={"content-type": "application/json"}) as r:
        ok = r.status == 200 and "x-routed-replica" in r.headers
        timing = parse_server_timing(r.headers.get("server-timing"))
        data = b""
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter() - t0
            data += line
    ok = ok and first is not None and b"[DONE]" in data
    return (first if first is not None else time.perf_counter() - t0), timing, ok


def _round_jobs(urls: list[str], rounds: list[list[bytes]], clients: int = 1,
                client: int = 0) -> list[list[tuple[str, bytes]]]:
    """Per round, the ``(url, body)`` requests that client ``client`` of ``clients`` sends:
    request ``i`` of a round by client ``i mod clients``, to ``urls[i mod len(urls)]``."""
    return [[(urls[i % len(urls)], b) for i, b in enumerate(bodies) if i % clients == client]
            for bodies in rounds]


async def _send_rounds(session, jobs: list[list[tuple[str, bytes]]], wait) -> list:
    """Each round of ``jobs`` sent all at once, after ``await wait(k)`` for round ``k``;
    the ``(round, _ttft result)`` of every request."""
    out = []
    for k, requests in enumerate(jobs):
        await wait(k)
        out += [(k, r) for r in await asyncio.gather(*(_ttft(session, u, b)
                                                       for u, b in requests))]
    return out


def _burst_client_main(jobs: list[list[tuple[str, bytes]]], warm: list[tuple[str, bytes]],
                       warmed, barrier, results) -> None:
    """One client process of a burst: sends ``warm`` (one request per ingress URL it uses,
    so that its connections are open) and waits on ``warmed`` (every client process and the
    parent, which then reads the ingress processes' CPU), then per round waits on
    ``barrier`` (every client process at once) and sends that round's ``(url, body)``
    requests all at once; puts the list of ``(round, _ttft result)`` on ``results``."""
    import aiohttp

    async def run():
        loop = asyncio.get_running_loop()
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=120)) as s:
            await asyncio.gather(*(_ttft(s, u, b) for u, b in warm))
            await loop.run_in_executor(None, warmed.wait, 120)
            return await _send_rounds(
                s, jobs, lambda k: loop.run_in_executor(None, barrier.wait, 120))

    results.put(asyncio.run(run()))


def _burst_in_processes(stack: Stack, urls: list[str], rounds: list[list[bytes]],
                        warm_body: bytes, clients: int, on_warm) -> list:
    """The burst's rounds sent by ``clients`` client processes started together (request
    ``i`` of a round by client ``i mod clients``, to ``urls[i mod len(urls)]``); the
    ``(round, _ttft result)`` of every request. ``on_warm()`` is called once every client
    has its warm-up answered, before the first round.

    Raises:
        RuntimeError: a client process did not report within 300 s, or did not warm up
            within 120 s.
    """
    import queue
    import threading

    ctx = stack.ctx
    warmed, barrier, results = ctx.Barrier(clients + 1), ctx.Barrier(clients), ctx.Queue()
    procs = []
    for c in range(clients):
        jobs = _round_jobs(urls, rounds, clients, c)
        used = sorted({u for job in jobs for u, _ in job})
        procs.append(ctx.Process(target=_burst_client_main, daemon=True, args=(
            jobs, [(u, warm_body) for u in used], warmed, barrier, results)))
    for p in procs:
        p.start()
    try:
        try:
            warmed.wait(120)
        except threading.BrokenBarrierError:
            raise RuntimeError("the burst's client processes did not warm up within "
                               "120 s") from None
        on_warm()
        return [r for _ in procs for r in results.get(timeout=300)]
    except queue.Empty:
        raise RuntimeError("a burst client process did not report within 300 s") from None
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


def measure_burst(stack: Stack, processes: int, tokens: int = 32768, concurrency: int = 32,
                  rounds: int = 3, singles: int = 10, clients: int = 1) -> dict:
    """docs/fault-cases.md 10.1's burst through the first ``processes`` ingress processes of
    ``stack``: ``singles`` chat requests of about ``tokens`` tokens one at a time, then
    ``rounds`` rounds of ``concurrency`` at once (request ``i`` to process ``i mod P``),
    every prompt its own system prompt of ``tokens`` tokens. The burst is sent by one
    client process (``clients`` 1, its requests on one event loop) or by ``clients``
    client processes released together by a barrier, as from separate users: the client's
    own work on 32 requests is then not queued on one loop.

    Returns:
        ``single_p50_ms``, ``burst_p50_ms`` / ``burst_p99_ms`` (time to first SSE data
        line), ``ratio`` (burst p99 / single p50), ``routing_p50_ms`` / ``routing_p99_ms``
        (the burst's server-timing: arrival in the handler to dispatch),
        ``single_routing_p50_ms`` (the same for the single requests), ``rest_p50_ms`` /
        ``rest_p99_ms`` (each burst request's time less its server-timing: its body's
        transfer before the handler, the engine call, the relay of the first event and
        the client's own work), ``<part>_p50_ms`` / ``<part>_p99_ms`` for the parts of
        the router's own time in the burst (``body``, ``prepare``, ``decide``:
        ``router.serve.protocol.RoutedRequest.timings``), ``first_round_p99_ms`` /
        ``later_rounds_p99_ms`` (the first round also opens connections: the client's to
        the ingress, the ingress's to Redis and to the engines), ``cpu_ms_per_request``
        (the ingress processes' CPU, all threads, from the first round's start to the
        last answer, per request of the rounds: with several client processes, from when
        every client has its warm-up answered; ``/proc`` counts CPU in 10 ms ticks per
        process, and the engine polls of that time are in it), ``ok`` / ``failed``
        (requests of both parts).
    """
    import aiohttp

    urls = stack.urls[:processes]
    tag = f"{stack.namespace}-burst{processes}"

    def body(seed: str) -> bytes:
        return json.dumps({"model": MODEL_NAME, "max_tokens": 1, "stream": True, "messages": [
            {"role": "system", "content": words_text(tokens, seed, stack.model_dir)},
            {"role": "user", "content": "Summarise."}]}).encode()

    single_bodies = [body(f"{tag}-s{i}") for i in range(singles + 1)]
    burst_bodies = [[body(f"{tag}-r{k}-{i}") for i in range(concurrency)]
                    for k in range(rounds)]

    async def run():
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(connector=connector,
                                         timeout=aiohttp.ClientTimeout(total=120)) as s:
            await asyncio.gather(*(_ttft(s, u, single_bodies[0]) for u in urls))  # warm
            single = [await _ttft(s, urls[i % len(urls)], b)
                      for i, b in enumerate(single_bodies[1:])]
            if clients > 1:
                return single, None

            async def wait(k):  # rounds 0.2 s apart; the CPU counted from the first
                if k == 0:
                    cpu0.extend(_cpu_s(p.pid) for p in ingress)
                else:
                    await asyncio.sleep(0.2)
            return single, await _send_rounds(s, _round_jobs(urls, burst_bodies), wait)

    ingress, cpu0 = stack.ingress[:processes], []
    single, burst = asyncio.run(run())
    counted = rounds * concurrency  # the requests the ingress CPU below was spent on
    if clients > 1:
        # the CPU counted from when every client has warmed up: a warm-up after the first
        # finds the head held and has its whole prompt encoded, work no round request does
        burst = _burst_in_processes(stack, urls, burst_bodies, single_bodies[0], clients,
                                    lambda: cpu0.extend(_cpu_s(p.pid) for p in ingress))
    cpu_ms = sum(_cpu_s(p.pid) - c for p, c in zip(ingress, cpu0)) * 1e3 / counted
    # the first round also opens the pools' connections (client to ingress, ingress to
    # Redis and to the engines): the warm-up opened one per ingress process
    first = [t for k, (t, _, _) in burst if k == 0]
    later = [t for k, (t, _, _) in burst if k > 0]
    burst = [r for _, r in burst]
    single_s = [t for t, _, _ in single]
    burst_s = [t for t, _, _ in burst]
    routing = [r["routing"] for _, r, _ in burst if "routing" in r]
    rest = [t - r["routing"] for t, r, _ in burst if "routing" in r]
    single_routing = [r["routing"] for _, r, _ in single if "routing" in r]
    parts = {}
    for name in TIMING_PARTS:
        got = [r[name] for _, r, _ in burst if name in r]
        parts[f"{name}_p50_ms"] = percentile(got, 0.5, 0.0) * 1e3
        parts[f"{name}_p99_ms"] = percentile(got, 0.99, 0.0) * 1e3
    s50 = percentile(single_s, 0.5)
    b99 = percentile(burst_s, 0.99)
    return {"processes": processes, "tokens": tokens, "concurrency": concurrency,
            "rounds": rounds, "singles": singles, "clients": clients,
            "ok": sum(ok for *_, ok in single + burst),
            "failed": sum(not ok for *_, ok in single + burst),
            "single_p50_ms": s50 * 1e3, "burst_p50_ms": percentile(burst_s, 0.5) * 1e3,
            "burst_p99_ms": b99 * 1e3, "ratio": b99 / s50,
            "routing_p50_ms": percentile(routing, 0.5, 0.0) * 1e3,
            "routing_p99_ms": percentile(routing, 0.99, 0.0) * 1e3,
            "single_routing_p50_ms": percentile(single_routing, 0.5, 0.0) * 1e3,
            "rest_p50_ms": percentile(rest, 0.5, 0.0) * 1e3,
            "rest_p99_ms": percentile(rest, 0.99, 0.0) * 1e3,
            "first_round_p99_ms": percentile(first, 0.99, 0.0) * 1e3,
            "later_rounds_p99_ms": percentile(later, 0.99, 0.0) * 1e3,
            "cpu_ms_per_request": cpu_ms, **parts}


def mean_prompt_tokens(model_dir: str, n_conv: int = 8) -> float:
    """Mean prompt tokens of the closed loop's turns (the model's chat template, rendered
    and tokenized whole), over ``n_conv`` conversations' ``TURNS`` turns."""
    from router.prompt.render import CHAT_PATH, PromptRenderer
    renderer = PromptRenderer(model_dir)
    systems = system_prompts("mean", model_dir)
    sizes = []
    for i in range(n_conv):
        conv = Conversation(systems[i % GROUPS], f"mean-c{i}", model_dir)
        for _ in range(TURNS):
            sizes.append(renderer.render(CHAT_PATH, json.loads(conv.body())).num_tokens)
            conv.answered()
    return sum(sizes) / len(sizes)


def profile_shares(path: str) -> list[tuple[str, float]]:
    """Where a cProfile stats file's CPU time went: own time (``tottime``) summed by
    package (a package on this interpreter's path, ``router.<module>``, the standard
    library's module, or for a built-in the library named in it), the wait in
    ``select``/``epoll`` left out (idle, not work); ``(group, share of the rest)``, largest
    first. Read it where it was written (the same paths)."""
    import pstats
    import re

    import sysconfig

    stats = pstats.Stats(path).stats  # {(file, line, name): (cc, nc, tt, ct, callers)}
    stdlib = sysconfig.get_paths()["stdlib"]
    # the roots packages are installed under (site-packages, PYTHONPATH entries), longest
    # first; the standard library's own folder and the repository are not among them
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    roots = sorted({os.path.join(p, "") for p in sys.path if p and os.path.isdir(p)
                    and os.path.abspath(p) not in (stdlib, here)}, key=len, reverse=True)
    groups: dict[str, float] = {}
    for (file, _, name), (_, _, tottime, _, _) in stats.items():
        if file == "~":  # a built-in: its name says whose it is
            if "epoll" in name or "select" in name:
                continue
            m = re.search(r"of '([A-Za-z_]+)", name)
            group = (m.group(1).lstrip("_") if m else "builtins").split(".")[0]
            if group == "socket":
                group = "socket calls"
        elif "/router/" in file and not any(file.startswith(r) for r in roots):
            group = "router." + file.split("/router/")[1].split("/")[0].removesuffix(".py")
        elif any(file.startswith(r) for r in roots):  # a package on the path
            root = next(r for r in roots if file.startswith(r))
            group = file[len(root):].split("/")[0].removesuffix(".py")
        else:
            group = "stdlib " + os.path.basename(os.path.dirname(file)) + "/" \
                + os.path.basename(file)
            if "/asyncio/" in file:
                group = "stdlib asyncio"
        groups[group] = groups.get(group, 0.0) + tottime
    total = sum(groups.values()) or 1.0
    return sorted(((g, t / total) for g, t in groups.items()), key=lambda x: -x[1])


def profile_summary(path: str, top: int = 25) -> str:
    """The CPU shares by package (``profile_shares``, those of at least 1 %) and the ``top``
    functions of a cProfile stats file by own time."""
    import io
    import pstats
    out = io.StringIO()
    out.write("CPU by package (own time, idle wait left out):\n")
    for group, share in profile_shares(path):
        if share >= 0.01:
            out.write(f"  {share:6.1%}  {group}\n")
    stats = pstats.Stats(path, stream=out)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


# --- the report ----------------------------------------------------------------------------

def tables(rows: list[dict], bursts: list[dict], mean_tokens: float,
           redis_desc: str = "one Redis") -> str:
    """The Markdown of a run: the throughput rows, the burst rows and the verdicts.
    ``redis_desc`` names the index's Redis (one Redis, or a cluster's masters and groups);
    the Redis CPU column is summed over its servers."""
    base = next((r for r in rows if r["processes"] == 1), None)
    t = ["| ingress processes | conversations | client processes | routed req/s | per process "
         "| speed-up vs 1 | latency p50 / p99 (ms) | failed | routed by cache / fallback | "
         "CPU per ingress process | CPU per client | Redis CPU | Redis CPU per request |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        up = f"{r['rps'] / base['rps']:.2f}" if base else "-"
        t.append(f"| {r['processes']} | {r['concurrency'] * r['processes']} | {r['clients']} | "
                 f"{r['rps']:,.0f} | {r['rps_per_process']:,.0f} | {up} | "
                 f"{r['p50_ms']:.1f} / {r['p99_ms']:.1f} | {r['failed']} | "
                 f"{r['cache_share']:.0%} / {r['fallback']} | "
                 f"{r['ingress_cpu'] * 100:.0f} % | {r['client_cpu'] * 100:.0f} % | "
                 f"{r['redis_cpu'] * 100:.0f} % | "
                 f"{r.get('redis_us_per_request', float('nan')):.0f} us |")
    text = (f"Closed loop, 2k-token multi-turn chat turns (mean {mean_tokens:,.0f} prompt "
            f"tokens), streamed, 1 output token, {rows[0]['engines']} zero-time engines, "
            f"{redis_desc}; "
            f"{rows[0]['window_s']:.0f} s window after a warm-up:\n\n" + "\n".join(t)) \
        if rows else "Closed-loop throughput: not measured here (`--burst-only`)."
    if bursts:
        b = ["| ingress processes | client processes | single request p50 (ms) "
             "| its router's own time p50 (ms) | 32 at once p50 / p99 (ms) | p99 / single "
             "| router's own time p50 / p99 (ms) "
             "| of it: body, prepare, decide p99 (ms) | the rest p50 / p99 (ms) "
             "| p99 first round / later rounds (ms) | ingress CPU per request (ms) | failed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in bursts:
            b.append(f"| {r['processes']} | {r.get('clients', 1)} | {r['single_p50_ms']:.1f} | "
                     f"{r['single_routing_p50_ms']:.1f} | "
                     f"{r['burst_p50_ms']:.1f} / {r['burst_p99_ms']:.1f} | {r['ratio']:.1f} | "
                     f"{r['routing_p50_ms']:.1f} / {r['routing_p99_ms']:.1f} | "
                     + ", ".join(f"{r.get(f'{n}_p99_ms', 0.0):.1f}" for n in TIMING_PARTS)
                     + f" | {r['rest_p50_ms']:.1f} / {r['rest_p99_ms']:.1f} | "
                     f"{r.get('first_round_p99_ms', 0.0):.1f} / "
                     f"{r.get('later_rounds_p99_ms', 0.0):.1f} | "
                     f"{r.get('cpu_ms_per_request', 0.0):.1f} | {r['failed']} |")
        text += (f"\n\ndocs/fault-cases.md 10.1's burst through the same path: "
                 f"{bursts[0]['concurrency']} chat requests of {bursts[0]['tokens']:,} tokens "
                 f"(each its own system prompt) at once, {bursts[0]['rounds']} rounds, time to "
                 f"the first SSE data line; single = {bursts[0]['singles']} such requests one "
                 f"at a time:\n\n" + "\n".join(b))
    return text + "\n\n" + verdicts(rows, bursts)


def verdicts(rows: list[dict], bursts: list[dict]) -> str:
    """The targets of issue 12 against ``rows`` and ``bursts``: at least
    ``TARGET_PER_PROCESS`` routed requests/s per ingress process; linear to 8 processes
    (per-process rate at 8 at least ``LINEAR_EFFICIENCY`` of the 1-process rate); the burst's
    p99 at most ``BURST_RATIO`` x the single-request p50 with 4 processes."""
    out = []
    one = next((r for r in rows if r["processes"] == 1), None)
    if one:
        per = one["rps_per_process"]
        out.append(f"- At least {TARGET_PER_PROCESS:.0f} routed requests/s per ingress "
                   f"process: {per:,.0f} with 1 process: "
                   f"**{'met' if per >= TARGET_PER_PROCESS else 'missed'}**.")
    eight = next((r for r in rows if r["processes"] == 8), None)
    if one and eight:
        eff = eight["rps_per_process"] / one["rps_per_process"]
        out.append(f"- Linear to 8 processes (per-process rate at 8 at least "
                   f"{LINEAR_EFFICIENCY:.0%} of 1's): {eight['rps'] / one['rps']:.2f} x with 8, "
                   f"{eff:.0%} per process: **{'met' if eff >= LINEAR_EFFICIENCY else 'missed'}"
                   f"**.")
    elif one:
        top = max(rows, key=lambda r: r["processes"])
        out.append(f"- Linear to 8 processes: not measured here (up to {top['processes']}: "
                   f"{top['rps'] / one['rps']:.2f} x with {top['processes']}).")
    four = next((b for b in bursts if b["processes"] == 4), None)
    if four:
        out.append(f"- 32-at-once burst p99 at most {BURST_RATIO:.0f} x the single-request "
                   f"time with 4 processes ({four.get('clients', 1)} client process"
                   f"{'es' if four.get('clients', 1) > 1 else ''}): "
                   f"{four['burst_p99_ms']:.1f} ms against "
                   f"{four['single_p50_ms']:.1f} ms, {four['ratio']:.1f} x: "
                   f"**{'met' if four['ratio'] <= BURST_RATIO else 'missed'}**.")
    elif bursts:
        out.append("- 32-at-once burst with 4 processes: not measured here.")
    return "Targets (issue 12):\n\n" + "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--processes", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--concurrency", type=int, default=32,
                    help="conversations per ingress process (closed loop)")
    ap.add_argument("--clients", type=int, default=None,
                    help="client processes (default: one per ingress process)")
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds before the window")
    ap.add_argument("--window", type=float, default=10.0, help="measuring window (s)")
    ap.add_argument("--no-burst", action="store_true", help="skip the 32-at-once burst")
    ap.add_argument("--burst-clients", type=int, default=1,
                    help="client processes that send the burst together (default 1)")
    ap.add_argument("--burst-only", action="store_true",
                    help="skip the closed-loop throughput: the burst alone")
    ap.add_argument("--profile", default=None,
                    help="run ingress process 0 under cProfile; stats written to this file")
    ap.add_argument("--redis-cluster", type=int, default=0, metavar="MASTERS",
                    help="start a local Redis Cluster of MASTERS masters for the run "
                         "(loadtest.redis_cluster) and route in the sharded mode; "
                         "--redis-url is then not used")
    ap.add_argument("--shard-groups", type=int, default=None,
                    help="index_shard_groups with --redis-cluster (default: 2 per master)")
    ap.add_argument("--doc", action="store_true", help="write the docs/benchmarks.md section")
    ap.add_argument("--suffix", default="", help="appended to the section title (machine)")
    a = ap.parse_args(argv)
    args = argv if argv is not None else sys.argv[1:]
    cmd = "python -m loadtest.router_throughput" + (" " + " ".join(args) if args else "")

    rows, bursts = [], []
    with contextlib.ExitStack() as resources:
        url, nodes, groups, redis_desc = a.redis_url, None, None, "one Redis"
        if a.redis_cluster:
            import tempfile

            from loadtest.redis_cluster import LocalRedisCluster
            workdir = resources.enter_context(tempfile.TemporaryDirectory())
            cluster = resources.enter_context(LocalRedisCluster(workdir, a.redis_cluster))
            url, nodes = cluster.url, [f"redis://127.0.0.1:{p}/0" for p in cluster.ports]
            groups = a.shard_groups or 2 * a.redis_cluster
            redis_desc = (f"a Redis Cluster of {a.redis_cluster} masters with the index in "
                          f"{groups} shard groups")
        stack = resources.enter_context(Stack(url, max(a.processes), a.engines, a.profile,
                                              cluster_nodes=nodes, shard_groups=groups))
        mean_tokens = _measure(stack, a, rows, bursts)
    if a.profile:
        print(profile_summary(a.profile))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"router-throughput-{int(time.time())}.json").write_text(
        json.dumps({"throughput": rows, "burst": bursts, "mean_prompt_tokens": mean_tokens,
                    "redis": redis_desc}, indent=1))
    text = tables(rows, bursts, mean_tokens, redis_desc)
    print(text)
    if a.doc:
        write_benchmark_doc("Router throughput (issue 12)" + a.suffix, cmd, text, NOTES)
    return 0


def _measure(stack: Stack, a: argparse.Namespace, rows: list[dict],
             bursts: list[dict]) -> float:
    """The throughput rows and the bursts of ``main``'s arguments ``a`` on ``stack``,
    appended to ``rows`` and ``bursts``; returns the mean prompt length (tokens)."""
    mean_tokens = mean_prompt_tokens(stack.model_dir)
    print(json.dumps({"mean_prompt_tokens": round(mean_tokens)}), flush=True)
    for p in [] if a.burst_only else a.processes:
        rows.append(measure_throughput(stack, p, a.concurrency, a.clients, a.warmup,
                                       a.window))
        print(json.dumps(rows[-1]), flush=True)
    if not a.no_burst:
        for p in a.processes:
            bursts.append(measure_burst(stack, p, clients=a.burst_clients))
            print(json.dumps(bursts[-1]), flush=True)
    return mean_tokens


NOTES = """Reading: "routed requests/s" counts 200s that carry `x-routed-replica` and end with
`data: [DONE]`, from a closed loop of conversations (no think time), so every ingress
process is kept busy; the loop's latency is then mostly queueing in the ingress (Little's
law: conversations / rate). Each request pays, in the ingress process: HTTP in (uvicorn), the
body's validation, the chat template, tokenization, block hashes, one Redis script for the
decision, the HTTP dispatch to the engine and the relay of its stream, and the load's release
in Redis. Ray Serve's proxy is not in it (it parses HTTP in a process of its own and hands the
request to an ingress replica over Ray). The engines answer at once and their CPU is small; the
CPU columns say which process ran out first: an ingress process near 100 % is the router's
own limit, a Redis near 100 % the shared index's, clients near 100 % would make the figure
the client's."""


if __name__ == "__main__":
    raise SystemExit(main())
