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
  ago), the one process whose check drops it deletes the namespace's keys (what remains
  was written by the other layout's rules, or during the overlap), all but ``<ns>:layouts``
  and the operator's drained set, and only keys of the router's kinds
  (``router.redis_keys.KINDS``), so a namespace that begins with this one and a colon is
  left alone. Meanwhile it marks the
  clear in ``<ns>:layouts`` ("clearing", renewed as it goes), and every process, itself
  included, stays off the namespace until it is done; a clear whose process stopped is
  taken over by the next check once its mark expires. Then all go back to the shared
  index, which the engines' KV events and new decisions fill again.

Routers of a version without this guard do not mark their presence: an upgrade from such
a version is not detected.
"""

from __future__ import annotations

import asyncio
import time

from router.index.base import IndexUnavailable
from router.logs import get_logger
from router.redis_keys import KINDS, LAYOUT_VERSION, RedisKeys, ScriptCache

logger = get_logger(__name__)


class LayoutConflict(IndexUnavailable):
    """Routers of another key layout are present in the namespace: this process leaves
    Redis alone until they are gone (``LayoutGuard``)."""


class LayoutGuard:
    """The layout check of one process's Redis connections in one namespace.

    ``RedisConnections.call`` calls ``ensure`` before each call: on each event loop the
    first call waits for that loop's first check; later ones start a new check every
    ``check_s`` without waiting for it. Each loop runs its own checks (a Serve ingress
    process has two loops: its own and Serve's router's); their verdict is shared.

    Args:
        namespace: ``Settings.index_namespace``.
        version: this router's layout (``router.redis_keys.LAYOUT_VERSION``).
        presence_s: how long a check keeps this layout marked present (s), and a clear
            under way marked so between two of its renewals.
        check_s: how often the presence is renewed and the others read (s); well below
            ``presence_s``, so a live router's presence never lapses between two checks.
        clock: wall-clock seconds (``time.time``), the presences' time base; routers whose
            clocks differ by much less than ``presence_s - check_s`` see each other.
    """

    PRESENCE_S = 30.0
    CHECK_S = 5.0
    CHECK_TIMEOUT_S = 2.0  # bound of one check's script call (the clear is not bounded)
    CLEAR_BATCH = 500  # keys deleted per DEL (per slot on a cluster: redis-py splits them)
    # The key kinds a clear deletes (router.redis_keys.KINDS, the part after "<ns>:", and
    # the shard groups' keys): the keys of a namespace that begins with this one and a colon
    # are left alone. The drained set is kept: an operator's drains outlast an upgrade.
    CLEARED = tuple(k for k in KINDS if k not in ("drained", "layouts")) + ("group",)

    def __init__(self, namespace: str, version: int = LAYOUT_VERSION,
                 presence_s: float = PRESENCE_S, check_s: float = CHECK_S,
                 clock=time.time):
        self.keys = RedisKeys(namespace)
        self.version = str(version)
        self.presence_s = presence_s
        self.check_s = check_s
        self.clock = clock
        # the other layouts present, and "clearing" while the namespace is being cleared;
        # None before any check answered (every loop's calls wait for their first check)
        self.others: list[str] | None = None
        self.cleared = 0  # keys this process deleted when another layout's routers left
        self._checks: dict[int, tuple[float, asyncio.Task | None]] = {}  # loop -> due, task
        self._scripts = ScriptCache()

    async def ensure(self, client) -> None:
        """Start this loop's check when due (awaited while none of this loop's has
        answered), then raise ``LayoutConflict`` while another layout is present or the
        namespace is being cleared.

        Raises:
            LayoutConflict: as above (as of the last check).
            IndexUnavailable: this loop's first check failed (the next call checks again).
        """
        loop = id(asyncio.get_running_loop())
        due, task = self._checks.get(loop, (0.0, None))
        if time.monotonic() >= due and (task is None or task.done()):
            task = asyncio.ensure_future(self.check(client))
            task.add_done_callback(_retrieve)
            self._checks[loop] = (time.monotonic() + self.check_s, task)
        if self.others is None or not task.done() and due == 0.0:
            try:
                await asyncio.shield(task)
            except (asyncio.CancelledError, IndexUnavailable):
                raise
            except Exception as exc:
                self._checks[loop] = (0.0, None)  # no answer: the next call checks again
                raise IndexUnavailable(f"key layout check: {type(exc).__name__}: {exc}") \
                    from exc
        if self.others:
            raise LayoutConflict(
                f"namespace {self.keys.namespace!r} is "
                + ("being cleared of another key layout's keys" if self.others == ["clearing"]
                   else f"used by routers of key layout {', '.join(self.others)} (this router "
                        f"writes layout {self.version})")
                + ": the shared index is not used meanwhile (give each version its own "
                  "index_namespace to keep it)")

    async def _script(self, client, op: str = "") -> tuple[list[str], int]:
        async with asyncio.timeout(self.CHECK_TIMEOUT_S):  # a hung Redis: checked again later
            others, clear = await self._scripts.of(client).layout(
                keys=[self.keys.layouts], args=[self.version, int(self.clock() * 1000),
                                                int(self.presence_s * 1000), op])
        return sorted(v.decode() if isinstance(v, bytes) else str(v) for v in others), clear

    async def check(self, client) -> list[str]:
        """Mark this layout present and read the others (``lua/layout.lua``); when this
        process is the one to clear the keys a layout that left behind, clear them first.
        The other layouts present (and ``"clearing"`` while another process clears)."""
        others, clear = await self._script(client)
        if clear:
            self._set(["clearing"])
            self.cleared += await self._clear(client)
            others, _ = await self._script(client, "done")
        self._set(others)
        return others

    def _set(self, others: list[str]) -> None:
        from router import metrics

        conflict = [v for v in others if v != "clearing"]
        if others != (self.others or []):
            if conflict:
                logger.error("routers of key layout %s share namespace %r with this one "
                             "(layout %s): routing without the shared index until they are "
                             "gone", ", ".join(conflict), self.keys.namespace, self.version)
            elif not others and self.others:
                logger.warning("namespace %r: no other key layout's routers are left: the "
                               "shared index is used again", self.keys.namespace)
        self.others = others
        metrics.set_gauge("index_layout_conflict", 1 if conflict else 0)

    async def _clear(self, client) -> int:
        """Delete the namespace's keys of every kind (``CLEARED``), the drained set and
        ``<ns>:layouts`` kept, in batches; renew the clear's mark every ``check_s``. How
        many were deleted."""
        n, batch, renewed = 0, [], time.monotonic()
        async for key in self.keys.own_keys(client, self.CLEARED):
            batch.append(key)
            if len(batch) >= self.CLEAR_BATCH:
                n += await client.delete(*batch)
                batch = []
                if time.monotonic() - renewed >= self.check_s:
                    await self._script(client, "renew")
                    renewed = time.monotonic()
        if batch:
            n += await client.delete(*batch)
        logger.warning("namespace %r: another key layout's routers are gone; deleted the %d "
                       "keys left (its drained set kept), for this layout's routers to fill "
                       "again", self.keys.namespace, n)
        return n

    def cancel(self) -> None:
        """Cancel the running loop's check (its connections are closing)."""
        loop = id(asyncio.get_running_loop())
        _, task = self._checks.pop(loop, (0.0, None))
        if task is not None and not task.done():
            task.cancel()


def _retrieve(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # a failed background check is retried at the next one
