"""One routing decision: index lookup, load, policy, predicted entries and reservation.

``RoutingCore`` is independent of Ray: the Ray ``RequestRouter`` (``router.request_router``)
calls it with the candidate replicas Serve offers, and the virtual-time simulator
(``loadtest``) calls it with simulated replicas, so both run the same code.

A decision never fails because of the index: when the lookup raises ``IndexUnavailable``
(Redis slow or down) the policy sees no matches and decides by load, the fallback is
counted, and the next lookups try again (DESIGN.md decision 7).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Sequence

from router.config import Settings
from router.hashing import HashSettings
from router.index.base import IndexUnavailable, PrefixIndex
from router.load import LoadTracker
from router.policies import (Candidate, Decision, Policy, PrefixAware, RouteRequest,
                             cached_tokens)

logger = logging.getLogger(__name__)


@dataclass
class ReplicaInfo:
    """A candidate replica as the router sees it: id, advertised metadata (hash settings,
    endpoints) and the last routing stats its replica reported."""

    replica_id: str
    metadata: dict
    stats: dict


def hash_mismatches(mine: HashSettings, metadata: dict) -> list[str]:
    """What a replica's advertised metadata contradicts in the router's hash settings: the
    differing settings, and ``hash_probe`` when the engine's own ``BlockStored`` hashes for a
    probe prompt differed from the router's. Empty for a replica with no metadata yet."""
    if "hash_algo" not in metadata:
        return []
    bad = mine.mismatches(metadata)
    if metadata.get("hash_probe") == "mismatch":
        bad.append("hash_probe (the engine's BlockStored hashes differ from the router's)")
    return bad


class RoutingCore:
    """Decides where each request goes.

    Args:
        settings: router settings (policy knobs, TTLs).
        index: the prefix index (memory or Redis).
        load: the load tracker.
        policy: the routing policy.
        on_index_error: called with the exception when the index fails (metrics hook).
        health: circuit breakers (``router.health.ReplicaHealth``) or None.
    """

    def __init__(self, settings: Settings, index: PrefixIndex, load: LoadTracker,
                 policy: Policy, on_index_error=None, health=None):
        self.settings = settings
        self.health = health
        self.hash_settings: HashSettings = settings.hash_settings
        self.index = index
        self.load = load
        self.policy = policy
        self.on_index_error = on_index_error
        self.index_available = True
        # The atomic Redis path: with the Redis index and the Redis load tracker.
        from router.index.redis_index import RedisPrefixIndex
        from router.load_redis import RedisLoadTracker
        self.atomic = load if (isinstance(load, RedisLoadTracker)
                               and isinstance(index, RedisPrefixIndex)) else None
        self._mismatch_logged: set[str] = set()
        self._restarts_seen: dict[str, int] = {}

    def usable(self, replica: ReplicaInfo) -> bool:
        """Not known dead (its engine reported down, or its circuit is open). A replica
        whose engine was restarted since its failures starts with a closed circuit."""
        if replica.stats.get("engine_alive") is False:
            return False
        if self.health is None:
            return True
        restarts = replica.stats.get("restarts")
        if restarts is not None and restarts != self._restarts_seen.get(replica.replica_id,
                                                                        restarts):
            self.health.forget(replica.replica_id)
        if restarts is not None:
            self._restarts_seen[replica.replica_id] = restarts
        return self.health.available(replica.replica_id)

    def compatible(self, replica: ReplicaInfo) -> bool:
        """Whether the replica's engine hashes blocks as the router does.

        A replica with no metadata yet is assumed compatible (it reports on readiness); one
        whose advertised settings differ is refused loudly: logged once, and never given
        cache-aware traffic (a silent 0 % hit rate otherwise, FAULTS.md 3.2 and 3.3).
        """
        md = replica.metadata or {}
        bad = hash_mismatches(self.hash_settings, md)
        if bad and replica.replica_id not in self._mismatch_logged:
            self._mismatch_logged.add(replica.replica_id)
            logger.error(
                "replica %s hashes blocks differently from this router (%s): router %s, "
                "replica %s; it is excluded from routing", replica.replica_id, ", ".join(bad),
                self.hash_settings.as_dict(), {k: md.get(k) for k in bad})
        return not bad

    async def decide(self, request_id: str, prompt_tokens: int, block_hashes: Sequence[int],
                     replicas: Sequence[ReplicaInfo], cacheable: bool = True,
                     policy: Policy | None = None,
                     text: str = "", first_user_text: str = "") -> Decision:
        """Choose a replica among ``replicas`` (non-empty) and reserve its load.

        Args:
            policy: overrides the core's policy for this decision.
            text / first_user_text: the prompt's characters, for the anchors' policies.
        Returns:
            The policy's ``Decision``; ``reason`` is ``fallback`` when the index failed.
        """
        decision = await self._decide(request_id, prompt_tokens, block_hashes, replicas,
                                      cacheable, policy, False, text, first_user_text)
        if self.health is not None:
            self.health.routed(decision.replica)  # a half-open replica's probe
        return decision

    async def _decide(self, request_id: str, prompt_tokens: int, block_hashes: Sequence[int],
                      replicas: Sequence[ReplicaInfo], cacheable: bool,
                      policy: Policy | None, _fallback: bool,
                      text: str, first_user_text: str) -> Decision:
        policy = policy or self.policy
        usable = [r for r in replicas if self.usable(r)] or list(replicas)
        ok = [r for r in usable if self.compatible(r)]
        pool = ok or usable
        ids = [r.replica_id for r in pool]
        if (self.atomic is not None and isinstance(policy, PrefixAware) and block_hashes
                and cacheable and ok):
            try:
                return await self._decide_atomic(request_id, prompt_tokens, block_hashes,
                                                 pool, policy)
            except IndexUnavailable as exc:
                self._index_error(exc, "route")
                return await self._decide(request_id, prompt_tokens, block_hashes, pool,
                                          False, policy, True, text, first_user_text)
        matched: dict[str, int] = {}
        index_failed = _fallback
        if policy.uses_index and block_hashes and cacheable and ok:
            try:
                matched = await self.index.lookup(block_hashes, ids)
                self.index_available = True
            except IndexUnavailable as exc:
                index_failed = True
                self._index_error(exc, "lookup")
        loads = await self.load.loads(ids)
        rate = self.fleet_prefill_rate(pool)
        candidates = [
            Candidate(replica=r.replica_id, matched_blocks=matched.get(r.replica_id, 0),
                      load=loads[r.replica_id], prefill_tokens_per_s=rate,
                      decode_step_s_per_seq=self.settings.decode_step_s,
                      kv_usage_frac=r.stats.get("kv_usage_frac"),
                      waiting=int(r.stats.get("waiting") or 0),
                      active_blocks=int(r.stats.get("active_blocks") or 0))
            for r in pool]
        req = RouteRequest(prompt_tokens=prompt_tokens, block_size=self.hash_settings.block_size,
                           num_blocks=len(block_hashes), cacheable=cacheable, text=text,
                           first_user_text=first_user_text)
        decision = policy.choose(req, candidates)
        policy.on_routed(req, decision.replica, self.load.clock.now())
        if index_failed:
            decision.reason = "fallback"
        chosen = decision.replica
        uncached = max(prompt_tokens - decision.predicted_cached_tokens.get(chosen, 0), 0)
        await self.load.reserve(request_id, chosen, uncached)
        if block_hashes and cacheable and ok and not index_failed:
            chosen_info = next(r for r in pool if r.replica_id == chosen)
            await self.record(chosen, block_hashes, self.predicted_ttl_s(chosen_info))
        return decision

    async def _decide_atomic(self, request_id: str, prompt_tokens: int,
                             block_hashes: Sequence[int], pool: Sequence[ReplicaInfo],
                             policy: "PrefixAware") -> Decision:
        """The prefix_aware decision as one Redis script: several routers are serialised,
        so a burst does not pile onto one replica (``lua/route.lua``)."""
        ids = [r.replica_id for r in pool]
        chosen, matched = await self.atomic.route(
            self.index, request_id, prompt_tokens, block_hashes, ids,
            [self.predicted_ttl_s(r) for r in pool], block_size=self.hash_settings.block_size,
            prefill_rate=self.fleet_prefill_rate(pool), work_weight=policy.work_weight,
            decode_step_s_per_seq=self.settings.decode_step_s,
            step_token_budget=policy.step_token_budget, tie_abs_s=policy.tie_abs_s,
            tie_rel=policy.tie_rel, u=policy.rng.random(), load_factor=policy.load_factor)
        self.index_available = True
        bs = self.hash_settings.block_size
        predicted = {r: cached_tokens(m, prompt_tokens, bs) for r, m in matched.items()}
        rest = sorted((r for r in ids if r != chosen), key=lambda r: -predicted[r])
        return Decision([chosen] + rest, "cache" if predicted[chosen] > 0 else "load",
                        predicted)

    def predicted_ttl_s(self, replica: ReplicaInfo) -> float:
        """Short TTL while the replica's KV events flow (exact entries take over), the long
        one when its engine publishes none (approximate mode, FAULTS.md 8.2)."""
        if replica.stats.get("kv_events_live") is False:
            return self.settings.predicted_ttl_s
        return self.settings.predicted_ttl_with_events_s

    def fleet_prefill_rate(self, replicas: Sequence[ReplicaInfo]) -> float:
        """Prefill rate (tokens/s) used for every candidate: the median of the replicas'
        measured rates, or ``Settings.prefill_tokens_per_s`` before any measurement.

        One rate for the fleet (replicas of one deployment run one model on one kind of
        hardware): a per-replica rate would be unmeasured on a replica that has had no
        traffic yet, and noise between equal engines would decide cold starts instead of
        load (a replica measured once as faster would take every cold start).
        """
        rates = sorted(float(r.stats["prefill_tokens_per_s"]) for r in replicas
                       if r.stats.get("prefill_rate_measured")
                       and r.stats.get("prefill_tokens_per_s"))
        if not rates:
            return self.settings.prefill_tokens_per_s
        return rates[len(rates) // 2]

    async def record(self, replica: str, block_hashes: Sequence[int], ttl_s: float) -> None:
        """Write predicted entries for ``replica``; an index failure is counted, not raised."""
        try:
            await self.index.record_predicted(replica, block_hashes, ttl_s)
        except IndexUnavailable as exc:
            self._index_error(exc, "record")

    async def moved(self, request_id: str, replica: ReplicaInfo, prompt_tokens: int,
                    block_hashes: Sequence[int], predicted_cached_tokens: int) -> None:
        """Serve sent the request to ``replica``, not the router's choice: move its
        reservation and predicted entries there."""
        if self.health is not None:
            self.health.routed(replica.replica_id)
        await self.load.reserve(request_id, replica.replica_id,
                                max(prompt_tokens - predicted_cached_tokens, 0))
        if block_hashes:
            await self.record(replica.replica_id, block_hashes, self.predicted_ttl_s(replica))

    async def remove_replica(self, replica: str) -> None:
        """Purge a replica that left the deployment from the index and the load tracker."""
        try:
            await self.index.remove_replica(replica)
        except IndexUnavailable as exc:
            self._index_error(exc, "remove_replica")
        await self.load.remove_replica(replica)
        if self.health is not None:
            self.health.forget(replica)

    def _index_error(self, exc: Exception, op: str) -> None:
        if self.index_available:
            logger.warning("prefix index unavailable (%s): routing by load until it returns",
                           exc)
        self.index_available = False
        if self.on_index_error:
            self.on_index_error(exc, op)
