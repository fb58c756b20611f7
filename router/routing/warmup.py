"""Cache-aware warm-up of a replica that joins, and re-homing of the prefixes of one that
leaves (docs/architecture.md, "Warm-up and re-homing").

Independent of Ray, like ``RoutingCore``: the ingress drives it in real time
(``router.serve.warmup``) and the virtual-time simulator (``loadtest.sim``) drives the same
objects in simulated time.

* ``HotPrefixes``: this process's bounded record of recent prefixes. Each prefix is a chain
  of block hashes with its token ids and extra keys (``cache_salt``, LoRA), kept in this
  process only (token ids never go to Redis, docs/security.md), with an exponentially
  decayed count of the requests that began with it and the replicas the index last said
  hold it.
* ``WarmupPacer``: the rate bound, a token bucket of prefill tokens per second and a cap on
  warm-up requests in flight.
* ``MemoryWarmupLease`` / ``RedisWarmupLease``: one ingress process warms a given replica
  (``SET NX`` on the replica id in Redis; without Redis each process is alone).
* ``Warmer``: plans the warm-up requests of a join (the hottest prefixes, to the new replica)
  or of a leave (the hot prefixes that only the leaver held, each to the survivor the cost
  rule picks, as for a request) and starts them as the pacer allows. Each is a prefill-only
  request (``max_tokens: 1``) of the prefix's exact token ids, decided by
  ``RoutingCore.decide`` (so its load is reserved and its blocks are written to the index as
  predicted entries at dispatch; the engine's KV events then confirm them).
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import Callable, Sequence

from router.clock import Clock
from router.index.base import IndexUnavailable
from router.logs import get_logger
from router.routing.replica import ReplicaInfo

logger = get_logger(__name__)

REASONS = ("scale_out", "rehome")  # the metric label values of a warm-up request


@dataclass(frozen=True)
class ExtraKeys:
    """What else, beside the token ids, enters a prefix's block hashes (``router.hashing``):
    the request's ``cache_salt`` (block 0) and LoRA adapter (every block). A warm-up
    request sends the same, so the engine's blocks hash the same."""

    cache_salt: str | None = None
    lora_name: str | None = None
    lora_path: str | None = None


@dataclass
class HotPrefix:
    """One recorded prefix (a node of ``HotPrefixes``' radix tree over blocks).

    Attributes:
        hashes: its block hashes (64-bit index keys), in prompt order; ``hashes[-1]`` is its
            key in the record.
        extra: its extra keys.
        count: decayed count of the requests that began with it, as of ``t`` (s).
        parent: the key of the longest recorded prefix of it, or None.
        children: the keys of the prefixes whose parent it is.
        holders: ``{replica: blocks held}``: where this process routed requests that began
            with it (``routed``), corrected by the index's answers (``refresh_holders``).
    """

    hashes: array
    extra: ExtraKeys
    count: float
    t: float
    parent: int | None = None
    children: set = field(default_factory=set)
    holders: dict[str, int] = field(default_factory=dict)

    @property
    def key(self) -> int:
        return self.hashes[-1]

    @property
    def blocks(self) -> int:
        return len(self.hashes)


@dataclass(frozen=True)
class WarmPrefix:
    """A prefix to warm, as a planner hands it out: its hashes, token ids (a whole number
    of blocks), extra keys, and its priority (the decayed request count it stands for)."""

    hashes: tuple[int, ...]
    token_ids: tuple[int, ...]
    extra: ExtraKeys
    priority: float


class HotPrefixes:
    """A bounded record of the prefixes this process's requests began with.

    Every request's block chain is recorded (``observe``). Where a request shares a leading
    part with a recorded chain and then diverges, the shared part becomes a prefix of its own
    (a system prompt shared by many conversations, say), so the record is a radix tree over
    blocks: a prefix's parent is its longest recorded prefix. Each prefix counts the
    requests that began with it, decayed exponentially with ``half_life_s``: ``count(t) =
    count(t0) * 2 ** (-(t - t0) / half_life_s) + hits``, so a steady rate of ``r`` requests
    per second counts about ``r * half_life_s / ln 2``. A shared part split off starts with
    the summed counts of the prefixes below it (the requests that went through it before).

    Memory: each distinct block's token ids are stored once (a prefix is its chain of
    blocks), ``max_tokens`` of them at most, and ``max_prefixes`` prefixes at most; beyond
    either, the prefixes of lowest count now are dropped first, down to 90 % of the bound.
    ``observe`` costs a binary search over the request's blocks and a walk up its recorded
    prefixes; a new shared part also scans its parent's children once.

    Args:
        block_size: tokens per block (``Settings.block_size``).
        half_life_s: the count's half-life (s).
        max_tokens: bound on the token ids held (tokens; 8 bytes each).
        max_prefixes: bound on the prefixes held.
        clock: the time source (``router.clock``).
    Raises:
        ValueError: a bound, the block size or the half-life is not positive.
    """

    def __init__(self, block_size: int, half_life_s: float, max_tokens: int,
                 max_prefixes: int, clock: Clock):
        if block_size <= 0 or half_life_s <= 0 or max_tokens <= 0 or max_prefixes <= 0:
            raise ValueError("block_size, half_life_s, max_tokens and max_prefixes must be "
                             "positive")
        self.block_size = block_size
        self.half_life_s = half_life_s
        self.max_tokens = max_tokens
        self.max_prefixes = max_prefixes
        self.clock = clock
        self._nodes: dict[int, HotPrefix] = {}  # last block hash -> prefix
        self._roots: set[int] = set()  # keys of the prefixes without a parent
        self._tokens: dict[int, array] = {}  # block hash -> its block's token ids
        self._refs: dict[int, int] = {}  # block hash -> prefixes whose chain holds it

    def __len__(self) -> int:
        return len(self._nodes)

    @property
    def tokens_held(self) -> int:
        """Token ids held (distinct blocks times the block size)."""
        return len(self._tokens) * self.block_size

    def count_now(self, node: HotPrefix, now: float | None = None) -> float:
        """``node``'s count decayed to ``now`` (default: the clock's now)."""
        now = self.clock.now() if now is None else now
        return node.count * 2.0 ** (-max(now - node.t, 0.0) / self.half_life_s)

    def get(self, key: int) -> HotPrefix | None:
        """The prefix whose last block hash is ``key``, or None."""
        return self._nodes.get(key)

    def token_ids(self, node: HotPrefix, blocks: int | None = None) -> list[int]:
        """The token ids of the prefix's first ``blocks`` blocks (default all)."""
        out: list[int] = []
        for h in node.hashes[:blocks]:
            out.extend(self._tokens[h])
        return out

    def observe(self, block_hashes: Sequence[int], token_ids: Sequence[int],
                extra: ExtraKeys = ExtraKeys()) -> None:
        """Record one request: ``block_hashes`` are its full blocks' hashes (computed with
        ``extra``) and ``token_ids`` its prompt's ids (at least ``len(block_hashes) *
        block_size`` of them). Every recorded prefix it begins with counts one more request.

        Raises:
            ValueError: fewer token ids than the blocks need.
        """
        n = len(block_hashes)
        if n == 0:
            return
        bs = self.block_size
        if len(token_ids) < n * bs:
            raise ValueError(f"{len(token_ids)} token ids cannot fill {n} blocks of {bs}")
        now = self.clock.now()
        # the deepest block already recorded: chained hashes make "recorded" a prefix
        # property (a recorded block's parents are recorded), so a binary search finds it
        lo, hi = 0, n  # blocks [0, lo) recorded; [hi, n) not
        while lo < hi:
            mid = (lo + hi) // 2
            if block_hashes[mid] in self._refs:
                lo = mid + 1
            else:
                hi = mid
        known = lo
        attach: int | None = None
        if known:
            attach = block_hashes[known - 1]
            if attach not in self._nodes:  # it diverges inside a recorded chain: split
                self._split(block_hashes, known, token_ids, extra, now)
            key: int | None = attach
            while key is not None:  # every recorded prefix of it counts one more
                node = self._nodes[key]
                node.count = self.count_now(node, now) + 1.0
                node.t = now
                key = node.parent
        if known < n:
            self._add(block_hashes, token_ids, extra, 1.0, now, attach)
        if len(self._tokens) * bs > self.max_tokens or len(self._nodes) > self.max_prefixes:
            self._evict(now)

    def routed(self, block_hashes: Sequence[int], replica: str) -> None:
        """A request recorded by ``observe`` was sent to ``replica``: it holds the request's
        recorded prefixes now (``HotPrefix.holders``)."""
        node = self._nodes.get(block_hashes[-1]) if block_hashes else None
        while node is not None:
            node.holders[replica] = node.blocks
            node = self._nodes.get(node.parent) if node.parent is not None else None

    def forget_replica(self, replica: str) -> None:
        """``replica`` left and its leave was planned: drop it from every prefix's holders."""
        for node in self._nodes.values():
            node.holders.pop(replica, None)

    def _split(self, block_hashes: Sequence[int], known: int, token_ids: Sequence[int],
               extra: ExtraKeys, now: float) -> None:
        """Make ``block_hashes[:known]`` (recorded inside longer chains) a prefix of its own,
        between its longest recorded prefix and the prefixes that go through it."""
        key = block_hashes[known - 1]
        parent = next((h for h in reversed(block_hashes[:known - 1]) if h in self._nodes),
                      None)
        siblings = self._nodes[parent].children if parent is not None else self._roots
        moved = [c for c in siblings if self._nodes[c].blocks > known - 1
                 and self._nodes[c].hashes[known - 1] == key]
        count = sum(self.count_now(self._nodes[c], now) for c in moved)
        self._add(block_hashes[:known], token_ids, extra, count, now, parent)
        for c in moved:
            siblings.discard(c)
            self._nodes[c].parent = key
            self._nodes[key].children.add(c)

    def _add(self, hashes: Sequence[int], token_ids: Sequence[int], extra: ExtraKeys,
             count: float, now: float, parent: int | None) -> None:
        bs = self.block_size
        chain = array("Q", hashes)
        for i, h in enumerate(chain):
            refs = self._refs.get(h, 0)
            if refs == 0:
                self._tokens[h] = array("q", token_ids[i * bs:(i + 1) * bs])
            self._refs[h] = refs + 1
        node = HotPrefix(chain, extra, count, now, parent)
        self._nodes[node.key] = node
        (self._nodes[parent].children if parent is not None else self._roots).add(node.key)

    def _drop(self, node: HotPrefix) -> None:
        """Forget ``node``: its children hang from its parent now."""
        key = node.key
        del self._nodes[key]
        up = self._nodes[node.parent].children if node.parent is not None else self._roots
        up.discard(key)
        for c in node.children:
            self._nodes[c].parent = node.parent
            up.add(c)
        for h in node.hashes:
            refs = self._refs[h] - 1
            if refs:
                self._refs[h] = refs
            else:
                del self._refs[h], self._tokens[h]

    def _evict(self, now: float) -> None:
        """Drop the prefixes of lowest count now until both bounds are 90 % full."""
        order = sorted(self._nodes.values(), key=lambda n: (self.count_now(n, now), n.t))
        tokens_goal = 0.9 * self.max_tokens
        nodes_goal = 0.9 * self.max_prefixes
        for node in order:
            if len(self._tokens) * self.block_size <= tokens_goal \
                    and len(self._nodes) <= nodes_goal:
                break
            self._drop(node)

    def hottest(self, limit: int, min_count: float,
                keep: Callable[[HotPrefix], bool] | None = None
                ) -> list[tuple[HotPrefix, float]]:
        """The ``limit`` prefixes worth warming, hottest first, as (prefix to send, the
        count it stands for).

        The hottest prefix of count at least ``min_count`` is taken, then followed down its
        heaviest branch while that branch carries more than half of its requests (a
        conversation's turns, each the prefix of the next: warming the latest turn warms
        the earlier ones); the prefixes along that branch and above it are covered. Then the
        next hottest prefix not covered. A system prompt shared by many requests that
        diverge after it is thus sent alone, and a conversation as its latest turn. With
        ``keep``, only the prefixes for which it holds start a branch.
        """
        if limit <= 0:
            return []
        now = self.clock.now()
        counts = {k: self.count_now(n, now) for k, n in self._nodes.items()}
        starts = sorted((k for k, c in counts.items() if c >= min_count
                         and (keep is None or keep(self._nodes[k]))),
                        key=lambda k: (-counts[k], -self._nodes[k].blocks))
        covered: set[int] = set()
        out: list[tuple[HotPrefix, float]] = []
        for k in starts:
            if k in covered:
                continue
            end = k
            while True:
                best = max(self._nodes[end].children, key=lambda c: counts[c], default=None)
                if best is None or counts[best] <= counts[end] / 2:
                    break
                end = best
            up: int | None = end
            while up is not None and up not in covered:
                covered.add(up)
                up = self._nodes[up].parent
            out.append((self._nodes[end], counts[k]))
            if len(out) >= limit:
                break
        return out

    def warm_prefix(self, node: HotPrefix, priority: float,
                    blocks: int | None = None) -> WarmPrefix:
        """A snapshot of ``node``'s first ``blocks`` blocks (default all) to send, its token
        ids copied out of the record."""
        hashes = tuple(node.hashes[:blocks])
        return WarmPrefix(hashes, tuple(self.token_ids(node, blocks)), node.extra, priority)

    async def refresh_holders(self, index, replicas: Sequence[str], limit: int,
                              min_count: float) -> int:
        """Ask ``index`` which of ``replicas`` hold the ``limit`` hottest prefixes (those
        a leave could re-home) and keep the answer on each (``HotPrefix.holders``): a
        replica that leaves is purged from the index at once, so what it held is read from
        here then. Returns the prefixes refreshed; an index failure leaves the rest as
        they were (``IndexUnavailable`` is not raised)."""
        done = 0
        if not replicas:
            return 0
        for node, _ in self.hottest(limit, min_count):
            try:
                matched = await index.lookup(list(node.hashes), list(replicas))
            except IndexUnavailable:
                break
            node.holders = {r: m for r, m in matched.items() if m > 0}
            done += 1
        return done


class WarmupPacer:
    """The rate bound of warm-up requests: a token bucket of prefill tokens and a cap on
    requests in flight.

    The bucket holds up to ``burst_tokens`` (default: one second's worth) and refills at
    ``tokens_per_s``; a request of ``n`` tokens starts when a slot is free and the bucket is
    full enough (a request larger than the bucket waits for a full bucket and leaves it
    negative, so the long-run rate still holds).

    Args:
        tokens_per_s: prefill tokens per second granted to warm-up (``> 0``).
        concurrency: warm-up requests in flight at most (``>= 1``).
        clock: the time source.
        burst_tokens: the bucket's size (tokens); default ``tokens_per_s``.
    """

    def __init__(self, tokens_per_s: float, concurrency: int, clock: Clock,
                 burst_tokens: float | None = None):
        if tokens_per_s <= 0 or concurrency < 1:
            raise ValueError("tokens_per_s must be positive and concurrency at least 1")
        self.rate = tokens_per_s
        self.concurrency = concurrency
        self.clock = clock
        self.capacity = burst_tokens if burst_tokens is not None else tokens_per_s
        self.level = self.capacity
        self._t = clock.now()
        self.inflight = 0
        self.granted_tokens = 0  # every token granted so far (tests check the rate)

    def _refill(self, now: float) -> None:
        self.level = min(self.capacity, self.level + (now - self._t) * self.rate)
        self._t = now

    def wait_s(self, tokens: int) -> float:
        """Seconds until a request of ``tokens`` may start: 0 now, ``inf`` while every slot
        is taken (a ``done`` frees one)."""
        if self.inflight >= self.concurrency:
            return math.inf
        self._refill(self.clock.now())
        need = min(tokens, self.capacity)
        return 0.0 if self.level >= need else (need - self.level) / self.rate

    def try_start(self, tokens: int) -> bool:
        """Take a slot and ``tokens`` from the bucket if ``wait_s(tokens)`` is 0."""
        if self.wait_s(tokens) > 0:
            return False
        self.level -= tokens
        self.inflight += 1
        self.granted_tokens += tokens
        return True

    def done(self) -> None:
        """A warm-up request ended (any outcome): its slot is free."""
        self.inflight = max(self.inflight - 1, 0)


class MemoryWarmupLease:
    """Leases of this process alone (no Redis: each ingress process warms by itself).

    Args:
        clock: the time source.
    """

    def __init__(self, clock: Clock):
        self.clock = clock
        self._until: dict[str, float] = {}

    async def acquire(self, key: str, ttl_s: float) -> bool:
        """Whether this process now holds ``key`` for ``ttl_s`` seconds (False while a
        lease on it lives)."""
        now = self.clock.now()
        for k in [k for k, t in self._until.items() if t <= now]:
            del self._until[k]
        if key in self._until:
            return False
        self._until[key] = now + ttl_s
        return True


class RedisWarmupLease:
    """Leases shared by every router through Redis (``SET key NX PX``), so that one ingress
    process warms a given replica. The key is ``<ns>:warmup:<reason>:<replica id>``
    (``router.redis_keys.RedisKeys.warmup_lease``): a replica id, nothing else.

    Args:
        connections: ``router.index.redis.RedisConnections``.
        namespace: ``Settings.index_namespace``.
    """

    def __init__(self, connections, namespace: str):
        from router.redis_keys import RedisKeys

        self.conn = connections
        self.keys = RedisKeys(namespace)

    async def acquire(self, key: str, ttl_s: float) -> bool:
        """Whether this process won the lease on ``key`` (one of ``<reason>:<replica>``).

        Raises:
            IndexUnavailable: Redis did not answer (the caller then does not warm).
        """
        name = self.keys.warmup_lease(key)
        ok = await self.conn.call(lambda c: c.set(name, b"1", nx=True,
                                                  px=max(int(ttl_s * 1000), 1)),
                                  maintenance=True)
        return bool(ok)


@dataclass
class WarmJob:
    """One planned warm-up request.

    Attributes:
        request_id: its id (``warm-<n>``), under which its load is reserved.
        reason: ``scale_out`` or ``rehome``.
        prefix: what it warms.
        pool: the replica ids it may go to (the new replica; the survivors).
        tokens: the prefill tokens it is expected to cost (the pacer's charge).
    """

    request_id: str
    reason: str
    prefix: WarmPrefix
    pool: tuple[str, ...]
    tokens: int


@dataclass
class WarmupStats:
    """What a ``Warmer`` did, per reason: requests started, failed, and prefill tokens
    sent (the prefix's tokens beyond what the index predicted on the chosen replica)."""

    started: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    failed: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    planned: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))


class Warmer:
    """Plans and starts warm-up requests (module docstring).

    Args:
        core: the ``RoutingCore`` that decides each warm-up request (its index, load tracker
            and cost rule).
        record: the process's ``HotPrefixes``.
        pacer: the rate bound.
        lease: ``MemoryWarmupLease`` or ``RedisWarmupLease``.
        send: ``send(job, replica, predicted_cached_tokens)`` starts the request on
            ``replica`` (a ``ReplicaInfo``) and returns at once; its driver calls
            ``finished(job.request_id, ok)`` when it ends.
        top_prefixes: the most prefixes one join or leave warms.
        min_count: the decayed request count from which a prefix is hot: 1.2 is reached
            only by a prefix used at least twice, the first time at most 2.3 half-lives ago
            (``1 + 2 ** -2.3 = 1.2``); a prefix seen once never is.
        lease_ttl_s: how long a lease on a replica lives (s).
        on_metrics: ``on_metrics(name, value, tags)`` counts ``warmup_requests`` and
            ``warmup_tokens`` (``router.metrics.inc``), or None.
    """

    def __init__(self, core, record: HotPrefixes, pacer: WarmupPacer, lease,
                 send: Callable[[WarmJob, ReplicaInfo, int], None], top_prefixes: int,
                 min_count: float = 1.2, lease_ttl_s: float = 3600.0, on_metrics=None):
        self.core = core
        self.record = record
        self.pacer = pacer
        self.lease = lease
        self.send = send
        self.top_prefixes = top_prefixes
        self.min_count = min_count
        self.lease_ttl_s = lease_ttl_s
        self.on_metrics = on_metrics
        self.queue: list[WarmJob] = []
        self.running: dict[str, tuple[WarmJob, str]] = {}  # request id -> job, replica
        self.stats = WarmupStats()
        self._n = 0

    def _job(self, reason: str, prefix: WarmPrefix, pool: Sequence[str], tokens: int) -> WarmJob:
        self._n += 1
        return WarmJob(f"warm-{self._n}", reason, prefix, tuple(pool), tokens)

    async def _leased(self, reason: str, replica: str) -> bool:
        try:
            return await self.lease.acquire(f"{reason}:{replica}", self.lease_ttl_s)
        except IndexUnavailable as exc:
            logger.warning("warm-up lease on replica %s not taken (%s): not warming",
                           replica, exc)
            return False

    async def replica_joined(self, replica: str) -> int:
        """``replica`` joined: queue the hottest prefixes (``top_prefixes``), to it, unless
        another process holds the lease on it. Returns the requests queued."""
        if not await self._leased("scale_out", replica):
            return 0
        jobs = []
        for node, count in self.record.hottest(self.top_prefixes, self.min_count):
            prefix = self.record.warm_prefix(node, count)
            jobs.append(self._job("scale_out", prefix, [replica],
                                  len(prefix.token_ids)))
        self._enqueue("scale_out", jobs)
        logger.info("replica %s joined: %d hot prefixes queued for warm-up", replica,
                    len(jobs))
        return len(jobs)

    async def replica_left(self, replica: str, survivors: Sequence[str]) -> int:
        """``replica`` left (scale-in, or drained): queue the hot prefixes it held further
        than any survivor, each to go where the cost rule sends it among ``survivors``, up
        to ``top_prefixes`` of them, unless another process holds the lease on it. What it
        held is what this process routed there and the index's answers (``HotPrefix.holders``:
        a replica that left is purged from the index at once), and the index's answer now
        where it still has the replica (a drain); what the survivors hold is asked now.
        Returns the requests queued."""
        if not survivors or not await self._leased("rehome", replica):
            return 0
        bs = self.record.block_size
        survivors = list(survivors)
        jobs = []
        def held(node: HotPrefix) -> bool:  # it holds more of it than any other, as known
            theirs = node.holders.get(replica, 0)
            return theirs > max((m for r, m in node.holders.items() if r != replica),
                                default=0)

        for node, count in self.record.hottest(4 * self.top_prefixes, self.min_count, held):
            try:
                matched = await self.core.index.lookup(list(node.hashes),
                                                       [replica] + survivors)
            except IndexUnavailable:
                break
            theirs = max(matched[replica], node.holders.get(replica, 0))
            best = max((matched[r] for r in survivors), default=0)
            if theirs <= best:
                continue  # a survivor holds it as far (or the leaver never held it)
            prefix = self.record.warm_prefix(node, count, theirs)
            jobs.append(self._job("rehome", prefix, survivors, (theirs - best) * bs))
            if len(jobs) >= self.top_prefixes:
                break
        self._enqueue("rehome", jobs)
        logger.info("replica %s left: %d hot prefixes only it held queued for re-homing",
                    replica, len(jobs))
        return len(jobs)

    def _enqueue(self, reason: str, jobs: list[WarmJob]) -> None:
        self.stats.planned[reason] += len(jobs)
        self.queue.extend(jobs)
        self.queue.sort(key=lambda j: -j.prefix.priority)

    def forget_replica(self, replica: str) -> None:
        """``replica`` left: its queued jobs go to the others of their pool, or are dropped
        when it was their only target."""
        kept = []
        for job in self.queue:
            pool = tuple(r for r in job.pool if r != replica)
            if pool:
                job.pool = pool
                kept.append(job)
        self.queue = kept

    async def pump(self, replicas: Sequence[ReplicaInfo]) -> float | None:
        """Start the queued requests the pacer allows now, over ``replicas`` (the replica set
        as routing sees it: a job whose pool left is dropped). Returns the seconds until
        the next one may start, ``inf`` while the slots are full (a ``finished`` frees
        one), or None when nothing is queued."""
        by_id = {r.replica_id: r for r in replicas}
        while self.queue:
            job = self.queue[0]
            pool = [by_id[r] for r in job.pool if r in by_id]
            if not pool:
                self.queue.pop(0)
                continue
            wait = self.pacer.wait_s(job.tokens)
            if wait > 0:
                return wait
            self.queue.pop(0)
            self.pacer.try_start(job.tokens)
            try:
                d = await self.core.decide(job.request_id, len(job.prefix.token_ids),
                                           list(job.prefix.hashes), pool,
                                           adapter=job.prefix.extra.lora_name)
            except Exception:  # noqa: BLE001 - a warm-up never fails anything else
                logger.exception("warm-up decision failed for %s", job.request_id)
                self.pacer.done()
                continue
            chosen = next(r for r in pool if r.replica_id == d.replica)
            cached = d.predicted_cached_tokens.get(d.replica, 0)
            self.running[job.request_id] = (job, d.replica)
            self.stats.started[job.reason] += 1
            sent = max(len(job.prefix.token_ids) - cached, 0)
            self.stats.tokens[job.reason] += sent
            if self.on_metrics is not None:
                self.on_metrics("warmup_tokens", sent, {"reason": job.reason})
            self.send(job, chosen, cached)
        return None

    async def finished(self, request_id: str, ok: bool) -> None:
        """A warm-up request ended (``ok``: the engine answered it): its reservation is
        released and its slot freed. One that failed drops the predicted entries its
        decision wrote on its replica (exact entries stay), so the prefix does not draw
        requests to an engine that never computed it. Index errors are not raised."""
        entry = self.running.pop(request_id, None)
        if entry is None:
            return
        job, replica = entry
        self.pacer.done()
        await self.core.load.release(request_id)
        if not ok:
            self.stats.failed[job.reason] += 1
            try:
                await self.core.index.forget_predicted(replica, list(job.prefix.hashes))
            except IndexUnavailable:
                pass
        if self.on_metrics is not None:
            self.on_metrics("warmup_requests", 1,
                            {"reason": job.reason, "outcome": "ok" if ok else "error"})
