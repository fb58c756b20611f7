"""What crosses the ingress → replica handle hop, and the replica's reply header.

The ingress computes a request's token count and block hashes once and passes them with the
client's raw body (forwarded to the engine byte for byte: unknown fields survive,
docs/fault-cases.md 13.1). The Ray ``RequestRouter`` reads the routing fields from
``PendingRequest.args[0]`` and writes its prediction back into the same object before Serve
sends it (Serve serialises the arguments only after ``choose_replicas`` returns,
``ray/serve/_private/router.py`` ``_route_and_send_request_once`` in Ray 2.60).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


class PromptRest(Protocol):
    """The untokenized rest of a long prompt whose head alone the ingress hashed
    (``RoutedRequest.rest``; ``router.serve.ingress``)."""

    async def finish(self, req: "RoutedRequest") -> None:
        """Tokenize the rest (off the event loop) and set ``req.prompt_tokens`` and
        ``req.block_hashes`` to the whole prompt's."""

    def done(self, req: "RoutedRequest") -> None:
        """The decision stands on ``req.block_hashes`` (the head's, or the whole prompt's
        after ``finish``)."""


@dataclass
class RoutedRequest:
    """One client request on its way to a replica.

    Attributes:
        request_id: the ingress's id (also the load-reservation key).
        path: the engine path, e.g. ``/v1/chat/completions``.
        body: the client's JSON body, unchanged.
        stream: whether the client asked for a streamed (SSE) answer.
        prompt_tokens: prompt length in tokens as the engine will count it (0 if unknown).
        block_hashes: the prompt's chained block keys (empty when not cacheable).
        excluded_replicas: replica ids not to route to (a failed first attempt).
        routed_replica: set by the router: the replica it chose.
        predicted_cached_tokens: set by the router: per candidate replica, the cached tokens
            the index predicts (the replica that serves the request reports its own).
        routing_reason: set by the router: ``cache``, ``load``, ``fallback`` or
            ``session``.
        closed: set by the ingress when an attempt is over (answered, failed, client gone)
            before it releases the load reservation, and cleared when a retry starts; the
            router releases a reservation it makes (or moves) after that moment itself, so
            none can outlive the request.
        policy: a policy name that overrides the configured one for this request (only
            when ``Settings.allow_policy_override``; benchmarks compare policies this way
            on the same replicas).
        t_arrival: ``time.perf_counter()`` at the ingress when the request arrived (the
            router, in the same process, measures arrival to dispatch from it).
        routing_s: set by the router on the first attempt: arrival to dispatch (s), the
            router's own overhead (``server-timing`` header, ``router_routing_overhead``).
        timings: the parts of ``routing_s`` (s), by name: ``body`` (reading the request
            body), ``prepare`` (validation, render, tokenization and hashing, with any wait
            for a render thread) and ``decide`` (the routing decision: the index and the
            load, one Redis script with Redis; for a long prompt whose head a replica
            holds, also the rest's tokenization and a second decision); the rest of
            ``routing_s`` is admission and the rate limits. Each part is set as it ends,
            on the first attempt only; all three travel in the ``server-timing`` header.
        max_output_tokens: the most the request may generate (``max_completion_tokens``
            or ``max_tokens``, times ``n``; 0 when it names none), for tenants' token limits.
        choices: the completions it asks for (``n``), for the same.
        untokenized_prompt_tokens: for the same, a prompt the router did not tokenize
            (``prompt_tokens`` 0): a batch of token lists' exact count, else one per byte
            of the client's body (``router.serve.ratelimit.untokenized_prompt_tokens``).
        session_key: its session's key (``router.routing.sessions.session_key``), or None.
        lora_name: the LoRA adapter its ``model`` names (``Settings.lora_adapters``), or None.
        trace_headers: while tracing is on, the headers that carry the attempt's trace
            context (``traceparent``...), which the replica sends its engine with the body;
            None otherwise (``router.tracing``).
        rest: for a long prompt hashed as far as its head (``block_hashes`` are the head's,
            ``prompt_tokens`` an estimate), the rest to tokenize if a replica holds the
            whole head; the routing step (``router.routing.core.route_request``) decides
            that and clears it. It stays in this process: never serialised.
    """

    request_id: str
    path: str
    body: bytes
    stream: bool = False
    prompt_tokens: int = 0
    block_hashes: list[int] = field(default_factory=list)
    excluded_replicas: list[str] = field(default_factory=list)
    routed_replica: str | None = None
    predicted_cached_tokens: dict[str, int] = field(default_factory=dict)
    routing_reason: str = ""
    policy: str | None = None
    closed: bool = False
    t_arrival: float = 0.0
    max_output_tokens: int = 0
    choices: int = 1
    untokenized_prompt_tokens: int = 0
    session_key: str | None = None
    lora_name: str | None = None
    routing_s: float | None = None
    timings: dict[str, float] = field(default_factory=dict)
    trace_headers: dict[str, str] | None = None
    rest: PromptRest | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["rest"] = None  # the tokenizer's state stays in the ingress process
        return state


# The parts of the router's own time that the server-timing header names, in this order
# after ``routing`` (RoutedRequest.timings)
TIMING_PARTS = ("body", "prepare", "decide")


def server_timing(req: RoutedRequest) -> str:
    """The ``server-timing`` header of an answer (W3C Server Timing: comma-separated
    ``name;dur=<milliseconds>`` metrics): ``routing`` (arrival to dispatch,
    ``req.routing_s``) first, then the parts of it in ``req.timings``.

    Example: ``routing;dur=2.310, body;dur=0.080, prepare;dur=1.402, decide;dur=0.611``.
    """
    parts = [f"routing;dur={(req.routing_s or 0.0) * 1e3:.3f}"]
    parts += [f"{name};dur={req.timings[name] * 1e3:.3f}" for name in TIMING_PARTS
              if name in req.timings]
    return ", ".join(parts)


def parse_server_timing(header: str | None) -> dict[str, float]:
    """The metrics of a ``server-timing`` header, by name, in seconds (metrics without a
    ``dur`` or with one that is not a number are left out; an empty dict for None)."""
    out: dict[str, float] = {}
    for metric in (header or "").split(","):
        name, *params = (p.strip() for p in metric.split(";"))
        for param in params:
            key, _, value = param.partition("=")
            if key.strip() == "dur" and name:
                try:
                    out[name] = float(value.strip().strip('"')) / 1e3
                except ValueError:
                    pass
    return out


# Response headers of the engine that describe its own connection to the proxy, not the
# answer: never passed on to the client (RFC 9110 section 7.6.1, plus the server's own).
HOP_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive",
                         "date", "server"})


def route_label(path: str) -> str:
    """The ``route`` label of metrics: ``chat`` or ``completions``."""
    return "chat" if path.endswith("/chat/completions") else "completions"


@dataclass
class ReplicaHead:
    """First item a replica yields: the engine's status and headers, before any body byte.

    ``retryable`` marks a failure before the first byte (engine down, connection refused,
    5xx) that the ingress may retry once on another replica.
    """

    replica_id: str
    status: int
    headers: dict[str, str]
    retryable: bool = False
    error: str = ""
    predicted_cached_tokens: int = 0
    engine_metrics: dict[str, Any] = field(default_factory=dict)
