"""The project's policy: lowest expected time to first token, with bounded load."""

from __future__ import annotations

import math
import random
from typing import Sequence

from router.policy.base import Candidate, Decision, Policy, RouteRequest, cached_tokens


class PrefixAware(Policy):
    """Lowest expected time to first token, charged for the work the request adds
    (docs/architecture.md, decision 4).

    For each candidate ``r`` with ``cached_r`` tokens of the prompt in its cache::

        uncached_r = prompt_tokens - cached_r                                   (tokens)
        ttft_r     = (queued_prefill_tokens_r + uncached_r) / prefill_rate
                   + ceil(work_r / step_token_budget) * decode_step_s_per_seq * running_r
        cost_r     = ttft_r + work_weight * uncached_r / prefill_rate + penalty_r

    ``ttft_r`` is the prefill work ahead of the request plus its own uncached tokens at the
    fleet's measured prefill rate, plus what the replica's running decodes add to each step
    the prefill needs (step model ``t = a + b·prefill + c·decode``, docs/reference.md 6.1).
    The ``work_weight`` term charges the delay the request's own prefill imposes on every
    request queued behind it on that replica; without it a burst of siblings sharing a new
    prefix would be spread to idle replicas, each recomputing the prefix, because the first
    sibling's prefill is still queued where the prefix is being built.

    Candidates within ``tie_rel`` (relative) or ``tie_abs_s`` of the best cost are near-ties:
    among them the replica with the most cached tokens, then the fewest requests in flight
    (a cold request or a spill goes where it adds least to the imbalance: decode-heavy load
    barely changes the cost), then the one whose last assignment is oldest (a rotating
    tie-break that spreads cold starts when nothing is in flight, docs/fault-cases.md 1.4), then
    chance.

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

    With ``max_inflight`` (the admission bound) the bound is also at most that many
    requests in flight.

    A miss is thus decided by load (docs/fault-cases.md 1.1); a warm replica keeps its traffic
    until its queue costs more than the prefill it saves or it exceeds the bound, judged per request
    (docs/fault-cases.md 1.6): there is no fleet-wide imbalance switch.
    """

    name = "prefix_aware"
    uses_index = True

    def __init__(self, rng: random.Random | None = None, tie_abs_s: float = 0.002,
                 tie_rel: float = 0.05, step_token_budget: int = 2048,
                 work_weight: float = 1.0, load_factor: float = 1.35,
                 max_inflight: int | None = None):
        super().__init__(rng)
        self.max_inflight = max_inflight
        self.tie_abs_s = tie_abs_s
        self.tie_rel = tie_rel
        self.step_token_budget = step_token_budget
        self.work_weight = work_weight
        self.load_factor = load_factor

    def load_bound(self, candidates: Sequence[Candidate]) -> float:
        """Largest in-flight count a candidate may have to take the request: the bounded
        load, capped at ``max_inflight`` (the admission bound, ``max_inflight_per_replica``:
        admission counts the fleet's free slots, so a request it admits must go to a
        replica with a free slot while one exists)."""
        mean = (sum(max(c.load.inflight, 0) for c in candidates) + 1) / len(candidates)
        bound = max(self.load_factor * mean, mean + 2)
        return bound if self.max_inflight is None else min(bound, self.max_inflight)

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
