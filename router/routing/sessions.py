"""Session affinity: a conversation's requests go to the replica that served its first one.

A session is named by the client: a header (``Settings.session_header``, ``x-session-id``
by default) or, when the request has none, OpenAI's ``user`` field. Its key is a digest of
the tenant and the session id (``session_key``), so two tenants' equal ids do not meet and
no id is stored in clear. The prefix index already keeps a conversation where its prefix is
cached. The pin keeps it there when the index cannot: a prefix shorter than a block, predicted
entries that expired during a long pause, Redis slow for one lookup.

The pins live in Redis when the router uses it (``<ns>:session:<digest>``, with a TTL of
``Settings.session_ttl_s`` refreshed on each turn), so every router process sees them. A
session's first turns sent to two routers at once land on one replica: the first pin is
written with ``SET NX``, and a router that loses the race moves its request to the winner's
replica. Without Redis the pins are this process's own.
"""

from __future__ import annotations

import hashlib
import threading
from typing import Protocol

from router.clock import Clock, SystemClock


def session_key(tenant: str | None, session_id: str) -> str:
    """The stored name of a session: SHA-256 of tenant and id, 24 hex digits (96 bits)."""
    raw = f"{tenant or ''}\x00{session_id}".encode("utf-8", "surrogatepass")
    return hashlib.sha256(raw).hexdigest()[:24]


class SessionStore(Protocol):
    """Where sessions are pinned. Every method may raise ``IndexUnavailable``."""

    async def get(self, key: str) -> str | None:
        """The replica ``key`` is pinned to, or None."""

    async def pin_first(self, key: str, replica: str, ttl_s: float) -> str:
        """Pin ``key`` to ``replica`` unless it is pinned already; returns the replica it
        is pinned to now (another router's, when that one was first)."""

    async def pin(self, key: str, replica: str, ttl_s: float) -> None:
        """Pin ``key`` to ``replica`` (a new pin, or a moved one), for ``ttl_s``."""


class MemorySessionStore:
    """This process's pins, expiring after their TTL (swept as new ones are written).

    Args:
        clock: time source.
        max_sessions: bound on the pins kept; past it the oldest-expiring go first.
    """

    def __init__(self, clock: Clock | None = None, max_sessions: int = 1_000_000):
        self.clock = clock or SystemClock()
        self.max_sessions = max_sessions
        self._pins: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    async def get(self, key: str) -> str | None:
        with self._lock:
            v = self._pins.get(key)
            if v is None or v[1] <= self.clock.now():
                return None
            return v[0]

    async def pin_first(self, key: str, replica: str, ttl_s: float) -> str:
        with self._lock:
            v = self._pins.get(key)
            if v is not None and v[1] > self.clock.now():
                return v[0]
            self._set(key, replica, ttl_s)
            return replica

    async def pin(self, key: str, replica: str, ttl_s: float) -> None:
        with self._lock:
            self._set(key, replica, ttl_s)

    def _set(self, key: str, replica: str, ttl_s: float) -> None:
        now = self.clock.now()
        self._pins[key] = (replica, now + ttl_s)
        if len(self._pins) > self.max_sessions:
            live = {k: v for k, v in self._pins.items() if v[1] > now}
            if len(live) > self.max_sessions:
                keep = sorted(live.items(), key=lambda kv: kv[1][1])[-self.max_sessions:]
                live = dict(keep)
            self._pins = live


class RedisSessionStore:
    """Pins in Redis, shared by every router.

    Args:
        connections: ``router.index.redis.RedisConnections``.
        namespace: key prefix (``Settings.index_namespace``).
    """

    def __init__(self, connections, namespace: str):
        from router.redis_keys import RedisKeys

        self.conn = connections
        self.prefix = RedisKeys(namespace).session_prefix

    async def get(self, key: str) -> str | None:
        v = await self.conn.call(lambda c: c.get(self.prefix + key), shed=True)
        return v.decode() if v is not None else None

    async def pin_first(self, key: str, replica: str, ttl_s: float) -> str:
        # SET NX GET (Redis 7.0): sets only if absent, and returns the value that was there
        old = await self.conn.call(lambda c: c.set(self.prefix + key, replica, nx=True,
                                                   get=True, px=int(ttl_s * 1000)))
        return old.decode() if old is not None else replica

    async def pin(self, key: str, replica: str, ttl_s: float) -> None:
        await self.conn.call(lambda c: c.set(self.prefix + key, replica,
                                             px=int(ttl_s * 1000)))

