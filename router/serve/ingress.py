"""The OpenAI-compatible HTTP front door, deployed with Ray Serve.

Routes: ``POST /v1/chat/completions`` and ``POST /v1/completions`` (streaming SSE or not),
``GET /v1/models``, ``GET /health``, ``GET /metrics``.

Per request the ingress reads what routing needs through pydantic models that mirror the
OpenAI schema (malformed JSON or wrong types → OpenAI-style 400), renders and tokenizes the
prompt with the served model's tokenizer, computes the block hashes, and routes: on the
direct data path it decides itself and streams from the chosen engine's HTTP server; on the
serve path it calls the engine deployment through its handle and the Ray ``RequestRouter``
decides (``Settings.data_path``, docs/architecture.md "The data path"). The client's body is
forwarded byte for byte. A failure before the first byte (engine down, 5xx, replica
actor died) is retried once on another replica; after the first byte never (docs/fault-cases.md
6.3). The load reservation is released in a ``finally`` on every path: success, error, retry,
client disconnect (docs/fault-cases.md 1.2, 5.1).

Response headers: ``x-routed-replica`` (the replica that served), ``x-predicted-cached-tokens``
(the index's prediction for it), ``x-routing-reason`` (cache, load, fallback or session),
``x-routing-policy`` and ``x-data-path`` (what served it) and ``server-timing:
routing;dur=<ms>`` (W3C Server Timing: arrival at the ingress to dispatch).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import os
import re
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from router import metrics, tracing
from router.config import Settings
from router.hashing import BlockHasher
from router.index.base import IndexUnavailable
from router.logs import get_logger
from router.policy import LIVE_POLICIES, PolicySet
from router.prompt.render import CHAT_PATH, COMPLETIONS_PATH, PromptInfo, PromptRenderer
from router.routing.core import replicas_without_kv_events
from router.routing.replica import hash_mismatches
from router.routing.sessions import session_key
from router.serve import state
from router.serve.admission import Admission, parse_priority
from router.serve.auth import Tenant, tenant_cache_salt
from router.serve.dispatch import (
    Attempt,
    DirectAttempt,
    GuardedStreamingResponse,
    KeepAliveStreamingResponse,
    ServeAttempt,
    abandon,
)
from router.serve.engine_client import ENGINE_ERRORS, EngineClient
from router.serve.errors import OpenAIError, bad_request, invalid_body, no_replicas
from router.serve.protocol import ReplicaHead, RoutedRequest, route_label, server_timing
from router.serve.ratelimit import (RateLimiter, choices, context_tokens, max_output_tokens,
                                    prompt_over_limit, request_tokens,
                                    untokenized_prompt_tokens)
from router.serve.schemas import SCHEMAS, validation_message

logger = get_logger(__name__)

# Larger bodies are rendered off the event loop, on the render threads
# (``Settings.render_threads``). Without them, a long prompt whose tokenization stops at its
# head (``Settings.route_head_chars``) is rendered inline up to 1 MiB: about 2 ms, most of it
# the head's tokenization, which holds up the loop.
_RENDER_INLINE_MAX_BYTES = 16 * 1024
_RENDER_HEAD_INLINE_MAX_BYTES = 1024 * 1024
_RENDER_THREADS_AUTO_MAX = 4
_RENDER_THREADS_MIN_CORES = 4

_JSON_DECODER = msgspec.json.Decoder()
_SURROGATE = re.compile("[\ud800-\udfff]")


def json_object(raw: bytes) -> dict:
    """A request body's JSON object (``decode_json_body``).

    Raises:
        OpenAIError: 400 (``invalid_body``) for a body that is not JSON, is nested too
            deeply, holds a lone surrogate (``lone_surrogate_at``), or is not an object.
    """
    try:
        body, strict = _decode_json(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid_body(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise invalid_body("request body is nested too deeply") from None
    # only json.loads lets a lone surrogate through (msgspec refuses it): checked only then
    where = None if strict else lone_surrogate_at(body)
    if where is not None:
        # the path as text that UTF-8 can encode (a key may hold the surrogate itself: its
        # JSON answer then failed to encode, a plain-text 500; a review)
        loc = where[0].encode("utf-8", "backslashreplace").decode("utf-8")
        raise invalid_body(f"request body holds a lone UTF-16 surrogate ({where[1]!r}) at "
                           f"{loc or 'its top level'}: it is not Unicode text, and no engine "
                           "can encode it", loc or None)
    if not isinstance(body, dict):
        raise invalid_body("request body must be a JSON object")
    return body


def lone_surrogate_at(value) -> tuple[str, str] | None:
    """Where a JSON value holds a lone UTF-16 surrogate (U+D800 to U+DFFF, which JSON's
    ``\\uD800`` escapes can spell but UTF-8 cannot encode) in a string or an object's key:
    ``(dotted path, the character as a 1-character string)`` of the first one found, the
    path in ``invalid_body``'s form (``messages.0.content``; a key's own path for a key),
    or None. Walks lists and objects without recursion. Found by a break test: forwarded,
    one in a message's content got vLLM's 400 with the tokenizer binding's type error as
    its message, and one in ``stop`` a 500 with an empty message (retried on a second
    replica, and counted against both in the circuit breakers); the router refuses it
    first, naming the field."""
    stack = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            bad = _SURROGATE.search(v)
            if bad:
                return path, bad.group()
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x)
                         for i, x in reversed(list(enumerate(v))))
        elif isinstance(v, dict):
            for k, x in reversed(list(v.items())):
                sub = f"{path}.{k}" if path else str(k)
                bad = _SURROGATE.search(k)
                if bad:
                    return sub, bad.group()
                stack.append((sub, x))
    return None


def text_chars(value) -> int:
    """The characters of every string inside a JSON value (lists and objects walked
    without recursion, their keys left out); 0 for a value without strings."""
    total, stack = 0, [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
    return total


def message_chars(messages) -> int:
    """The characters of a chat request's messages that its prompt holds as text: a
    string ``content``, the ``text`` of each part of a list ``content`` (an image's, an
    audio's or a video's part becomes placeholder tokens, not its URL's characters), and
    every string of the messages' other fields (``name``, ``tool_calls``...); 0 for a value
    that is not a list."""
    if not isinstance(messages, list):
        return 0
    total = 0
    for m in messages:
        if not isinstance(m, dict):
            continue
        for key, v in m.items():
            if key == "content" and isinstance(v, list):
                total += sum(len(p["text"]) for p in v
                             if isinstance(p, dict) and isinstance(p.get("text"), str))
            else:
                total += text_chars(v)
    return total


def decode_json_body(raw: bytes):
    """The JSON value of a request body, exactly as ``json.loads(raw)`` gives it, in about
    a third of its time for long bodies: msgspec's strict RFC 8259 decoder first (42.7
    against 103.7 us for a 134 KB chat body of 32k tokens on the 2-core VM, under the GIL:
    docs/benchmarks.md, "Request bodies decoded by msgspec"), and ``json.loads`` for
    whatever it refuses. msgspec accepts no text that ``json.loads`` refuses (integers
    past Python's 4,300 digits included), and decodes what both accept to the same value;
    ``json.loads`` alone accepts NaN and Infinity, numbers beyond a float's range (as
    inf), lone surrogate escapes, a UTF-8 byte order mark and UTF-16 or UTF-32 bodies, and
    it gives the error messages.

    Raises:
        ValueError / UnicodeDecodeError / RecursionError: as ``json.loads``.
    """
    return _decode_json(raw)[0]


def _decode_json(raw: bytes) -> tuple[object, bool]:
    """``decode_json_body``'s value, and whether msgspec's strict decoder gave it (False:
    ``json.loads`` did, for a body msgspec refuses)."""
    try:
        return _JSON_DECODER.decode(raw), True
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return json.loads(raw), False


def cgroup_cpu_limit(path: str = "/sys/fs/cgroup/cpu.max") -> float | None:
    """The CPU limit of this process's cgroup (v2 ``cpu.max``: quota / period, in cores), as
    a container with a CPU limit has (Kubernetes' ``resources.limits.cpu``); None when there
    is none or it cannot be read. Affinity alone shows the host's cores in a container."""
    try:
        with open(path) as f:
            quota, period = f.read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def render_threads(settings: Settings) -> int:
    """How many render threads an ingress process runs: ``settings.render_threads``, or
    when it is None half the cores this process may run on (``os.sched_getaffinity``), at
    most ``_RENDER_THREADS_AUTO_MAX``, and none below ``_RENDER_THREADS_MIN_CORES`` cores:
    on the 2-core VM, where the client, the engines and Redis share the cores, a 32-request
    burst's p99 was no better with threads and its median worse (docs/benchmarks.md,
    "Router throughput"). 0 means none: bodies are rendered on the event loop."""
    if settings.render_threads is not None:
        return settings.render_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    quota = cgroup_cpu_limit()
    if quota is not None:
        cores = min(cores, max(1, int(quota)))
    if cores < _RENDER_THREADS_MIN_CORES:
        return 0
    return min(_RENDER_THREADS_AUTO_MAX, cores // 2)


class _Rest:
    """The rest of a long prompt that ``IngressCore.prepare`` hashed as far as its head
    (``router.serve.protocol.PromptRest``, carried by ``RoutedRequest.rest``). Made on the
    ingress's event loop; the routing step may run on another (Serve's router loop, a
    thread of its own, on the handle data path)."""

    def __init__(self, ingress: "IngressCore", info: PromptInfo):
        self.ingress, self.info = ingress, info
        self.loop = asyncio.get_running_loop()

    async def finish(self, req: RoutedRequest) -> None:
        """Encode the rest and hash the whole prompt, on asyncio's threads (not ahead of
        other requests' renders)."""
        await asyncio.to_thread(self.ingress._finish, req, self.info)

    def done(self, req: RoutedRequest) -> None:
        """Record the prompt as routed (head or whole) for the warm-up, on the ingress's
        loop, where every other use of the warm-up's record runs (it has no lock). Never
        raises: a loop already closed (the ingress stopping) records nothing."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.ingress._observe, req, self.info)


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
        self.policies = PolicySet(settings)
        self.admission = Admission(self.load, settings.max_inflight_per_replica,
                                   settings.queue_timeout_s, settings.retry_after_s,
                                   overloaded_timeout_s=settings.overloaded_queue_timeout_s)
        state.put("admission", self.admission)  # route_request ends holds from any path
        self.rate_limits = RateLimiter(
            state.redis_connections(settings) if settings.redis_url else None,
            settings.index_namespace)
        # for a request that names no max_tokens: the engine may fill the context
        self.context_tokens = context_tokens(settings.max_model_len, settings.model)
        if self.context_tokens is None:
            logger.info("the model's context length is unknown (no max_model_len, no "
                        "max_position_embeddings in %s/config.json): a chat request without "
                        "max_tokens is charged its prompt alone against a tenant's "
                        "tokens_per_minute", settings.model)
        self._index = None  # made on first use, on the ingress's loop (a Redis client's own)
        self._routing = None  # the direct path's RoutingCore, likewise
        self._engine_client = None  # the direct path's pooled HTTP client, likewise
        self._any_turn = 0  # rotates any_engine's first choice
        self._gauges_task: asyncio.Task | None = None  # see _keep_gauges
        self._turn: asyncio.Lock | None = None  # see _cpu_turn
        threads = render_threads(settings)  # see prepare; started on first use
        self._render_pool = ThreadPoolExecutor(threads, thread_name_prefix="render") \
            if threads else None
        tracing.configure(settings)  # OpenTelemetry traces, when an endpoint is configured
        self.warmup = None  # warm-up and re-homing (router.serve.warmup), when enabled
        if settings.warmup_enabled:
            from router.serve.warmup import WarmupService
            self.warmup = WarmupService(settings, self)

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
            await self.prefix_index().forget_predicted(replica, req.block_hashes[start:])
        except IndexUnavailable:
            metrics.inc("index_errors", tags={"op": "forget_predicted"})

    def prefix_index(self):
        """The index, made on first use: on the ingress's own loop (a Redis client belongs
        to the loop that made it)."""
        if self._index is None:
            self._index = state.make_index(self.settings)
        return self._index

    def _count_inflight(self, replica: str, delta: int) -> None:
        n = self.inflight.get(replica, 0) + delta
        self.inflight[replica] = n
        metrics.set_gauge("inflight", n, tags={"replica": replica})
        if self._gauges_task is None:
            self._gauges_task = asyncio.get_running_loop().create_task(self._keep_gauges())

    async def _keep_gauges(self, period_s: float = 5.0) -> None:
        """Every ``period_s``, the gauges that describe the fleet now, idle or not:
        ``router_replica_hash_mismatch`` per replica known now,
        ``router_replicas_without_kv_events``, ``router_admission_waiting`` (with a bound)
        and, on the direct path, the index's probe (``RoutingCore.probe_index``; the Ray
        router's own loop probes on the serve path). Every gauge is set through
        ``metrics.set_gauge``, which hands it to Ray again while unchanged (Ray's exporter
        drops a gauge that has not been set for a while: one set only on change vanished
        from ``/metrics``); a replica that left the deployment has its series forgotten
        (its ``router_inflight`` once its count is 0)."""
        mismatch: set[str] = set()
        while True:
            await asyncio.sleep(period_s)
            try:
                mismatch = await self._set_gauges(mismatch)
            except Exception:  # a bug here must not end the gauges for good
                logger.exception("fleet gauges not set")

    async def _set_gauges(self, mismatch: set[str]) -> set[str]:
        """One round of ``_keep_gauges``; ``mismatch``: the replicas whose
        ``router_replica_hash_mismatch`` the last round set. Returns this round's."""
        if self.admission.bound is not None:
            metrics.set_gauge("admission_waiting", self.admission.waiting)
        infos = state.replica_infos() or ()
        for info in infos:
            metrics.set_gauge("hash_mismatch", 1 if hash_mismatches(
                self.settings.hash_settings, info.metadata) else 0,
                tags={"replica": info.replica_id})
        for gone in mismatch - {i.replica_id for i in infos}:
            metrics.forget_gauge("hash_mismatch", {"replica": gone})
        metrics.set_gauge("replicas_without_kv_events", replicas_without_kv_events(infos))
        if self._routing is not None:
            await self._routing.probe_index()
        current = state.replica_ids()
        for replica, n in list(self.inflight.items()):
            if current is not None and replica not in current and n == 0:
                del self.inflight[replica]
                metrics.forget_gauge("inflight", {"replica": replica})
        return {i.replica_id for i in infos}

    def check_tokens_body(self, path: str, body: dict) -> None:
        """Refuse, before an engine spends on it, a ``/tokenize`` body with more text than
        any prompt of the model can hold, or a ``/detokenize`` body with more tokens than
        its context. vLLM bounds an inference request's prompt so before tokenizing it (at
        most the context length times the vocabulary's longest token in characters:
        ``_text_len_check``, ``vllm/renderers/params.py``; the message below is its
        wording) but not these two endpoints: a 10 MB text held one engine for 10.8 s, and
        a chat request routed to it meanwhile waited as long. The text counted is every
        string of ``prompt`` and ``tools`` and the text of ``messages``
        (``message_chars``: an image's data URL is not text). No bound while the context
        length is unknown (``context_tokens``).

        Raises:
            OpenAIError: 400 (``BadRequestError``; ``param`` ``tokens``, ``messages`` or
                ``prompt``).
        """
        ctx = self.context_tokens
        if ctx is None:
            return
        if path == "/detokenize":
            tokens = body.get("tokens")
            if isinstance(tokens, list) and len(tokens) > ctx:
                raise bad_request(f"This model's maximum context length is {ctx} tokens. "
                                  f"However, the request has {len(tokens)} tokens to "
                                  f"detokenize.", "tokens")
            return
        limit = ctx * self.renderer.max_chars_per_token
        chars = text_chars(body.get("prompt")) + text_chars(body.get("tools")) + \
            message_chars(body.get("messages"))
        if chars > limit:
            raise bad_request(
                f"This model's maximum context length is {ctx} tokens. However, your prompt "
                f"contains {chars} characters (more than {limit} characters, which is the "
                f"upper bound for {ctx} input tokens). Please reduce the length of the input "
                f"prompt.", "messages" if "messages" in body else "prompt")

    # --- helpers -----------------------------------------------------------------------
    def _replica_count(self) -> int | None:
        return state.replica_count()

    def _prepare(self, path: str, raw: bytes, head_chars: int = 0,
                 tenant: Tenant | None = None, priority: int | None = None,
                 session: str | None = None) -> tuple[RoutedRequest, PromptInfo]:
        body = json_object(raw)
        client_bytes = len(raw)
        try:
            parsed = SCHEMAS[path].model_validate(body)
        except RecursionError:
            raise invalid_body("request body is nested too deeply") from None
        except ValidationError as exc:
            msg, loc = validation_message(exc)
            raise invalid_body(msg, loc) from None
        tracing.request_attributes(path, body)  # gen_ai.* on the request's span
        overrides: dict = {}
        if tenant is not None and self.settings.tenant_cache_isolation:
            # the engine keeps the tenant's blocks apart, and the router's hashes follow
            overrides["cache_salt"] = tenant_cache_salt(tenant, parsed.cache_salt or None,
                                                        self.settings.cache_salt_secret)
        if priority is not None and self.settings.engine_priority_scheduling:
            overrides["priority"] = priority
        if overrides:
            body.update(overrides)
            raw = json.dumps(body).encode()  # ASCII escapes: any text survives
        if len(raw) > self.settings.route_tokenize_max_bytes:
            info = PromptInfo(cacheable=False, reason="too long to tokenize for routing")
        else:
            info = self.renderer.render(path, body, head_chars)
        user = body.get("user") if self.settings.session_from_user else None
        session = session or (user if isinstance(user, str) and user else None)
        req = RoutedRequest(request_id=uuid.uuid4().hex, path=path, body=raw,
                            stream=bool(parsed.stream),
                            max_output_tokens=max_output_tokens(
                                body, completions=path == COMPLETIONS_PATH),
                            choices=choices(body, completions=path == COMPLETIONS_PATH),
                            untokenized_prompt_tokens=0 if info.cacheable else
                            untokenized_prompt_tokens(body, client_bytes),
                            session_key=session_key(tenant.name if tenant else None, session)
                            if session else None)
        adapter = self.settings.adapter(body.get("model"))
        req.lora_name = adapter.name if adapter else None
        self._hash(req, info)
        return req, info

    def _hash(self, req: RoutedRequest, info: PromptInfo) -> None:
        req.prompt_tokens = info.num_tokens
        adapter = self.settings.adapter(req.lora_name)
        req.block_hashes = self.hasher.block_hashes(
            info.token_ids, cache_salt=info.cache_salt, lora_name=req.lora_name,
            lora_path=adapter.path if adapter else None) if info.cacheable else []

    def _finish(self, req: RoutedRequest, info: PromptInfo, budget: int | None = None) -> bool:
        """Encode the rest of a prompt whose head a replica holds, and hash it all (True).
        With a ``budget`` (tokens), only when the whole prompt is at most that long: False
        when it is longer, the prompt left unfinished (``PromptInfo.finish``). Text the
        tokenizer refuses (a lone surrogate...) leaves the request routed by load, as
        ``PromptRenderer.render`` does: the engine gives the authoritative 400 (True: the
        estimate stands)."""
        try:
            if not info.finish(budget):
                return False
        except Exception as exc:
            logger.debug("prompt rest not encoded (%s): routing by load", exc)
            req.block_hashes = []
            return True
        self._hash(req, info)
        return True

    async def prepare(self, path: str, raw: bytes, policy: str | None = None,
                      tenant: Tenant | None = None, priority: int | None = None,
                      session: str | None = None) -> RoutedRequest:
        """Validate, render, tokenize and hash; long prompts off the event loop.

        Under ``prefix_aware``, a prompt longer than ``Settings.route_head_chars`` is first
        encoded up to about that many characters. Its blocks past the head can match a
        replica only if that replica holds every block of the head (a match is a prefix), so
        the rest is encoded only then. The request leaves with the head's hashes, its
        length estimated from the head's tokens per UTF-8 byte, and its rest
        (``RoutedRequest.rest``): the routing step decides on the head's hashes, in the
        same Redis script as the decision, and encodes the rest only when a replica holds
        the whole head (``router.routing.core.route_request``). Otherwise the decision on
        the head is the decision on every block, and predicted entries are written for the
        head only (a burst sharing the new prefix still finds them and lands together; the
        engine's events then bring every block).

        With a ``tenant`` (API keys on) and ``tenant_cache_isolation``, the body forwarded
        carries the tenant's ``cache_salt`` (``router.serve.auth.tenant_cache_salt``) and
        the block hashes are the salted ones; with ``engine_priority_scheduling`` it
        carries ``priority``. Only then is the body re-serialised rather than forwarded
        byte for byte.

        Args:
            policy: the request's own policy (``x-routing-policy``), or None.
            tenant: the authenticated caller, or None when keys are off.
            priority: the request's resolved priority (``resolve_priority``), or None.
            session: the request's session header, or None (then its ``user`` field may
                name its session, ``Settings.session_from_user``).
        Raises:
            OpenAIError: 400 for malformed bodies.
        """
        prefix_aware = self.settings.policy_for(policy) == "prefix_aware"
        head = self.settings.route_head_chars if prefix_aware else 0
        inline = _RENDER_HEAD_INLINE_MAX_BYTES if (
            self._render_pool is None and head and self.renderer.segments.chunked) \
            else _RENDER_INLINE_MAX_BYTES
        if len(raw) > inline:
            req, info = await self._off_loop(self._prepare, path, raw, head, tenant,
                                             priority, session)
        else:
            async with self._cpu_turn():
                req, info = self._prepare(path, raw, head, tenant, priority, session)
        if info.rest is not None and tenant is not None and tenant.tokens_per_minute is not None:
            # a tenant with a token limit is charged its prompt's exact count (the rest's
            # estimate from a sparse head let 8,050 tokens through as 563), encoded only as
            # far as its limit can hold: a prompt over it costs about that many tokens of
            # encoding, however long it is
            budget = max(tenant.tokens_per_minute - req.max_output_tokens, 0)
            if not await asyncio.to_thread(self._finish, req, info, budget):
                raise prompt_over_limit(tenant, budget + 1 + req.max_output_tokens)
        if info.rest is not None and req.block_hashes:
            req.rest = _Rest(self, info)  # the routing step decides whether to encode it
            return req
        if info.rest is not None:
            # the head holds no full block to look up (it opens with a long text without
            # spaces): the whole prompt, on asyncio's threads, not ahead of other renders
            await asyncio.to_thread(self._finish, req, info)
            metrics.inc("long_prompts", tags={"tokenized": "whole"})
        self._observe(req, info)
        return req

    def _observe(self, req: RoutedRequest, info: PromptInfo) -> None:
        """Record the prompt for the warm-up of new replicas (``Settings.warmup``)."""
        if self.warmup is not None:
            self.warmup.observe(req.block_hashes, info.token_ids, info.cache_salt,
                                req.lora_name)

    async def _off_loop(self, fn, *args):
        """``fn(*args)`` on a render thread (``Settings.render_threads``: a pool that takes
        work in arrival order), or on asyncio's default threads when there are none, with
        this task's context (its tracing span). The tokenizer releases the GIL, so a burst
        of long prompts is tokenized on several cores while the loop serves I/O; the parts
        that hold the GIL (JSON parsing, the chat template, hashing) still take turns.
        (``asyncio.to_thread`` is this with the default threads.)"""
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(
            self._render_pool, ctx.run, fn, *args)

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

    def check_policy(self, policy: str | None) -> None:
        """Refuse an ``x-routing-policy`` header this service does not honour: an unknown
        name, or any name while ``allow_policy_override`` is off (the request would run the
        configured policy while its sender believes it runs another).

        Raises:
            OpenAIError: 400 naming the header.
        """
        if not policy:
            return
        if not self.settings.allow_policy_override:
            raise bad_request(
                f"this service routes every request by {self.settings.policy!r}; the "
                "x-routing-policy header is honoured only with the setting "
                "allow_policy_override", "x-routing-policy")
        if policy not in LIVE_POLICIES:
            raise bad_request(f"unknown routing policy {policy!r}; choose from "
                              f"{sorted(LIVE_POLICIES)}", "x-routing-policy")

    # --- the request path --------------------------------------------------------------
    async def handle(self, path: str, raw: bytes, t_arrival: float,
                     policy: str | None = None, data_path: str | None = None,
                     tenant: Tenant | None = None, priority: str | None = None,
                     session: str | None = None, body_s: float | None = None,
                     prepared: Callable[[], None] | None = None) -> Response:
        """Serve one inference request; returns the response to send.

        The request is admitted first (``router.serve.admission``: with
        ``max_inflight_per_replica``, it waits while every replica is at its bound, by
        priority, and gets a 429 past ``queue_timeout_s``). A failure before the first
        body byte (engine down or refusing with a 5xx, the replica actor gone) is retried
        once on another replica; the second failure is answered with its status (502 when
        there is none) in the OpenAI error shape.

        Args:
            policy / data_path: the request's ``x-routing-policy`` / ``x-data-path``
                headers (benchmarks compare policies and data paths on the same replicas;
                honoured only with ``allow_policy_override``).
            tenant: the authenticated caller (``router.serve.auth``), or None.
            priority: the request's priority header (``Settings.priority_header``), or None.
            session: its session header (``Settings.session_header``), or None.
            body_s: seconds its body took to read after ``t_arrival``, when the caller
                read it (``RoutedRequest.timings``).
            prepared: called once the request is rendered and within its tenant's rate
                limits (the caller's ``TenantSlot.release``).
        Raises:
            OpenAIError: 400 (malformed body or priority, refused ``x-routing-policy`` or
                ``x-data-path``), 429 (the tenant's rate limit, or overloaded), 503 (no
                replica).
        """
        if self._replica_count() == 0:
            raise no_replicas()
        self.check_policy(policy)
        await self.admission.refuse_early(self._usable_replica_ids)
        if self.warmup is not None:
            self.warmup.start()
        attempt_cls = self._attempt_class(data_path)
        prio = resolve_priority(priority, tenant, self.settings.priority_header)
        await self.rate_limits.check(tenant, 1, peek=True)  # over its limit: no render
        t_prepare = time.perf_counter()
        with tracing.span("prepare") as span:
            req = await self.prepare(path, raw, policy, tenant, prio, session)
            if span is not None:
                tracing.current_span().set_attribute(tracing.ATTR_REQUEST_ID, req.request_id)
                span.set_attributes({tracing.ATTR_PROMPT_TOKENS: req.prompt_tokens,
                                     tracing.ATTR_BLOCKS: len(req.block_hashes)})
        req.timings["prepare"] = time.perf_counter() - t_prepare
        if body_s is not None:
            req.timings["body"] = body_s
        req.policy = policy or None
        req.t_arrival = t_arrival
        route = route_label(path)
        await self.rate_limits.check(tenant, request_tokens(
            req.prompt_tokens, req.max_output_tokens,
            req.untokenized_prompt_tokens or len(req.body), self.context_tokens, req.choices))
        if prepared is not None:
            prepared()
        interval = self.settings.sse_keepalive_s
        if not req.stream or interval is None:
            return await self._answer(req, attempt_cls, route, prio)
        # a stream that has nothing to send within the keep-alive interval starts with
        # keep-alives instead (router.serve.dispatch.KeepAliveStreamingResponse)
        answer = asyncio.ensure_future(self._answer(req, attempt_cls, route, prio))
        try:
            done, _ = await asyncio.wait({answer}, timeout=interval)
        except asyncio.CancelledError:
            abandon(answer)  # it may still return a response (end_answer): closed then
            raise
        if done:
            return answer.result()
        metrics.inc("keepalive_streams", tags={"route": route})
        return KeepAliveStreamingResponse(answer, interval, headers={
            "x-data-path": "direct" if issubclass(attempt_cls, DirectAttempt) else "serve"})

    async def _answer(self, req: RoutedRequest, attempt_cls: type[Attempt], route: str,
                      priority: int) -> Response:
        """Admit ``req``, then route and dispatch it, retrying once on another replica
        (``handle``'s rules); returns the response to send.

        Raises:
            OpenAIError: 429 (overloaded), 503 (no replica).
        """
        await state.make_drains(self.settings).refresh()  # at most one read a second
        with tracing.span("admission", {tracing.ATTR_PRIORITY: priority}) \
                if self.settings.max_inflight_per_replica is not None else tracing.NO_SPAN:
            await self.admission.admit(req.request_id, self._usable_replica_ids, priority)
        try:  # route_request ends the admission's hold once the decision has reserved
            for attempt in (1, 2):
                dispatch = attempt_cls(self, req, route, attempt)
                head, body = await self._try(dispatch, retry_left=attempt == 1)
                if self.warmup is not None and dispatch.replica:
                    self.warmup.routed(req.block_hashes, dispatch.replica)
                resp = await self._outcome(dispatch, head, body, attempt)
                if resp is not None:
                    return resp
        except BaseException:  # no answer: its slot's hold ends here if no dispatch ended it
            self.admission.released(req.request_id)
            raise
        finally:
            self.admission.reserved(req.request_id)  # also when it failed before routing
        raise AssertionError("unreachable: the second attempt always returns")

    def _usable_replica_ids(self) -> list[str]:
        """The replicas admission counts slots on: those whose engine is up, whose circuit
        is closed and that are not drained (all of them when none is)."""
        infos = state.replica_infos() or ()
        drained = state.make_drains(self.settings).current()
        up = [i.replica_id for i in infos if i.stats.engine_alive is not False
              and self.health.available(i.replica_id)] or [i.replica_id for i in infos]
        return [r for r in up if r not in drained] or up

    async def _outcome(self, dispatch: Attempt, head: ReplicaHead, body: bytes | None,
                       attempt: int) -> Response | None:
        """The client's response for an attempt, or None when it failed before the first
        byte on the first attempt and the request goes on to a second one."""
        req = dispatch.req
        if head.retryable and attempt == 1:
            logger.warning("replica %s failed before the first byte (%s %s); retrying on "
                           "another replica", dispatch.replica, head.status, head.error)
            metrics.inc("retries", tags={"reason": f"status_{head.status}"})
            if dispatch.span is not None:
                dispatch.span.set_attribute(tracing.ATTR_RETRIED, True)
            if dispatch.replica:
                req.excluded_replicas.append(dispatch.replica)
            await dispatch.close()
            if dispatch.release_task is not None:  # the retry reserves the same request
                # id: its first lease released first (a slow Redis's release in flight
                # would overlap the new reservation's bookkeeping)
                await asyncio.wait((dispatch.release_task,))
            return None
        if head.error:  # no engine answer to pass on
            await dispatch.close()
            logger.error("request %s failed (attempt %d): %s", req.request_id, attempt,
                         head.error)
            err = OpenAIError(head.status, head.error, "ServiceUnavailableError"
                              if head.status == 503 else "InternalServerError",
                              headers={"x-routed-replica": head.replica_id})
            return JSONResponse(err.body(), status_code=head.status, headers=err.response_headers(
                time.perf_counter() - req.t_arrival if req.t_arrival else None))
        return self._respond(dispatch, head, body)

    def _attempt_class(self, data_path: str | None) -> type[Attempt]:
        """The data path a request takes: its ``x-data-path`` (honoured only with
        ``allow_policy_override``), else ``Settings.data_path``.

        Raises:
            OpenAIError: 400 for an ``x-data-path`` that is refused or unknown.
        """
        if data_path and (not self.settings.allow_policy_override
                          or data_path not in ("direct", "serve")):
            raise bad_request("x-data-path must be 'direct' or 'serve', and is honoured only "
                              "with the setting allow_policy_override", "x-data-path")
        return DirectAttempt if (data_path or self.settings.data_path) == "direct" \
            else ServeAttempt

    async def _try(self, dispatch: Attempt, retry_left: bool) -> tuple[ReplicaHead,
                                                                        bytes | None]:
        """Run one attempt up to what the client is sent first: the engine's head, and the
        whole body of a non-streaming answer (None for a stream, an error, or a failure
        that will be retried). A failure of the replica (its actor died, the call or the
        body broke) becomes a 502 head, retryable while no body byte was read; the
        attempt's outcome is recorded in the replica's circuit breaker.

        Raises:
            OpenAIError, asyncio.CancelledError: after closing the attempt.
        """
        body = None
        try:
            head = await dispatch.start()
            if not dispatch.streaming and not head.error \
                    and not (head.retryable and retry_left):
                body = await dispatch.whole_body()
        except (OpenAIError, asyncio.CancelledError):
            await dispatch.close()
            raise
        except Exception as exc:  # the replica actor died, the call or the body failed
            head = ReplicaHead(dispatch.replica, 502, {}, retryable=not dispatch.started_body,
                               error=f"engine replica failed: {type(exc).__name__}: {exc}")
            dispatch.failed = True
        if dispatch.replica:  # once the attempt's outcome is known (a probe's too)
            self.health.record(dispatch.replica, not (head.retryable or head.error))
        return head, body

    def _respond(self, dispatch: "Attempt", head: ReplicaHead,
                 body: bytes | None) -> Response:
        """The client's response for an attempt whose engine answered: the engine's status
        and headers plus the router's, and the body: streamed (SSE), or ``body`` whole."""
        req = dispatch.req
        headers = dict(head.headers)
        headers.update({"x-routed-replica": dispatch.replica,
                        "x-predicted-cached-tokens": str(head.predicted_cached_tokens),
                        "x-routing-reason": req.routing_reason or "load",
                        "x-routing-policy": self.settings.policy_for(req.policy),
                        "x-data-path": "direct" if isinstance(dispatch, DirectAttempt)
                        else "serve"})
        if req.routing_s is not None:  # W3C Server-Timing: the router's own time, its parts
            headers["server-timing"] = server_timing(req)
        if dispatch.parent is not None:  # the request's span: who served it, and why
            dispatch.parent.set_attributes({
                tracing.ATTR_REPLICA: dispatch.replica,
                tracing.ATTR_REASON: headers["x-routing-reason"],
                tracing.ATTR_PREDICTED: head.predicted_cached_tokens,
                tracing.ATTR_POLICY: headers["x-routing-policy"],
                tracing.ATTR_DATA_PATH: headers["x-data-path"],
                tracing.ATTR_ATTEMPT: dispatch.attempt})
        if dispatch.streaming:
            headers.pop("content-type", None)
            return GuardedStreamingResponse(dispatch, status_code=head.status,
                                             headers=headers, media_type="text/event-stream")
        return Response(body, status_code=head.status, headers=headers)

    # --- the direct data path ------------------------------------------------------------
    def engine_client(self):
        """The pooled keep-alive HTTP client of the direct path, made on first use (on the
        ingress's own loop, which owns its connections)."""
        if self._engine_client is None:
            self._engine_client = EngineClient(self.settings.request_timeout_s)
        return self._engine_client

    async def close(self) -> None:
        """Wait for the lease releases still running (at most Redis's maintenance bound,
        2 s; those left go to the other routers' sweep once this router's heartbeat
        expires, and are logged), then close the direct path's pooled engine connections
        and stop the render threads (at the ingress's stop)."""
        from router.index.redis import RedisConnections
        from router.routing.core import finish_releases

        left = await finish_releases(RedisConnections.MAINTENANCE_TIMEOUT_S)
        if left:
            logger.warning("%d lease releases still running at the ingress's stop: the other "
                           "routers release those leases once this router's heartbeat "
                           "expires", left)
        if self._render_pool is not None:  # renders already queued still finish
            pool, self._render_pool = self._render_pool, None
            pool.shutdown(wait=False)
        if self._engine_client is not None:
            await self._engine_client.close()

    async def open_connections(self) -> int:
        """Open ``redis_warm_connections`` connections to Redis on this loop now (at the
        ingress's start; ``RedisConnections.open_connections``), so that the first burst
        of concurrent requests finds them open. A Redis that does not answer is logged and
        left to open connections on demand (routing degrades to load meanwhile, as for any
        index failure).

        Returns:
            The connections open in the pool (0 without Redis, or when it failed).
        """
        n = self.settings.redis_warm_connections
        if not self.settings.redis_url or n <= 0:
            return 0
        try:
            return await state.redis_connections(self.settings).open_connections(n)
        except IndexUnavailable as exc:
            logger.warning("could not open %d connections to Redis at start-up: %s", n, exc)
            return 0

    def routing_core(self):
        """The ``RoutingCore`` of the direct path, made on first use on the ingress's loop."""
        if self._routing is None:
            self._routing = state.make_routing_core(self.settings, self.policies.default)
        return self._routing

    async def any_engine(self, method: str, path: str,
                         body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        """Ask one engine for an answer every engine gives alike (``/v1/models``,
        ``/tokenize``): an engine that is up (its replica reports it alive and its circuit is
        closed), the next one when it fails or answers 5xx, three tries at most.

        Returns:
            The engine's status, headers (hop-by-hop ones dropped) and body.
        Raises:
            OpenAIError: 503 when no engine answered.
        """
        if self.settings.data_path == "direct":
            infos = [i for i in await self.replica_set() if i.metadata.engine_url]
            up = [i for i in infos if i.stats.engine_alive is not False
                  and self.health.available(i.replica_id)]
            self._any_turn += 1
            k = self._any_turn % len(up) if up else 0
            order = up[k:] + up[:k] + [i for i in infos if i not in up]
            for info in order[:3]:
                try:
                    status, headers, data = await self.engine_client().call(
                        method, info.metadata.engine_url + path, body,
                        {"content-type": "application/json"}, timeout_s=30.0)
                except ENGINE_ERRORS as exc:
                    logger.warning("%s %s on replica %s failed: %s", method, path,
                                   info.replica_id, exc)
                    continue
                if status < 500:
                    return status, headers, data
        else:
            for _ in range(3):  # Serve picks a replica by load each time
                try:
                    return await self.engine.forward.remote(method, path, body)
                except Exception as exc:
                    logger.warning("%s %s through a replica failed (%s: %s)", method, path,
                                   type(exc).__name__, exc)
        raise OpenAIError(503, f"no engine replica answered {method} {path}; retry shortly",
                          "ServiceUnavailableError", headers={"retry-after": "1"})

    async def replica_set(self, wait_s: float = 10.0):
        """The engine replicas to route among (``state.replica_infos``). Right after start
        the Ray router may not have heard of the replica set yet: wait for it up to
        ``wait_s``.

        Raises:
            OpenAIError: 503 when there is no replica.
        """
        deadline = time.monotonic() + wait_s
        while True:
            infos = state.replica_infos()
            if infos:
                return infos
            if infos is not None or time.monotonic() >= deadline:
                raise no_replicas()
            await asyncio.sleep(0.05)


def resolve_priority(header: str | None, tenant: Tenant | None,
                     name: str = "x-priority") -> int:
    """A request's priority (lower first): its header's (``name``), else its tenant's; a
    tenant's request cannot go ahead of its tenant's own priority.

    Raises:
        OpenAIError: 400 for a header that is not an integer.
    """
    floor = tenant.priority if tenant is not None else None
    p = parse_priority(header, floor if floor is not None else 0, name)
    return max(p, floor) if floor is not None else p


def build_fastapi_app() -> FastAPI:
    """The FastAPI app; its routes delegate to ``Ingress`` (set as ``app.state.ingress``)."""
    # a trailing slash is an unknown path (404 in the OpenAI shape), not a redirect to a
    # URL built from the Host header
    app = FastAPI(title="prefix-router", version="0.1.0", redirect_slashes=False)
    # the server span of each inference request, while tracing is on (router.tracing)
    app.add_middleware(tracing.TracingMiddleware, paths=(CHAT_PATH, COMPLETIONS_PATH))

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
