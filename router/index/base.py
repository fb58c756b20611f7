"""The prefix index: which replica holds which KV blocks, in vLLM's key space.

One interface, two backends beside it (``memory.py``: in-process, the default;
``redis.py``: shared by every router through Redis). Entries are of two kinds,
keyed by the same 64-bit block hash (``router.hashing.BlockHash``):

* **predicted**: written at routing time for the replica a request was sent to, with an
  expiry (``ttl_s``); they let a burst of siblings land together before the engine's first
  ``BlockStored`` arrives, and they are the whole index for engines without KV events.
* **exact**: applied from the engine's KV events (``BlockStored`` / ``BlockRemoved`` /
  ``AllBlocksCleared``), see ``apply_events``. An exact entry counts the physical blocks
  the engine holds with that hash (the engine does not de-duplicate), so removing one copy
  keeps the others (docs/reference.md 4.5).

Ownership rules (tested against real engines): a ``BlockStored`` adds one copy per hash; a
``BlockRemoved`` removes one and the entry goes at zero; a ``BlockStored`` run that starts at
block 0 (no parent) over hashes the replica already holds is a re-announcement
(``kv_cache_report_mode="full"`` republishes reused prefixes that way) and adds nothing, so
no phantom entry outlives the block. The one case this undercounts, two copies of a block-0
run computed in the same engine step, can only make the router miss a hit (an entry dropped
while one copy remains), never predict one that is not there.

``lookup`` returns, per candidate replica, the number of leading blocks of the request the
replica holds (predicted or exact). Matching stops at the first block a replica lacks: a
later block is worthless without its parent (docs/fault-cases.md 2.4), and chained hashes make a
block's key depend on its whole prefix (docs/fault-cases.md 3.1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

from router.hashing import BlockHash
from router.kv_events.wire import EventKind, KVEvent


# A replica that left is purged for good: its writes are refused this long (s) after
# ``remove_replica`` (its feed may still write during its shutdown; Serve never reuses a
# replica id).
GONE_TTL_S = 86400


class IndexUnavailable(RuntimeError):
    """The index backend did not answer within its timeout, or is down.

    Routing catches it and decides by load alone for that request (docs/architecture.md, decision
    7).
    """


class IndexBusy(IndexUnavailable):
    """A routing call not sent: as many of this process's routing calls to Redis are in
    flight as its adaptive bound allows (``router.index.redis.RoutingCallLimit``: Redis
    answers late). The request is routed as for any ``IndexUnavailable``, at once, without
    adding to Redis's queue."""


class HeadHeld(Exception):
    """A decision on a long prompt's head (``router.routing.core.RouteInput.head``: the
    blocks of its first ``Settings.route_head_chars`` characters or so, the rest not yet
    tokenized) found a candidate that holds every one of those blocks, so that candidate's
    match may go on past the head: nothing was decided, reserved or written; the caller
    tokenizes the rest and decides again on the whole prompt's blocks.

    Attributes:
        matched: per candidate looked up, its matched blocks of the head.
    """

    def __init__(self, matched: dict[str, int]):
        super().__init__("a candidate holds the whole head")
        self.matched = matched


@dataclass
class IndexStats:
    """Size of the index: ``blocks`` distinct block keys, ``entries`` (block, replica) pairs
    (``-1`` where the backend cannot count them cheaply)."""

    blocks: int
    entries: int


class PrefixIndex(ABC):
    """Maps block hashes to the replicas holding them. All methods are coroutines.

    Raises:
        IndexUnavailable: from any method when the backend cannot answer in time.
    """

    @abstractmethod
    async def lookup(self, block_hashes: Sequence[BlockHash],
                     replicas: Sequence[str]) -> dict[str, int]:
        """Matched prefix length per replica, in blocks.

        Args:
            block_hashes: the request's chained block keys, in prompt order.
            replicas: candidate replica ids.
        Returns:
            ``{replica: n}`` for every candidate, ``0 <= n <= len(block_hashes)``: the
            replica holds blocks ``0..n-1`` (exact entries, or unexpired predicted ones).
        """

    @abstractmethod
    async def record_predicted(self, replica: str, block_hashes: Sequence[BlockHash],
                               ttl_s: float) -> None:
        """Mark ``block_hashes`` as (soon) held by ``replica`` until now + ``ttl_s``.

        An existing predicted entry's expiry only moves later.
        """

    @abstractmethod
    async def forget_predicted(self, replica: str, block_hashes: Sequence[BlockHash]) -> None:
        """Drop ``replica``'s predicted entries of ``block_hashes`` (the engine refused the
        request that predicted them, so it will not hold them); exact entries stay."""

    @abstractmethod
    async def apply_events(self, replica: str, events: Sequence[KVEvent]) -> bool:
        """Apply one engine's KV events, in order, to its exact entries (``AllBlocksCleared``
        also drops the replica's predicted entries: they predate the clear). Returns False,
        having written nothing, when the index refuses them: the replica was purged as
        gone (``remove_replica``) and its tombstone lives on; True otherwise.

        Raises:
            IndexUnavailable: the index did not answer.
        """

    async def clear_replica(self, replica: str) -> None:
        """Forget every entry (exact and predicted) of ``replica`` without a tombstone: the
        replica may come back under the same id (an engine reached by URL that leaves the
        engines file and is listed again). An ``AllBlocksCleared``, bounded like a purge
        (a removal must not be lost because a loaded machine answered late).

        Raises:
            IndexUnavailable: the index did not answer.
        """
        await self.apply_events(replica, [KVEvent(EventKind.CLEARED)])

    @abstractmethod
    async def remove_replica(self, replica: str) -> None:
        """Forget every entry (exact and predicted) of ``replica``, which has left: its
        KV events are refused from now on, for ``GONE_TTL_S``."""

    @abstractmethod
    async def exact_entry_count(self, replica: str) -> int:
        """Number of blocks with an exact entry for ``replica``."""

    async def lists_root_holder(self, replica: str, root: BlockHash) -> bool:
        """Whether the index lists ``replica`` among the holders of ``root`` (a prompt's
        first block), where it keeps such a list apart from the entries (the Redis index's
        ``<ns>:roots``, which a lookup reads first: a replica missing from it is not walked
        for the prompt). True for an index that keeps no such list.

        Raises:
            IndexUnavailable: the index did not answer.
        """
        return True

    @abstractmethod
    async def stats(self) -> IndexStats:
        """Current size of the index."""

    async def close(self) -> None:
        """Release connections; the index is unusable afterwards."""
