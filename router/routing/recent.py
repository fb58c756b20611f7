"""The fallback of a router whose shared index fails: its own recent decisions."""

from __future__ import annotations

from typing import Sequence

from router.clock import Clock


class RecentDecisions:
    """This router process's own recent decisions, block by block: the prefix index it falls
    back to when the shared index fails (Redis slow or down), so a conversation's next turn
    still goes where this router sent its last one instead of being decided by load alone.

    Each decision maps its block hashes to the chosen replica until ``ttl_s`` later (the
    predicted-entry TTL); a later decision over the same block takes it over (one owner per
    block: enough to keep a conversation in place, not a second index). The blocks are kept
    in two generations (dicts): decisions write into the current one; when a write would
    take it past ``max_blocks / 2`` blocks, it becomes the previous one first and the
    previous one is dropped. So at most ``max_blocks`` are kept, and a block written again
    since the last turn-over is kept longest (the oldest-written go first, a generation at
    a time). A write costs one C-level ``dict.update``: popping and re-inserting each block
    in one dict cost 570 us for a 2,048-block prompt in a full dict (its deleted slots
    force resizes of the whole table), on the event loop of every routed request.

    Args:
        clock: time source (s).
        max_blocks: bound on the blocks kept (memory: about 150 bytes each).
    """

    def __init__(self, clock: Clock, max_blocks: int = 200_000):
        self.clock = clock
        self.max_blocks = max_blocks
        self._current: dict[int, tuple[str, float]] = {}
        self._previous: dict[int, tuple[str, float]] = {}

    def __len__(self) -> int:
        """Blocks held (a block in both generations counted twice)."""
        return len(self._current) + len(self._previous)

    def record(self, replica: str, block_hashes: Sequence[int], ttl_s: float) -> None:
        """``replica`` was chosen for a request of ``block_hashes`` (prompt order; past
        ``max_blocks / 2`` blocks only the leading ones are kept)."""
        half = max(1, self.max_blocks // 2)
        block_hashes = block_hashes[:half]
        if len(self._current) + len(block_hashes) > half:
            self._previous, self._current = self._current, {}
        self._current.update(dict.fromkeys(block_hashes, (replica, self.clock.now() + ttl_s)))

    def _get(self, h: int) -> tuple[str, float] | None:
        e = self._current.get(h)
        return self._previous.get(h) if e is None else e

    def lookup(self, block_hashes: Sequence[int], replicas: Sequence[str]) -> dict[str, int]:
        """Leading blocks of ``block_hashes`` last sent to each of ``replicas`` and not
        expired: ``{replica: n}`` as ``PrefixIndex.lookup`` returns it (one replica at most
        has n > 0)."""
        out = dict.fromkeys(replicas, 0)
        if not block_hashes:
            return out
        first = self._get(block_hashes[0])
        now = self.clock.now()
        if first is None or first[1] <= now or first[0] not in out:
            return out
        replica, n = first[0], 0
        for h in block_hashes:
            e = self._get(h)
            if e is None or e[0] != replica or e[1] <= now:
                break
            n += 1
        out[replica] = n
        return out

    def remove_replica(self, replica: str) -> None:
        """Forget the replica's blocks (it left the deployment). A block it owned in the
        current generation goes from the previous one too: an older owner there was
        replaced by the later decision and must not come back."""
        cur, prev = self._current, self._previous
        for h in [h for h, e in cur.items() if e[0] == replica]:
            del cur[h]
            prev.pop(h, None)
        for h in [h for h, e in prev.items() if e[0] == replica]:
            del prev[h]
