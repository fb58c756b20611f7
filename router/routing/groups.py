"""The first level of the two-level choice on a Redis Cluster: which shard group decides.

With shard groups (``Settings.index_shard_groups``, docs/scaling.md), the atomic decision
(``lua/route.lua``) runs on one group's keys, hence on one shard, with that group's
replicas as candidates. Before it, the router picks the group, without a Redis round trip:

1. **Where this router sent the prefix.** A router-local summary, an in-process prefix index
   whose "replicas" are the groups (``router.index.memory.MemoryPrefixIndex``), is fed with
   every decision this router makes (the group and the request's blocks, for
   ``Settings.predicted_ttl_s``). The group holding the longest prefix of the request in it
   wins, among the groups within the load bound below.
2. **A rule every router computes alike** for a prefix this router has not seen: weighted
   rendezvous hashing of the prompt's first block over the groups (each group weighted by
   its number of candidates: score ``-w / ln(u)``, u uniform from BLAKE2b of the block and
   the group's tag; Schindelhauer and Schomaker, "Weighted distributed hash tables", SPAA
   2005), walked in score order with a bounded-load skip: a group whose requests in flight
   per candidate would exceed ``max(c x mean, mean + 2)`` is passed over (consistent hashing
   with bounded loads, Mirrokni, Thorup and Zadimoghaddam, SODA 2018; ``c`` is
   ``Settings.index_group_load_factor``; the ``mean + 2`` floor is ``lua/route.lua``'s). So
   two routers that never saw a prefix send it to the same group while that group is not
   overloaded, and a hot first block (a shared system prompt) spills to the next group in
   its order, the same next group for every router.

The group loads are those the route script returned with this router's own decisions in
the last ``stale_s`` seconds (the candidates' requests in flight, every router's, after the
reservation); a group not heard of within it counts as idle.
What is lost against one Redis (docs/scaling.md): a request is compared only with the
replicas of the group chosen here, the summary knows only this router's decisions (another
router's, and KV events, reach it only through the rule above), and the load bound uses
loads up to ``stale_s`` old.
"""

from __future__ import annotations

import hashlib
import math
from typing import Mapping, Sequence

from router.clock import Clock, SystemClock
from router.index.memory import MemoryPrefixIndex
from router.redis_keys import ShardGroups


class GroupChoice:
    """Chooses the shard group of a decision (the first level), from this router's own
    decisions and the group loads the route script returns.

    Args:
        groups: the layout (``ShardGroups``, the index's).
        clock: time source (s).
        load_factor: ``c`` of the bounded-load skip (>= 1; ``Settings.index_group_load_factor``).
        ttl_s: how long a decision's blocks stay in the summary (s).
        max_blocks: bound on the summary's (block, group) entries (about 300 bytes each in
            CPython); past it the entries closest to expiry go first.
        stale_s: a group's reported load older than this is not used (s).
    Raises:
        ValueError: ``load_factor`` below 1, or ``ttl_s`` / ``stale_s`` not positive.
    """

    def __init__(self, groups: ShardGroups, clock: Clock | None = None,
                 load_factor: float = 1.25, ttl_s: float = 600.0,
                 max_blocks: int = 500_000, stale_s: float = 2.0):
        if load_factor < 1 or ttl_s <= 0 or stale_s <= 0:
            raise ValueError(f"need load_factor >= 1, ttl_s > 0, stale_s > 0; got "
                             f"{load_factor}, {ttl_s}, {stale_s}")
        self.groups = groups
        self.clock = clock or SystemClock()
        self.load_factor = load_factor
        self.ttl_s = ttl_s
        self.stale_s = stale_s
        self.summary = MemoryPrefixIndex(self.clock, max_predicted_entries=max_blocks)
        self._load: dict[int, tuple[int, float]] = {}  # group -> (in flight, when, s)

    def loads(self, parts: Mapping[int, Sequence[str]]) -> dict[int, float]:
        """Requests in flight per group of ``parts`` (group -> its candidates), as last
        reported within ``stale_s``; a group not reported within it counts as idle (0): a
        bounded-load skip then goes to it, and that decision reports its load. (Counting
        it at the mean of the others would let a router that has decided in one group
        only never spill out of it.)"""
        now = self.clock.now()
        return {g: float(self._load[g][0])
                if g in self._load and now - self._load[g][1] <= self.stale_s else 0.0
                for g in parts}

    def order(self, key: bytes, parts: Mapping[int, Sequence[str]]) -> list[int]:
        """The groups of ``parts`` by weighted rendezvous score for ``key``, highest first
        (weight: the group's number of candidates)."""
        def score(g: int) -> float:
            tag = (self.groups.tags[g] or "").encode()
            h = int.from_bytes(hashlib.blake2b(key + b"\0" + tag, digest_size=8).digest(), "big")
            u = (h + 1) / (2.0 ** 64 + 2)  # in (0, 1)
            return -len(parts[g]) / math.log(u)
        return sorted(parts, key=score, reverse=True)

    def choose(self, block_hashes: Sequence[int], parts: Mapping[int, Sequence[str]],
               request_id: str = "") -> int:
        """The group to decide in.

        Args:
            block_hashes: the request's block hashes in prompt order (may be empty: then
                the rendezvous key is ``request_id``, a decision by load alone).
            parts: the candidates by group (``ShardGroups.split``), non-empty.
        Returns:
            A group of ``parts``.
        Raises:
            ValueError: ``parts`` is empty.
        """
        if not parts:
            raise ValueError("no candidate group")
        if len(parts) == 1:
            return next(iter(parts))
        inflight = self.loads(parts)
        n = sum(len(r) for r in parts.values())
        mean = (sum(inflight.values()) + 1) / n
        bound = max(self.load_factor * mean, mean + 2)
        within = [g for g in parts if (inflight[g] + 1) / len(parts[g]) <= bound]
        if block_hashes:
            key = int(block_hashes[0]).to_bytes(8, "big", signed=False)
        else:
            key = request_id.encode("utf-8", "surrogatepass")
        order = self.order(key, parts)
        if block_hashes and within:
            matched = self.summary.lookup_now(block_hashes, [str(g) for g in within])
            best = max(matched.values())
            if best > 0:
                return next(g for g in order if g in within and matched[str(g)] == best)
        for g in order:
            if g in within:
                return g
        return min(parts, key=lambda g: inflight[g] / len(parts[g]))

    def observe(self, group: int, block_hashes: Sequence[int], inflight: int) -> None:
        """This router decided in ``group`` for a request of ``block_hashes``; the route
        script reported ``inflight`` requests in flight on the group's candidates."""
        self._load[group] = (int(inflight), self.clock.now())
        if block_hashes:
            # entries with half their TTL left stay as they are (as lua/route.lua's)
            self.summary.record_predicted_now(str(group), block_hashes, self.ttl_s,
                                              fresh_s=self.ttl_s / 2)
