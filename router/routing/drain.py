"""Replicas an operator drained: they take no new request until undrained.

Draining is the operator's side of a scale-in or of maintenance (``POST
/admin/replicas/{id}/drain``): the replica's requests in flight finish, and every router
leaves it out of its candidates from its next decision on, unless no other live replica is
left (a request is never refused for it; ``RoutingCore.candidates_of``). The set lives in Redis with ``redis_url`` (every
router reads it, at most ``refresh_s`` old), else in this process (with one ingress
process; several without Redis do not share it: ``drain`` then reaches only the process
that took the call, and the admin API says so).

The Redis set keeps a marker member (the empty string: no replica id is empty) from the
first drain on, so that a set gone whole tells a Redis that lost its data (a restart
without persistence, a failover, a flush) from an undrain of the last replica. A router
that finds it gone writes its copy back (logged), and a drain or undrain sent while it is
gone restores the copy first, in the same script (``lua/drained.lua``), so that the change
does not erase the others' drains. Only a copy that was current right before the loss is
written back: its last read at most ``2 * refresh_s`` (and at least ``TRUST_S``) before the
first read that failed or found the set gone (an operator's undrain through another router
after that read would be undone; within that window it is). A router without recent
requests has no such copy; those with requests refresh every ``refresh_s``. To clear every
drain, undrain each replica.
"""

from __future__ import annotations

import math
import time

from router.index.base import IndexUnavailable
from router.logs import get_logger
from router.redis_keys import RedisKeys, ScriptCache

logger = get_logger(__name__)


class DrainedReplicas:
    """The drained replica ids.

    Args:
        connections: ``router.index.redis.RedisConnections``, or None (in process).
        namespace: key prefix (``Settings.index_namespace``).
        refresh_s: how old the Redis copy may be before ``refresh`` reads it again (s).
    """

    def __init__(self, connections=None, namespace: str = "prefix-router",
                 refresh_s: float = 1.0):
        self.conn = connections
        self.key = RedisKeys(namespace).drained
        self.refresh_s = refresh_s
        self._ids: frozenset[str] = frozenset()
        self._marked = False  # the last read found the marker: the set existed in Redis
        self._read_at = -math.inf
        self._read_ok_at = -math.inf  # the last read that succeeded
        self._failed_at: float | None = None  # the first failed read after it
        self.scripts = ScriptCache()

    @property
    def shared(self) -> bool:
        """Whether every router sees the same set (Redis)."""
        return self.conn is not None

    def current(self) -> frozenset[str]:
        """The drained ids as last read (never blocks)."""
        return self._ids

    MARK = ""  # the marker member: no replica id is empty
    TRUST_S = 2.0  # the least age (s) of a copy that is still written back

    def _trusted_copy(self, now: float) -> list[str]:
        """This router's copy, to write back into a set Redis lost: when it was read
        from a marked set at most ``2 * refresh_s`` (``TRUST_S`` at least) before the loss
        showed (the first failed read after it, or now); none otherwise."""
        seen = self._failed_at if self._failed_at is not None else now
        window = max(2 * self.refresh_s, self.TRUST_S)
        if self._marked and self._ids and seen - self._read_ok_at <= window:
            return sorted(self._ids)
        return []

    def _read(self, members) -> frozenset[str]:
        got = {m.decode() if isinstance(m, bytes) else m for m in members}
        self._marked = self.MARK in got
        self._ids = frozenset(got - {self.MARK})
        self._read_ok_at, self._failed_at = time.monotonic(), None
        return self._ids

    async def refresh(self) -> frozenset[str]:
        """Read the set from Redis when this copy is older than ``refresh_s``; a failed
        read keeps the last copy (routing goes on). A set gone whole gets this router's
        copy back when it is to be trusted (see the module's docstring)."""
        if self.conn is None or time.monotonic() - self._read_at < self.refresh_s:
            return self._ids
        now = self._read_at = time.monotonic()
        try:
            members = await self.conn.call(lambda c: c.smembers(self.key))
            copy = self._trusted_copy(now) if not members else []
            if copy:  # the whole set gone, marker too: Redis lost it
                members = await self.conn.call(lambda c: self.scripts.of(c).drained(
                    keys=[self.key], args=["add", copy[0], *copy]))
                logger.warning("the drained replicas' set was gone from Redis (a restart "
                               "or a flush?): restored this router's copy, %s", copy)
        except IndexUnavailable as exc:
            if self._failed_at is None:
                self._failed_at = now
            logger.debug("drained replicas not read (%s); using the last copy", exc)
            return self._ids
        return self._read(members)

    async def set(self, replica: str, drained: bool) -> frozenset[str]:
        """Drain (``drained``) or undrain ``replica``; returns the new set. With Redis, a
        set that Redis lost is restored from this router's copy first, in the same script
        (the change would otherwise start a new set and erase the others' drains).

        Raises:
            IndexUnavailable: Redis did not take it (nothing changed).
        """
        if self.conn is not None:
            copy = self._trusted_copy(time.monotonic())
            members = await self.conn.call(lambda c: self.scripts.of(c).drained(
                keys=[self.key], args=["add" if drained else "rem", replica, *copy]),
                maintenance=True)
            self._read_at = time.monotonic()
            return self._read(members)
        self._ids = self._ids | {replica} if drained else self._ids - {replica}
        return self._ids

    async def forget(self, replica: str) -> None:
        """``replica`` left the deployment: it is no longer drained (its id never comes
        back)."""
        if replica in self._ids:
            try:
                await self.set(replica, False)
            except IndexUnavailable:
                pass
