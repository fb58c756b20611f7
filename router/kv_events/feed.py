"""Feeds one engine's KV events into a prefix index, and watches that the feed is alive.

``EventFeed`` subscribes to one engine (``router.kv_events.subscriber.KVEventSubscriber``: gaps are
filled by replay or turned into a clear, an engine restart clears), keeps a local ownership
record of what the engine holds (a ``MemoryPrefixIndex`` of that one replica), and writes the
events to the shared index in batches. Where the consumer runs follows from the backend
(docs/architecture.md, decision 2): with Redis, each replica consumes its own engine's events;
with the in-process index, the router does.

The local record makes the shared index rebuildable: when a write fails (Redis down or
slow) the feed keeps consuming, marks itself dirty, and once the index answers again it
rewrites the replica's entries from the record; it also notices a flushed index (the
replica's entries vanished while the engine still holds blocks) and rewrites them.

``FeedHealth`` tells whether the engine publishes events at all: when the engine's own
counters show it computed a whole prompt block and no batch arrives within ``grace_s``, the
feed is silent (an engine without ``--kv-events-config``, a wrong endpoint).
The replica reports it, and the router then keeps predicted entries for that replica with
the long TTL (approximate mode) instead of dropping to 0 % hits.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from router.index.base import IndexUnavailable, PrefixIndex
from router.index.memory import MemoryPrefixIndex
from router.kv_events.subscriber import KVEventSubscriber
from router.kv_events.wire import UNKNOWN_PARENT, EventBatch, EventKind, KVEvent
from router.logs import get_logger

logger = get_logger(__name__)


@dataclass
class FeedHealth:
    """Liveness of one engine's event feed, judged from the engine's own counters, so it
    holds whatever path the requests take to the engine. Times are ``time.time()`` seconds.

    vLLM stores (and publishes, ``BlockStored``) every block it computes in full, and its
    prefix-cache hits are whole blocks, so a request that computed at least ``block_size``
    prompt tokens stored a block. Between two scrapes the engine's computed prompt tokens
    (``prefix_cache_queries - prefix_cache_hits``) grow by ``Δc`` over at most ``n`` requests
    (those that finished meanwhile, any reason, plus those running or waiting now); when
    ``Δc > n·(block_size - 1)`` at least one of them computed a whole block (pigeonhole), so
    a batch is owed. None within ``grace_s`` of that scrape: the feed is silent (an engine
    started without ``--kv-events-config``, a wrong endpoint). A refused
    request, or one cancelled before its prefill, computes nothing and owes nothing.

    What the bound does not see: vLLM (0.32) leaves requests aborted by their client out of
    ``request_success``, so aborts of prompts shorter than a block each, between two scrapes,
    can add up to a block owed that no engine stores; a live feed's next batch clears it.
    """

    grace_s: float = 5.0
    started_at: float = 0.0
    last_batch_at: float | None = None
    last_batch_engine_ts: float | None = None
    owed_since: float | None = None
    _base: tuple[float, float] | None = None  # (computed tokens, finished) counted from

    def on_batch(self, engine_ts: float, now: float) -> None:
        self.last_batch_at = now
        self.last_batch_engine_ts = engine_ts
        self.owed_since = None
        self._base = None  # count again from the next scrape

    def on_engine_counters(self, computed_prompt_tokens: float, finished_requests: float,
                           unfinished_requests: float, block_size: int, now: float) -> None:
        """One scrape of the engine's counters (cumulative ``computed_prompt_tokens`` and
        ``finished_requests``, the gauge ``unfinished_requests`` = running + waiting)."""
        if (self._base is None or computed_prompt_tokens < self._base[0]
                or finished_requests < self._base[1]):  # first scrape, or engine restart
            self._base = (computed_prompt_tokens, finished_requests)
            return
        computed = computed_prompt_tokens - self._base[0]
        requests = max(finished_requests - self._base[1] + unfinished_requests, 0)
        if computed >= block_size and computed > requests * (block_size - 1) \
                and self.owed_since is None:
            self.owed_since = now

    def live(self, now: float) -> bool:
        """False once a batch has been owed for ``grace_s`` and none came."""
        t = self.owed_since
        return t is None or now - t < self.grace_s

    def lag_s(self) -> float | None:
        """Receive time minus the engine's step time of the last batch (s)."""
        if self.last_batch_at is None or self.last_batch_engine_ts is None:
            return None
        return max(self.last_batch_at - self.last_batch_engine_ts, 0.0)


class EventFeed:
    """Consumes one replica's engine events into ``index``.

    Args:
        replica_id: the replica the events belong to (index owner id).
        endpoint / replay_endpoint: the engine's publisher and replay sockets.
        index: the shared index to write, or None (only the local record and health).
        flush_interval_s: longest time events wait before a batched write.
        max_pending_events: write at once when this many events are pending.
    """

    ROOTS_CHECK_S = 1.0  # how often the index's listing of a held root is checked

    def __init__(self, replica_id: str, endpoint: str, replay_endpoint: str | None,
                 index: PrefixIndex | None, flush_interval_s: float = 0.01,
                 max_pending_events: int = 2000, on_stats=None):
        self.replica_id = replica_id
        self.index = index
        self.subscriber = KVEventSubscriber(endpoint, replay_endpoint)
        self.record = MemoryPrefixIndex()
        self.health = FeedHealth(started_at=time.time())
        self.flush_interval_s = flush_interval_s
        self.max_pending_events = max_pending_events
        self.on_stats = on_stats
        self.pending: list[KVEvent] = []
        self.pending_batch_ts: list[float] = []  # engine step times of live batches pending
        self.dirty = False
        # the index refused this replica's events (purged as gone, its tombstone alive):
        # nothing more is written to it (``_refused``) until another index is set
        self.refused = False
        self.batches = 0
        self.events_applied = 0
        self.blocks_applied = 0
        self.write_errors = 0
        self.resyncs = 0
        self._tasks: list[asyncio.Task] = []
        self._wake = asyncio.Event()
        self._roots_checked = 0.0  # when _root_to_check last gave a root (time.monotonic)

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._consume()), loop.create_task(self._writer())]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            try:
                await t
            except (asyncio.CancelledError, Exception):
                pass
        self._tasks = []

    # --- consuming ---------------------------------------------------------------------
    async def _consume(self) -> None:
        from router import metrics

        tags = {"replica": self.replica_id}
        gaps = 0
        async for item in self.subscriber.batches():
            if self.subscriber.gaps > gaps:
                metrics.inc("kv_event_gaps", self.subscriber.gaps - gaps, tags=tags)
                gaps = self.subscriber.gaps
            if isinstance(item, EventBatch):
                self.batches += 1
                self.health.on_batch(item.ts, time.time())
                metrics.inc("kv_event_batches", 1, tags=tags)
                lag = self.health.lag_s()
                if lag is not None and not item.replayed:
                    metrics.get("kv_event_lag").observe(lag, tags=tags)
                    if item.events:
                        self.pending_batch_ts.append(item.ts)
                events = item.events
            else:  # "restart" or "clear": the replica's entries are unknown now
                logger.warning("KV events of replica %s: %s; clearing its entries",
                               self.replica_id, item)
                events = [KVEvent(EventKind.CLEARED)]
            self._enqueue(events)

    def _enqueue(self, events: list[KVEvent]) -> None:
        self.record.apply_events_now(self.replica_id, events)
        self.pending.extend(events)
        if self.pending:
            self._wake.set()

    def set_index(self, index: PrefixIndex | None) -> None:
        """Write to ``index`` from now on (None: keep the local record and health only).
        A new index gets the replica's entries rewritten from the record at once: the
        events before this call were not written there."""
        if index is self.index:
            return
        self.index = index
        self.refused = False
        if index is not None:
            self.dirty = True
            self._wake.set()

    def engine_exited(self) -> None:
        """The engine died: it holds nothing any more. Its exact and predicted entries are
        cleared now, not when a restarted engine's first event arrives (that can be long
        after, and routing would meanwhile predict hits on an empty cache)."""
        logger.warning("engine of replica %s exited; clearing its index entries",
                       self.replica_id)
        self._enqueue([KVEvent(EventKind.CLEARED)])

    async def _writer(self) -> None:
        while True:
            try:
                async with asyncio.timeout(1.0):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()
            if len(self.pending) < self.max_pending_events:
                await asyncio.sleep(self.flush_interval_s)  # let a burst accumulate
            root = self._root_to_check()  # before the flush, which writes all it may name
            await self.flush()
            if self.index is not None and not self.refused and (
                    self.dirty or await self._entries_vanished(root)):
                await self.resync()

    async def flush(self) -> None:
        """Write pending events to the index (dropped and marked dirty on failure)."""
        if not self.pending:
            return
        events, self.pending = self.pending, []
        stamps, self.pending_batch_ts = self.pending_batch_ts, []
        if self.index is None or self.refused:
            return
        if self.dirty:
            return  # a resync will rewrite everything from the record
        from router import metrics
        try:
            if not await self.index.apply_events(self.replica_id, events):
                self._refused()
                return
            self.events_applied += len(events)
            blocks = sum(len(e.block_hashes) for e in events)
            self.blocks_applied += blocks
            metrics.inc("kv_blocks_applied", blocks, tags={"replica": self.replica_id})
            now = time.time()
            for ts in stamps:
                metrics.get("kv_event_apply_lag").observe(max(now - ts, 0.0),
                                                          tags={"replica": self.replica_id})
        except IndexUnavailable as exc:
            self.write_errors += 1
            metrics.inc("index_errors", tags={"op": "kv_events_write"})
            if not self.dirty:
                logger.warning("index write for replica %s failed (%s); it will be rebuilt "
                               "from this replica's record when the index returns",
                               self.replica_id, exc)
            self.dirty = True

    def _refused(self) -> None:
        """The index refused this replica's events: it was purged as gone (a scale-in, a
        drain's end) while its engine still publishes. Nothing more is written to that
        index: a rewrite from the record would be refused too, and it was tried (and
        logged as done) every second until the engine stopped (an operator's review)."""
        self.refused, self.dirty = True, False
        self.pending, self.pending_batch_ts = [], []
        logger.info("replica %s was purged from the index as gone: its KV events are no "
                    "longer written there", self.replica_id)

    def _root_to_check(self) -> int | None:
        """A root block the replica holds by its record, once every ``ROOTS_CHECK_S`` (None
        otherwise), for ``_entries_vanished``. Taken before a flush: the flush then writes
        every event the record holds, so the index must list the replica for this root."""
        now = time.monotonic()
        if now - self._roots_checked < self.ROOTS_CHECK_S:
            return None
        self._roots_checked = now
        return self.record.any_root_entry(self.replica_id)

    async def _entries_vanished(self, root: int | None = None) -> bool:
        """The index lost this replica's entries (e.g. FLUSHDB) while the engine holds blocks,
        or its listing among the holders of ``root``, a root it holds (``<ns>:roots``
        deleted or evicted alone: the replica's entries would then never be walked; Redis
        evicts or deletes a whole key, so one root tells)."""
        if not await self.record.exact_entry_count(self.replica_id):
            return False
        try:
            if await self.index.exact_entry_count(self.replica_id) == 0:
                return True
            return root is not None and not await self.index.lists_root_holder(
                self.replica_id, root)
        except IndexUnavailable:
            self.dirty = True
            return False

    async def resync(self) -> bool:
        """Rewrite the replica's exact entries in the index from the local record. The
        events still pending are in the record already: they are dropped here (a flush
        after the rewrite would count their blocks' copies twice), and the feed is dirty
        until the rewrite succeeds. Each block is written after its parent where the record
        knows it (``MemoryPrefixIndex.exact_runs``), so the index's orphan count
        (``lua/exact.lua``) comes out as the engine's events had left it."""
        held = self.record.exact_entries(self.replica_id)
        self.pending, self.pending_batch_ts = [], []
        self.dirty = True
        events: list[KVEvent] = [KVEvent(EventKind.CLEARED)]
        # each block after its parent where the replica holds it (the index then searches
        # its held runs: router/lua/exact.lua), then the copies past the first
        events += [KVEvent(EventKind.STORED, run, parent_block_hash=parent)
                   for parent, run in self.record.exact_runs(self.replica_id)]
        for copies in range(2, max(held.values(), default=0) + 1):
            hs = [h for h, n in held.items() if n >= copies]
            events.append(KVEvent(EventKind.STORED, hs, parent_block_hash=UNKNOWN_PARENT))
        # the prompts' first blocks again as such (a run from block 0 over held blocks adds
        # no copy): the index walks a replica for a prompt only if it is among the holders
        # of the prompt's first block (router/lua/roots.lua)
        events += [KVEvent(EventKind.STORED, [h], parent_block_hash=None)
                   for h in self.record.root_entries(self.replica_id)]
        try:
            if not await self.index.apply_events(self.replica_id, events):
                self._refused()
                return False
        except IndexUnavailable:
            return False
        self.dirty = False
        self.resyncs += 1
        logger.info("index entries of replica %s rebuilt from its record (%d blocks)",
                    self.replica_id, len(held))
        return True
