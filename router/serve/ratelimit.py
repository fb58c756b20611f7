"""Per-tenant rate limits: requests and tokens per minute, shared by every router.

A tenant's limits come from its key in the keys document (``requests_per_minute``,
``tokens_per_minute``; ``router.serve.auth``). A request costs one request and its tokens
as OpenAI counts them for its limits: the prompt's tokens plus the most it may generate
(``max_output_tokens``: a chat request's ``max_completion_tokens`` or ``max_tokens``, a
completion's ``max_tokens``; for a chat request that names neither, the rest of the model's
context, which the engine may fill; for a completion, vLLM's default of 16). It is checked
before admission, and a tenant already over a limit is refused before its request is
rendered (a check that counts nothing). Over a limit,
the answer is a 429 with ``Retry-After`` and OpenAI's ``x-ratelimit-*`` headers, and nothing
is counted. The minute slides: two fixed windows, the previous one weighted by the share of
it still inside the last 60 s (``lua/rate_limit.lua``, after Cloudflare's counting:
blog.cloudflare.com/counting-things-a-lot-of-different-things). With Redis the counters are
shared by every router process. Without Redis, or while Redis fails, each process counts
its own requests, so the fleet's limit is then per process; a process also counts the
requests Redis admitted, so a Redis call that fails or times out mid-minute is checked
against this process's share of the minute, not against an empty counter.
"""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path
from typing import Any

from router.clock import Clock, SystemClock
from router.index.base import IndexBusy, IndexUnavailable
from router.logs import get_logger
from router.redis_keys import RedisKeys, ScriptCache
from router.serve.auth import Tenant
from router.serve.errors import OpenAIError

logger = get_logger(__name__)

WINDOW_S = 60.0
KINDS = ("requests", "tokens")


def lax_int(value: Any) -> int | None:
    """``value`` as the engine's request model reads an integer field (pydantic's lax mode:
    vLLM's protocol models): an int, a float with no fraction (``4.0``), or a string of one
    (``"4"``, ``" 4 "``, ``"4.0"``); None for anything else (a bool included: counted as
    absent)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            value = float(value.strip()) if "." in value or "e" in value.lower() \
                else int(value.strip())
        except ValueError:
            return None
        if isinstance(value, int):
            return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def prompts_in(body: dict[str, Any]) -> int:
    """The prompts of a ``/v1/completions`` body: a batch (a list of texts, or of token
    lists) generates for each; 1 otherwise."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


def choices(body: dict[str, Any], completions: bool = False) -> int:
    """The completions a request asks for: ``n`` (1 when absent or invalid, read as the
    engine reads it: ``lax_int``), times the prompts of a ``/v1/completions`` batch
    (``completions``: ``prompts_in``)."""
    n = lax_int(body.get("n"))
    n = n if n is not None and n > 0 else 1
    return n * (prompts_in(body) if completions else 1)


COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM 0.32 CompletionRequest.max_tokens's default
# (vllm/entrypoints/openai/completion/protocol.py; OpenAI's legacy completions say 16 too)


def max_output_tokens(body: dict[str, Any], completions: bool = False) -> int:
    """The most a request may generate, times its ``choices``: for a chat request
    ``max_completion_tokens``, else ``max_tokens`` (vLLM's chat model takes the first it
    has); for a ``/v1/completions`` request (``completions``) ``max_tokens`` only (vLLM's
    completion model has no ``max_completion_tokens``: a client that sent one there got
    ``max_tokens`` generated while the limit counted the other), or when it names none
    ``COMPLETIONS_DEFAULT_MAX_TOKENS``, the engine's default. 0 when it names none (a chat
    request, or a completion's explicit null: the engine may fill the context, and
    ``request_tokens`` charges the rest of it). Values are read as the engine reads them
    (``lax_int``: ``"300"`` is 300)."""
    if completions:
        if "max_tokens" not in body:
            return COMPLETIONS_DEFAULT_MAX_TOKENS * choices(body, completions)
        out = lax_int(body.get("max_tokens"))
    else:
        out = lax_int(body.get("max_completion_tokens"))
        if not out:
            out = lax_int(body.get("max_tokens"))
    out = out if out is not None and out > 0 else 0
    return out * choices(body, completions)


def untokenized_prompt_tokens(body: dict[str, Any], body_bytes: int) -> int:
    """The tokens charged for a prompt the router did not tokenize: a ``/v1/completions``
    prompt of token ids (a batch of token lists included) is counted exactly; any other,
    one per byte of the client's ``body_bytes`` (at least as many as the text holds with a
    byte-level BPE vocabulary; an image given by URL is not in the body, and not counted)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return len(prompt)
        if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool)
                                           for t in p) for p in prompt):
            return sum(len(p) for p in prompt)
    return body_bytes


def request_tokens(prompt_tokens: int, output_tokens: int, body_bytes: int,
                   context_tokens: int | None = None, n: int = 1) -> int:
    """A request's tokens for its tenant's tokens-per-minute limit: its prompt's (when the
    router did not tokenize it, one per byte of body: a token of a byte-level BPE vocabulary
    is at least one byte of text, so no prompt is counted short; a guess of one per 4 bytes
    let text of few bytes per token, such as CJK, through at several times its count) plus
    the most it may generate:
    ``output_tokens``, or when the request named no limit (0) and the model's context
    length ``context_tokens`` is known, what is left of the context, ``n`` times (vLLM's
    default ``max_tokens`` is at most the context left after the prompt: ``get_max_tokens``
    in vLLM 0.32's ``vllm/entrypoints/serve/utils/api_utils.py``)."""
    prompt = prompt_tokens or body_bytes
    if not output_tokens and context_tokens:
        output_tokens = max(context_tokens - prompt, 0) * n
    return prompt + output_tokens


def _refused(tenant: Tenant, kind: str, limit: int, used: int, cost: int | None,
             retry_s: float) -> OpenAIError:
    """The 429 of a request over ``tenant``'s limit of ``kind``; ``cost`` None: a request
    refused before its cost was known (``RateLimiter.check``'s peek)."""
    headers = {f"x-ratelimit-limit-{kind}": str(limit),
               f"x-ratelimit-remaining-{kind}": str(max(limit - used, 0))}
    if retry_s < 0:  # this request alone is over the limit: waiting will not help
        return OpenAIError(429, f"Request too large for tenant {tenant.name!r}: {cost} {kind}"
                                f" against a limit of {limit} {kind} per minute.",
                           "RateLimitError", headers=headers)
    wait = max(1, math.ceil(retry_s))
    headers["retry-after"] = str(wait)
    headers[f"x-ratelimit-reset-{kind}"] = f"{wait}s"
    requested = "" if cost is None else f", requested {cost}"
    return OpenAIError(429, f"Rate limit reached for tenant {tenant.name!r} on {kind} per "
                            f"minute: limit {limit}, used {used}{requested}. Please "
                            f"try again in {wait}s.", "RateLimitError", headers=headers)


def prompt_over_limit(tenant: Tenant, at_least: int) -> OpenAIError:
    """The 429 of a request whose prompt alone is found over ``tenant``'s tokens-per-minute
    limit (more than ``at_least`` - 1 tokens, with its output) before it was encoded whole
    (``PromptInfo.finish`` with a budget): waiting will not help, so no ``Retry-After``."""
    from router import metrics
    metrics.inc("admission_refused", tags={"reason": "rate_limit_tokens"})
    limit = tenant.tokens_per_minute or 0
    return OpenAIError(429, f"Request too large for tenant {tenant.name!r}: at least "
                            f"{at_least} tokens against a limit of {limit} tokens per minute.",
                       "RateLimitError", headers={"x-ratelimit-limit-tokens": str(limit)})


def context_tokens(max_model_len: int | None, model_dir: str | None) -> int | None:
    """The engines' context length in tokens: ``max_model_len`` when set, else the model's
    ``max_position_embeddings`` (``config.json`` in ``model_dir``; vLLM's default
    ``--max-model-len`` derives from it); None when neither is known."""
    if max_model_len:
        return max_model_len
    try:
        value = json.loads((Path(model_dir or "") / "config.json").read_text()).get(
            "max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


class MemoryRateLimiter:
    """This process's counters (the sliding-minute rule of ``lua/rate_limit.lua``)."""

    def __init__(self, clock: Clock | None = None, window_s: float = WINDOW_S):
        self.clock = clock or SystemClock()
        self.window_s = window_s
        self._counts: dict[tuple[str, str, int], int] = {}
        self._pruned_w = -1  # the window whose start last pruned the counts
        self._lock = threading.Lock()

    def check_now(self, tenant: str, limits: list[tuple[str, int, int]], peek: bool = False
                  ) -> tuple[str, int, float] | None:
        """Count ``(kind, limit, cost)`` for ``tenant`` if all fit (``peek``: count
        nothing); else return the first kind over its limit with its use and the seconds
        until it may fit (-1: never)."""
        return self._count(tenant, limits, check=True, peek=peek)

    def record(self, tenant: str, limits: list[tuple[str, int, int]]) -> int:
        """Count ``(kind, limit, cost)`` for ``tenant`` without checking (a request that
        Redis is asked about, or admitted: this process's share, for when Redis fails);
        returns the window it was counted in, for ``unrecord``."""
        return self._count(tenant, limits, check=False)

    def unrecord(self, tenant: str, limits: list[tuple[str, int, int]], window: int) -> None:
        """Take back a ``record`` of ``window`` (Redis refused the request, or did not
        answer and the request is checked here instead)."""
        with self._lock:
            for kind, _, cost in limits:
                key = (tenant, kind, window)
                if key in self._counts:
                    self._counts[key] = max(self._counts[key] - cost, 0)

    def _count(self, tenant: str, limits: list[tuple[str, int, int]], check: bool,
               peek: bool = False):
        """``check_now``'s answer; without ``check``, the window counted in (``record``)."""
        now = self.clock.now()
        w = int(now // self.window_s)
        elapsed = now - w * self.window_s
        with self._lock:
            for kind, limit, cost in limits if check else ():
                curr = self._counts.get((tenant, kind, w), 0)
                prev = self._counts.get((tenant, kind, w - 1), 0)
                used = prev * (self.window_s - elapsed) / self.window_s + curr
                if used + cost > limit:
                    return kind, int(used), (-1.0 if cost > limit else self.window_s - elapsed)
            if peek:
                return None
            for kind, _, cost in limits:
                self._counts[(tenant, kind, w)] = self._counts.get((tenant, kind, w), 0) + cost
            if w != self._pruned_w:  # once per window: old windows' counts go
                self._pruned_w = w
                for key in [k for k in self._counts if k[2] < w - 1]:
                    del self._counts[key]
        return None if check else w


class RateLimiter:
    """Checks a tenant's request against its limits.

    Args:
        connections: Redis connections (``router.index.redis.RedisConnections``), or None
            for this process's counters only.
        namespace: the Redis key prefix (``Settings.index_namespace``).
        clock: time source.
    """

    def __init__(self, connections=None, namespace: str = "prefix-router",
                 clock: Clock | None = None):
        self.conn = connections
        self.keys = RedisKeys(namespace)
        self.clock = clock or SystemClock()
        self.local = MemoryRateLimiter(self.clock)
        self.scripts = ScriptCache()
        # tenant -> when its last refusal's Retry-After ends (one entry per configured
        # tenant at most: tenants are the keys file's)
        self._refused_until: dict[str, float] = {}

    async def check(self, tenant: Tenant | None, cost_tokens: int, peek: bool = False) -> None:
        """Count one request of ``cost_tokens`` tokens for ``tenant``, or refuse it.

        ``peek``: count nothing, only refuse a request that would not fit; the ingress
        peeks with one token before it renders a request, so a tenant over its limit is
        refused before the router spends its CPU on the request (a 3.9 MB body took 2.4-3.2
        s to render before its 429), then checks with the request's count. With Redis, a
        peek asks it only for a tenant that this process's own counts (its share of the
        tenant's use) put over a limit, or that it refused less than that refusal's
        ``Retry-After`` ago; any other tenant's peek passes at no Redis call (most requests
        of a limited tenant fit: the peek cost them a second Redis call each). A tenant
        driven over its limit by other processes costs this one one rendered request
        before its peeks ask Redis again.

        Raises:
            OpenAIError: 429 (``RateLimitError``) with ``Retry-After`` and
                ``x-ratelimit-*`` headers when a limit would be exceeded (then nothing is
                counted); without ``Retry-After`` when the request alone exceeds it.
        """
        if tenant is None:
            return
        limits = [(k, lim, c) for k, lim, c in (
            ("requests", tenant.requests_per_minute, 1),
            ("tokens", tenant.tokens_per_minute, cost_tokens)) if lim is not None]
        if not limits:
            return
        over = None
        if peek and self.conn is not None and self.local.check_now(
                tenant.name, limits, peek=True) is None \
                and self._refused_until.get(tenant.name, 0.0) <= self.clock.now():
            return
        if self.conn is not None:
            # counted here before Redis answers: a request whose call times out is checked
            # against this process's counts, which then hold the requests whose calls are
            # still under way (a burst on one busy router admitted 32-40 of 60 against a
            # limit of 30 when they did not)
            window = None if peek else self.local.record(tenant.name, limits)
            try:
                over = await self._check_redis(tenant.name, limits, peek)
                if over is not None and window is not None:
                    self.local.unrecord(tenant.name, limits, window)
            except IndexUnavailable as exc:
                (logger.debug if isinstance(exc, IndexBusy) else logger.warning)(
                    "rate limits counted in this process only (Redis: %s)", exc)
                if window is not None:
                    self.local.unrecord(tenant.name, limits, window)
                over = self.local.check_now(tenant.name, limits, peek)
            except BaseException:
                if window is not None:
                    self.local.unrecord(tenant.name, limits, window)
                raise
        else:
            over = self.local.check_now(tenant.name, limits, peek)
        if over is not None:
            kind, used, retry_s = over
            limit, cost = next((lim, c) for k, lim, c in limits if k == kind)
            from router import metrics
            metrics.inc("admission_refused", tags={"reason": f"rate_limit_{kind}"})
            if retry_s > 0:  # the tenant's state (not this request's size): peeks ask Redis
                self._refused_until[tenant.name] = self.clock.now() + retry_s
            raise _refused(tenant, kind, limit, used, None if peek else cost, retry_s)

    async def _check_redis(self, tenant: str, limits: list[tuple[str, int, int]],
                           peek: bool = False) -> tuple[str, int, float] | None:
        now_ms = int(self.clock.now() * 1000)
        window_ms = int(WINDOW_S * 1000)
        w = now_ms // window_ms
        keys, args = [], [window_ms, now_ms]
        for kind, limit, cost in limits:
            keys += [self.keys.rate(tenant, kind, w), self.keys.rate(tenant, kind, w - 1)]
            args += [limit, cost]
        if peek:
            args.append("peek")

        async def run(c):
            return await self.scripts.of(c).rate_limit(keys=keys, args=args)

        res = await self.conn.call(run)
        if int(res[0]) == 0:
            return None
        return limits[int(res[0]) - 1][0], int(res[2]), int(res[1]) / 1000
