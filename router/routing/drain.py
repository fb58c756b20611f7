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
without persistence, a failover, a flush) from an undrain of the last replica: a router
that finds it gone writes its last copy back (within ``refresh_s``; logged), so a replica
under maintenance does not take traffic again because Redis restarted. To clear every
drain, undrain each replica.
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
        self._marked = False  # the last read found the marker: the set existed in Redis
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
        got = {m.decode() if isinstance(m, bytes) else m for m in members}
        if not got and self._marked and self._ids:  # the whole set gone: Redis lost it
            ids = self._ids
            try:
                await self.conn.call(lambda c: c.sadd(self.key, self.MARK, *ids))
            except IndexUnavailable as exc:
                logger.debug("drained replicas not restored yet (%s)", exc)
                return self._ids
            logger.warning("the drained replicas' set was gone from Redis (a restart or a "
                           "flush?): restored this router's copy, %s", sorted(ids))
            return self._ids
        self._marked = self.MARK in got
        self._ids = frozenset(got - {self.MARK})
        return self._ids

    MARK = ""  # the marker member: no replica id is empty

    async def set(self, replica: str, drained: bool) -> frozenset[str]:
        """Drain (``drained``) or undrain ``replica``; returns the new set.

        Raises:
            IndexUnavailable: Redis did not take it (nothing changed).
        """
        if self.conn is not None:
            if drained:  # the marker with the first drain (see the module's docstring)
                call = lambda c: c.sadd(self.key, self.MARK, replica)  # noqa: E731
            else:
                call = lambda c: c.srem(self.key, replica)  # noqa: E731
            await self.conn.call(call, maintenance=True)
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
