"""The project's policy: the lowest expected latency cost, the request's and what it adds to others'."""

from __future__ import annotations

import math
import random
from typing import Sequence

from router.load.base import decayed_placements
from router.policy.base import (
    Candidate,
    Decision,
    Policy,
    RouteRequest,
    cached_tokens,
    new_prefix,
)


class PrefixAware(Policy):
    """Lowest expected cost in seconds: the request's own time to first token plus the time
    it takes from the requests it shares a replica with (docs/architecture.md, "The cost
    model"). No threshold decides between cache and load; the terms do.

    For each candidate ``r`` with ``cached_r`` tokens of the prompt in its cache, ``n_r``
    requests in flight there and ``queued_r`` prefill tokens ahead; ``R`` the fleet's
    measured prefill rate (tokens/s), ``c`` the step time one more decoding sequence adds
    (s, ``Candidate.decode_step_s_per_seq``: the engine profile's per-sequence term), ``D``
    the expected output length (tokens, ``RouteRequest.expected_output_tokens``: what the
    engines report, ``vllm:generation_tokens_total / vllm:request_success_total``)::

        uncached_r = prompt_tokens - cached_r                                   (tokens)
        ttft_r     = (queued_r + uncached_r) / R
                   + ceil((queued_r + uncached_r) / step_token_budget) * c * n_r
        cost_r     = ttft_r                                   # its own first token
                   + (work_weight + n_r) * uncached_r / R     # its prefill, borne by others
                   + 2 * c * D * n_r                          # its decode beside theirs
                   + (1 + work_weight + n_r) * over_r / R     # its KV that will not fit
                   + evicted_r / R                            # the cache it evicts
                   + penalty_r

    * ``ttft_r``: the prefill work ahead of it plus its own uncached tokens, plus what the
      running decodes add to each step the prefill needs (step model
      ``t = a + b * prefill + c * decode``, docs/reference.md 6.1).
    * Its prefill, borne by others: every step that carries its prefill chunks is longer for
      the ``n_r`` requests decoding there (vLLM mixes prefill chunks into decode steps), by
      ``uncached_r / R`` in all; and ``work_weight`` (1) more request, the next one to
      arrive, waits behind it. Without the latter a burst of siblings sharing a new prefix
      is spread to idle replicas, each recomputing the prefix, while the first sibling's
      prefill is still queued where the prefix is being built.
    * Its decode beside theirs: for about ``D`` steps its sequence adds ``c`` to each step
      of the ``n_r`` others, and theirs add ``c * n_r`` to each of its own: the
      inter-token latency it costs and suffers, ``2 * c * D * n_r``. This is what spreads a
      hot prefix: a replica keeps it while the prefill the hit saves outweighs the decode
      interference of its extra requests, judged per request with the engine's own step
      profile, not at a fixed imbalance.
    * Its KV that will not fit: the request needs ``uncached_r + D`` tokens of KV cache
      (its uncached prompt, then its output); the engine has ``free_r`` (``C_r x (1 -
      usage_r)``: ``num_gpu_blocks x block_size`` of ``vllm:cache_config_info`` and
      ``vllm:kv_cache_usage_perc``), of which the ``queued_r`` prefill tokens routed
      there will take their share first. ``over_r = max(uncached_r + D - max(free_r -
      queued_r, 0), 0)`` tokens do not fit: vLLM's V1 scheduler then keeps a waiting
      request waiting (no blocks, no admission) or, for a running one, preempts the
      latest admitted and recomputes it later (``Scheduler.schedule``, preemption by
      recompute). Either way about ``over_r`` tokens are computed again or waited for,
      charged as that much prefill: borne by the request, by the ``n_r`` running beside
      it and by the next arrival, as its own prefill is. Unknown KV state (an engine not
      scraped yet) charges nothing; with room to spare it is 0. The hit's blocks are
      taken to be held by running requests (then they are in the usage already); a hit
      on cached blocks no request holds takes that many free blocks too (vLLM's
      ``allocate_slots`` counts them), which the term does not see: the router does not
      know which of a replica's cached blocks are held. Charging the whole prompt, the
      other bound, did worse on the pressure case (TTFT p99 5.26 against 3.68 s at 5 x),
      and so did counting the ``n_r x D`` tokens the running decodes will still add
      (docs/architecture.md, "The cost model").
    * The cache it evicts: vLLM keeps a freed block's hash until the block is reused (its
      free queue is an LRU of cached blocks, ``BlockPool``), so the request's uncached
      prompt takes the blocks never used while the engine has some (``empty_r = C_r -
      cached_r``, ``cached_r`` the tokens its KV events hold,
      ``RoutingStats.kv_cached_tokens``), and past them evicts cached prefixes, least
      recently used first (a freed block without a hash, a partial last block, is among
      them in that order; the term counts it as empty). The queued prefill routed there takes the empty blocks first,
      as for the KV that will not fit: ``evicted_r = max(uncached_r - max(empty_r -
      queued_r, 0), 0)`` tokens, each charged once at the prefill rate, the recomputation
      of a request that would have found it (a bound: the least recently used block may
      never be asked for again). On a fleet whose caches are not full it is 0 everywhere;
      once they fill, a prompt that shares little with a replica's cache goes where it
      evicts least, instead of displacing the prefixes of a busy holder of its first
      blocks (the Mooncake trace at 64 replicas with an eighth of the H200 cache: 61 ->
      95 % of the ideal hit rate, docs/benchmarks.md). Unknown (no live KV events, no
      engine size) charges nothing. The output's blocks are not counted.

    A new prefix (no candidate holds even its first block, ``new_prefix``) brings more
    than itself: its later requests will follow it to the replica chosen now. Nothing is
    known yet of how popular it will be, so it is taken to be as popular as the prefixes
    placed before it (the prior behind SGLang's and Ray Serve's rule of sending an
    unmatched prompt to the replica with the smallest cache tree), and a replica's share of
    the fleet's coming load is its share of the recent new-prefix placements. For such a
    request the terms that others bear use, instead of ``n_r``, the expected
    concurrency::

        k_r   = placements on r, decaying with time constant W, the routers' mean request
                life (ReplicaLoad.placements, RouteRequest.placement_window_s)
        n_r'  = max(n_r, mean(n) * k_r / mean(k)),  mean(n) = (sum(n) + 1) / N

    so a replica that has just been given several new prefixes, whose later requests
    have not come yet, is not taken for idle. A placement weighs e^-1 as much after one
    request life, by when its requests are among the ``n_r`` in flight.

    The terms are sums of seconds over the requests concerned (one user's first
    token, many users' inter-token gaps), so the policy minimises the total latency the
    decision adds. ``running_weight``, ``interference`` and ``kv_pressure`` scale the
    second, third and fourth terms, ``eviction`` the fifth (1: as stated; 0: without, for
    the benchmark's ablation only).

    Candidates within ``tie_rel`` (relative) or ``tie_abs_s`` of the best cost are near-ties:
    among them the replica with the most cached tokens, then the lowest ``ttft_r`` (the
    request's own expected first token: of two near-ties holding as much of the prompt, the
    one with fewer requests in flight may have a prefill queued ahead of it), then the fewest
    requests in flight, then the one whose last assignment is oldest (a rotating tie-break
    that spreads cold starts when nothing is in flight, docs/fault-cases.md 1.4), then
    chance.

    ``load_factor`` (off by default: ``None``) is an operator's explicit cap, consistent
    hashing with bounded loads (Mirrokni et al. 2018, as KubeAI's CHWBL applies it): a
    candidate whose in-flight count would exceed
    ``max(load_factor * (total + 1) / n, (total + 1) / n + 2)`` is passed over while any is
    within it. With ``max_inflight`` (the admission bound) a candidate must also have fewer
    than that many requests in flight while one does.

    A miss is thus decided by load (docs/fault-cases.md 1.1); a warm replica keeps its traffic
    until its queue and its decode interference cost more than the prefill it saves, judged
    per request (docs/fault-cases.md 1.6): there is no fleet-wide imbalance switch.
    """

    name = "prefix_aware"
    counts_placements = True
    #: Assignments this close count as simultaneous: 1 ms, as ``lua/route.lua`` compares
    #: Redis's integer milliseconds (``last <= oldest + 1``). The extra microsecond absorbs
    #: the rounding of ``ms / 1000`` in a float (its spacing is 2.4e-7 s at today's epoch),
    #: without which 3 in 10 pairs of stamps 1 ms apart were a tie in Redis and not here.
    LAST_ASSIGNED_TIE_S = 0.001 + 1e-6
    uses_index = True

    def __init__(self, rng: random.Random | None = None, tie_abs_s: float = 0.002,
                 tie_rel: float = 0.05, step_token_budget: int = 2048,
                 work_weight: float = 1.0, load_factor: float | None = None,
                 max_inflight: int | None = None, running_weight: float = 1.0,
                 interference: float = 1.0, kv_pressure: float = 1.0,
                 eviction: float = 1.0):
        super().__init__(rng)
        self.eviction = eviction
        self.kv_pressure = kv_pressure
        self.max_inflight = max_inflight
        self.tie_abs_s = tie_abs_s
        self.tie_rel = tie_rel
        self.step_token_budget = step_token_budget
        self.work_weight = work_weight
        self.load_factor = math.inf if load_factor is None else load_factor
        self.running_weight = running_weight
        self.interference = interference

    def load_bound(self, candidates: Sequence[Candidate]) -> float:
        """Largest in-flight count a candidate may have to take the request: the bounded
        load, capped at ``max_inflight`` (the admission bound, ``max_inflight_per_replica``:
        admission counts the fleet's free slots, so a request it admits must go to a
        replica with a free slot while one exists)."""
        mean = (sum(max(c.load.inflight, 0) for c in candidates) + 1) / len(candidates)
        bound = max(self.load_factor * mean, mean + 2)
        return bound if self.max_inflight is None else min(bound, self.max_inflight)

    def expected_ttft_s(self, request: RouteRequest, c: Candidate,
                        uncached: int | None = None) -> float:
        """Expected time to first token on candidate ``c`` (s). ``uncached``: the
        request's uncached tokens there, when the caller has them (``uncached_tokens``)."""
        if uncached is None:
            uncached = self.uncached_tokens(request, c)
        work = max(c.load.prefill_tokens, 0) + uncached
        steps = math.ceil(work / self.step_token_budget)
        return (work / c.prefill_tokens_per_s
                + steps * c.decode_step_s_per_seq * max(c.load.inflight, 0))

    @staticmethod
    def expected_inflight(request: RouteRequest,
                          candidates: Sequence[Candidate]) -> dict[str, float]:
        """Requests each candidate is expected to run beside this one (by replica):
        ``n_r``, or for a new prefix ``max(n_r, mean(n) * k_r / mean(k))`` with ``k_r``
        its decayed new-prefix placements and ``mean(n)`` counting this request (so an idle
        fleet still spreads them); the class docstring; ``lua/route.lua`` the same."""
        n = {c.replica: float(max(c.load.inflight, 0)) for c in candidates}
        window = request.placement_window_s
        if window <= 0 or not new_prefix(request, candidates):
            return n
        k = {c.replica: decayed_placements(c.load, request.now_s, window) for c in candidates}
        mean_k = sum(k.values()) / len(k)
        if mean_k <= 0:
            return n
        mean_n = (sum(n.values()) + 1) / len(n)  # this request counted, as load_bound does
        return {r: max(n[r], mean_n * k[r] / mean_k) for r in n}

    def cost_s(self, request: RouteRequest, c: Candidate,
               expected_inflight: float | None = None) -> float:
        """The quantity minimised: TTFT plus the delay imposed on others (s).
        ``expected_inflight``: the candidate's entry of ``expected_inflight`` (default:
        its requests in flight)."""
        return self._cost_and_ttft(request, c, expected_inflight)[0]

    def _cost_and_ttft(self, request: RouteRequest, c: Candidate,
                       expected_inflight: float | None) -> tuple[float, float]:
        """``cost_s`` and ``expected_ttft_s`` of candidate ``c`` (s, s), the request's
        uncached tokens there derived once."""
        n = max(c.load.inflight, 0)
        m = n if expected_inflight is None else expected_inflight
        uncached = self.uncached_tokens(request, c)
        ttft = self.expected_ttft_s(request, c, uncached)
        cost = (ttft
                + (self.work_weight + self.running_weight * m)
                * uncached / c.prefill_tokens_per_s
                + self.interference * 2 * c.decode_step_s_per_seq
                * request.expected_output_tokens * m
                + self.kv_pressure * (1 + self.work_weight + m)
                * self.kv_overflow_tokens(request, c, uncached) / c.prefill_tokens_per_s
                + self.eviction * self.evicted_tokens(request, c, uncached)
                / c.prefill_tokens_per_s
                + c.healthy_penalty_s)
        return cost, ttft

    def evicted_tokens(self, request: RouteRequest, c: Candidate,
                       uncached: int | None = None) -> float:
        """Cached tokens this request's uncached prompt would evict on candidate ``c``
        (tokens): ``max(uncached_r - max(empty_r - queued_r, 0), 0)`` with ``empty_r`` the
        engine's KV that holds no block (``Candidate.kv_empty_tokens``); 0 when that is
        unknown. The class docstring says what they cost. ``uncached``: as
        ``expected_ttft_s`` takes it."""
        empty = c.kv_empty_tokens
        if empty is None:
            return 0.0
        if uncached is None:
            uncached = self.uncached_tokens(request, c)
        return max(uncached - max(empty - max(c.load.prefill_tokens, 0), 0.0), 0.0)

    def kv_overflow_tokens(self, request: RouteRequest, c: Candidate,
                           uncached: int | None = None) -> float:
        """Tokens of this request's KV that will not fit on candidate ``c`` (tokens):
        ``max(uncached_r + D - max(free_r - queued_r, 0), 0)``, with ``free_r`` the
        engine's free KV (``Candidate.kv_free_tokens``); 0 when the engine's KV state is
        unknown. The class docstring says what they cost. ``uncached``: as
        ``expected_ttft_s`` takes it."""
        free = c.kv_free_tokens
        if free is None:
            return 0.0
        if uncached is None:
            uncached = self.uncached_tokens(request, c)
        need = uncached + request.expected_output_tokens
        return max(need - max(free - max(c.load.prefill_tokens, 0), 0.0), 0.0)

    @staticmethod
    def uncached_tokens(request: RouteRequest, c: Candidate) -> int:
        """The request's prompt tokens candidate ``c`` would compute (tokens, at least 1:
        vLLM computes the last token whatever it holds, ``max_cached_blocks``)."""
        cached = cached_tokens(c.matched_blocks, request.prompt_tokens, request.block_size)
        return max(request.prompt_tokens - cached, 1)

    def choose(self, request, candidates):
        bound = self.load_bound(candidates)
        within = [c for c in candidates
                  if max(c.load.inflight, 0) + 1 <= bound] or list(candidates)
        expected = self.expected_inflight(request, candidates)
        both = {c.replica: self._cost_and_ttft(request, c, expected[c.replica])
                for c in candidates}
        costs = {r: cost for r, (cost, _) in both.items()}
        ttft = {r: t for r, (_, t) in both.items()}
        predicted = self._predicted(request, candidates)
        pool = within
        best = min(costs[c.replica] for c in pool)
        tie_bound = best + max(self.tie_abs_s, self.tie_rel * best)
        ties = [c for c in pool if costs[c.replica] <= tie_bound]
        # Among near-ties: the most cached tokens, then the soonest first token, then the
        # fewest in flight, then the longest since an assignment, then chance.
        most_cached = max(predicted[c.replica] for c in ties)
        ties = [c for c in ties if predicted[c.replica] == most_cached]
        soonest = min(ttft[c.replica] for c in ties)
        ties = [c for c in ties if ttft[c.replica] == soonest]
        # counts below zero (a shared count that lost an increment) count as zero: never
        # a reason to send everything to one replica
        fewest = min(max(c.load.inflight, 0) for c in ties)
        ties = [c for c in ties if max(c.load.inflight, 0) == fewest]
        oldest = min(c.load.last_assigned_s for c in ties)
        finalists = [c for c in ties
                     if c.load.last_assigned_s <= oldest + self.LAST_ASSIGNED_TIE_S]
        pick = finalists[int(self.rng.random() * len(finalists))]  # as lua/route.lua does
        rest = sorted((c for c in candidates if c is not pick),
                      key=lambda c: (costs[c.replica], c.load.last_assigned_s))
        ranked = [pick.replica] + [c.replica for c in rest]
        reason = "cache" if predicted[pick.replica] > 0 else "load"
        return Decision(ranked, reason, predicted, ttft)
