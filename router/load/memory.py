"""Load reservations held in this process: the embedded default, and every Redis tracker's
local mirror (what a router knows of its own requests when Redis fails).

Shared by the router loop and the ingress loop of one process: a lock guards it.
"""

from __future__ import annotations

import threading
from typing import Sequence

from router.clock import Clock, SystemClock
from router.load.base import LoadTracker, ReplicaLoad, Reservation


class MemoryLoadTracker(LoadTracker):
    """Load reservations held in this process (the embedded default)."""

    def __init__(self, clock: Clock | None = None):
        self.clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._res: dict[str, Reservation] = {}
        self._load: dict[str, ReplicaLoad] = {}

    def loads_now(self, replicas: Sequence[str]) -> dict[str, ReplicaLoad]:
        with self._lock:
            out = {}
            for r in replicas:
                load = self._load.get(r) or ReplicaLoad()
                out[r] = ReplicaLoad(load.inflight, load.prefill_tokens, load.last_assigned_s)
            return out

    async def loads(self, replicas: Sequence[str]) -> dict[str, ReplicaLoad]:
        return self.loads_now(replicas)

    def reserve_now(self, request_id: str, replica: str, prefill_tokens: int) -> None:
        now = self.clock.now()
        with self._lock:
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
        with self._lock:
            self._release_locked(request_id)

    async def release(self, request_id: str) -> None:
        self.release_now(request_id)

    async def remove_replica(self, replica: str) -> None:
        with self._lock:
            for rid in [k for k, v in self._res.items() if v.replica == replica]:
                del self._res[rid]
            self._load.pop(replica, None)

    def total_inflight(self) -> int:
        with self._lock:
            return sum(v.inflight for v in self._load.values())
