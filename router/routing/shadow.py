"""Shadow evaluation: what other policies would have chosen, on live traffic, without acting.

For a sample of the live decisions (``Settings.shadow_sample_rate``), each policy of
``Settings.shadow_policies`` chooses on the same state the live decision saw: the index's
match per candidate (the one lookup or route script of the decision) and the candidates'
loads (read just before the decision, so without this request's reservation; when Serve
asks again for a request already reserved, that earlier reservation is still in them). Its figure is
the cached tokens its choice holds for the request, ``cached_tokens(matched[choice])``; the
live decision's figure is its own prediction. The live policy is evaluated too, as a copy
taken just before it decided (same random state, same counters): its shadow choice equals
the live one unless another router changed the loads between the read and the decision, so
it also checks online that the Redis script and the Python rule agree.

A configured shadow policy with the live policy's name is that copy (one figure per name).

It is a one-step counterfactual: each alternative is judged on the state the live policy
created by its earlier choices, not on the state the alternative would have built had it
routed every request (a router that never routes by cache would not see these matches).
The simulator (``loadtest.sim``) answers the other question.

Metrics (labels: the configured policy names and ``live``; bounded):
``router_shadow_decisions_total{policy, agrees}``, ``router_shadow_cached_tokens_total{policy}``
(``policy="live"``: the live decisions' own predictions over the same sample) and
``router_shadow_seconds_total`` (the router time spent on it: the loads read, the copy
and the choices; ``router.routing.core.RoutingCore.decide`` counts it).
"""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from typing import Sequence

from router.policy import Candidate, Decision, Policy, RouteRequest, cached_tokens, make_policy


@dataclass(frozen=True)
class ShadowChoice:
    """One shadow policy's answer for one request: its ``replica``, the ``cached_tokens``
    that replica holds for the request (index match at decision time, vLLM's cap applied),
    and whether it ``agrees`` with the live choice."""

    replica: str
    cached_tokens: int
    agrees: bool


class ShadowEvaluator:
    """Runs the shadow policies on a sample of decisions.

    Args:
        policies: the shadow policies' names (``router.policy.POLICIES``); each is made once
            and kept (round robin's counter advances on sampled requests only).
        sample_rate: fraction of eligible decisions evaluated, in [0, 1].
        policy_kwargs: ``Settings.policy_kwargs`` (name -> keyword arguments).
        rng: draws the sample (seeded in tests).
    Raises:
        ValueError: an unknown policy name.
    """

    def __init__(self, policies: Sequence[str], sample_rate: float, policy_kwargs=None,
                 rng: random.Random | None = None):
        kwargs = policy_kwargs or (lambda name: {})
        self.sample_rate = sample_rate
        self.rng = rng or random.Random()
        self.policies: dict[str, Policy] = {
            name: make_policy(name, rng=random.Random(), **kwargs(name)) for name in policies}

    def sampled(self) -> bool:
        """Whether to evaluate the next decision (``sample_rate`` of them)."""
        return self.sample_rate > 0 and self.rng.random() < self.sample_rate

    @staticmethod
    def snapshot(policy: Policy) -> Policy:
        """A copy of the live policy as it is before it decides (random state, counters)."""
        return copy.deepcopy(policy)

    def evaluate(self, request: RouteRequest, candidates: Sequence[Candidate],
                 live: Decision, live_copy: Policy | None = None) -> dict[str, ShadowChoice]:
        """Each shadow policy's choice on ``candidates`` (the live decision's state), and the
        live policy's copy's under its own name; the metrics are counted.

        Returns:
            policy name -> ``ShadowChoice``.
        """
        matched = {c.replica: c.matched_blocks for c in candidates}
        runs = dict(self.policies)
        if live_copy is not None:
            runs[live_copy.name] = live_copy
        out: dict[str, ShadowChoice] = {}
        for name, policy in runs.items():
            choice = policy.choose(request, candidates).replica
            out[name] = ShadowChoice(
                choice, cached_tokens(matched.get(choice, 0), request.prompt_tokens,
                                      request.block_size), choice == live.replica)
        from router import metrics
        for name, sc in out.items():
            metrics.inc("shadow_decisions", tags={"policy": name,
                                                  "agrees": "true" if sc.agrees else "false"})
            metrics.inc("shadow_cached_tokens", sc.cached_tokens, tags={"policy": name})
        metrics.inc("shadow_cached_tokens", live.predicted_cached_tokens.get(live.replica, 0),
                    tags={"policy": "live"})
        return out
