"""The baselines: round robin, random, and power of two choices on in-flight requests."""

from __future__ import annotations

import random

from router.policy.base import Decision, Policy


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
