"""Admission: overload answered by fast refusals, not by ever longer queues.

With ``Settings.max_inflight_per_replica`` set, a request is admitted while some usable
replica has fewer requests in flight than that bound (the shared load: every router's
requests, from the load tracker). When every replica is at its bound, the request waits in
this ingress's queue, ordered by priority (lower first, as vLLM's ``priority`` field) and then
by arrival, for at most ``Settings.queue_timeout_s``. Past that it is refused with a 429 and a
``Retry-After`` header, so a client under overload learns it in a bounded time and backs off
(OpenAI answers rate limits and overload the same way). A request that cannot be admitted
in time is refused at once: the queue drains at a measured rate (the slots handed out in
the last seconds), so a request with ``k`` requests ahead of it would wait about
``k / rate``; past ``queue_timeout_s`` it gets its 429 on arrival, not after waiting for it.
Bursts within the fleet's capacity wait; sustained overload is refused fast. And a queue
that has not been empty for ``queue_timeout_s`` is a standing queue, not a burst: a request
that joins it may wait only ``overloaded_timeout_s`` (5 ms by default) before its 429. This is
the controlled-delay rule of Facebook's servers (B. Maurer, "Fail at Scale", ACM Queue
13(8), 2015: "if the queue has not been empty for the last N ms, then the amount of time
spent in the queue is limited to M ms", with N = 100 ms and M = 5 ms there), itself after
CoDel (Nichols and Jacobson, RFC 8289). Under twice the fleet's capacity, though, the queue
empties often between arrivals (a slot frees, nobody waits), so it is rarely standing for
``queue_timeout_s``. A request that finds no free slot is therefore refused at once, without
waiting at all, while the requests that arrived over the last ``RATE_WINDOW_S`` outnumber the
slots handed out in it by more than ``OVERLOAD_RATIO`` (1.5): the offered load is then well
past what the fleet serves, and the excess is refused either way (a few milliseconds of
waiting would catch a freed slot rarely, at 8 slots/s 4 % of the time in 5 ms, and on a busy
event loop cost far more than 5 ms: measured, 429 p50 41 ms against 26 ms without it). This
is the rule of Google's adaptive throttling (Site Reliability Engineering, O'Reilly 2016,
ch. 21 "Handling Overload": requests against accepts over a window, rejecting locally past
``K x accepts``, K = 2 there, "reducing the multiplier will make adaptive throttling more
aggressive"), applied at the server: arrivals against grants. It counts every arrival, refused or not, so it does not feed itself: under
the fleet's capacity nearly every arrival gets its slot (ratio about 1), and fast refusals
while it held would lower the grants by their own share only. Under sustained overload the
refusals thus come in a few milliseconds, where a request the drain-rate estimate let in
would otherwise wait the whole ``queue_timeout_s`` before its 429. Only the head
of the queue looks at the load. It looks again every ``poll_s`` and at once when this process releases a request,
so the queue drains as fast as the fleet frees slots.

The bound is soft across router processes. Two ingresses may each admit into the last free
slot at the same moment, so the fleet can exceed it by at most one request per ingress
process. Within a process, requests admitted but not yet reserved count as taken
(``reserved`` ends that, called by ``route_request`` once the decision holds its
reservation), so concurrent looks do not hand out one slot twice; a request that reserved
after a look's load read began counts as taken in that look too (the read may predate its
reservation, and the request is no longer pending when the look counts). While a bound is set,
each admission costs one load read (one Redis round trip with the Redis tracker).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import time
from collections import deque
from typing import Callable, Sequence

from router import metrics
from router.load.base import LoadTracker
from router.logs import get_logger
from router.serve.errors import OpenAIError

logger = get_logger(__name__)


def overloaded(timeout_s: float | None, retry_after_s: int) -> OpenAIError:
    """The 429 of a request that found every replica at its bound for ``timeout_s``, or
    (``timeout_s`` None) at once under sustained overload."""
    why = (f"none freed a slot within {timeout_s:g} s" if timeout_s is not None else
           "requests arrive much faster than slots free up")
    return OpenAIError(429, f"every engine replica is at its bound of requests in flight and "
                            f"{why}; retry after {retry_after_s} s", "RateLimitError",
                       headers={"retry-after": str(retry_after_s)})


class Admission:
    """The ingress's admission queue.

    Args:
        load: the load tracker (shared loads; its local fallback when Redis fails).
        bound: requests in flight per replica at which a replica counts as full; None
            admits everything at once (no queue).
        timeout_s: longest wait in the queue (s) before the 429.
        retry_after_s: the ``Retry-After`` of the 429 (s).
        poll_s: how often the head of the queue reads the load while it waits (s).
        overloaded_timeout_s: longest wait (s) of a request that joins a queue that has
            not been empty for ``timeout_s`` (the module's controlled-delay rule).
    """

    def __init__(self, load: LoadTracker, bound: int | None, timeout_s: float = 2.0,
                 retry_after_s: int = 1, poll_s: float = 0.01,
                 overloaded_timeout_s: float = 0.005):
        self.load = load
        self.bound = bound
        self.timeout_s = timeout_s
        self.overloaded_timeout_s = min(overloaded_timeout_s, timeout_s)
        self._last_empty = time.monotonic()  # when the queue was last seen empty
        self.retry_after_s = retry_after_s
        self.poll_s = poll_s
        self._queue: list[tuple] = []  # (priority, seq, turn, request id), a heap
        self._seq = itertools.count()
        # admitted here: request id -> when it reserved (None: not yet). A request that
        # reserved after a load read began may be missing from that read, so it is kept
        # (and counted) until every read in flight began after its reservation.
        self._pending: dict[str, float | None] = {}
        self._reads: list[float] = []  # start times of the load reads in flight
        self._pending_lock = threading.Lock()  # reserved() comes from the Ray router's loop too
        self._wake: asyncio.Event | None = None
        self._head_task: asyncio.Task | None = None
        # within the last RATE_WINDOW_S (older ones are dropped as they are read): when
        # slots were handed out, and when requests arrived
        self._grants: deque[float] = deque()
        self._arrivals: deque[float] = deque()
        if bound is not None:  # the series exists from the start: a queue refused at once
            metrics.get("admission_waiting").set(0)  # by its drain rate never sets it

    RATE_WINDOW_S = 10.0
    OVERLOAD_RATIO = 1.5

    def drain_rate(self, now: float | None = None) -> float | None:
        """Slots handed out per second over the last ``RATE_WINDOW_S`` (s; at once or from
        the queue: while every slot is taken, the rate slots free up), or None before 4
        were (then every request may wait)."""
        now = time.monotonic() if now is None else now
        recent = self._recent(self._grants, now)
        if len(recent) < 4:
            return None
        return len(recent) / max(now - recent[0], 1e-3)

    def _recent(self, times: deque[float], now: float) -> deque[float]:
        """``times`` without those older than ``RATE_WINDOW_S`` (dropped in place)."""
        while times and now - times[0] > self.RATE_WINDOW_S:
            times.popleft()
        return times

    def _record(self, times: deque[float], now: float) -> None:
        """Add ``now`` to ``times``, dropping those older than ``RATE_WINDOW_S``."""
        times.append(now)
        self._recent(times, now)

    def sustained_overload(self, now: float | None = None) -> bool:
        """Whether the requests that arrived over the last ``RATE_WINDOW_S`` outnumber the
        slots handed out in it (at once or from the queue) by more than ``OVERLOAD_RATIO``:
        offered load past 1.5 x what the fleet serves (the module's adaptive-throttling
        rule): a request that finds no free slot is then refused at once. False before 4
        slots were handed out."""
        now = time.monotonic() if now is None else now
        granted = len(self._recent(self._grants, now))
        return granted >= 4 and len(self._recent(self._arrivals, now)) > \
            self.OVERLOAD_RATIO * granted

    @property
    def waiting(self) -> int:
        """Requests in this process's queue now."""
        return len(self._queue)

    def released(self) -> None:
        """This process released a request: the head of the queue looks again at once."""
        if self._wake is not None:
            self._wake.set()

    def reserved(self, request_id: str) -> None:
        """``request_id`` now holds its load reservation (it counts in the shared load), or
        failed before it could: its admission slot is no longer held here. Idempotent, and
        safe from any thread."""
        with self._pending_lock:
            if request_id in self._pending:
                self._pending[request_id] = time.monotonic()
                self._prune_locked()

    def _take(self, request_id: str) -> None:
        with self._pending_lock:
            self._pending[request_id] = None

    def _prune_locked(self) -> None:
        """Forget the requests that reserved before every load read in flight began:
        those reads, and every later one, count them."""
        oldest = min(self._reads, default=time.monotonic())
        for rid in [r for r, t in self._pending.items() if t is not None and t < oldest]:
            del self._pending[rid]

    async def _room(self, replicas: Sequence[str]) -> int:
        if not replicas:  # the replica set is not known yet: nothing to count slots on
            return 1
        with self._pending_lock:
            t0 = time.monotonic()
            self._reads.append(t0)
        try:
            loads = await self.load.loads(list(replicas))
        finally:
            with self._pending_lock:
                self._reads.remove(t0)
        free = sum(max(self.bound - loads[r].inflight, 0) for r in replicas)
        with self._pending_lock:
            # not reserved yet, or reserved after this read began (the read may miss it)
            held = sum(1 for t in self._pending.values() if t is None or t >= t0)
            self._prune_locked()
            return free - held

    async def admit(self, request_id: str, replicas: Callable[[], Sequence[str]],
                    priority: int = 0) -> float:
        """Wait for a slot for ``request_id``; returns the time waited (s). ``reserved``
        must follow once the request holds its reservation, or has failed before.

        Args:
            replicas: the usable replicas' ids now (called at each look).
            priority: lower goes first (vLLM's convention); ties by arrival.
        Raises:
            OpenAIError: 429 with ``Retry-After`` after ``timeout_s`` without a slot, or at
                once when the queue's drain rate says it would not get one in time or
                under sustained overload (``sustained_overload``).
        """
        t0 = time.monotonic()
        if self.bound is None:
            return 0.0
        self._record(self._arrivals, t0)
        if not self._queue:
            self._last_empty = time.monotonic()
        if not self._queue and await self._room(replicas()) > 0 and not self._queue:
            self._take(request_id)
            self._record(self._grants, time.monotonic())
            return 0.0
        if self.sustained_overload():  # the excess is refused either way: at once
            metrics.inc("admission_refused", tags={"reason": "sustained_overload"})
            raise overloaded(None, self.retry_after_s)
        standing = not self._queue_empty_within(self.timeout_s)
        timeout = self.overloaded_timeout_s if standing else self.timeout_s
        rate = self.drain_rate()
        ahead = sum(1 for e in self._queue if e[0] <= priority and not e[2].done())
        if rate is not None and (ahead + 1) / rate > self.timeout_s:
            metrics.inc("admission_refused", tags={"reason": "overloaded"})
            raise overloaded(self.timeout_s, self.retry_after_s)  # it would time out anyway
        loop = asyncio.get_running_loop()
        turn: asyncio.Future = loop.create_future()
        entry = (priority, next(self._seq), turn, request_id)
        heapq.heappush(self._queue, entry)
        metrics.get("admission_waiting").set(len(self._queue))
        if self._head_task is None or self._head_task.done():
            self._head_task = loop.create_task(self._serve_queue(replicas))
        try:
            async with asyncio.timeout(timeout):  # not wait_for: see RedisConnections.client
                await asyncio.shield(turn)
        except TimeoutError:
            if turn.done() and not turn.cancelled():  # admitted at the last moment
                return time.monotonic() - t0
            self._drop(entry)
            metrics.inc("admission_refused",
                        tags={"reason": "standing_queue" if standing else "overloaded"})
            raise overloaded(timeout, self.retry_after_s) from None
        except asyncio.CancelledError:  # the client left while waiting
            self.reserved(request_id)  # a slot it was just given goes back
            self._drop(entry)
            raise
        waited = time.monotonic() - t0
        metrics.get("admission_wait").observe(waited)
        return waited

    def _queue_empty_within(self, window_s: float) -> bool:
        """Whether the queue was empty at some moment of the last ``window_s`` (s)."""
        if not any(not e[2].done() for e in self._queue):
            self._last_empty = time.monotonic()
        return time.monotonic() - self._last_empty <= window_s

    def _drop(self, entry) -> None:
        try:
            self._queue.remove(entry)
            heapq.heapify(self._queue)
        except ValueError:
            pass
        if not self._queue:
            self._last_empty = time.monotonic()
        if not entry[2].done():
            entry[2].cancel()
        metrics.get("admission_waiting").set(len(self._queue))

    async def _serve_queue(self, replicas: Callable[[], Sequence[str]]) -> None:
        """Hand slots to the queue's head while it is not empty."""
        self._wake = asyncio.Event()
        while self._queue:
            head = self._queue[0]
            if head[2].done():  # timed out or left
                heapq.heappop(self._queue)
                if not self._queue:
                    self._last_empty = time.monotonic()
                continue
            try:
                room = await self._room(replicas())
                # the head may have timed out or left during the look
                if room > 0 and self._queue and self._queue[0] is head \
                        and not head[2].done():
                    heapq.heappop(self._queue)
                    self._take(head[3])
                    head[2].set_result(True)
                    self._record(self._grants, time.monotonic())
                    if not self._queue:
                        self._last_empty = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the load tracker falls back itself
                logger.warning("admission could not read the load: %s", exc)
                room = 0
            if room > 0:
                metrics.get("admission_waiting").set(len(self._queue))
                continue
            self._wake.clear()
            try:
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            except TimeoutError:
                pass


def parse_priority(value: str | None, default: int = 0) -> int:
    """A request's priority from its header: an integer (lower first); ``default`` when
    absent.

    Raises:
        OpenAIError: 400 naming the header, for a value that is not an integer within
            +/- 2**31 (vLLM's ``priority`` is an int).
    """
    if value is None or value.strip() == "":
        return default
    try:
        p = int(value.strip())
    except ValueError:
        p = None
    if p is None or abs(p) >= 2 ** 31:
        raise OpenAIError(400, f"priority must be an integer (lower is served first), not "
                               f"{value[:40]!r}", "BadRequestError", "x-priority")
    return p
