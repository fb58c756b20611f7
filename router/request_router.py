"""The Ray Serve ``RequestRouter`` that routes engine replicas with ``RoutingCore``.

Serve builds one instance per ``DeploymentHandle`` (one per ingress process), runs its
coroutines on a dedicated event loop, and may call ``choose_replicas`` several times for one
request (backoff), so the method is idempotent: a reservation is keyed by the request id
and replaced, never added twice. The chosen replica is ranked alone first, because Serve
picks the least loaded replica *inside* a rank; the others follow in cost order as
fallbacks (DESIGN.md decision 6; ``../shared/reference/RAY_SERVE_AND_VLLM.md`` 1.3).

No ``FIFOMixin``: a prefix-aware choice belongs to its own request, not the oldest pending
one. State lives on ``self`` or in ``router.state`` (this module is pickled by value).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import List, Optional

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from router import metrics, state
from router.config import Settings
from router.policies import make_policy
from router.protocol import RoutedRequest
from router.routing import ReplicaInfo, RoutingCore

logger = logging.getLogger("ray.serve")


class PrefixCacheRequestRouter(RequestRouter):
    """Routes each request to the replica with the lowest expected TTFT (or a baseline
    policy chosen by name in the settings).

    ``request_router_kwargs``: ``{"settings": Settings.dump()}``.
    """

    def initialize_state(self, settings: Optional[dict] = None, **kwargs) -> None:
        self.settings = Settings(**(settings or {}))
        self.policy = make_policy(self.settings.policy, rng=random.Random(),
                                  **self.settings.policy_kwargs(self.settings.policy))
        self._policies = {self.policy.name: self.policy}
        self._core: RoutingCore | None = None
        self._known: set[str] = set()
        self._feeds: dict = {}
        state.put("replica_ids", None)

    def _routing_core(self) -> RoutingCore:
        # Created on the router's own loop: a Redis client belongs to the loop that made it.
        if self._core is None:
            self._core = RoutingCore(
                self.settings, state.make_index(self.settings),
                state.make_load_tracker(self.settings), self.policy,
                on_index_error=lambda exc, op: (
                    metrics.inc("index_errors", tags={"op": op}),
                    metrics.get("index_available").set(0)),
                health=state.replica_health())
            self._stats_task = asyncio.get_running_loop().create_task(self._report_index_size())
        return self._core

    async def _report_index_size(self, period_s: float = 10.0) -> None:
        """Export the index size every ``period_s`` (``router_index_entries``)."""
        from router.index.base import IndexUnavailable
        while True:
            try:
                metrics.get("index_entries").set((await self._core.index.stats()).entries)
            except IndexUnavailable:
                pass
            await asyncio.sleep(period_s)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        req = _routed_request(pending_request)
        if req is None or not candidate_replicas:
            return [candidate_replicas]
        t0 = time.perf_counter()
        try:
            ranked = await self._choose(candidate_replicas, req)
        except Exception:  # never fail (Serve would retry forever): Serve picks by load
            logger.exception("routing decision failed for request %s; routing by load",
                             req.request_id)
            metrics.inc("decisions", tags={"reason": "fallback", "policy": self.policy.name})
            return [candidate_replicas]
        now = time.perf_counter()
        metrics.get("decision_time").observe(now - t0, tags={"policy": self.policy.name})
        if req.t_arrival and not req.excluded_replicas:  # first attempt: arrival to dispatch
            req.routing_s = now - req.t_arrival
            metrics.get("overhead").observe(req.routing_s, tags={"policy": self.policy.name})
        return ranked

    async def _choose(self, candidate_replicas: List[RunningReplica],
                      req: RoutedRequest) -> List[List[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        pool = [r for r in candidate_replicas
                if r.replica_id.unique_id not in req.excluded_replicas] or candidate_replicas
        infos = [ReplicaInfo(r.replica_id.unique_id, r.replica_metadata or {},
                             r.routing_stats or {}) for r in pool]
        core = self._routing_core()
        metrics.get("replicas_without_kv_events").set(
            sum(1 for i in infos if i.stats.get("kv_events_live") is False))
        policy = self._policy_for(req)
        try:
            decision = await core.decide(req.request_id, req.prompt_tokens, req.block_hashes,
                                         infos, cacheable=bool(req.block_hashes), policy=policy)
        except BaseException:  # cancelled mid-decision: a reservation may exist; drop it
            asyncio.get_running_loop().create_task(core.load.release(req.request_id))
            raise
        if req.closed:  # the ingress is done with it already (client gone)
            await core.load.release(req.request_id)
        if decision.reason != "fallback":
            metrics.get("index_available").set(1)
        req.routed_replica = decision.replica
        req.predicted_cached_tokens = dict(decision.predicted_cached_tokens)
        req.routing_reason = decision.reason
        metrics.inc("decisions", tags={"reason": decision.reason, "policy": policy.name})
        metrics.inc("predicted_blocks",
                    decision.predicted_cached_tokens.get(decision.replica, 0)
                    // self.settings.block_size, tags={"replica": decision.replica})
        return [[by_id[rid]] for rid in decision.ranked]

    def _policy_for(self, req: RoutedRequest):
        name = self.settings.policy_for(req.policy)
        if name not in self._policies:
            self._policies[name] = make_policy(name, rng=random.Random(),
                                               **self.settings.policy_kwargs(name))
        return self._policies[name]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result) -> None:
        req = _routed_request(pending_request)
        if req is None or req.routed_replica == replica_id.unique_id or self._core is None:
            return
        # Serve sent it elsewhere (the choice was at max_ongoing_requests): follow it.
        actual = replica_id.unique_id
        req.routed_replica = actual
        running = next((r for r in self.curr_replicas.values()
                        if r.replica_id.unique_id == actual), None)
        info = ReplicaInfo(actual, running.replica_metadata if running else {},
                           running.routing_stats if running else {})
        asyncio.get_running_loop().create_task(self._follow(req, info))

    async def _follow(self, req: RoutedRequest, info: ReplicaInfo) -> None:
        """Move the reservation to where Serve sent the request; released again if the
        ingress finished with the request meanwhile (its release may have come first)."""
        core = self._core
        await core.moved(req.request_id, info, req.prompt_tokens, req.block_hashes,
                         req.predicted_cached_tokens.get(info.replica_id, 0))
        if req.closed:
            await core.load.release(req.request_id)

    def update_replicas(self, replicas: List[RunningReplica]) -> None:
        super().update_replicas(replicas)
        ids = {r.replica_id.unique_id for r in replicas}
        state.put("replica_ids", frozenset(ids))
        state.put("request_router", self)
        gone = self._known - ids
        self._known = ids
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        core = self._routing_core()
        for rid in gone:
            logger.info("replica %s left; purging its index entries", rid)
            feed = self._feeds.pop(rid, None)
            if feed is not None:
                loop.create_task(feed.stop())
            loop.create_task(core.remove_replica(rid))
        if not self.settings.redis_url:
            # In-process index: this router consumes the engines' KV events itself (the
            # engines' ipc:// endpoints are on this host, DESIGN.md decision 2).
            from router.kv_consumer import EventFeed
            for r in replicas:
                rid, md = r.replica_id.unique_id, r.replica_metadata or {}
                if rid in self._feeds or not md.get("kv_events_endpoint"):
                    continue
                feed = EventFeed(rid, md["kv_events_endpoint"], md.get("kv_replay_endpoint"),
                                 core.index)
                feed.start()
                self._feeds[rid] = feed

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        logger.warning("replica %s died", replica_id.unique_id)


def _routed_request(pending_request: Optional[PendingRequest]) -> Optional[RoutedRequest]:
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg if isinstance(arg, RoutedRequest) else None
