"""Routers of different key layouts never share a namespace's data.

What the router keeps in Redis (``router.redis_keys``: the index's entries, the load, the
leases, the sessions...) is read and written by every router and engine replica of a
namespace, each by the rules of its own version. A version whose keys or values mean
something else (``LAYOUT_VERSION`` is raised for every such change) would misread the
other's: an upgrade that rolls replicas over one at a time runs both for a while, and
nothing would show it but worse routing.

So each process that uses Redis marks its layout present in the namespace (the hash
``<ns>:layouts``: version -> expiry of its presence, ``lua/layout.lua``), renewed every
``CHECK_S`` and kept ``PRESENCE_S``, and reads which other layouts are present:

* while another layout is present, this process uses none of the namespace's keys: each
  Redis call raises ``LayoutConflict`` (an ``IndexUnavailable``), so routing falls back to
  the process's own load as it does when Redis is down, and no request fails (the routers
  of the other layout, if they have this guard, do the same); logged once, and the gauge
  ``router_index_layout_conflict`` is 1;
* once the other layout's presence has expired (its last router stopped ``PRESENCE_S``
  ago), the one process whose check drops it deletes every other key of the namespace
  (what remains was written by the other layout's rules, or during the overlap), and all
  go back to the shared index, which the engines' KV events and new decisions then fill.

Routers of a version without this guard do not mark their presence: an upgrade from such
a version is not detected.
"""

from __future__ import annotations

import asyncio
import time

from router.index.base import IndexUnavailable
from router.logs import get_logger
from router.redis_keys import LAYOUT_VERSION, RedisKeys, ScriptCache

logger = get_logger(__name__)


class LayoutConflict(IndexUnavailable):
    """Routers of another key layout are present in the namespace: this process leaves
    Redis alone until they are gone (``LayoutGuard``)."""


class LayoutGuard:
    """The layout check of one process's Redis connections in one namespace.

    ``RedisConnections.call`` calls ``ensure`` before each call: the first waits for the
    check's answer; later ones start a new check every ``check_s`` without waiting for it.

    Args:
        namespace: ``Settings.index_namespace``.
        version: this router's layout (``router.redis_keys.LAYOUT_VERSION``).
        presence_s: how long a check keeps this layout marked present (s).
        check_s: how often the presence is renewed and the others read (s); well below
            ``presence_s``, so a live router's presence never lapses between two checks.
        clock: wall-clock seconds (``time.time``), the presences' time base; routers whose
            clocks differ by much less than ``presence_s - check_s`` see each other.
    """

    PRESENCE_S = 30.0
    CHECK_S = 5.0
    CHECK_TIMEOUT_S = 2.0  # bound of one check's script call (the clear is not bounded)

    def __init__(self, namespace: str, version: int = LAYOUT_VERSION,
                 presence_s: float = PRESENCE_S, check_s: float = CHECK_S,
                 clock=time.time):
        self.keys = RedisKeys(namespace)
        self.version = str(version)
        self.presence_s = presence_s
        self.check_s = check_s
        self.clock = clock
        self.others: list[str] | None = None  # present other layouts; None before a check
        self.cleared = 0  # keys deleted when another layout's presence ended
        self._due = 0.0  # time.monotonic() of the next check
        self._check: asyncio.Task | None = None
        self._scripts = ScriptCache()

    async def ensure(self, client) -> None:
        """Start the check when due (awaited when none has answered yet), then raise
        ``LayoutConflict`` while another layout is present.

        Raises:
            LayoutConflict: another layout is present (as of the last check).
            RedisError, OSError, asyncio.TimeoutError: the first check failed (the caller
                turns them into ``IndexUnavailable``; the next call checks again).
        """
        loop = asyncio.get_running_loop()
        running = self._check is not None and not self._check.done() \
            and self._check.get_loop() is loop  # a check of another loop's client: not ours
        if time.monotonic() >= self._due and not running:
            self._due = time.monotonic() + self.check_s
            self._check = asyncio.ensure_future(self.check(client))
            self._check.add_done_callback(_retrieve)
        if self.others is None:
            try:
                await asyncio.shield(self._check)
            except BaseException:
                self._due = 0.0  # no answer yet: the next call checks again
                raise
        if self.others:
            raise LayoutConflict(
                f"routers of key layout {', '.join(self.others)} use namespace "
                f"{self.keys.namespace!r} (this router writes layout {self.version}): the "
                f"shared index is not used until they are gone (or give each version its "
                f"own index_namespace)")

    async def check(self, client) -> list[str]:
        """Mark this layout present, read the others present (``lua/layout.lua``), clear
        the namespace when this check found another layout's presence ended; the other
        layouts present."""
        from router import metrics

        async with asyncio.timeout(self.CHECK_TIMEOUT_S):  # a hung Redis: checked again later
            others, dropped = await self._scripts.of(client).layout(
                keys=[self.keys.layouts],
                args=[self.version, int(self.clock() * 1000), int(self.presence_s * 1000)])
        others = sorted(v.decode() if isinstance(v, bytes) else str(v) for v in others)
        if others != (self.others or []):
            if others:
                logger.error("routers of key layout %s share namespace %r with this one "
                             "(layout %s): routing without the shared index until they are "
                             "gone", ", ".join(others), self.keys.namespace, self.version)
            elif self.others:
                logger.warning("the routers of another key layout left namespace %r: the "
                               "shared index is used again", self.keys.namespace)
        self.others = others
        metrics.get("index_layout_conflict").set(1 if others else 0)
        if dropped:
            self.cleared += await self._clear(client)
        return others

    async def _clear(self, client) -> int:
        """Delete every key of the namespace but ``<ns>:layouts``; how many were deleted."""
        n = 0
        async for key in client.scan_iter(match=self.keys.pattern(), count=1000):
            if key != self.keys.layouts.encode():
                n += await client.delete(key)
        logger.warning("namespace %r: another key layout's routers are gone; deleted the %d "
                       "keys they and this layout left, for this layout's routers to fill "
                       "again", self.keys.namespace, n)
        return n


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a failed background check is retried at the next one
