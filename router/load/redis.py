"""Load shared by every router through Redis, with leases that survive a router's death.

Keys (``router.redis_keys``): the load hash (``<replica>:n`` in flight, ``:p`` queued
prefill tokens, ``:t`` last assignment), the lease hash (``request id -> "replica|prefill
tokens|prefill done|router id|attempt"``; every counter change goes with a lease change in
one script, so releasing twice is a no-op, ``lua/lease.lua``), and each router's heartbeat: any
router's sweep releases the leases of routers whose heartbeat is gone (a killed ingress
process leaves no phantom load, docs/fault-cases.md 5.1).

The tracker keeps leases and counts only: the one-round-trip decision that reserves with
them is ``router.routing.atomic.AtomicRoute``.

With shard groups (``Settings.index_shard_groups``, the Redis Cluster mode), each group has
its own load hash, lease hash and router heartbeats, under the group's hash tag
(``router.redis_keys.ShardGroups``): a replica's counts live in its group's hash, a
request's lease in the group of the replica it was reserved on (this router remembers
which), and a router keeps a heartbeat, and sweeps the leases of dead routers, in the
groups it has routed to within its heartbeat's TTL (a group no live router uses has no
decision that its stale counts could mislead; a router that starts using it sweeps it on
its next heartbeat). When Redis fails, every method falls back
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
from router.index.redis import RedisConnections, each_group
from router.load.base import LoadTracker, ReplicaLoad, Reservation
from router.load.memory import MemoryLoadTracker
from router.logs import get_logger
from router.redis_keys import TABLE_FIELD, TABLE_VALUE, LoadField, ShardGroups, ScriptCache

logger = get_logger(__name__)


class RedisLoadTracker(LoadTracker):
    """Load reservations in Redis.

    Args:
        connections: the Redis connections (shared with the Redis index).
        namespace: key prefix.
        heartbeat_ttl_s: a router silent this long is dead; its leases are released.
        shard_groups: ``Settings.index_shard_groups`` (None: one Redis, no groups); the
            same as the index's.
    Raises:
        ValueError: ``shard_groups`` out of range (``ShardGroups``).
    """

    def __init__(self, connections: RedisConnections, namespace: str = "prefix-router",
                 heartbeat_ttl_s: float = 30.0,
                 clock: Clock | None = None, shard_groups: int | None = None):
        self.conn = connections
        self.ns = namespace
        self.groups = ShardGroups(namespace, shard_groups)
        self.clock = clock or SystemClock()
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.router_id = uuid.uuid4().hex[:12]
        self.local = MemoryLoadTracker(clock=self.clock)
        self.scripts = ScriptCache()
        self._heartbeat_task: asyncio.Task | None = None
        # without groups: the namespace's keys; with groups, group 0's (``group_keys``)
        self.redis_keys = self.groups.keys[0]
        self.keys = self.group_keys(0)  # lease.lua's KEYS
        self.heartbeat_key = self.heartbeat_key_of(0)
        # with groups: request id -> the group of its current lease, and of its pending
        # release (``_unreleased``); group -> when this router last reserved there (s)
        self._lease_group: dict[str, int] = {}
        self._release_group: dict[str, int] = {}
        self._used: dict[int, float] = {}
        self._attempt_ids = itertools.count(1)
        self._owners: dict[str, str] = {}  # request id -> its current lease's owner
        self._unreleased: dict[str, str] = {}  # releases Redis has not taken: id -> owner
        # what Redis's counts are known to miss or to hold past its time, per request id
        # (corrected in ``loads``): reservations whose write failed, releases not taken
        self._unsynced: dict[str, Reservation] = {}
        self._stale: dict[str, Reservation] = {}
        # first bytes whose shared write waits (``prefill_done_soon``), and writes running
        self._prefill_timers: dict[str, asyncio.TimerHandle] = {}
        self._writes: set[asyncio.Task] = set()

    def group_keys(self, group: int) -> list[str]:
        """``lua/lease.lua``'s KEYS in ``group``: its load hash and its lease hash."""
        k = self.groups.keys[group]
        return [k.load, k.leases]

    def heartbeat_key_of(self, group: int) -> str:
        """This router's heartbeat key in ``group``."""
        return self.groups.keys[group].heartbeat(self.router_id)

    def group_of_request(self, request_id: str) -> int | None:
        """The group of ``request_id``'s current lease (0 without groups), or None when
        this router holds none for it."""
        if not self.groups.tagged:
            return 0
        return self._lease_group.get(request_id)

    def reserving(self, request_id: str, group: int) -> int | None:
        """A script is about to reserve ``request_id`` in ``group`` (``AtomicRoute``): its
        lease may be there from now on, even if the call fails (a later reservation or
        release of the id then goes there too). Returns the group its lease was known in
        before (None: none, or no groups), for ``not_reserved``."""
        self.used(group)
        if not self.groups.tagged:
            return None
        before = self._lease_group.get(request_id)
        self._lease_group[request_id] = group
        return before

    def not_reserved(self, request_id: str, before: int | None) -> None:
        """The script announced by ``reserving`` answered that it wrote no lease (a long
        prompt's head found held, ``route_head``): the lease's group is what it was
        before (``before``, ``reserving``'s answer), so that the next decision does not
        release a lease that is not there first."""
        if not self.groups.tagged:
            return
        if before is None:
            self._lease_group.pop(request_id, None)
        else:
            self._lease_group[request_id] = before

    def used(self, group: int) -> None:
        """This router reserved in ``group`` now: its heartbeat there is kept, and the
        group swept, for a heartbeat TTL from now."""
        self._used[group] = self.clock.now()

    def active_groups(self) -> list[int]:
        """The groups where this router keeps a heartbeat and sweeps: group 0 without
        groups; with groups, those of its leases, its pending releases and its
        reservations within the heartbeat TTL."""
        if not self.groups.tagged:
            return [0]
        horizon = self.clock.now() - self.heartbeat_ttl_s
        for g in [g for g, t in self._used.items() if t < horizon]:
            del self._used[g]
        return sorted(set(self._used) | set(self._lease_group.values())
                      | set(self._release_group.values()))

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
                groups = self.active_groups()
                ttl_ms = int(self.heartbeat_ttl_s * 1000)

                async def beat(c):
                    pipe = c.pipeline(transaction=False)  # one key each: any shard
                    for g in groups:
                        pipe.set(self.heartbeat_key_of(g), 1, px=ttl_ms)
                        # the load hash a hash table, as the index's hashes (TABLE_FIELD):
                        # as a listpack (up to 128 fields: 25 replicas) every field that
                        # the route script reads or writes is found by a scan (its read
                        # of 8 replicas' loads took 14-19 us of Redis time on the 2-core
                        # VM, 4 us in a hash table)
                        pipe.hsetnx(self.groups.keys[g].load, TABLE_FIELD, TABLE_VALUE)
                    return await pipe.execute()

                if groups:
                    await self.conn.call(beat, maintenance=True)
                if self._unreleased:
                    await self.retry_releases()
                swept = await self.sweep(groups)
                if swept:
                    logger.warning("released %d leases of routers that stopped", swept)
            except IndexUnavailable:
                pass
            await asyncio.sleep(period)

    async def sweep(self, groups: list[int] | None = None) -> int:
        """Release the leases of routers whose heartbeat expired, in ``groups`` (default:
        every group; one script per group); returns how many."""
        groups = list(range(self.groups.count)) if groups is None else groups

        async def one(g: int) -> int:
            async def run(c):
                return await self.scripts.of(c).lease(
                    keys=self.group_keys(g), args=["sweep", self.groups.keys[g].router_prefix])
            return int(await self.conn.call(run, maintenance=True))

        if len(groups) == 1:
            return await one(groups[0])
        return sum(await asyncio.gather(*(one(g) for g in groups)))

    # --- LoadTracker -------------------------------------------------------------------
    async def loads(self, replicas: Sequence[str]) -> dict[str, ReplicaLoad]:
        """Every replica's load (one ``HMGET`` per group, the groups' at once); this
        router's own reservations alone when Redis fails."""
        async def one(group: int, reps: list[str]) -> list:
            fields = [f.of(r) for r in reps for f in (
                LoadField.INFLIGHT, LoadField.PREFILL_TOKENS, LoadField.LAST_ASSIGNED_MS,
                LoadField.PLACEMENTS, LoadField.PLACEMENTS_AT_MS)]
            key = self.groups.keys[group].load
            return await self.conn.call(lambda c: c.hmget(key, fields))

        try:
            got = await each_group(self.groups.split(replicas) if replicas else {0: []}, one)
        except IndexUnavailable:
            return self.local.loads_now(replicas)
        out = {}
        for reps, vals in got:
            for i, r in enumerate(reps):
                n, p, t, k, kt = (float(v) if v is not None else 0.0
                                  for v in vals[5 * i:5 * i + 5])
                out[r] = ReplicaLoad(int(n), int(p), t / 1000, k, kt / 1000)
        out = {r: out[r] for r in replicas}
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
        """Reserve ``replica`` for ``request_id``: any earlier lease of the id released,
        counts, lease and heartbeat written atomically (one Redis: a ``MULTI`` of the
        release script and the writes; with shard groups: ``lua/lease.lua``'s ``reserve``
        in the replica's group, a cluster pipeline taking no script)."""
        self.ensure_heartbeat()
        self.local.reserve_now(request_id, replica, prefill_tokens)
        group = self.groups.group_of(replica)
        try:
            await self.release_elsewhere(request_id, group)
        except IndexUnavailable:
            self._unsynced[request_id] = Reservation(replica, int(prefill_tokens))
            return
        owner = self.lease_owner(request_id)
        self.reserving(request_id, group)  # even if the write fails, a lease may be there
        if self.groups.tagged:
            args = ["reserve", request_id, replica, int(prefill_tokens), self._now_ms(),
                    owner, int(self.heartbeat_ttl_s * 1000)]
            keys = self.group_keys(group) + [self.heartbeat_key_of(group)]

            async def run(c):
                return await self.scripts.of(c).lease(keys=keys, args=args)
        else:
            lease = f"{replica}|{int(prefill_tokens)}|0|{owner}"

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
            self._took_lease(request_id, group)
            self._unsynced.pop(request_id, None)
        except IndexUnavailable:
            self._unsynced[request_id] = Reservation(replica, int(prefill_tokens))

    def _took_lease(self, request_id: str, group: int) -> None:
        """Redis holds ``request_id``'s lease in ``group`` now (a script released any
        earlier lease of the id there): a release of the id still pending is forgotten."""
        self._unreleased.pop(request_id, None)
        self._release_group.pop(request_id, None)
        self._stale.pop(request_id, None)
        if self.groups.tagged:
            self._lease_group[request_id] = group

    async def release_elsewhere(self, request_id: str, group: int) -> None:
        """Before ``request_id`` is reserved in ``group``: release its lease held in
        another group, if any (with groups, a script releases an earlier lease of the id
        only in its own group). Nothing without groups.

        Raises:
            IndexUnavailable: Redis did not take the release (it stays pending).
        """
        old = self._lease_group.get(request_id) if self.groups.tagged else None
        if old is None or old == group:
            return
        owner = self._owners.get(request_id, "")
        del self._lease_group[request_id]
        self._unreleased[request_id] = owner
        self._release_group[request_id] = old
        self.ensure_heartbeat()
        await self._release(request_id, owner)

    async def prefill_done(self, request_id: str) -> None:
        self._prefill_done_here(request_id)
        await self._write_prefill_done(request_id, self._owners.get(request_id, ""))

    def _prefill_done_here(self, request_id: str) -> None:
        self.local.prefill_done_now(request_id)
        if request_id in self._unsynced:
            self._unsynced[request_id].prefill_done = True

    async def _write_prefill_done(self, request_id: str, owner: str) -> None:
        group = self.group_of_request(request_id)
        if group is None:
            return  # no lease in Redis (its reservation's write failed)
        try:
            await self.conn.call(lambda c: self.scripts.of(c).lease(
                keys=self.group_keys(group), args=["prefill_done", request_id, owner]))
        except IndexUnavailable:
            pass

    # how long the shared write of a first byte waits for the release that would make
    # it useless: an answer that is not streamed ends with its first byte, and a short
    # stream soon after; other routers see the prefill queued that much longer
    PREFILL_DONE_DELAY_S = 0.02

    def prefill_done_soon(self, request_id: str) -> None:
        """This process's counts at once; Redis's after ``PREFILL_DONE_DELAY_S`` unless
        the request is released first (its release script takes the undone prefill off
        the queue as well, so one round trip does both). Saves the ``prefill_done`` call
        of every answer that is not streamed and of every stream that ends within the
        delay (``loadtest.router_throughput``'s one-token answers)."""
        self._prefill_done_here(request_id)
        if request_id in self._prefill_timers:
            return
        owner = self._owners.get(request_id, "")  # this attempt's, not a later one's
        self._prefill_timers[request_id] = asyncio.get_running_loop().call_later(
            self.PREFILL_DONE_DELAY_S, self._prefill_done_due, request_id, owner)

    def _prefill_done_due(self, request_id: str, owner: str) -> None:
        self._prefill_timers.pop(request_id, None)
        task = asyncio.ensure_future(self._write_prefill_done(request_id, owner))
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    async def release(self, request_id: str) -> None:
        """Release the request's lease. It must not be lost: a lease of a live router is
        never swept, so a release that fails (Redis slow or down) is kept and retried with
        every heartbeat until Redis takes it (docs/fault-cases.md 5.1)."""
        timer = self._prefill_timers.pop(request_id, None)
        if timer is not None:  # the release takes the prefill off the queue too
            timer.cancel()
        held = self.local.reservation(request_id)
        if held is not None and timer is not None:
            held.prefill_done = False  # as Redis holds it: its first byte was never sent
        self.local.release_now(request_id)
        owner = self._owners.pop(request_id, "")
        if self._unsynced.pop(request_id, None) is not None:
            held = None  # Redis never counted it (or counts it, and the release ends it)
        group = self.group_of_request(request_id)
        if group is None:
            return  # with groups: no lease of this router for the id, in any group
        if self.groups.tagged:
            self._release_group[request_id] = self._lease_group.pop(request_id)
        # pending from now until Redis takes it: the loads read meanwhile leave the
        # request out (``_correct``), as they do after a failed release, so that an answer
        # sent before a slow Redis took the release is not counted as load
        self._unreleased[request_id] = owner
        if held is not None:
            self._stale[request_id] = held
        try:
            await self._release(request_id, owner)
        except IndexUnavailable:
            self.ensure_heartbeat()

    async def _release(self, request_id: str, owner: str) -> None:
        """End the lease of ``request_id`` written by ``owner`` (a no-op where a later
        attempt holds the lease, or none does); then that release is no longer pending.

        Raises:
            IndexUnavailable: Redis did not take it.
        """
        group = self._release_group.get(request_id, 0) if self.groups.tagged else 0
        await self.release_attempt(request_id, owner, group)
        self._release_group.pop(request_id, None)
        if self._unreleased.get(request_id) == owner:
            del self._unreleased[request_id]
            self._stale.pop(request_id, None)

    def holds(self, request_id: str) -> bool:
        """Whether this router still holds a reservation of ``request_id`` (it is routed
        and not released)."""
        return self.local.reservation(request_id) is not None

    async def release_attempt(self, request_id: str, owner: str, group: int) -> None:
        """End, in ``group``, the lease of ``request_id`` that ``owner`` (one attempt's
        ``lease_owner``) wrote, or an earlier attempt's; a later attempt's lease, or none,
        is left as it is. For a write that reached Redis after its caller had moved on (a
        route script that answered late, ``AtomicRoute.settle``; and every release,
        ``_release``). Bounded by the maintenance timeout.

        Raises:
            IndexUnavailable: Redis did not take it.
        """
        await self.conn.call(lambda c: self.scripts.of(c).lease(
            keys=self.group_keys(group), args=["release", request_id, owner]),
            maintenance=True)

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
        keys = self.group_keys(self.groups.group_of(replica))
        try:
            await self.conn.call(lambda c: self.scripts.of(c).lease(keys=keys,
                                                                   args=["purge", replica]))
        except IndexUnavailable:
            pass

    async def placed(self, replica: str, window_s: float,
                     request_id: str | None = None, local_only: bool = False) -> None:
        """``LoadTracker.placed`` in the local mirror (what the loads fall back to when
        Redis fails) and, unless ``local_only``, in Redis (``lua/lease.lua``'s ``placed``,
        in the replica's group); a failed write leaves Redis's count as it is (Redis's
        failure is reported where the loads are read)."""
        self.local.placed_now(replica, window_s, request_id, shared=not local_only)
        if not local_only:
            await self._placement_op("placed", replica, window_s)

    async def unplaced(self, replica: str, window_s: float, mirror: bool = True,
                       local_only: bool = False) -> None:
        """``LoadTracker.unplaced`` in Redis (``lua/lease.lua``'s ``unplaced``) unless
        ``local_only``, and, with ``mirror``, in the local mirror."""
        if mirror:
            self.local.placed_now(replica, window_s, delta=-1.0)
        if not local_only:
            await self._placement_op("unplaced", replica, window_s)

    async def _placement_op(self, op: str, replica: str, window_s: float) -> None:
        keys = self.group_keys(self.groups.group_of(replica))
        now_ms = int(self.clock.now() * 1000)
        try:  # the window in fractional ms, as route.lua gets it
            await self.conn.call(lambda c: self.scripts.of(c).lease(
                keys=keys, args=[op, replica, now_ms, window_s * 1000]))
        except IndexUnavailable as exc:
            logger.debug("new-prefix %s on %s not written to Redis: %s", op, replica, exc)

    def placement_of(self, request_id: str) -> tuple[str, bool] | None:
        return self.local.placement_of(request_id)

    def _forget_placement(self, request_id: str) -> None:
        self.local._forget_placement(request_id)

    def adopt_placement(self, request_id: str | None, replica: str, window_s: float) -> None:
        """A route script counted a new prefix on ``replica`` in Redis (``AtomicRoute``):
        mirror it locally, as ``request_id``'s placement (None: as no request's, one that
        has ended). A count of it this router kept in its own counts only (the fallback's,
        ``local_only``) is that one, now shared: not counted twice."""
        held = self.local.placement_of(request_id) if request_id is not None else None
        self.local.placed_now(replica, window_s, request_id,
                              delta=0.0 if held == (replica, False) else 1.0)

    def mean_request_life_s(self) -> float:
        return self.local.mean_request_life_s()

    def adopt(self, request_id: str, replica: str, prefill_tokens: int) -> None:
        """A script reserved ``request_id`` on ``replica`` in Redis (``AtomicRoute``, with
        the attempt of ``lease_owner``; the script also released any earlier lease of the
        id in the replica's group): mirror it locally, and forget a release of the id still
        pending."""
        self._took_lease(request_id, self.groups.group_of(replica))
        self._unsynced.pop(request_id, None)
        self.local.reserve_now(request_id, replica, prefill_tokens)

    async def close(self) -> None:
        for timer in self._prefill_timers.values():
            timer.cancel()
        self._prefill_timers.clear()
        for task in list(self._writes):
            task.cancel()
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
