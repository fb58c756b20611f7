"""Admission: overload answered by fast refusals, not by ever longer queues.

With ``Settings.max_inflight_per_replica`` set, a request is admitted while some usable
replica has fewer requests in flight than that bound (the shared load: every router's
requests, from the load tracker). When every replica is at its bound, the request waits in
this ingress's queue, ordered by priority (lower first, as vLLM's ``priority`` field) and then
by arrival, for at most ``Settings.queue_timeout_s``. Past that it is refused with a 429 and a
``Retry-After`` header, so a client under overload learns it in a bounded time and backs off
(OpenAI answers rate limits and overload the same way). A request that is unlikely to be
admitted in time is refused at once, not after waiting for its 429: it waits only when
the probability that enough slots free up within its timeout (one for it and one for each
request ahead of it) is at least ``QUEUE_CONFIDENCE`` (0.9). That probability comes from
the ages of the requests in flight and the hold times of the last released ones
(``slot_probability``): the head of the queue must wait for the oldest request in flight
to end, which the mean drain rate does not know (measured at 0.9 x capacity with 4 s
answers: the head found no slot within 0.25 s about 17 % of the time, and those waited the
whole timeout before their 429). Until ``MIN_HELD_SAMPLES`` holds have ended, the measured
drain rate decides instead (the slots handed out in the last seconds): a request with ``k``
requests ahead of it would wait about ``k / rate``, and past ``queue_timeout_s`` it is
refused on arrival.
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
reservation, and the request is no longer pending when the look counts). When such requests
alone leave no free slot (the read may have counted them as well), the look reads again.
While a bound is set, each admission costs one load read (one Redis round trip with the
Redis tracker; up to three in that case).
"""

from __future__ import annotations

import asyncio
import bisect
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


class TenantSlots:
    """Requests of each tenant being received and prepared in this process, at most
    ``limit`` at once (``Settings.tenant_max_inflight``): a tenant that opens connections
    and trickles their bodies (a byte every few seconds restarts the idle timeout) holds
    at most that many of the process's requests, and other tenants keep being served.

    A request holds its slot from its authentication to the end of its rate-limit check
    (its body, its rendering: ``TenantSlot.release`` is called then), not while it waits
    for admission or its answer. ``limit`` None: no bound. Used from one event loop (no
    lock)."""

    def __init__(self, limit: int | None):
        self.limit = limit
        self._held: dict[str, int] = {}

    def held(self, tenant: str) -> int:
        """The slots ``tenant`` holds now."""
        return self._held.get(tenant, 0)

    def take(self, tenant: str | None) -> "TenantSlot":
        """A context manager holding one of ``tenant``'s slots (None: keys are off, no
        slot).

        Raises:
            OpenAIError: 429 when ``tenant`` holds ``limit`` already (nothing is taken).
        """
        if tenant is not None and self.limit is not None:
            n = self._held.get(tenant, 0)
            if n >= self.limit:
                metrics.inc("admission_refused", tags={"reason": "tenant_inflight"})
                raise OpenAIError(429, f"Too many requests in flight for tenant {tenant!r}: "
                                       f"at most {self.limit} at once per router process "
                                       "(setting tenant_max_inflight).", "RateLimitError",
                                  headers={"retry-after": "1"})
            self._held[tenant] = n + 1
        return TenantSlot(self, tenant if self.limit is not None else None)


class TenantSlot:
    """One slot of ``TenantSlots``, given back when its ``with`` block ends."""

    def __init__(self, slots: TenantSlots, tenant: str | None):
        self.slots, self.tenant = slots, tenant

    def __enter__(self) -> "TenantSlot":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Give the slot back (once; later calls do nothing)."""
        if self.tenant is not None:
            n = self.slots._held.get(self.tenant, 0) - 1
            if n > 0:
                self.slots._held[self.tenant] = n
            else:
                self.slots._held.pop(self.tenant, None)
            self.tenant = None


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
        # the slots this process handed out and holds: request id -> when (monotonic s);
        # and how long the last released ones were held (s), for ``slot_probability``
        self._holds: dict[str, float] = {}
        self._held: deque[float] = deque(maxlen=self.HELD_SAMPLES)
        self._held_sorted: list[float] | None = None
        self._inflight_seen = 0  # requests in flight on the usable replicas at the last look
        if bound is not None:  # the series exists from the start: a queue refused at once
            metrics.set_gauge("admission_waiting", 0)  # by its drain rate never sets it

    RATE_WINDOW_S = 10.0
    OVERLOAD_RATIO = 1.5
    # a request that finds no slot waits only when at least this likely to get one within
    # its timeout (``slot_probability``); below, it is refused at once
    QUEUE_CONFIDENCE = 0.9
    HELD_SAMPLES = 512  # hold times kept for the estimate (the most recent)
    MIN_HELD_SAMPLES = 16  # fewer: the drain-rate rule decides instead
    HOLDS_MAX = 65536  # slots held in one process past which the oldest half is forgotten

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

    def released(self, request_id: str | None = None) -> None:
        """This process released a request: the head of the queue looks again at once, and
        the time ``request_id`` held its slot (from its grant) joins the hold times of
        ``slot_probability``. Idempotent per request."""
        if request_id is not None:
            granted = self._holds.pop(request_id, None)
            if granted is not None:
                self._held.append(time.monotonic() - granted)
                self._held_sorted = None
        if self._wake is not None:
            self._wake.set()

    def _granted(self, request_id: str, now: float) -> None:
        """A slot went to ``request_id`` at ``now``."""
        self._take(request_id)
        self._record(self._grants, now)
        self._holds[request_id] = now
        if len(self._holds) > self.HOLDS_MAX:  # a hold no release ended (a bug elsewhere):
            oldest = sorted(self._holds.values())[len(self._holds) // 2]  # forget the
            for rid in [r for r, t in self._holds.items() if t < oldest]:  # older half
                del self._holds[rid]

    def slot_probability(self, needed: int, within_s: float,
                         now: float | None = None) -> float | None:
        """The probability that at least ``needed`` slots free up within ``within_s`` (s),
        from how long slots were held lately; None with fewer than ``MIN_HELD_SAMPLES``
        hold times (the caller then uses the drain rate).

        A slot this process holds frees with the conditional probability of its hold time
        given its age ``a``: ``(S(a) - S(a + T)) / S(a)``, where ``S`` is the empirical
        survival function of the recent hold times and ``T = within_s``: a request that is
        nearly done is likely to free its slot soon, one just granted is not. A slot held
        by another router process (the shared load's in-flight count less this process's
        holds), or one of this process's held longer than any recent hold, has unknown
        age; it frees with the stationary probability of a renewal process,
        ``E[min(D, T)] / E[D]`` for hold times ``D`` (the residual-life distribution:
        S. Ross, Stochastic Processes, 2nd ed., Wiley 1996, section 3.4). Slots free
        independently of each other; the count that frees is then a Poisson-binomial
        variable, whose tail this computes exactly (O(slots x needed)).

        With equal hold times (a fleet where every answer has the same length) the ages
        tell when each slot frees, and the estimate is near 0 or 1; with hold times that
        vary, it spreads accordingly. Unlike the drain rate alone, it knows that the head
        of the queue must wait for the oldest request in flight to end, which may be
        further off than the mean gap between completions.
        """
        if len(self._held) < self.MIN_HELD_SAMPLES:
            return None
        if needed <= 0:
            return 1.0
        now = time.monotonic() if now is None else now
        if self._held_sorted is None:
            self._held_sorted = sorted(self._held)
        held = self._held_sorted
        n = len(held)
        mean = sum(held) / n
        stationary = min(1.0, sum(min(d, within_s) for d in held) / n / mean) \
            if mean > 0 else 1.0

        def survival(x: float) -> float:  # fraction of recent hold times longer than x
            return (n - bisect.bisect_right(held, x)) / n

        probs = []
        for granted in list(self._holds.values()):  # a copy: never "changed size"
            age = max(now - granted, 0.0)
            alive = survival(age)
            probs.append((alive - survival(age + within_s)) / alive if alive > 0
                         else stationary)
        others = max(self._inflight_seen - len(probs), 0)
        probs.extend([stationary] * others)
        # tail[j]: probability that exactly j slots freed (j < needed), or at least
        # `needed` (j == needed), over the slots folded in so far
        tail = [1.0] + [0.0] * needed
        for p in probs:
            for j in range(needed, 0, -1):
                tail[j] = tail[j] * (1 - p) + tail[j - 1] * p + (tail[j] * p
                                                                 if j == needed else 0.0)
            tail[0] *= 1 - p
        return tail[needed]

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

    async def _room(self, replicas: Sequence[str], looks: int = 3) -> int:
        """Free slots on ``replicas`` less those admitted here and not yet counted (may be
        negative); one load read, or up to ``looks`` when the first ones are unsure.

        A request that reserved while a read travelled is counted as taken (the read may
        have missed it), so when the read did see it, it counts twice and a free slot looks
        taken. When only such requests stand between the count and a free slot, the look
        reads again: a read that begins after their reservations counts each of them once.
        """
        for _ in range(looks - 1):
            room, unsure = await self._look(replicas)
            if room > 0 or room + unsure <= 0:
                return room
        return (await self._look(replicas))[0]

    async def _look(self, replicas: Sequence[str]) -> tuple[int, int]:
        """One load read: (free slots less those held here, how many of those held here
        reserved while the read travelled and may be in its counts too)."""
        if not replicas:  # the replica set is not known yet: nothing to count slots on
            return 1, 0
        with self._pending_lock:
            t0 = time.monotonic()
            self._reads.append(t0)
        try:
            loads = await self.load.loads(list(replicas))
        finally:
            with self._pending_lock:
                self._reads.remove(t0)
        free = sum(max(self.bound - loads[r].inflight, 0) for r in replicas)
        self._inflight_seen = sum(loads[r].inflight for r in replicas)
        with self._pending_lock:
            # not reserved yet, or reserved after this read began (the read may miss it)
            unsure = sum(1 for t in self._pending.values() if t is not None and t >= t0)
            held = unsure + sum(1 for t in self._pending.values() if t is None)
            self._prune_locked()
            return free - held, unsure

    async def refuse_early(self, replicas: Callable[[], Sequence[str]]) -> None:
        """Under sustained overload (``sustained_overload``), refuse a request that would
        find no free slot before the ingress spends anything on it: the same 429 that
        ``admit`` would give it at once, but before its body is rendered, tokenized and
        hashed. Those steps take the event loop's render turn in arrival order, so under
        overload a request bound for a refusal would otherwise wait behind every admitted
        request's render first. A request that passes is admitted (or refused) by ``admit``
        as before; this costs one more load read, and only while the overload holds.

        Raises:
            OpenAIError: 429 with ``Retry-After`` (counted as an arrival, reason
                ``sustained_overload``).
        """
        if self.bound is None or not self.sustained_overload():
            return
        if self._queue or await self._room(replicas()) <= 0:
            self._record(self._arrivals, time.monotonic())
            metrics.inc("admission_refused", tags={"reason": "sustained_overload"})
            raise overloaded(None, self.retry_after_s)

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
        room = None
        if not self._queue:
            room = await self._room(replicas())
            if room > 0 and not self._queue:
                self._granted(request_id, time.monotonic())
                return 0.0
        if self.sustained_overload():  # the excess is refused either way: at once
            metrics.inc("admission_refused", tags={"reason": "sustained_overload"})
            raise overloaded(None, self.retry_after_s)
        standing = not self._queue_empty_within(self.timeout_s)
        timeout = self.overloaded_timeout_s if standing else self.timeout_s
        ahead = sum(1 for e in self._queue if e[0] <= priority and not e[2].done())
        # slots that must free before this request's: those of the requests ahead, and
        # those admitted here but not yet counted in the shared load (room below 0)
        needed = ahead + 1 + (max(-room, 0) if room is not None else 0)
        likely = self.slot_probability(needed, timeout)
        if likely is not None:
            hopeless = likely < self.QUEUE_CONFIDENCE
        else:
            rate = self.drain_rate()
            hopeless = rate is not None and needed / rate > self.timeout_s
        if hopeless:
            metrics.inc("admission_refused", tags={"reason": "overloaded"})
            raise overloaded(self.timeout_s, self.retry_after_s)  # it would time out anyway
        loop = asyncio.get_running_loop()
        turn: asyncio.Future = loop.create_future()
        entry = (priority, next(self._seq), turn, request_id)
        heapq.heappush(self._queue, entry)
        metrics.set_gauge("admission_waiting", len(self._queue))
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
            self._holds.pop(request_id, None)
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
        metrics.set_gauge("admission_waiting", len(self._queue))

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
                    self._granted(head[3], time.monotonic())
                    head[2].set_result(True)
                    if not self._queue:
                        self._last_empty = time.monotonic()
            except Exception as exc:  # noqa: BLE001 - the load tracker falls back itself
                logger.warning("admission could not read the load: %s", exc)
                room = 0
            if room > 0:
                metrics.set_gauge("admission_waiting", len(self._queue))
                continue
            self._wake.clear()
            try:
                async with asyncio.timeout(self.poll_s):
                    await self._wake.wait()
            except TimeoutError:
                pass


def parse_priority(value: str | None, default: int = 0, header: str = "x-priority") -> int:
    """A request's priority from its header (named ``header``, ``Settings.priority_header``):
    an integer (lower first); ``default`` when absent.

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
        raise OpenAIError(400, f"priority must be an integer from {-(2 ** 31) + 1} to "
                               f"{2 ** 31 - 1} (lower is served first), not {value[:40]!r}",
                          "BadRequestError", header)
    return p
