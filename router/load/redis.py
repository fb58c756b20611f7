"""Load shared by every router through Redis, with leases that survive a router's death.

Keys (``router.redis_keys``): the load hash (``<replica>:n`` in flight, ``:p`` queued
prefill tokens, ``:t`` last assignment), the lease hash (``request id -> "replica|prefill
tokens|prefill done|router id|attempt"``; every counter change goes with a lease change in
one script, so releasing twice is a no-op, ``lua/lease.lua``), and each router's heartbeat: any
router's sweep releases the leases of routers whose heartbeat is gone (a killed ingress
process leaves no phantom load, docs/fault-cases.md 5.1).

The tracker keeps leases and counts only: the one-round-trip decision that reserves with
them is ``router.routing.atomic.AtomicRoute``. When Redis fails, every method falls back
to this process's own reservations (``local``), so decisions continue by the load this router
knows, and the failure is reported as ``IndexUnavailable`` where a caller needs to know.

Every reservation of a request id is a new *attempt* (a number that grows within this
router): a release names the attempt it ends and takes that attempt's lease or an earlier
one's, never a later one's. So a late retry of an earlier attempt's release (Redis was
slow, the heartbeat retried it while Serve routed the request again) cannot end the
reservation that replaced it, and a route script that ran after its caller had timed out
(and reserved the request again by the fallback) leaves no lease behind.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from typing import Sequence

from router.clock import Clock, SystemClock
from router.index.base import IndexUnavailable
from router.index.redis import RedisConnections
from router.load.base import LoadTracker, ReplicaLoad, Reservation
from router.load.memory import MemoryLoadTracker
from router.logs import get_logger
from router.redis_keys import LoadField, RedisKeys, ScriptCache

logger = get_logger(__name__)


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
        self.scripts = ScriptCache()
        self._heartbeat_task: asyncio.Task | None = None
        self.redis_keys = RedisKeys(namespace)
        self.keys = [self.redis_keys.load, self.redis_keys.leases]  # lease.lua's KEYS
        self.heartbeat_key = self.redis_keys.heartbeat(self.router_id)
        self._attempt_ids = itertools.count(1)
        self._owners: dict[str, str] = {}  # request id -> its current lease's owner
        self._unreleased: dict[str, str] = {}  # releases Redis has not taken: id -> owner
        # what Redis's counts are known to miss or to hold past its time, per request id
        # (corrected in ``loads``): reservations whose write failed, releases not taken
        self._unsynced: dict[str, Reservation] = {}
        self._stale: dict[str, Reservation] = {}

    @property
    def pending_releases(self) -> set[str]:
        """The request ids whose release Redis has not taken yet (retried each heartbeat)."""
        return set(self._unreleased)

    def lease_owner(self, request_id: str) -> str:
        """A new attempt of ``request_id``: the owner (``"router id|attempt"``, the tail of
        the lease) that its reservation writes, by ``reserve`` or by the route script
        (``AtomicRoute``, mirrored by ``adopt``). Releases and ``prefill_done`` name it."""
        owner = f"{self.router_id}|{next(self._attempt_ids)}"
        self._owners[request_id] = owner
        return owner

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
                await self.conn.call(lambda c: c.set(self.heartbeat_key, 1,
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
            return await self.scripts.of(c).lease(keys=self.keys,
                                                  args=["sweep", self.redis_keys.router_prefix])
        return int(await self.conn.call(run, maintenance=True))

    # --- LoadTracker -------------------------------------------------------------------
    async def loads(self, replicas: Sequence[str]) -> dict[str, ReplicaLoad]:
        fields = [f.of(r) for r in replicas for f in (LoadField.INFLIGHT, LoadField.PREFILL_TOKENS,
                                                     LoadField.LAST_ASSIGNED_MS)]

        async def run(c):
            return await c.hmget(self.redis_keys.load, fields)

        try:
            vals = await self.conn.call(run)
        except IndexUnavailable:
            return self.local.loads_now(replicas)
        out = {}
        for i, r in enumerate(replicas):
            n, p, t = (float(v) if v is not None else 0.0 for v in vals[3 * i:3 * i + 3])
            out[r] = ReplicaLoad(int(n), int(p), t / 1000)
        self._correct(out)
        return out

    def _correct(self, loads: dict[str, ReplicaLoad]) -> None:
        """Redis's counts as this router knows them to be: plus its reservations whose write
        failed (Redis may have taken one after all: then it counts twice until released, a
        wait too many, never a slot handed out twice), minus its releases Redis has not
        taken yet (the request is over; the count falls when the retry lands)."""
        for sign, held in ((1, self._unsynced), (-1, self._stale)):
            for res in list(held.values()):
                load = loads.get(res.replica)
                if load is None:
                    continue
                load.inflight = max(load.inflight + sign, 0)
                if not res.prefill_done:
                    load.prefill_tokens = max(load.prefill_tokens + sign * res.prefill_tokens, 0)

    async def reserve(self, request_id: str, replica: str, prefill_tokens: int) -> None:
        self.ensure_heartbeat()
        self.local.reserve_now(request_id, replica, prefill_tokens)
        lease = f"{replica}|{int(prefill_tokens)}|0|{self.lease_owner(request_id)}"

        async def run(c):
            pipe = c.pipeline(transaction=True)
            # drop an earlier lease of this request first (re-reservation)
            await self.scripts.of(c).lease(keys=self.keys, args=["release", request_id],
                                           client=pipe)
            pipe.hincrby(self.redis_keys.load, LoadField.INFLIGHT.of(replica), 1)
            pipe.hincrby(self.redis_keys.load, LoadField.PREFILL_TOKENS.of(replica),
                         int(prefill_tokens))
            pipe.hset(self.redis_keys.load, LoadField.LAST_ASSIGNED_MS.of(replica),
                      self._now_ms())
            pipe.hset(self.redis_keys.leases, request_id, lease)
            # no lease without a live heartbeat: another router's sweep would release it
            pipe.set(self.heartbeat_key, 1, px=int(self.heartbeat_ttl_s * 1000))
            return await pipe.execute()

        try:
            await self.conn.call(run)
            self._unreleased.pop(request_id, None)  # the script released any earlier lease
            self._stale.pop(request_id, None)
            self._unsynced.pop(request_id, None)
        except IndexUnavailable:
            self._unsynced[request_id] = Reservation(replica, int(prefill_tokens))

    async def prefill_done(self, request_id: str) -> None:
        self.local.prefill_done_now(request_id)
        if request_id in self._unsynced:
            self._unsynced[request_id].prefill_done = True
        owner = self._owners.get(request_id, "")
        try:
            await self.conn.call(lambda c: self.scripts.of(c).lease(
                keys=self.keys, args=["prefill_done", request_id, owner]))
        except IndexUnavailable:
            pass

    async def release(self, request_id: str) -> None:
        """Release the request's lease. It must not be lost: a lease of a live router is
        never swept, so a release that fails (Redis slow or down) is kept and retried with
        every heartbeat until Redis takes it (docs/fault-cases.md 5.1)."""
        held = self.local.reservation(request_id)
        self.local.release_now(request_id)
        owner = self._owners.pop(request_id, "")
        if self._unsynced.pop(request_id, None) is not None:
            held = None  # Redis never counted it (or counts it, and the release ends it)
        try:
            await self._release(request_id, owner)
        except IndexUnavailable:
            self._unreleased[request_id] = owner
            if held is not None:
                self._stale[request_id] = held
            self.ensure_heartbeat()

    async def _release(self, request_id: str, owner: str) -> None:
        """End the lease of ``request_id`` written by ``owner`` (a no-op where a later
        attempt holds the lease, or none does); then that release is no longer pending.

        Raises:
            IndexUnavailable: Redis did not take it.
        """
        await self.conn.call(lambda c: self.scripts.of(c).lease(
            keys=self.keys, args=["release", request_id, owner]), maintenance=True)
        if self._unreleased.get(request_id) == owner:
            del self._unreleased[request_id]
            self._stale.pop(request_id, None)

    async def retry_releases(self) -> int:
        """Retry the releases that failed; returns how many are still pending.

        Raises:
            IndexUnavailable: Redis failed again (the rest stay pending).
        """
        for request_id, owner in list(self._unreleased.items()):
            await self._release(request_id, owner)
        return len(self._unreleased)

    async def remove_replica(self, replica: str) -> None:
        await self.local.remove_replica(replica)
        for held in (self._unsynced, self._stale):
            for rid in [k for k, v in held.items() if v.replica == replica]:
                del held[rid]
        try:
            await self.conn.call(lambda c: self.scripts.of(c).lease(keys=self.keys,
                                                                   args=["purge", replica]))
        except IndexUnavailable:
            pass

    def adopt(self, request_id: str, replica: str, prefill_tokens: int) -> None:
        """A script reserved ``request_id`` on ``replica`` in Redis (``AtomicRoute``, with
        the attempt of ``lease_owner``; the script also released any earlier lease of the
        id): mirror it locally, and forget a release of the id still pending."""
        self._unreleased.pop(request_id, None)
        self._stale.pop(request_id, None)
        self._unsynced.pop(request_id, None)
        self.local.reserve_now(request_id, replica, prefill_tokens)

    async def close(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
