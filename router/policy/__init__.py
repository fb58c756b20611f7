"""Routing policies: given the candidates' cache matches and loads, rank the replicas.

``base`` (what a policy sees and answers), ``baselines`` (round robin, random, power of two
choices), ``prefix_aware`` (the project's cost rule) and ``anchors`` (the other routers'
rules, re-implemented for the simulator). This module is the one registry: a policy is
selectable by name once it is listed here.
"""

from __future__ import annotations

import random

from router.policy.anchors import ANCHORS
from router.policy.base import (
    Candidate,
    Decision,
    Policy,
    RouteRequest,
    cached_tokens,
    max_cached_blocks,
)
from router.policy.baselines import LeastLoaded, Random, RoundRobin
from router.policy.prefix_aware import PrefixAware

__all__ = ["ANCHORS", "Candidate", "Decision", "LIVE_POLICIES", "LeastLoaded", "POLICIES",
           "Policy", "PolicySet", "PrefixAware", "Random", "RoundRobin", "RouteRequest",
           "cached_tokens", "make_policy", "max_cached_blocks"]


_LIVE: tuple[type[Policy], ...] = (PrefixAware, RoundRobin, Random, LeastLoaded)

POLICIES: dict[str, type[Policy]] = {p.name: p for p in (*_LIVE, *ANCHORS)}
"""Every policy by name: the live ones, and the anchors' re-implementations, which the
simulator runs for comparison (some need the prompt's characters, ``Policy.uses_text``)."""

LIVE_POLICIES: tuple[str, ...] = tuple(p.name for p in _LIVE)
"""Names of the policies the live router runs."""


class PolicySet:
    """The policies one router process runs: the configured one, and those requests ask
    for by name (``x-routing-policy``, when ``Settings.allow_policy_override``), each made
    once and kept (round robin's counter and the tie-break state live in the object).

    Args:
        settings: ``router.config.Settings`` (its ``policy`` and ``policy_kwargs``).
    """

    def __init__(self, settings):
        self.settings = settings
        self._made: dict[str, Policy] = {}
        self.default = self.get(None)

    def get(self, requested: str | None) -> Policy:
        """The policy a request runs (``Settings.policy_for``)."""
        name = self.settings.policy_for(requested)
        policy = self._made.get(name)
        if policy is None:
            policy = self._made[name] = make_policy(
                name, rng=random.Random(), **self.settings.policy_kwargs(name))
        return policy


def make_policy(name: str, rng: random.Random | None = None, **kwargs) -> Policy:
    """The policy called ``name``.

    Raises:
        ValueError: unknown name (the message lists the known ones).
    """
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {sorted(POLICIES)}") from None
    return cls(rng=rng, **kwargs)
