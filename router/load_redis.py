"""Load shared by every router through Redis, with leases that survive a router's death.

Keys (``<ns>`` = ``Settings.index_namespace``):

* ``<ns>:load``: hash with ``<replica>:n`` (requests in flight), ``<replica>:p`` (queued
  prefill tokens), ``<replica>:t`` (time of its last assignment, ms);
* ``<ns>:leases``: hash ``request id -> "replica|prefill tokens|prefill done (0/1)|router id"``;
  every counter change goes with a lease change in one script, so releasing twice is a no-op
  (``lua/lease.lua``);
* ``<ns>:router:<id>``: a router's heartbeat (expires after ``heartbeat_ttl_s``); any router's
  sweep releases the leases of routers whose heartbeat is gone (a killed ingress process
  leaves no phantom load, FAULTS.md 5.1).

With the prefix_aware policy and the Redis index, one script (``lua/route.lua``) matches,
scores, chooses and reserves atomically (``route``). When Redis fails, every method falls back
to this process's own reservations (``local``), so decisions continue by the load this router
knows, and the failure is reported as ``IndexUnavailable`` where a caller needs to know.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Sequence

from router.clock import Clock, SystemClock
from router.index.base import IndexUnavailable
from router.index.redis_index import RedisConnections, load_lua, pack_hashes
from router.load import LoadTracker, MemoryLoadTracker, ReplicaLoad

logger = logging.getLogger(__name__)


class RedisLoadTracker(LoadTracker):
    """Load reservations in Redis.

    Args:
        connections: the Redis connections (shared with the Redis index).
        namespace: key prefix.
        heartbeat_ttl_s: a router silent this long is dead; its leases are released.
    """

    def __init__(self, connections: RedisConnections, namespace: str = "prefix-router",
                 heartbeat_ttl_s: float = 30.0,
                 clock: Clock | None = None):
        self.conn = connections
        self.ns = namespace
        self.clock = clock or SystemClock()
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.router_id = uuid.uuid4().hex[:12]
        self.local = MemoryLoadTracker(clock=self.clock)
        self._lease_src = load_lua("lease")
        self._route_src = load_lua("route")
        self._scripts: dict[int, tuple] = {}
        self._heartbeat_task: asyncio.Task | None = None
        self.keys = [f"{namespace}:load", f"{namespace}:leases"]
        self._heartbeat_key = f"{namespace}:router:{self.router_id}"
        self._unreleased: set[str] = set()  # releases Redis has not taken yet

    def _s(self, client):
        s = self._scripts.get(id(client))
        if s is None:
            s = self._scripts[id(client)] = (client.register_script(self._lease_src),
                                              client.register_script(self._route_src))
        return s

    def _now_ms(self) -> int:
        return int(self.clock.now() * 1000)

    # --- heartbeat and sweep -----------------------------------------------------------
    def ensure_heartbeat(self) -> None:
        """Start this router's heartbeat and lease sweep on the running loop (idempotent)."""
        if self._heartbeat_task is None or self._heartbeat_task.done():
            self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat())

    async def _heartbeat(self) -> None:
        period = self.heartbeat_ttl_s / 3
        while True:
            try:
                await self.conn.call(lambda c: c.set(self._heartbeat_key, 1,
                                                     px=int(self.heartbeat_ttl_s * 1000)),
                                     maintenance=True)
                if self._unreleased:
                    await self.retry_releases()
                swept = await self.sweep()
                if swept:
                    logger.warning("released %d leases of routers that stopped", swept)
            except IndexUnavailable:
                pass
            await asyncio.sleep(period)

    async def sweep(self) -> int:
        """Release the leases of routers whose heartbeat expired; returns how many."""
        async def run(c):
            return await self._s(c)[0](keys=self.keys, args=["sweep", f"{self.ns}:router:"])
        return int(await self.conn.call(run, maintenance=True))

    # --- LoadTracker -------------------------------------------------------------------
    async def loads(self, replicas: Sequence[str]) -> dict[str, ReplicaLoad]:
        fields = [f"{r}:{k}" for r in replicas for k in "npt"]

        async def run(c):
            return await c.hmget(self.keys[0], fields)

        try:
            vals = await self.conn.call(run)
        except IndexUnavailable:
            return self.local.loads_now(replicas)
        out = {}
        for i, r in enumerate(replicas):
            n, p, t = (float(v) if v is not None else 0.0 for v in vals[3 * i:3 * i + 3])
            out[r] = ReplicaLoad(int(n), int(p), t / 1000)
        return out

    async def reserve(self, request_id: str, replica: str, prefill_tokens: int) -> None:
        self.ensure_heartbeat()
        self.local.reserve_now(request_id, replica, prefill_tokens)
        lease = f"{replica}|{int(prefill_tokens)}|0|{self.router_id}"

        async def run(c):
            pipe = c.pipeline(transaction=True)
            # drop an earlier lease of this request first (re-reservation)
            await self._s(c)[0](keys=self.keys, args=["release", request_id], client=pipe)
            pipe.hincrby(self.keys[0], f"{replica}:n", 1)
            pipe.hincrby(self.keys[0], f"{replica}:p", int(prefill_tokens))
            pipe.hset(self.keys[0], f"{replica}:t", self._now_ms())
            pipe.hset(self.keys[1], request_id, lease)
            # no lease without a live heartbeat: another router's sweep would release it
            pipe.set(self._heartbeat_key, 1, px=int(self.heartbeat_ttl_s * 1000))
            return await pipe.execute()

        try:
            await self.conn.call(run)
            self._unreleased.discard(request_id)  # the script released any earlier lease
        except IndexUnavailable:
            pass

    async def prefill_done(self, request_id: str) -> None:
        self.local.prefill_done_now(request_id)
        try:
            await self.conn.call(lambda c: self._s(c)[0](
                keys=self.keys, args=["prefill_done", request_id]))
        except IndexUnavailable:
            pass

    async def release(self, request_id: str) -> None:
        """Release the request's lease. It must not be lost: a lease of a live router is
        never swept, so a release that fails (Redis slow or down) is kept and retried with
        every heartbeat until Redis takes it (FAULTS.md 5.1)."""
        self.local.release_now(request_id)
        try:
            await self._release(request_id)
        except IndexUnavailable:
            self._unreleased.add(request_id)
            self.ensure_heartbeat()

    async def _release(self, request_id: str) -> None:
        await self.conn.call(lambda c: self._s(c)[0](keys=self.keys,
                                                     args=["release", request_id]),
                             maintenance=True)
        self._unreleased.discard(request_id)

    async def retry_releases(self) -> int:
        """Retry the releases that failed; returns how many are still pending."""
        for request_id in list(self._unreleased):
            await self._release(request_id)
        return len(self._unreleased)

    async def remove_replica(self, replica: str) -> None:
        await self.local.remove_replica(replica)
        try:
            await self.conn.call(lambda c: self._s(c)[0](keys=self.keys,
                                                         args=["purge", replica]))
        except IndexUnavailable:
            pass

    # --- the atomic decision -----------------------------------------------------------
    async def route(self, index, request_id: str, prompt_tokens: int,
                    block_hashes: Sequence[int], replicas: Sequence[str],
                    ttls_s: Sequence[float], *, block_size: int, prefill_rate: float,
                    work_weight: float, decode_step_s_per_seq: float, step_token_budget: int,
                    tie_abs_s: float, tie_rel: float, u: float, load_factor: float = 1.35
                    ) -> tuple[str, dict[str, int]]:
        """Match, score, choose and reserve in one script (the prefix_aware rule).

        Args:
            index: the ``RedisPrefixIndex`` (its key layout).
        Returns:
            (chosen replica, matched blocks per replica).
        Raises:
            IndexUnavailable: Redis failed; nothing was reserved in Redis.
        """
        self.ensure_heartbeat()
        keys = self.keys + [k for r in replicas for k in index.replica_keys(r)]
        args = [self._now_ms(), "route", request_id, self.router_id, prompt_tokens, block_size,
                prefill_rate, work_weight, decode_step_s_per_seq, step_token_budget, tie_abs_s,
                tie_rel, min(load_factor, 1e9), u, f"{index.ns}:", len(replicas), *replicas,
                *(int(t * 1000) for t in ttls_s), pack_hashes(block_hashes),
                self._heartbeat_key, int(self.heartbeat_ttl_s * 1000)]

        async def run(c):
            return await self._s(c)[1](keys=keys, args=args)

        res = await self.conn.call(run)
        self._unreleased.discard(request_id)  # the script released any earlier lease
        chosen = replicas[int(res[0]) - 1]
        matched = {r: int(n) for r, n in zip(replicas, res[1:])}
        cached = min(matched[chosen], (prompt_tokens - 1) // block_size) * block_size \
            if prompt_tokens > 0 else 0
        self.local.reserve_now(request_id, chosen, max(prompt_tokens - cached, 0))
        return chosen, matched

    async def close(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
