"""In-process prefix index: the embedded default (no Redis), and the simulator's index.

State lives in plain dicts guarded by one lock, so the router's event loop, a KV-event
consumer and the virtual-time simulator can share one instance. No iteration over a dict
happens while another caller can mutate it (docs/fault-cases.md 11.1): every method holds the lock
for its whole (short, non-awaiting) body.
"""

from __future__ import annotations

import heapq
import threading
from typing import Sequence

from router.clock import Clock, SystemClock
from router.hashing import BlockHash
from router.index.base import GONE_TTL_S, IndexStats, PrefixIndex
from router.kv_events.wire import UNKNOWN_PARENT, EventKind, KVEvent


class MemoryPrefixIndex(PrefixIndex):
    """Prefix index held in this process.

    Args:
        clock: time source for predicted-entry expiry.
        max_predicted_entries: bound on live predicted (block, replica) pairs; beyond it the
            entries closest to expiry are dropped first.
    """

    def __init__(self, clock: Clock | None = None, max_predicted_entries: int = 4_000_000):
        self.clock = clock or SystemClock()
        self.max_predicted_entries = max_predicted_entries
        self._lock = threading.Lock()
        # block hash -> {replica: physical copies held by the engine (exact, > 0)}
        self._exact: dict[int, dict[str, int]] = {}
        # block hash -> {replica: expiry time (s)}
        self._predicted: dict[int, dict[str, float]] = {}
        self._exact_by_replica: dict[str, set[int]] = {}
        # block hash -> the parent it was stored after (None: a prompt's first block;
        # UNKNOWN_PARENT: not known), while some replica holds it exactly; a hash's parent is
        # the same on every replica (it is hashed into the block's own hash)
        self._parent: dict[int, int | None] = {}
        # replica -> its exact entries stored as a prompt's first block (a run from block 0)
        self._roots_by_replica: dict[str, set[int]] = {}
        self._expiry_heap: list[tuple[float, int, str]] = []
        self._n_predicted = 0
        self._gone: dict[str, float] = {}  # removed replica -> until when its writes are refused

    # --- queries ---------------------------------------------------------------------
    async def lookup(self, block_hashes: Sequence[BlockHash],
                     replicas: Sequence[str]) -> dict[str, int]:
        return self.lookup_now(block_hashes, replicas)

    def lookup_now(self, block_hashes: Sequence[BlockHash],
                   replicas: Sequence[str]) -> dict[str, int]:
        """Synchronous ``lookup`` (the simulator calls it directly)."""
        now = self.clock.now()
        matched = {r: len(block_hashes) for r in replicas}
        alive = set(replicas)
        with self._lock:
            for i, h in enumerate(block_hashes):
                exact = self._exact.get(h)
                pred = self._predicted.get(h)
                if exact is None and pred is None:  # nobody holds it: the walks end here
                    for r in alive:
                        matched[r] = i
                    break
                lost = [r for r in alive
                        if not ((exact and exact.get(r, 0) > 0)
                                or (pred and pred.get(r, 0.0) > now))]
                for r in lost:
                    matched[r] = i
                    alive.discard(r)
                if not alive:
                    break
        return matched

    async def stats(self) -> IndexStats:
        with self._lock:
            self._expire_locked(self.clock.now())
            blocks = len(self._exact.keys() | self._predicted.keys())
            entries = sum(len(v) for v in self._exact.values()) + self._n_predicted
        return IndexStats(blocks=blocks, entries=entries)

    # --- predicted entries -----------------------------------------------------------
    async def record_predicted(self, replica: str, block_hashes: Sequence[BlockHash],
                               ttl_s: float) -> None:
        self.record_predicted_now(replica, block_hashes, ttl_s)

    def record_predicted_now(self, replica: str, block_hashes: Sequence[BlockHash],
                             ttl_s: float, fresh_s: float | None = None) -> None:
        """Synchronous ``record_predicted``. With ``fresh_s`` (s), an entry with more than
        that left to live is left as it is (as ``lua/route.lua`` leaves an entry with half
        its TTL left): a prefix written again and again then costs a dictionary read per
        block, not a new expiry in the heap each time."""
        now = self.clock.now()
        expiry = now + ttl_s
        keep_after = now + fresh_s if fresh_s is not None else None
        with self._lock:
            for h in block_hashes:
                owners = self._predicted.setdefault(h, {})
                old = owners.get(replica)
                if keep_after is not None and old is not None and old > keep_after:
                    continue
                if old is None or old <= now:
                    if old is None:
                        self._n_predicted += 1
                    owners[replica] = expiry
                    heapq.heappush(self._expiry_heap, (expiry, h, replica))
                elif old < expiry:
                    owners[replica] = expiry
                    heapq.heappush(self._expiry_heap, (expiry, h, replica))
            self._expire_locked(now)
            while self._n_predicted > self.max_predicted_entries and self._expiry_heap:
                self._pop_heap_locked(force=True, now=now)

    async def forget_predicted(self, replica: str, block_hashes: Sequence[BlockHash]) -> None:
        with self._lock:
            for h in block_hashes:
                owners = self._predicted.get(h)
                if owners is not None and owners.pop(replica, None) is not None:
                    self._n_predicted -= 1
                    if not owners:
                        del self._predicted[h]

    def _pop_heap_locked(self, force: bool, now: float) -> None:
        expiry, h, r = heapq.heappop(self._expiry_heap)
        owners = self._predicted.get(h)
        if owners is None or owners.get(r) != expiry:
            return  # superseded by a later push
        if force or expiry <= now:
            del owners[r]
            self._n_predicted -= 1
            if not owners:
                del self._predicted[h]

    def _expire_locked(self, now: float) -> None:
        heap = self._expiry_heap
        while heap and heap[0][0] <= now:
            self._pop_heap_locked(force=False, now=now)
        # Drop superseded heap items if they pile up (each live entry has one current item).
        if len(heap) > 4 * max(self._n_predicted, 1024):
            self._expiry_heap = [(e, h, r) for (e, h, r) in heap
                                 if self._predicted.get(h, {}).get(r) == e]
            heapq.heapify(self._expiry_heap)

    # --- exact entries ---------------------------------------------------------------
    async def apply_events(self, replica: str, events: Sequence[KVEvent]) -> bool:
        return self.apply_events_now(replica, events)

    def apply_events_now(self, replica: str, events: Sequence[KVEvent]) -> bool:
        """Synchronous ``apply_events``."""
        with self._lock:
            if self._gone.get(replica, 0.0) > self.clock.now():
                return False  # purged as gone (GONE_TTL_S)
            held = self._exact_by_replica.setdefault(replica, set())
            for ev in events:
                if ev.kind is EventKind.CLEARED:  # predicted entries predate the clear too
                    self._clear_exact_locked(replica)
                    self._clear_predicted_locked(replica)
                    held = self._exact_by_replica.setdefault(replica, set())
                elif ev.medium not in (None, "GPU"):
                    continue
                elif ev.kind is EventKind.STORED:
                    from_root = ev.parent_block_hash is None
                    if from_root and ev.block_hashes:
                        self._roots_by_replica.setdefault(replica, set()).add(
                            ev.block_hashes[0])
                    parent = ev.parent_block_hash
                    for h in ev.block_hashes:
                        if self._parent.get(h, UNKNOWN_PARENT) == UNKNOWN_PARENT:
                            self._parent[h] = parent
                        parent = h if parent != UNKNOWN_PARENT else UNKNOWN_PARENT
                        owners = self._exact.setdefault(h, {})
                        n = owners.get(replica, 0)
                        # A run stored from block 0 over blocks already held is a
                        # re-announcement (kv_cache_report_mode="full"), not new copies.
                        owners[replica] = n if (from_root and n > 0) else n + 1
                        held.add(h)
                elif ev.kind is EventKind.REMOVED:
                    for h in ev.block_hashes:
                        owners = self._exact.get(h)
                        if not owners or replica not in owners:
                            continue
                        if owners[replica] <= 1:
                            del owners[replica]
                            held.discard(h)
                            self._roots_by_replica.get(replica, set()).discard(h)
                            if not owners:
                                del self._exact[h]
                                self._parent.pop(h, None)
                        else:
                            owners[replica] -= 1
        return True

    def _clear_exact_locked(self, replica: str) -> None:
        self._roots_by_replica.pop(replica, None)
        for h in self._exact_by_replica.pop(replica, set()):
            owners = self._exact.get(h)
            if owners is not None:
                owners.pop(replica, None)
                if not owners:
                    del self._exact[h]
                    self._parent.pop(h, None)

    def exact_entries(self, replica: str) -> dict[int, int]:
        """``{block hash: copies}`` of the replica's exact entries (a snapshot)."""
        with self._lock:
            return {h: self._exact[h][replica] for h in self._exact_by_replica.get(replica, ())
                    if replica in self._exact.get(h, {})}

    def exact_runs(self, replica: str) -> list[tuple[int | None, list[int]]]:
        """The replica's exact entries (one copy each) as runs of ``BlockStored`` that
        store every block after its parent where the replica holds it: ``[(parent,
        hashes)]``, ``hashes`` chained (each block's parent is the one before), ``parent``
        None for a run from block 0, ``UNKNOWN_PARENT`` where not known, or a block
        another run before stored, or one the replica does not hold. Replaying them
        in order leaves no block stored before its held parent (the Redis index's search,
        ``lua/exact.lua``). Each block is in exactly one run (a snapshot)."""
        with self._lock:
            held = {h for h in self._exact_by_replica.get(replica, ())
                    if replica in self._exact.get(h, {})}
            children: dict[int, list[int]] = {}
            starts = []
            for h in held:
                p = self._parent.get(h, UNKNOWN_PARENT)
                if p is not None and p in held:
                    children.setdefault(p, []).append(h)
                else:
                    starts.append(h)
            runs: list[tuple[int | None, list[int]]] = []
            stack = [(self._parent.get(h, UNKNOWN_PARENT), h) for h in starts]
            while stack:
                parent, h = stack.pop()
                run = [h]
                while children.get(run[-1]):
                    first, *rest = children[run[-1]]
                    stack += [(run[-1], c) for c in rest]
                    run.append(first)
                runs.append((parent, run))
            return runs

    def root_entries(self, replica: str) -> list[int]:
        """The replica's exact entries that were stored as a prompt's first block (a
        ``BlockStored`` from block 0): the roots of its prompts' chains (a snapshot)."""
        with self._lock:
            return sorted(self._roots_by_replica.get(replica, ()))

    def any_root_entry(self, replica: str) -> int | None:
        """One of ``root_entries(replica)`` (None when there is none), without copying
        them."""
        with self._lock:
            return next(iter(self._roots_by_replica.get(replica, ())), None)

    async def exact_entry_count(self, replica: str) -> int:
        with self._lock:
            return len(self._exact_by_replica.get(replica, ()))

    def _clear_predicted_locked(self, replica: str) -> None:
        for h in [h for h, owners in self._predicted.items() if replica in owners]:
            owners = self._predicted[h]
            del owners[replica]
            self._n_predicted -= 1
            if not owners:
                del self._predicted[h]

    async def remove_replica(self, replica: str) -> None:
        with self._lock:
            self._clear_exact_locked(replica)
            self._clear_predicted_locked(replica)
            now = self.clock.now()
            for r in [r for r, until in self._gone.items() if until <= now]:
                del self._gone[r]
            self._gone[replica] = now + GONE_TTL_S
