"""The fallback of a router whose shared index fails: its own recent decisions."""

from __future__ import annotations

import itertools
from typing import Sequence

from router.clock import Clock


class RecentDecisions:
    """This router process's own recent decisions, block by block: the prefix index it falls
    back to when the shared index fails (Redis slow or down), so a conversation's next turn
    still goes where this router sent its last one instead of being decided by load alone.

    Each decision maps its block hashes to the chosen replica until ``ttl_s`` later (the
    predicted-entry TTL); a later decision over the same block takes it over (one owner per
    block: enough to keep a conversation in place, not a second index). At most
    ``max_blocks`` blocks are kept; beyond it the oldest-written go first (dict order).

    Args:
        clock: time source (s).
        max_blocks: bound on the blocks kept (memory: about 150 bytes each).
    """

    def __init__(self, clock: Clock, max_blocks: int = 200_000):
        self.clock = clock
        self.max_blocks = max_blocks
        self._owner: dict[int, tuple[str, float]] = {}

    def record(self, replica: str, block_hashes: Sequence[int], ttl_s: float) -> None:
        """``replica`` was chosen for a request of ``block_hashes`` (prompt order)."""
        entry = (replica, self.clock.now() + ttl_s)
        owner = self._owner
        for h in block_hashes:  # re-insert: a block written again counts as new
            owner.pop(h, None)
        owner.update(dict.fromkeys(block_hashes, entry))
        excess = len(owner) - self.max_blocks
        if excess > 0:
            for h in list(itertools.islice(owner, excess)):
                del owner[h]

    def lookup(self, block_hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` last sent to each of ``replicas`` and not
        expired: ``{replica: n}`` as ``PrefixIndex.lookup`` returns it (one replica at most
        has n > 0)."""
        out = dict.fromkeys(replicas, 0)
        if not block_hashes:
            return out
        first = self._owner.get(block_hashes[0])
        now = self.clock.now()
        if first is None or first[1] <= now or first[0] not in out:
            return out
        replica, n = first[0], 0
        for h in block_hashes:
            e = self._owner.get(h)
            if e is None or e[0] != replica or e[1] <= now:
                break
            n += 1
        out[replica] = n
        return out

    def remove_replica(self, replica: str) -> None:
        """Forget the replica's blocks (it left the deployment)."""
        for h in [h for h, e in self._owner.items() if e[0] == replica]:
            del self._owner[h]
