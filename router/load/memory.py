"""Load reservations held in this process: the embedded default, and every Redis tracker's
local mirror (what a router knows of its own requests when Redis fails).

Shared by the router loop and the ingress loop of one process: a lock guards it.
"""

from __future__ import annotations

import threading
from typing import Sequence

from router.clock import Clock, SystemClock
from router.load.base import LoadTracker, ReplicaLoad, Reservation, decayed_placements


class MemoryLoadTracker(LoadTracker):
    """Load reservations held in this process (the embedded default)."""

    #: weight of a release in the mean request life: an exponential moving average over
    #: about the last 1,000 releases (as ``RoutingCore.observe_output``'s window)
    LIFE_WEIGHT = 1 / 1000

    def __init__(self, clock: Clock | None = None):
        self.clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._res: dict[str, Reservation] = {}
        self._load: dict[str, ReplicaLoad] = {}
        # mean_request_life_s: the area under the in-flight count (request-seconds) and the
        # releases, both decayed at each release; the time the area is integrated to
        self._area = 0.0
        self._releases = 0.0
        self._area_at: float | None = None
        # request id -> (replica its placement is on, whether a shared store has it too)
        self._placed_by: dict[str, tuple[str, bool]] = {}

    def loads_now(self, replicas: Sequence[str]) -> dict[str, ReplicaLoad]:
        with self._lock:
            out = {}
            for r in replicas:
                load = self._load.get(r) or ReplicaLoad()
                out[r] = ReplicaLoad(load.inflight, load.prefill_tokens, load.last_assigned_s,
                                     load.placements, load.placements_at_s)
            return out

    async def loads(self, replicas: Sequence[str]) -> dict[str, ReplicaLoad]:
        return self.loads_now(replicas)

    def _integrate_locked(self, now: float) -> None:
        """Add the in-flight count's area up to ``now`` (before the count changes)."""
        if self._area_at is not None:
            self._area += len(self._res) * max(now - self._area_at, 0.0)
        self._area_at = now

    def reserve_now(self, request_id: str, replica: str, prefill_tokens: int) -> None:
        now = self.clock.now()
        with self._lock:
            self._integrate_locked(now)
            self._release_locked(request_id)
            load = self._load.setdefault(replica, ReplicaLoad())
            load.inflight += 1
            load.prefill_tokens += prefill_tokens
            load.last_assigned_s = now
            self._res[request_id] = Reservation(replica, prefill_tokens)

    async def reserve(self, request_id: str, replica: str, prefill_tokens: int) -> None:
        self.reserve_now(request_id, replica, prefill_tokens)

    def prefill_done_now(self, request_id: str) -> None:
        with self._lock:
            res = self._res.get(request_id)
            if res is not None and not res.prefill_done:
                res.prefill_done = True
                self._load[res.replica].prefill_tokens -= res.prefill_tokens

    async def prefill_done(self, request_id: str) -> None:
        self.prefill_done_now(request_id)

    def prefill_done_soon(self, request_id: str) -> None:
        self.prefill_done_now(request_id)

    def _release_locked(self, request_id: str) -> None:
        res = self._res.pop(request_id, None)
        if res is None:
            return
        load = self._load.get(res.replica)
        if load is None:
            return
        load.inflight -= 1
        if not res.prefill_done:
            load.prefill_tokens -= res.prefill_tokens

    def reservation(self, request_id: str) -> Reservation | None:
        """A copy of ``request_id``'s reservation, or None."""
        with self._lock:
            res = self._res.get(request_id)
            return None if res is None else Reservation(res.replica, res.prefill_tokens,
                                                        res.prefill_done)

    def release_now(self, request_id: str) -> None:
        now = self.clock.now()
        with self._lock:
            self._integrate_locked(now)
            if request_id in self._res:  # one release more, the window moves on
                keep = 1 - self.LIFE_WEIGHT
                self._area *= keep
                self._releases = self._releases * keep + 1
            self._release_locked(request_id)
            self._placed_by.pop(request_id, None)

    async def release(self, request_id: str) -> None:
        self.release_now(request_id)

    def placed_now(self, replica: str, window_s: float, request_id: str | None = None,
                   delta: float = 1.0, shared: bool = True) -> None:
        """``placed`` (``delta`` -1: ``unplaced``), at once; ``shared``: recorded with the
        request's placement (``placement_of``) for a tracker that mirrors a shared one."""
        now = self.clock.now()
        with self._lock:
            load = self._load.setdefault(replica, ReplicaLoad())
            load.placements = max(decayed_placements(load, now, window_s) + delta, 0.0)
            load.placements_at_s = now
            if request_id is not None:
                self._placed_by[request_id] = (replica, shared)

    async def placed(self, replica: str, window_s: float,
                     request_id: str | None = None, local_only: bool = False) -> None:
        self.placed_now(replica, window_s, request_id)

    async def unplaced(self, replica: str, window_s: float, mirror: bool = True,
                       local_only: bool = False) -> None:
        self.placed_now(replica, window_s, delta=-1.0)

    def placement_of(self, request_id: str) -> tuple[str, bool] | None:
        with self._lock:
            return self._placed_by.get(request_id)

    def _forget_placement(self, request_id: str) -> None:
        with self._lock:
            self._placed_by.pop(request_id, None)

    def mean_request_life_s(self) -> float:
        """The mean request life (s) by Little's law, ``W = L / lambda``: the area under
        the in-flight count (request-seconds) over the releases in the same window, both
        decayed by ``1 - LIFE_WEIGHT`` at each release (about the last 1,000). The
        requests still in flight count with the time they have been in flight, so before
        the first release it is the request-seconds so far (as if one had ended), not 0;
        0 before any reservation."""
        now = self.clock.now()
        with self._lock:
            area = self._area
            if self._area_at is not None:
                area += len(self._res) * max(now - self._area_at, 0.0)
            return area / max(self._releases, 1.0)

    async def remove_replica(self, replica: str) -> None:
        with self._lock:
            self._integrate_locked(self.clock.now())
            for rid in [k for k, v in self._res.items() if v.replica == replica]:
                del self._res[rid]
            # placements on it are gone with it: a later move must not write it back
            for rid in [k for k, (r, _) in self._placed_by.items() if r == replica]:
                del self._placed_by[rid]
            self._load.pop(replica, None)

    def total_inflight(self) -> int:
        with self._lock:
            return sum(v.inflight for v in self._load.values())
