"""Replicas an operator drained: they take no new request until undrained.

Draining is the operator's side of a scale-in or of maintenance (``POST
/admin/replicas/{id}/drain``): the replica's requests in flight finish, and every router
leaves it out of its candidates from its next decision on, unless no other live replica is
left (a request is never refused for it; ``RoutingCore.candidates_of``). The set lives in Redis with ``redis_url`` (every
router reads it, at most ``refresh_s`` old), else in this process (with one ingress
process; several without Redis do not share it: ``drain`` then reaches only the process
that took the call, and the admin API says so).
"""

from __future__ import annotations

import math
import time

from router.index.base import IndexUnavailable
from router.logs import get_logger
from router.redis_keys import RedisKeys

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
        self._read_at = -math.inf

    @property
    def shared(self) -> bool:
        """Whether every router sees the same set (Redis)."""
        return self.conn is not None

    def current(self) -> frozenset[str]:
        """The drained ids as last read (never blocks)."""
        return self._ids

    async def refresh(self) -> frozenset[str]:
        """Read the set from Redis when this copy is older than ``refresh_s``; a failed
        read keeps the last copy (routing goes on)."""
        if self.conn is None or time.monotonic() - self._read_at < self.refresh_s:
            return self._ids
        self._read_at = time.monotonic()
        try:
            members = await self.conn.call(lambda c: c.smembers(self.key))
        except IndexUnavailable as exc:
            logger.debug("drained replicas not read (%s); using the last copy", exc)
            return self._ids
        self._ids = frozenset(m.decode() if isinstance(m, bytes) else m for m in members)
        return self._ids

    async def set(self, replica: str, drained: bool) -> frozenset[str]:
        """Drain (``drained``) or undrain ``replica``; returns the new set.

        Raises:
            IndexUnavailable: Redis did not take it (nothing changed).
        """
        if self.conn is not None:
            op = "sadd" if drained else "srem"
            await self.conn.call(lambda c: getattr(c, op)(self.key, replica),
                                 maintenance=True)
            self._read_at = -math.inf
            return await self.refresh()
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
