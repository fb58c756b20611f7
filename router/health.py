"""Per-replica failure memory: a circuit breaker that outlives single requests.

A replica that accepts connections but fails requests would otherwise keep winning on cache
score, and every request would pay a failed attempt before its retry (FAULTS.md 6.2). The
ingress reports each attempt's outcome; after ``failure_threshold`` consecutive failures the
circuit opens and the router gives the replica no traffic for ``open_s``; then it is
half-open: one request may probe it, a success closes the circuit, a failure opens it again.
A replica that reports its engine dead (routing stats ``engine_alive: false``) is excluded
without waiting for failures.

One instance per process (``router.state``), shared by the ingress loop and the router loop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from router.clock import Clock, SystemClock


@dataclass
class _Circuit:
    consecutive_failures: int = 0
    open_until: float = 0.0
    probing: bool = False


class ReplicaHealth:
    """Circuit breakers keyed by replica id.

    Args:
        failure_threshold: consecutive failures that open the circuit.
        open_s: how long an open circuit keeps the replica out before a probe.
    """

    def __init__(self, failure_threshold: int = 3, open_s: float = 10.0,
                 clock: Clock | None = None):
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.clock = clock or SystemClock()
        self._lock = threading.Lock()
        self._c: dict[str, _Circuit] = {}

    def record(self, replica: str, ok: bool) -> None:
        """The outcome of one attempt on ``replica`` (ok: any answer but a 5xx/failure)."""
        with self._lock:
            c = self._c.setdefault(replica, _Circuit())
            c.probing = False
            if ok:
                c.consecutive_failures = 0
                c.open_until = 0.0
                return
            c.consecutive_failures += 1
            if c.consecutive_failures >= self.failure_threshold:
                c.open_until = self.clock.now() + self.open_s

    def available(self, replica: str) -> bool:
        """Whether the router may send ``replica`` a request now. A half-open circuit lets
        exactly one probe through until its outcome is recorded."""
        with self._lock:
            c = self._c.get(replica)
            if c is None or c.consecutive_failures < self.failure_threshold:
                return True
            if self.clock.now() < c.open_until or c.probing:
                return False
            c.probing = True
            return True

    def is_open(self, replica: str) -> bool:
        with self._lock:
            c = self._c.get(replica)
            return c is not None and c.consecutive_failures >= self.failure_threshold

    def forget(self, replica: str) -> None:
        with self._lock:
            self._c.pop(replica, None)
