"""Per-replica failure memory: a circuit breaker that outlives single requests.

A replica that accepts connections but fails requests would otherwise keep winning on cache
score, and every request would pay a failed attempt before its retry (docs/fault-cases.md 6.2). The
ingress reports each attempt's outcome; after ``failure_threshold`` consecutive failures the
circuit opens and the router gives the replica no traffic for ``open_s``; then it is
half-open: it is a candidate again, and the first request the router actually sends it is
the probe (no other request goes there until the probe's outcome is recorded, or for
``open_s`` if it never is); a success closes the circuit, a failure opens it again.
Considering a half-open replica does not take its probe slot, or a replica the policy passed
over once would stay out forever.
A replica that reports its engine dead (routing stats ``engine_alive: false``) is excluded
without waiting for failures.

One instance per process (``router.serve.state``), shared by the ingress loop and the router loop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from router.clock import Clock, SystemClock


@dataclass
class _Circuit:
    consecutive_failures: int = 0
    open_until: float = 0.0
    probe_until: float = 0.0  # a probe is out (outcome unrecorded) until this time


class ReplicaHealth:
    """Circuit breakers keyed by replica id.

    Args:
        failure_threshold: consecutive failures that open the circuit.
        open_s: how long an open circuit keeps the replica out before a probe, and how long
            a probe whose outcome is never recorded (its client left) blocks the next one.
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
            c.probe_until = 0.0
            if ok:
                c.consecutive_failures = 0
                c.open_until = 0.0
                return
            c.consecutive_failures += 1
            if c.consecutive_failures >= self.failure_threshold:
                c.open_until = self.clock.now() + self.open_s

    def available(self, replica: str) -> bool:
        """Whether ``replica`` may be a candidate now: its circuit is closed, or half-open
        with no probe out. No side effect (see ``routed``)."""
        with self._lock:
            c = self._c.get(replica)
            if c is None or c.consecutive_failures < self.failure_threshold:
                return True
            now = self.clock.now()
            return now >= c.open_until and now >= c.probe_until

    def routed(self, replica: str) -> None:
        """A request was sent to ``replica``; if its circuit is half-open, that request is
        the probe and the replica takes no other until its outcome is recorded."""
        with self._lock:
            c = self._c.get(replica)
            if c is not None and c.consecutive_failures >= self.failure_threshold:
                c.probe_until = self.clock.now() + self.open_s

    def is_open(self, replica: str) -> bool:
        """Whether the replica's circuit is open or half-open (failures at the threshold)."""
        with self._lock:
            c = self._c.get(replica)
            return c is not None and c.consecutive_failures >= self.failure_threshold

    def forget(self, replica: str) -> None:
        """Drop the replica's memory (it left, or its engine restarted)."""
        with self._lock:
            self._c.pop(replica, None)
