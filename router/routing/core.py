"""One routing decision: index lookup, load, policy, predicted entries and reservation.

``RoutingCore`` is independent of Ray: the Ray ``RequestRouter`` (``router.serve.request_router``)
calls it with the candidate replicas Serve offers, and the virtual-time simulator
(``loadtest``) calls it with simulated replicas, so both run the same code.

A decision never fails because of the index: when the lookup raises ``IndexUnavailable``
(Redis slow or down) the policy sees only this router's own recent decisions
(``RecentDecisions``: a conversation's next turn stays where this router sent the last one)
and otherwise decides by load; the fallback is counted, and the next lookups try again
(docs/architecture.md, decision 7).
"""

from __future__ import annotations

import collections
import dataclasses
import time
from dataclasses import dataclass
from typing import Sequence

from router.config import Settings
from router.hashing import HashSettings
from router.index.base import HeadHeld, IndexBusy, IndexUnavailable, PrefixIndex
from router.load.base import LoadTracker, ReplicaLoad
from router.logs import get_logger
from router.policy import (
    Candidate,
    Decision,
    Policy,
    PrefixAware,
    RouteRequest,
    cached_tokens,
)
from router.policy.base import kv_empty_tokens, kv_free_tokens, new_prefix
from router.routing.recent import RecentDecisions
from router.routing.replica import ReplicaInfo, hash_mismatches

logger = get_logger(__name__)


@dataclass
class RouteInput:
    """One request as routing sees it.

    Attributes:
        request_id: the id its load reservation is kept under.
        prompt_tokens: prompt length (tokens).
        block_hashes: its full blocks' chained hashes, in prompt order.
        cacheable: False for a request whose cached blocks the router cannot know (routed
            by load, and no predicted entries written).
        text / first_user_text: the prompt's characters, for the policies that read them
            (``Policy.uses_text``; only the simulator supplies them).
        session: its session's key (``router.routing.sessions.session_key``), or None.
        head: ``block_hashes`` are those of a long prompt's head, its rest not tokenized
            (``router.serve.protocol.RoutedRequest.rest``; ``prompt_tokens`` is then an
            estimate). A match cannot pass the head unless a candidate holds every block
            of it: then the decision raises ``HeadHeld`` before it reserves or writes
            anything; otherwise the decision on the head's blocks is the decision on all.
    """

    request_id: str
    prompt_tokens: int
    block_hashes: Sequence[int]
    cacheable: bool = True
    text: str = ""
    first_user_text: str = ""
    session: str | None = None
    head: bool = False


class RoutingCore:
    """Decides where each request goes.

    Args:
        settings: router settings (policy knobs, TTLs).
        index: the prefix index (memory or Redis).
        load: the load tracker.
        policy: the routing policy.
        on_index_error: called with the exception and the operation when the index fails
            (metrics hook).
        health: circuit breakers (``router.routing.health.ReplicaHealth``) or None.
        atomic: the one-round-trip decision (``router.routing.atomic.AtomicRoute``) over
            this index and load tracker, where both are in one Redis; None otherwise.
        sessions: the session pins (``router.routing.sessions``), or None (no affinity).
        shadow: the shadow evaluation (``router.routing.shadow.ShadowEvaluator``), or None.
        drains: the replicas an operator drained (``router.routing.drain``), or None.
    """

    def __init__(self, settings: Settings, index: PrefixIndex, load: LoadTracker,
                 policy: Policy, on_index_error=None, health=None, atomic=None,
                 sessions=None, shadow=None, drains=None):
        self.settings = settings
        self.health = health
        self.hash_settings: HashSettings = settings.hash_settings
        self.index = index
        self.load = load
        self.policy = policy
        self.on_index_error = on_index_error
        self.atomic = atomic
        self.sessions = sessions
        self.shadow = shadow
        self.drains = drains
        self._index_available = True
        # what the outage log lines last told (available or not), when the last outage's
        # start was logged (load.clock, s), and the outages not logged since
        self._told_available = True
        self._outage_logged_at: float | None = None
        self._outages_unlogged = 0
        self.recent = RecentDecisions(load.clock)
        self._outputs: collections.deque[int] = collections.deque(maxlen=1000)
        self._outputs_sum = 0
        self._mismatch_logged: set[str] = set()
        self._restarts_seen: dict[str, int] = {}

    def drained(self, replica: ReplicaInfo) -> bool:
        """An operator drained it (``router.routing.drain``)."""
        return self.drains is not None and replica.replica_id in self.drains.current()

    def candidates_of(self, replicas: Sequence[ReplicaInfo]) -> list[ReplicaInfo]:
        """The replicas a decision chooses among: the usable ones that are not drained; the
        usable ones when every one of those is drained (a drain never refuses a request,
        and a live drained replica beats a dead one); all of them when none is usable."""
        usable = [r for r in replicas if self.usable(r)] or list(replicas)
        return [r for r in usable if not self.drained(r)] or usable

    def usable(self, replica: ReplicaInfo) -> bool:
        """Not known dead (its engine reported down, or its circuit is open). A replica
        whose engine was restarted since its failures starts with a closed circuit."""
        if replica.stats.engine_alive is False:
            return False
        if self.health is None:
            return True
        restarts = replica.stats.restarts
        if restarts is not None and restarts != self._restarts_seen.get(replica.replica_id,
                                                                        restarts):
            self.health.forget(replica.replica_id)
        if restarts is not None:
            self._restarts_seen[replica.replica_id] = restarts
        return self.health.available(replica.replica_id)

    def compatible(self, replica: ReplicaInfo) -> bool:
        """Whether the replica's engine hashes blocks as the router does.

        A replica with no metadata yet is assumed compatible (it reports on readiness); one
        whose advertised settings differ is refused loudly: logged once, and never given
        cache-aware traffic (a silent 0 % hit rate otherwise, docs/fault-cases.md 3.2 and 3.3).
        """
        bad = hash_mismatches(self.hash_settings, replica.metadata)
        if bad and replica.replica_id not in self._mismatch_logged:
            self._mismatch_logged.add(replica.replica_id)
            logger.error(
                "replica %s hashes blocks differently from this router (%s): router %s, "
                "replica %s; it is excluded from routing", replica.replica_id, ", ".join(bad),
                self.hash_settings.as_dict(), replica.metadata.hash_settings)
        return not bad

    async def decide(self, request_id: str, prompt_tokens: int, block_hashes: Sequence[int],
                     replicas: Sequence[ReplicaInfo], cacheable: bool = True,
                     policy: Policy | None = None,
                     text: str = "", first_user_text: str = "",
                     session: str | None = None, adapter: str | None = None,
                     head: bool = False) -> Decision:
        """Choose a replica among ``replicas`` (non-empty) and reserve its load.

        Replicas known dead are left out, and so are those that hash blocks differently
        (unless none other remains). With Redis and ``prefix_aware``, the decision is one
        script (``atomic``); otherwise the index is looked up and the policy chooses here.
        When the index fails, the decision is a fallback: the policy sees this router's
        recent decisions only (``RecentDecisions``) and no predicted entries are written.
        A route script that missed the deadline may still run: once it answers, what it
        did that the request did not follow is undone in the background
        (``_settle_late``), whether or not this decision completed. A request decided
        before (the retry of a failed attempt, Serve asking again) has the new-prefix
        placement its earlier decision counted taken back first
        (``LoadTracker.retract_placement``).

        A request of a session (``session``: its ``router.routing.sessions.session_key``)
        goes to the replica its session is pinned to while that replica is usable and not
        overloaded (``reason`` ``session``); otherwise it is decided as any other and its
        session is pinned to the choice (first turn) or moved there (the pin yielded).

        A request for a LoRA adapter (``adapter``) is decided among the replicas that load
        it (``ReplicaMetadata.lora_adapters``), all of them when none does (the engine then
        gives its own 404).

        Args:
            policy: overrides the core's policy for this decision.
            text / first_user_text: the prompt's characters, for the anchors' policies.
            session: the request's session key, or None.
            adapter: the LoRA adapter's name, or None (the base model).
            head: ``block_hashes`` are a long prompt's head (``RouteInput.head``).
        A sampled cache-aware decision that its policy made (not a pin, not a fallback) is
        also evaluated by the shadow policies (``router.routing.shadow``); its
        ``Decision.shadow`` holds their choices.

        Returns:
            The policy's ``Decision``; ``reason`` is ``fallback`` when the index failed,
            ``session`` when the session's pin decided.
        Raises:
            HeadHeld: with ``head``, a candidate (the session's replica, for a kept pin)
                holds every block given, as the index answered; nothing was reserved or
                written.
        """
        inp = RouteInput(request_id, prompt_tokens, block_hashes, cacheable, text,
                         first_user_text, session, head)
        late: list = []  # the LateRoute of a route script that missed the deadline
        decision = None
        # decided before (a retry, Serve asking again): its earlier new-prefix count goes
        undo = self.load.retract_placement(request_id, self.load.mean_request_life_s())
        if undo is not None:
            _background(undo)
        try:
            decision = await self._decide(inp, replicas, policy or self.policy, adapter, late)
            return decision
        finally:  # also when the decision failed or was cancelled: the script may have run
            if late:
                routed = decision and next((r for r in replicas
                                            if r.replica_id == decision.replica), None)
                _background(self._settle_late(late[0], routed))

    async def _decide(self, inp: RouteInput, replicas: Sequence[ReplicaInfo], policy: Policy,
                      adapter: str | None, late: list) -> Decision:
        """``decide``'s work; a ``LateRoute`` of its script goes to ``late``."""
        block_hashes, session = inp.block_hashes, inp.session
        _, pool, cache_aware = await self._pool(replicas, block_hashes, inp.cacheable, adapter)
        decision = None
        index_failed = False
        pinned, outcome = None, None
        # a sampled decision's (request, candidates, seconds spent, live policy's copy)
        observed: list | None = None
        if self.shadow is not None and cache_aware and self.shadow.sampled():
            observed = []
        if session and self.sessions is not None:
            pinned, outcome = await self._session_pin(session, pool)
            if outcome == "kept":
                decision = await self._decide_pinned(inp, pool, pinned, cache_aware)
        # the one-script decision also for a prompt with nothing to look up (shorter than a
        # block, or not cacheable): decided by load alone, but serialised with every other
        # router's decisions, so a burst of them does not pile onto the replica that looked
        # least loaded to all at once
        if decision is None and self.atomic is not None and self.atomic.supports(policy):
            try:
                decision = await self._decide_atomic(
                    inp if cache_aware else dataclasses.replace(inp, block_hashes=[]),
                    pool, policy, observed)
            except IndexUnavailable as exc:
                self._index_error(exc, "route")
                index_failed = True
                from router.routing.atomic import LateRoute
                if isinstance(exc, LateRoute):
                    late.append(exc)
        if decision is None:
            decision = await self._decide_here(inp, pool, policy, cache_aware, index_failed,
                                               observed)
        if observed and decision.reason in ("cache", "load"):
            self._shadow(decision, *observed[0])
        if session and self.sessions is not None and outcome != "kept":
            decision, outcome = await self._pin_session(inp, pool, session, decision, outcome,
                                                        cache_aware)
        if outcome is not None:
            from router import metrics
            metrics.inc("sessions", tags={"outcome": outcome})
        if cache_aware:
            self.recent.record(decision.replica, block_hashes, self.settings.predicted_ttl_s)
        if self.health is not None:
            self.health.routed(decision.replica)  # a half-open replica's probe
        return decision

    async def _settle_late(self, late, routed: ReplicaInfo | None) -> None:
        """Undo what a route script that answered late (``router.routing.atomic.
        LateRoute``) did that its request did not follow (``AtomicRoute.settle``): left as
        they were, its predicted entries sent a conversation's next turn to a replica that
        never saw the conversation. ``routed``: where the request went (None: nowhere).
        Counted in ``router_late_routes_total`` by outcome (``settle``'s, or ``failed``
        when a correction's call failed)."""
        from router import metrics

        try:
            outcome = await self.atomic.settle(
                late, routed and routed.replica_id,
                self.predicted_ttl_s(routed) if routed else 0.0)
        except IndexUnavailable as exc:
            logger.warning("a late route's correction failed: %s", exc)
            outcome = "failed"
        metrics.inc("late_routes", tags={"outcome": outcome})

    async def _pool(self, replicas: Sequence[ReplicaInfo], block_hashes: Sequence[int],
                    cacheable: bool, adapter: str | None
                    ) -> tuple[list[ReplicaInfo], list[ReplicaInfo], bool]:
        """What a decision (``decide``, ``explain``) chooses among.

        Returns:
            ``(replicas, pool, cache_aware)``: the replicas that load ``adapter`` (all of
            them when none does, or for the base model); the pool, those of them that are
            candidates (``candidates_of``, the drained set read at most once a second) and
            hash blocks as the router does (all candidates when none does); and whether the
            index is consulted (blocks to look up, a cacheable prompt, a compatible pool).
        """
        if self.drains is not None:
            await self.drains.refresh()  # at most one read a second
        if adapter is not None:
            replicas = [r for r in replicas if adapter in r.metadata.lora_adapters] \
                or list(replicas)
        usable = self.candidates_of(replicas)
        compatible = [r for r in usable if self.compatible(r)]
        cache_aware = bool(block_hashes) and cacheable and bool(compatible)
        return list(replicas), compatible or usable, cache_aware

    async def _session_pin(self, session: str, pool: Sequence[ReplicaInfo]
                           ) -> tuple[str | None, str | None]:
        """The replica ``session`` is pinned to and what becomes of the pin: ``kept`` (the
        replica is usable and not overloaded), ``new`` (no pin yet), ``yielded_dead`` (the
        replica left or is down), ``yielded_overloaded``, or ``unavailable`` (the store
        failed: the request is decided as one without a session)."""
        try:
            pinned = await self.sessions.get(session)
        except IndexUnavailable as exc:
            self._index_error(exc, "session")
            return None, "unavailable"
        if pinned is None:
            return None, "new"
        if not any(r.replica_id == pinned for r in pool):
            return pinned, "yielded_dead"
        if await self._overloaded(pinned, pool):
            return pinned, "yielded_overloaded"
        return pinned, "kept"

    async def _overloaded(self, replica: str, pool: Sequence[ReplicaInfo]) -> bool:
        """Whether a session's replica is too busy to keep it: at the admission bound
        (``max_inflight_per_replica``), or with more than ``session_overload_factor``
        times the pool's mean requests in flight (plus one) while another has fewer."""
        ids = [r.replica_id for r in pool]
        if len(ids) < 2:
            return False
        loads = await self.load.loads(ids)
        mine = loads[replica].inflight
        bound = self.settings.max_inflight_per_replica
        if bound is not None and mine >= bound:
            return True
        mean = sum(v.inflight for v in loads.values()) / len(ids)
        least = min(v.inflight for v in loads.values())
        return mine > self.settings.session_overload_factor * mean + 1 and least < mine

    async def _decide_pinned(self, inp: RouteInput, pool: Sequence[ReplicaInfo], replica: str,
                             cache_aware: bool) -> Decision:
        """The session's replica serves the request: its match (for the prediction), the
        reservation, the predicted entries, and the pin's TTL refreshed."""
        matched = 0
        if cache_aware:
            try:
                matched = (await self.index.lookup(inp.block_hashes, [replica]))[replica]
            except IndexUnavailable as exc:
                self._index_error(exc, "lookup")
                matched = self.recent.lookup(inp.block_hashes, [replica])[replica]
            else:
                if inp.head and matched >= len(inp.block_hashes):
                    raise HeadHeld({replica: matched})
        bs = self.hash_settings.block_size
        predicted = {replica: cached_tokens(matched, inp.prompt_tokens, bs)}
        await self.load.reserve(inp.request_id, replica,
                                max(inp.prompt_tokens - predicted[replica], 0))
        info = next(r for r in pool if r.replica_id == replica)
        if cache_aware:
            await self.record(replica, inp.block_hashes, self.predicted_ttl_s(info))
        try:
            await self.sessions.pin(inp.session, replica, self.settings.session_ttl_s)
        except IndexUnavailable as exc:
            self._index_error(exc, "session")
        rest = [r.replica_id for r in pool if r.replica_id != replica]
        return Decision([replica] + rest, "session", predicted)

    async def _pin_session(self, inp: RouteInput, pool: Sequence[ReplicaInfo], session: str,
                           decision: Decision, outcome: str | None,
                           cache_aware: bool) -> tuple[Decision, str | None]:
        """After a decision without the pin: pin the session to the choice. A first turn
        pins only if no other router pinned it meanwhile (``pin_first``); if one did, the
        request moves to that replica (``joined``), so concurrent first turns meet."""
        ttl = self.settings.session_ttl_s
        try:
            if outcome == "new":
                winner = await self.sessions.pin_first(session, decision.replica, ttl)
                info = next((r for r in pool if r.replica_id == winner), None)
                if winner != decision.replica and info is not None:
                    predicted = dict(decision.predicted_cached_tokens)
                    await self.load.reserve(inp.request_id, winner, max(
                        inp.prompt_tokens - predicted.get(winner, 0), 0))
                    await self.load.placement_moved(inp.request_id, winner,
                                                    self.load.mean_request_life_s())
                    if cache_aware:
                        await self.record(winner, inp.block_hashes, self.predicted_ttl_s(info))
                    rest = [r for r in decision.ranked if r != winner]
                    return Decision([winner] + rest, "session", predicted), "joined"
                if winner != decision.replica:  # pinned to a replica that is gone
                    await self.sessions.pin(session, decision.replica, ttl)
            elif outcome is not None and outcome.startswith("yielded"):
                await self.sessions.pin(session, decision.replica, ttl)
        except IndexUnavailable as exc:
            self._index_error(exc, "session")
            return decision, "unavailable"
        return decision, outcome

    async def _decide_here(self, inp: RouteInput, pool: Sequence[ReplicaInfo], policy: Policy,
                           cache_aware: bool, index_failed: bool,
                           observed: list | None = None) -> Decision:
        """The policy chooses in this process: index lookup (or this router's recent
        decisions when the index failed), loads, choice, reservation, predicted entries.
        ``observed`` (a list) receives the (request, candidates, seconds, copy of the
        policy just before it chose) of a sampled decision."""
        ids = [r.replica_id for r in pool]
        use_index = cache_aware and policy.uses_index
        matched: dict[str, int] = {}
        if use_index and not index_failed:
            try:
                matched = await self.index.lookup(inp.block_hashes, ids)
                self.index_available = True
            except IndexUnavailable as exc:
                index_failed = True
                self._index_error(exc, "lookup")
            else:
                if inp.head and max(matched.values(), default=0) >= len(inp.block_hashes):
                    raise HeadHeld(matched)
        if use_index and index_failed:
            matched = self.recent.lookup(inp.block_hashes, ids)
        loads = await self.load.loads(ids)
        candidates = self._candidates(pool, matched, loads)
        req = self._route_request(inp, pool, index_read=use_index)
        if observed is not None:  # the copy right before the policy draws or counts
            t0 = time.perf_counter()
            live_copy = self.shadow.snapshot(policy)
            observed.append((req, candidates, time.perf_counter() - t0, live_copy))
        decision = policy.choose(req, candidates)
        policy.on_routed(req, decision.replica, self.load.clock.now())
        if index_failed:
            decision.reason = "fallback"
        chosen = decision.replica
        uncached = max(inp.prompt_tokens - decision.predicted_cached_tokens.get(chosen, 0), 0)
        await self.load.reserve(inp.request_id, chosen, uncached)
        # a fallback decision counts too, in this router's own counts (those it read; no
        # call that would wait for a failing store): its policy weighed the new-prefix term
        if policy.counts_placements and new_prefix(req, candidates):
            await self.load.placed(chosen, req.placement_window_s, inp.request_id,
                                   local_only=index_failed)
        if cache_aware and not index_failed:
            chosen_info = next(r for r in pool if r.replica_id == chosen)
            await self.record(chosen, inp.block_hashes, self.predicted_ttl_s(chosen_info))
        return decision

    def _shadow(self, decision: Decision, req: RouteRequest, candidates: list[Candidate],
                spent_s: float, live_copy: Policy) -> None:
        """Evaluate the shadow policies on a sampled decision (``router.routing.shadow``).
        Never fails the decision: an error is logged and counted, and the decision stands."""
        from router import metrics
        t0 = time.perf_counter()
        try:
            decision.shadow = self.shadow.evaluate(req, candidates, decision, live_copy)
        except Exception:  # noqa: BLE001 - an optional view must not cost the request
            logger.exception("shadow evaluation failed; the decision stands")
            metrics.inc("index_errors", tags={"op": "shadow"})
        metrics.inc("shadow_seconds", spent_s + time.perf_counter() - t0)

    async def explain(self, prompt_tokens: int, block_hashes: Sequence[int],
                      replicas: Sequence[ReplicaInfo], policy: Policy | None = None,
                      cacheable: bool = True, text: str = "",
                      first_user_text: str = "", adapter: str | None = None) -> dict:
        """What a decision of this request would see and choose now, with nothing reserved
        or written: the operator's "why did it go there" (``POST /admin/explain``).

        The policy decides on a copy of itself (its counters and random draws are left as
        they are), over the index's match and the loads read now; an atomic Redis decision
        runs the same rule in its script (checked against Python in tests), with its own
        tie-break draw. A LoRA ``adapter`` narrows the candidates as in ``decide``; a
        session's pin is not applied (the answer is the decision without it).

        Returns:
            ``{"policy", "choice", "reason", "prompt_tokens", "blocks", "candidates": [{
            "replica", "usable", "drained", "candidate", "compatible", "matched_blocks",
            "predicted_cached_tokens", "inflight", "prefill_tokens_queued",
            "kv_free_tokens" (the engine's free KV, tokens; None: unknown),
            "kv_empty_tokens" (its KV that holds no block, tokens; None: unknown),
            "expected_ttft_s", "cost_s" (prefix_aware only)}]}``, candidates best first.
        Raises:
            IndexUnavailable: the index or the load could not be read.
        """
        import copy

        policy = policy or self.policy
        replicas, pool, cache_aware = await self._pool(replicas, block_hashes, cacheable,
                                                       adapter)
        ids = [r.replica_id for r in pool]
        matched = await self.index.lookup(block_hashes, ids) \
            if cache_aware and policy.uses_index else {}
        loads = await self.load.loads(ids)
        inp = RouteInput("explain", prompt_tokens, block_hashes, cacheable, text,
                         first_user_text)
        req = self._route_request(inp, pool, index_read=cache_aware and policy.uses_index)
        candidates = self._candidates(pool, matched, loads)
        decision = copy.deepcopy(policy).choose(req, candidates)
        cost = getattr(policy, "cost_s", None)
        expected = policy.expected_inflight(req, candidates) if cost is not None else {}
        by_id = {c.replica: c for c in candidates}
        drained = self.drains.current() if self.drains is not None else frozenset()
        rows = []
        for rid in decision.ranked + [r.replica_id for r in replicas
                                      if r.replica_id not in decision.ranked]:
            c = by_id.get(rid)
            info = next(r for r in replicas if r.replica_id == rid)
            row = {"replica": rid, "usable": self.usable(info), "drained": rid in drained,
                   "candidate": c is not None,
                   "compatible": self.compatible(info),
                   "matched_blocks": c.matched_blocks if c else None,
                   "predicted_cached_tokens": decision.predicted_cached_tokens.get(rid),
                   "inflight": c.load.inflight if c else None,
                   "prefill_tokens_queued": c.load.prefill_tokens if c else None,
                   "kv_free_tokens": c.kv_free_tokens if c else None,
                   "kv_empty_tokens": c.kv_empty_tokens if c else None,
                   "expected_ttft_s": decision.expected_ttft_s.get(rid)}
            if cost is not None and c is not None:
                row["cost_s"] = cost(req, c, expected.get(rid))
            rows.append(row)
        return {"policy": policy.name, "choice": decision.replica, "reason": decision.reason,
                "prompt_tokens": prompt_tokens, "blocks": len(block_hashes),
                "candidates": rows}

    def _candidates(self, pool: Sequence[ReplicaInfo], matched: dict[str, int],
                    loads: dict[str, ReplicaLoad]) -> list[Candidate]:
        """What the policy sees of each replica of ``pool``: its match (blocks), its load,
        the fleet's prefill rate and the engine's reported state."""
        rate = self.fleet_prefill_rate(pool)
        return [Candidate(replica=r.replica_id, matched_blocks=matched.get(r.replica_id, 0),
                          load=loads[r.replica_id], prefill_tokens_per_s=rate,
                          decode_step_s_per_seq=self.settings.decode_step_s,
                          kv_usage_frac=r.stats.kv_usage_frac,
                          kv_capacity_tokens=r.stats.kv_capacity_tokens, waiting=r.stats.waiting,
                          active_blocks=r.stats.active_blocks,
                          kv_cached_tokens=r.stats.kv_cached_tokens)
                for r in pool]

    def observe_output(self, output_tokens: int) -> None:
        """A request routed here finished with ``output_tokens`` tokens: the mean of the
        last 1,000 is the policy's expected output length (``expected_output_tokens``)."""
        if len(self._outputs) == self._outputs.maxlen:
            self._outputs_sum -= self._outputs[0]
        self._outputs.append(output_tokens)
        self._outputs_sum += output_tokens

    MIN_FINISHED = 20  # finished requests before the engines' ratio is trusted

    def expected_output_tokens(self, pool: Sequence[ReplicaInfo] = ()) -> float:
        """The expected output length of a request (tokens): output tokens over finished
        requests summed over the pool's engines (``RoutingStats.output_tokens_total /
        requests_finished_total``) once they have finished ``MIN_FINISHED`` (a fresh
        engine's only finished request is the 1-token hash probe, and the tokens of the
        requests still decoding count above the line, not below it), else the mean of this
        core's last 1,000 completions (``observe_output``: the simulator), else 0."""
        tokens = sum(r.stats.output_tokens_total for r in pool)
        finished = sum(r.stats.requests_finished_total for r in pool)
        if finished >= self.MIN_FINISHED:
            return tokens / finished
        return self._outputs_sum / len(self._outputs) if self._outputs else 0.0

    def _route_request(self, inp: RouteInput, pool: Sequence[ReplicaInfo] = (),
                       index_read: bool = True) -> RouteRequest:
        """What the policy sees of ``inp``. A decision made without reading the index
        (``index_read`` false: no compatible replica, or a policy that does not use it)
        knows no prefix to be new, so its request is not cacheable for the new-prefix
        term (``router.policy.base.new_prefix``)."""
        return RouteRequest(prompt_tokens=inp.prompt_tokens,
                            block_size=self.hash_settings.block_size,
                            num_blocks=len(inp.block_hashes),
                            cacheable=inp.cacheable and index_read,
                            text=inp.text, first_user_text=inp.first_user_text,
                            expected_output_tokens=self.expected_output_tokens(pool),
                            placement_window_s=self.load.mean_request_life_s(),
                            now_s=self.load.clock.now())

    async def _decide_atomic(self, inp: RouteInput, pool: Sequence[ReplicaInfo],
                             policy: PrefixAware, observed: list | None = None) -> Decision:
        """The prefix_aware decision as one Redis script: several routers are serialised,
        so a burst does not pile onto one replica (``router.routing.atomic``). For a
        sampled decision (``observed``, a list) the loads are read just before the script,
        and (request, candidates, seconds of that read, copy of the policy just before it
        draws its tie-break) go to ``observed``."""
        ids = [r.replica_id for r in pool]
        bs = self.hash_settings.block_size
        before = live_copy = None
        if observed is not None:
            t0 = time.perf_counter()
            before = await self.load.loads(ids)
            live_copy = self.shadow.snapshot(policy)  # right before the draw below
            read_s = time.perf_counter() - t0
        chosen, matched = await self.atomic.route(
            inp.request_id, inp.prompt_tokens, inp.block_hashes, ids,
            [self.predicted_ttl_s(r) for r in pool], block_size=bs,
            prefill_rate=self.fleet_prefill_rate(pool), work_weight=policy.work_weight,
            decode_step_s_per_seq=self.settings.decode_step_s,
            step_token_budget=policy.step_token_budget, tie_abs_s=policy.tie_abs_s,
            tie_rel=policy.tie_rel, u=policy.rng.random(), load_factor=policy.load_factor,
            max_inflight=policy.max_inflight, running_weight=policy.running_weight,
            interference=policy.interference,
            expected_output_tokens=self.expected_output_tokens(pool),
            placement_window_s=self.load.mean_request_life_s(),
            kv_pressure=policy.kv_pressure,
            kv_free_tokens=[kv_free_tokens(r.stats.kv_capacity_tokens, r.stats.kv_usage_frac)
                            for r in pool], eviction=policy.eviction,
            kv_empty_tokens=[kv_empty_tokens(r.stats.kv_capacity_tokens,
                                             r.stats.kv_cached_tokens) for r in pool],
            head=inp.head)
        self.index_available = True
        if before is not None:
            observed.append((self._route_request(inp, pool),
                             self._candidates(pool, matched, before), read_s, live_copy))
        predicted = {r: cached_tokens(m, inp.prompt_tokens, bs) for r, m in matched.items()}
        rest = sorted((r for r in ids if r != chosen), key=lambda r: -predicted[r])
        return Decision([chosen] + rest, "cache" if predicted[chosen] > 0 else "load",
                        predicted)

    def predicted_ttl_s(self, replica: ReplicaInfo) -> float:
        """Short TTL while the replica's KV events flow (exact entries take over), the long
        one when its engine publishes none (approximate mode, docs/fault-cases.md 8.2)."""
        if replica.stats.kv_events_live is False:
            return self.settings.predicted_ttl_s
        return self.settings.predicted_ttl_with_events_s

    def fleet_prefill_rate(self, replicas: Sequence[ReplicaInfo]) -> float:
        """Prefill rate (tokens/s) used for every candidate: the median of the replicas'
        measured rates, or ``Settings.prefill_tokens_per_s`` before any measurement.

        One rate for the fleet (replicas of one deployment run one model on one kind of
        hardware): a per-replica rate would be unmeasured on a replica that has had no
        traffic yet, and noise between equal engines would decide cold starts instead of
        load (a replica measured once as faster would take every cold start).
        """
        rates = sorted(float(r.stats.prefill_tokens_per_s) for r in replicas
                       if r.stats.prefill_rate_measured and r.stats.prefill_tokens_per_s)
        if not rates:
            return self.settings.prefill_tokens_per_s
        return rates[len(rates) // 2]

    async def record(self, replica: str, block_hashes: Sequence[int], ttl_s: float) -> None:
        """Write predicted entries for ``replica``; an index failure is counted, not raised."""
        try:
            await self.index.record_predicted(replica, block_hashes, ttl_s)
        except IndexUnavailable as exc:
            self._index_error(exc, "record")

    async def moved(self, request_id: str, replica: ReplicaInfo, prompt_tokens: int,
                    block_hashes: Sequence[int], predicted_cached_tokens: int) -> None:
        """Serve sent the request to ``replica``, not the router's choice: move its
        reservation, its new-prefix placement if it counted one, and its predicted entries
        there."""
        if self.health is not None:
            self.health.routed(replica.replica_id)
        await self.load.reserve(request_id, replica.replica_id,
                                max(prompt_tokens - predicted_cached_tokens, 0))
        await self.load.placement_moved(request_id, replica.replica_id,
                                        self.load.mean_request_life_s())
        if block_hashes:
            self.recent.record(replica.replica_id, block_hashes, self.settings.predicted_ttl_s)
            await self.record(replica.replica_id, block_hashes, self.predicted_ttl_s(replica))

    async def remove_replica(self, replica: str) -> None:
        """Purge a replica that left the deployment from the index (leaving its tombstone)
        and from everything ``forget_replica`` clears."""
        try:
            await self.index.remove_replica(replica)
        except IndexUnavailable as exc:
            self._index_error(exc, "remove_replica")
        await self.forget_replica(replica)

    async def forget_replica(self, replica: str) -> None:
        """Drop a replica that left from the load tracker, this router's recent decisions,
        the drained set and the circuit breakers (its index entries are the caller's)."""
        await self.load.remove_replica(replica)
        self.recent.remove_replica(replica)
        if self.drains is not None:
            await self.drains.forget(replica)
        if self.health is not None:
            self.health.forget(replica)

    #: At most one outage's start is logged per this many seconds (a Redis that flaps, its
    #: calls failing and succeeding by turns, would log a pair of lines per request).
    OUTAGE_LOG_INTERVAL_S = 10.0

    async def probe_index(self) -> None:
        """Read the index's size now (``PrefixIndex.stats``: one cheap read) and export it:
        ``router_index_entries``, and ``router_index_available`` (1 when it answered, 0
        when not). The routers' periodic loops call it, so that an idle router's
        ``router_index_available`` follows Redis too: set only by the decisions, it kept
        the last one's value however long the router was idle (a review)."""
        from router import metrics

        try:
            stats = await self.index.stats()
        except IndexUnavailable:
            metrics.set_gauge("index_available", 0)
            return
        metrics.set_gauge("index_available", 1)
        metrics.set_gauge("index_entries", stats.entries)

    @property
    def index_available(self) -> bool:
        """Whether the last index call succeeded. An outage logs a warning at its start
        and one at its end, so that an operator sees both ends; on an index that flaps,
        the starts of outages within ``OUTAGE_LOG_INTERVAL_S`` of the last one logged are
        counted instead (their ends are not logged either), and the next start logged
        says how many there were; one still going on when the interval is over is
        logged at its next failure. ``router_index_available`` and
        ``router_index_errors_total`` show every one."""
        return self._index_available

    @index_available.setter
    def index_available(self, value: bool) -> None:
        if value and not self._told_available:
            logger.warning("prefix index available again: routing with it")
            self._told_available = True
        self._index_available = value

    def _index_error(self, exc: Exception, op: str) -> None:
        if isinstance(exc, IndexBusy):  # not sent: Redis is slow, not gone (no flip, no log)
            from router import metrics
            metrics.inc("index_shed", tags={"op": op})
            return
        if self._told_available:
            now = self.load.clock.now()
            if (self._outage_logged_at is None
                    or now - self._outage_logged_at >= self.OUTAGE_LOG_INTERVAL_S):
                # an outage counted at its start as not logged, and logged now that it
                # outlasted the interval, is not one of those not logged
                unlogged = self._outages_unlogged - (0 if self._index_available else 1)
                more = (f"; {unlogged} shorter outages since the last line were not logged"
                        if unlogged > 0 else "")
                logger.warning("prefix index unavailable (%s): routing by load until it "
                               "returns%s", exc, more)
                self._told_available = False
                self._outage_logged_at, self._outages_unlogged = now, 0
            elif self.index_available:
                self._outages_unlogged += 1
        self.index_available = False
        if self.on_index_error:
            self.on_index_error(exc, op)


def replicas_without_kv_events(replicas: Sequence[ReplicaInfo]) -> int:
    """Replicas whose engine should publish KV events and does not (an engine listed
    without an events endpoint is routed on predicted entries by design: not counted);
    ``router_replicas_without_kv_events``."""
    return sum(1 for r in replicas
               if r.stats.kv_events_live is False and r.metadata.kv_events_endpoint)


# tasks that outlive their request (releases, late routes' settlements), still running:
# the event loop keeps only weak references to tasks
_RELEASING: set = set()


def _background(coro):
    """Run ``coro`` in a task of its own, kept in ``_RELEASING`` until it ends (a
    cancellation of the caller cannot stop it half-way); returns the task."""
    import asyncio

    task = asyncio.get_running_loop().create_task(coro)
    _RELEASING.add(task)
    task.add_done_callback(_RELEASING.discard)
    return task


async def finish_releases(timeout_s: float) -> int:
    """Wait up to ``timeout_s`` (s) for this event loop's releases and late settlements
    still running (``_background``), at a router's stop: a lease released here is one
    that other routers need not find and sweep once this router's heartbeat has expired.
    Only this loop's: those of Serve's request router, on its own loop, are not waited for.

    Returns:
        How many were still running when the time was up (they are left running).
    """
    import asyncio

    loop = asyncio.get_running_loop()
    # a copy first: Serve's request router adds to the set from its own loop's thread
    pending = {t for t in list(_RELEASING) if not t.done() and t.get_loop() is loop}
    if not pending:
        return 0
    _, pending = await asyncio.wait(pending, timeout=timeout_s)
    return len(pending)


def release_soon(load: LoadTracker, request_id: str):
    """Release ``request_id``'s reservation in a task of its own, which a cancellation of
    the caller cannot stop half-way; returns the task (await it through
    ``asyncio.shield`` to wait for it)."""
    return _background(load.release(request_id))


def _admission():
    """This process's admission queue (``router.serve.admission``), if an ingress runs here."""
    from router.serve import state

    return state.peek("admission")


async def route_request(core: RoutingCore, req, replicas: Sequence[ReplicaInfo],
                        policy: Policy) -> Decision:
    """Decide one ``RoutedRequest`` (``router.serve.protocol``) among ``replicas`` (non-empty),
    write the decision into it and count it: the one routing step of both data paths (the
    Ray ``RequestRouter`` on Serve's handle path, the ingress itself on the direct path).

    Replicas a failed first attempt used (``req.excluded_replicas``) are left out unless
    no other remains. A long prompt hashed as far as its head (``req.rest``) is decided on
    the head's blocks (``RouteInput.head``), in the same Redis script as any decision; only
    when a candidate holds the whole head (``HeadHeld``) is the rest tokenized
    (``req.rest.finish``) and the request decided again on all its blocks. Either way
    ``req.rest`` is then done (``done``) and cleared, and ``router_long_prompts_total``
    counts how it was tokenized. Sets ``req.routed_replica``, ``predicted_cached_tokens``,
    ``routing_reason`` and, on a first attempt, ``routing_s`` (arrival at the ingress to
    this decision, s). A reservation made for a request whose ingress is already done with
    it (``req.closed``: the client left meanwhile) is released at once.

    Raises:
        Exception: whatever the decision raised (a bug); the caller routes by load then.
            A cancelled decision releases what it may have reserved.
    """
    import asyncio
    import time

    from router import metrics

    pool = [r for r in replicas if r.replica_id not in req.excluded_replicas] or list(replicas)

    def decide(head: bool):
        return core.decide(req.request_id, req.prompt_tokens, req.block_hashes, pool,
                           cacheable=bool(req.block_hashes), policy=policy,
                           session=req.session_key, adapter=req.lora_name, head=head)

    t0 = time.perf_counter()
    rest, req.rest = req.rest, None
    try:
        try:
            decision = await decide(head=rest is not None)
        except HeadHeld:  # a replica may match past the head: the whole prompt decides
            await rest.finish(req)
            decision = await decide(head=False)
            metrics.inc("long_prompts", tags={"tokenized": "whole"})
        else:
            if rest is not None:
                metrics.inc("long_prompts", tags={"tokenized": "head"})
    except BaseException:  # cancelled mid-decision: a reservation may exist; drop it
        release_soon(core.load, req.request_id)
        raise
    if rest is not None:
        rest.done(req)
    if req.closed:  # the ingress is done with it already (client gone)
        await asyncio.shield(release_soon(core.load, req.request_id))
    admission = _admission()
    if admission is not None:  # the reservation now counts in the load: the hold ends
        admission.reserved(req.request_id)
    now = time.perf_counter()
    if decision.reason != "fallback":
        metrics.set_gauge("index_available", 1)
    req.routed_replica = decision.replica
    req.predicted_cached_tokens = dict(decision.predicted_cached_tokens)
    req.routing_reason = decision.reason
    metrics.inc("decisions", tags={"reason": decision.reason, "policy": policy.name})
    metrics.inc("predicted_blocks",
                decision.predicted_cached_tokens.get(decision.replica, 0)
                // core.hash_settings.block_size, tags={"replica": decision.replica})
    metrics.get("decision_time").observe(now - t0, tags={"policy": policy.name})
    if req.t_arrival and not req.excluded_replicas:  # first attempt: arrival to dispatch
        req.routing_s = now - req.t_arrival
        req.timings["decide"] = now - t0
        metrics.get("overhead").observe(req.routing_s, tags={"policy": policy.name})
    return decision
