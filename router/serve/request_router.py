"""The Ray Serve ``RequestRouter`` that routes engine replicas with ``RoutingCore``.

Serve builds one instance per ``DeploymentHandle`` (one per ingress process), runs its
coroutines on a dedicated event loop, and may call ``choose_replicas`` several times for one
request (backoff), so the method is idempotent: a reservation is keyed by the request id
and replaced, never added twice. The chosen replica is ranked alone first, because Serve
picks the least loaded replica *inside* a rank; the others follow in cost order as
fallbacks (docs/architecture.md, decision 6; docs/reference.md 1.3).

No ``FIFOMixin``: a prefix-aware choice belongs to its own request, not the oldest pending
one. State lives on ``self`` or in ``router.serve.state`` (this module is pickled by value).
"""

from __future__ import annotations

import asyncio
from typing import List, Optional

from ray.serve.request_router import (
    PendingRequest,
    ReplicaID,
    RequestRouter,
    RunningReplica,
)

from router import metrics
from router.config import Settings
from router.logs import get_logger
from router.policy import PolicySet
from router.routing.core import RoutingCore, route_request
from router.routing.replica import ReplicaInfo, ReplicaMetadata, RoutingStats
from router.serve import state
from router.serve.protocol import RoutedRequest

logger = get_logger(__name__)


class PrefixCacheRequestRouter(RequestRouter):
    """Routes each request to the replica with the lowest expected TTFT (or a baseline
    policy chosen by name in the settings).

    ``request_router_kwargs``: ``{"settings": Settings.dump()}``.
    """

    def initialize_state(self, settings: Optional[dict] = None, **kwargs) -> None:
        self.settings = Settings(**(settings or {}))
        self.policies = PolicySet(self.settings)
        self.policy = self.policies.default
        self._core: RoutingCore | None = None
        self._known: set[str] = set()
        self._feeds: dict = {}
        state.put("replica_infos", None)

    def _routing_core(self) -> RoutingCore:
        # Created on the router's own loop: a Redis client belongs to the loop that made it.
        if self._core is None:
            self._core = state.make_routing_core(self.settings, self.policy)
            self._stats_task = asyncio.get_running_loop().create_task(self._report_index_size())
        return self._core

    async def _report_index_size(self, period_s: float = 5.0) -> None:
        """Probe the index every ``period_s`` (``RoutingCore.probe_index``:
        ``router_index_entries``, ``router_index_available``)."""
        while True:
            try:
                await self._core.probe_index()
            except Exception:  # a bug here must not end the probes for good
                logger.exception("index probe failed")
            await asyncio.sleep(period_s)

    async def choose_replicas(self, candidate_replicas: List[RunningReplica],
                              pending_request: Optional[PendingRequest] = None
                              ) -> List[List[RunningReplica]]:
        req = _routed_request(pending_request)
        if req is None or not candidate_replicas:
            return [candidate_replicas]
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        try:
            decision = await route_request(self._routing_core(), req,
                                           [replica_info(r) for r in candidate_replicas],
                                           self.policies.get(req.policy))
        except Exception:  # never fail (Serve would retry forever): Serve picks by load
            logger.exception("routing decision failed for request %s; routing by load",
                             req.request_id)
            metrics.inc("decisions", tags={"reason": "fallback", "policy": self.policy.name})
            return [candidate_replicas]
        return [[by_id[rid]] for rid in decision.ranked]

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
        info = replica_info(running) if running else ReplicaInfo(actual, {}, {})
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
        # The direct data path decides in the ingress, from this snapshot (Serve calls this
        # on every replica-set or routing-stats broadcast, on the router's own loop).
        state.put("replica_infos", tuple(replica_info(r) for r in replicas))
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
            # engines' ipc:// endpoints are on this host, docs/architecture.md, decision 2).
            from router.kv_events.feed import EventFeed
            for r in replicas:
                rid = r.replica_id.unique_id
                md = ReplicaMetadata.from_dict(r.replica_metadata)
                if rid in self._feeds or not md.kv_events_endpoint:
                    continue
                feed = EventFeed(rid, md.kv_events_endpoint, md.kv_replay_endpoint or None,
                                 core.index)
                feed.start()
                self._feeds[rid] = feed

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        logger.warning("replica %s died", replica_id.unique_id)


def replica_info(replica: RunningReplica) -> ReplicaInfo:
    """What routing reads of one of Serve's running replicas (copies, so a later broadcast
    does not change a decision under way)."""
    return ReplicaInfo(replica.replica_id.unique_id,
                       ReplicaMetadata.from_dict(replica.replica_metadata),
                       RoutingStats.from_dict(replica.routing_stats))


def _routed_request(pending_request: Optional[PendingRequest]) -> Optional[RoutedRequest]:
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg if isinstance(arg, RoutedRequest) else None
