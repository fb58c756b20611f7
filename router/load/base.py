"""Per-replica load that the routers themselves put on the engines.

A reservation is taken for every dispatched request and released on every exit path (the
ingress releases it in a ``finally``; docs/fault-cases.md 1.2 and 5.1):

* ``inflight``: requests dispatched to the replica and not finished;
* ``prefill_tokens``: uncached prompt tokens of those requests that have not produced a
  first token yet (the prefill work queued ahead of a new request, docs/architecture.md, decision
  4);
* ``last_assigned_s``: when the replica was last given a request: among otherwise equal
  candidates the one that waited longest wins (a rotating tie-break), the signal that
  spreads cold starts when nothing is in flight (docs/fault-cases.md 1.4). A restarted replica gets
  its turn, not a catch-up burst.
* ``placements``: prefixes no replica held that were placed on the replica, a count that
  decays over the routers' mean request life (``decayed_placements``): where the load of
  their later requests will come (docs/architecture.md, "The cost model").

Backends beside this interface: ``memory.py`` (in-process, the default) and ``redis.py``
(shared by every router, with leases that survive a router's death).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Coroutine, Sequence


@dataclass
class ReplicaLoad:
    """Load of one replica: ``inflight`` requests, ``prefill_tokens`` queued for prefill,
    ``last_assigned_s`` time of its last assignment (clock seconds, 0 = never);
    ``placements`` new prefixes placed there, a decaying count as of ``placements_at_s``
    (clock seconds; ``decayed_placements`` gives it at another time)."""

    inflight: int = 0
    prefill_tokens: int = 0
    last_assigned_s: float = 0.0
    placements: float = 0.0
    placements_at_s: float = 0.0


def decayed_placements(load: ReplicaLoad, now_s: float, window_s: float) -> float:
    """``load.placements`` at ``now_s``: ``placements * exp(-(now_s - placements_at_s) /
    window_s)`` (an exponentially decaying count, time constant ``window_s`` seconds;
    ``lua/route.lua`` computes the same in milliseconds). 0 when ``window_s`` is not
    positive."""
    if window_s <= 0 or load.placements <= 0:
        return 0.0
    return load.placements * math.exp(-max(now_s - load.placements_at_s, 0.0) / window_s)


@dataclass
class Reservation:
    replica: str
    prefill_tokens: int
    prefill_done: bool = False


class LoadTracker(ABC):
    """Reservations of load per replica. All methods are coroutines and never block."""

    @abstractmethod
    async def loads(self, replicas: Sequence[str]) -> dict[str, ReplicaLoad]:
        """Current load of each of ``replicas`` (zeros for unknown ones)."""

    @abstractmethod
    async def reserve(self, request_id: str, replica: str, prefill_tokens: int) -> None:
        """Count ``request_id`` on ``replica``; replaces an earlier reservation of the same id."""

    @abstractmethod
    async def prefill_done(self, request_id: str) -> None:
        """The request's first token arrived: its prefill tokens leave the queue."""

    @abstractmethod
    def prefill_done_soon(self, request_id: str) -> None:
        """``prefill_done`` without waiting for it (the relay of the first byte goes on at
        once); a tracker that shares its counts may send them a little later, or not at
        all when the release comes first (it ends the prefill too). Never raises."""

    @abstractmethod
    async def release(self, request_id: str) -> None:
        """The request finished (success, error or disconnect). Idempotent."""

    async def placed(self, replica: str, window_s: float,
                     request_id: str | None = None, local_only: bool = False) -> None:
        """A prefix no replica held was placed on ``replica``: its decaying placement count
        (``ReplicaLoad.placements``, time constant ``window_s`` seconds) grows by one. With
        ``request_id``, the placement is the request's (``placement_moved`` follows it)
        until its ``release``. ``local_only``: in this router's own counts only (a decision
        made while the shared store fails: no call that would wait for it). Never raises:
        a count that could not be written only weakens the spread of new prefixes."""

    async def unplaced(self, replica: str, window_s: float, mirror: bool = True,
                       local_only: bool = False) -> None:
        """One placement less on ``replica`` (its decayed count less one, never below 0): a
        placement counted where its request did not go. ``mirror``: in this router's own
        counts too (false for a count only the shared store has, a late route script's);
        ``local_only``: in those only (a count the shared store never had). Never raises."""

    def placement_of(self, request_id: str) -> tuple[str, bool] | None:
        """Where ``request_id``'s new-prefix placement was counted (``placed`` with its
        id, or a route script's that this router adopted), until its release:
        ``(replica, shared)``, ``shared`` false for a count kept in this router's own counts
        only (``local_only``)."""
        return None

    async def placement_moved(self, request_id: str, replica: str, window_s: float) -> None:
        """``request_id`` went to ``replica``, not where its decision counted its new
        prefix (a session's first turn joining another router's pin, Serve choosing
        another replica): the count follows it, where it was kept (shared, or this
        router's own only). Nothing when it placed none, or there."""
        held = self.placement_of(request_id)
        if held is None or held[0] == replica:
            return
        # forgotten before the first await (retract_placement): a second move of the same
        # request meanwhile finds none to move, not one count taken twice
        await self.retract_placement(request_id, window_s)
        await self.placed(replica, window_s, request_id, local_only=not held[1])

    def retract_placement(self, request_id: str,
                          window_s: float) -> Coroutine[Any, Any, None] | None:
        """``request_id`` is decided again (the retry of a failed first attempt, or Serve
        asking again): the placement its earlier decision counted is forgotten now, so
        that the request counts once, where its new decision puts it, and the returned
        coroutine takes its count back where it was kept (the caller may run it in the
        background: a shared store's call then adds nothing to the decision's time). None
        when it counted none."""
        held = self.placement_of(request_id)
        if held is None:
            return None
        self._forget_placement(request_id)
        return self.unplaced(held[0], window_s, local_only=not held[1])

    def _forget_placement(self, request_id: str) -> None:
        """Drop ``request_id``'s placement record (``placement_of``), counts unchanged."""

    def mean_request_life_s(self) -> float:
        """Mean seconds from reservation to release of this process's requests (about
        the last 1,000, those in flight included; 0 before any): the time constant of
        ``ReplicaLoad.placements``."""
        return 0.0

    async def remove_replica(self, replica: str) -> None:
        """Forget a replica's load (it left the deployment)."""

    async def close(self) -> None:
        pass
