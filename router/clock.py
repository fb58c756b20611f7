"""The one clock that every TTL, lease and rate in the router reads.

Production code uses ``SystemClock``; the virtual-time simulator (``loadtest``) and tests
inject a ``ManualClock`` so that predicted-entry TTLs, leases and decays follow simulated
time (docs/architecture.md, decision 2).
"""

from __future__ import annotations

import time
from typing import Protocol


class Clock(Protocol):
    def now(self) -> float:
        """Seconds since an arbitrary epoch (monotonic within one run)."""


class SystemClock:
    """Wall-clock time (``time.time()``), shared by all processes of a deployment so that
    expiry times written to Redis by one router mean the same to another."""

    def now(self) -> float:
        return time.time()


class ManualClock:
    """A clock that moves only when told to (tests, virtual-time simulation)."""

    def __init__(self, start_s: float = 0.0):
        self.t = start_s

    def now(self) -> float:
        return self.t

    def advance(self, dt_s: float) -> None:
        self.t += dt_s
