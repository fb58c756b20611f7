"""The prefix_aware decision in one Redis round trip: match, score, choose, reserve and
predict, atomically (``router/lua/route.lua``).

Several routers deciding at once are serialised by Redis, so a burst does not pile onto
one replica (docs/architecture.md, decision 3). The script's cost rule is
``router.policy.prefix_aware.PrefixAware``'s, line for line; ``tests/test_route_lua.py``
checks that both choose alike.

With shard groups (the Redis Cluster mode, docs/scaling.md) the decision has two levels:
``router.routing.groups.GroupChoice`` picks one group of the candidates in this process,
then the script runs on that group's keys with that group's candidates only: still one
round trip, to one shard, atomic among every router deciding in that group.
"""

from __future__ import annotations

import asyncio
import math
from typing import Iterable, Sequence

from router.index.base import HeadHeld
from router.index.redis import LateCall, RedisPrefixIndex
from router.load.redis import RedisLoadTracker
from router.policy.base import Policy, cached_tokens
from router.policy.prefix_aware import PrefixAware
from router.redis_keys import pack_hashes
from router.routing.groups import GroupChoice


class AtomicRoute:
    """One-round-trip decisions over a Redis index and the Redis load tracker of the same
    Redis (built with them by ``router.serve.state.make_routing_core``).

    Args:
        index: the Redis prefix index (its keys hold the candidates' entries).
        load: the Redis load tracker (its leases, counts, router id and heartbeat).
        first_level: with shard groups, the choice of the group
            (default: a ``GroupChoice`` with its defaults, on the load tracker's clock);
            unused without groups.
    Raises:
        ValueError: the index and the load tracker have different shard groups.
    """

    def __init__(self, index: RedisPrefixIndex, load: RedisLoadTracker,
                 first_level: GroupChoice | None = None):
        if index.groups.tags != load.groups.tags:
            raise ValueError(f"the index has {index.groups.count} shard groups and the load "
                             f"tracker {load.groups.count}: they must be the same")
        self.index = index
        self.load = load
        self.first_level = first_level
        if first_level is None and index.groups.tagged:
            self.first_level = GroupChoice(index.groups, clock=load.clock)

    @staticmethod
    def supports(policy: Policy) -> bool:
        """Whether the script implements ``policy``'s rule (``prefix_aware`` only)."""
        return isinstance(policy, PrefixAware)

    async def route(self, request_id: str, prompt_tokens: int, block_hashes: Sequence[int],
                    replicas: Sequence[str], ttls_s: Sequence[float], *, block_size: int,
                    prefill_rate: float, work_weight: float, decode_step_s_per_seq: float,
                    step_token_budget: int, tie_abs_s: float, tie_rel: float, u: float,
                    load_factor: float = math.inf,
                    max_inflight: int | None = None, running_weight: float = 0.0,
                    interference: float = 0.0,
                    expected_output_tokens: float = 0.0,
                    placement_window_s: float = 0.0, kv_pressure: float = 0.0,
                    kv_free_tokens: Sequence[float | None] | None = None,
                    eviction: float = 0.0,
                    kv_empty_tokens: Sequence[float | None] | None = None,
                    head: bool = False) -> tuple[str, dict[str, int]]:
        """Choose among ``replicas`` (non-empty) and reserve the choice's load.

        Args:
            prompt_tokens / block_hashes: the request (block hashes in prompt order).
            ttls_s: per replica, the TTL of the predicted entries written for it (s).
            block_size: tokens per block.
            prefill_rate: tokens/s; work_weight, decode_step_s_per_seq (s),
                step_token_budget (tokens), tie_abs_s (s), tie_rel, load_factor,
                max_inflight, running_weight, interference: the ``PrefixAware``
                parameters of the same names.
            expected_output_tokens: ``RouteRequest.expected_output_tokens``.
            placement_window_s: ``RouteRequest.placement_window_s`` (s; the script
                takes it in fractional milliseconds).
            kv_pressure: the ``PrefixAware`` parameter; kv_free_tokens: per replica, its
                engine's free KV (tokens, ``Candidate.kv_free_tokens``; None: unknown,
                no KV term). Default: all unknown.
            eviction: the ``PrefixAware`` parameter; kv_empty_tokens: per replica, its
                engine's KV that holds no block (tokens, ``Candidate.kv_empty_tokens``;
                None: unknown, no eviction term). Default: all unknown.
            u: uniform in [0, 1), the final tie-break (the policy's rng draws it).
            head: ``block_hashes`` are a long prompt's head (``RouteInput.head``): the
                script's ``route_head`` mode.
        Returns:
            (chosen replica, matched blocks per replica). With shard groups, the matched
            blocks of the replicas outside the chosen group are 0 (not looked up).
        Raises:
            HeadHeld: with ``head``, a candidate holds every block given; the script
                decided, reserved and wrote nothing.
            LateRoute: no answer within the routing bound; the script may still run
                (``settle``).
            IndexUnavailable: Redis failed; nothing was reserved in Redis.
        """
        load, groups = self.load, self.index.groups
        load.ensure_heartbeat()
        everyone = replicas
        kv_free_tokens = list(kv_free_tokens or [None] * len(replicas))
        kv_empty_tokens = list(kv_empty_tokens or [None] * len(replicas))
        group, lease_group = 0, None
        if groups.tagged:
            parts = groups.split(replicas)
            group = self.first_level.choose(block_hashes, parts, request_id)
            ttl_of = dict(zip(replicas, ttls_s))
            free_of = dict(zip(replicas, kv_free_tokens))
            empty_of = dict(zip(replicas, kv_empty_tokens))
            replicas = parts[group]
            ttls_s = [ttl_of[r] for r in replicas]
            kv_free_tokens = [free_of[r] for r in replicas]
            kv_empty_tokens = [empty_of[r] for r in replicas]
            # a lease of this request in another group (Serve asked again) goes first
            await load.release_elsewhere(request_id, group)
            lease_group = load.reserving(request_id, group)
        keys, lkeys = groups.keys[group], load.groups.keys[group]
        redis_keys = [k for r in replicas for k in keys.replica_entries(r)] + [
            keys.replicas, lkeys.load, lkeys.leases, load.heartbeat_key_of(group), keys.roots]
        owner = load.lease_owner(request_id)
        args = ["route_head" if head else "route", int(load.clock.now() * 1000),
                len(replicas), pack_hashes(block_hashes), request_id, owner, prompt_tokens,
                block_size, prefill_rate, work_weight, decode_step_s_per_seq,
                step_token_budget, tie_abs_s, tie_rel,
                min(load_factor, 1e9), u, int(load.heartbeat_ttl_s * 1000),
                int(max_inflight or 0), running_weight, interference, expected_output_tokens,
                placement_window_s * 1000, kv_pressure, eviction,
                *(int(t * 1000) for t in ttls_s),
                *(-1 if f is None else max(float(f), 0.0) for f in kv_free_tokens),
                *(-1 if e is None else max(float(e), 0.0) for e in kv_empty_tokens),
                *replicas]

        async def run(client):
            return await load.scripts.of(client).route(keys=redis_keys, args=args)

        try:
            res = await load.conn.call_or_leave(run)
        except LateCall as exc:
            raise LateRoute(str(exc), exc.reply, request_id, owner, list(replicas),
                            block_hashes, group) from None
        matched = {r: int(n) for r, n in zip(replicas, res[1:len(replicas) + 1])}
        if int(res[0]) < 1:  # route_head: the whole head is held; nothing was done
            load.not_reserved(request_id, lease_group)
            raise HeadHeld(matched)
        chosen = replicas[int(res[0]) - 1]
        cached = cached_tokens(matched[chosen], prompt_tokens, block_size)
        load.adopt(request_id, chosen, max(prompt_tokens - cached, 0))
        if placed_new_prefix(block_hashes, matched.values()):
            load.adopt_placement(request_id, chosen, placement_window_s)
        if groups.tagged:
            self.first_level.observe(group, block_hashes, int(res[len(replicas) + 1]))
            matched = {r: matched.get(r, 0) for r in everyone}
        return chosen, matched

    async def settle(self, late: "LateRoute", routed: str | None,
                     routed_ttl_s: float = 0.0) -> str:
        """After a late route (``LateRoute``) whose request went to ``routed`` (None: it
        went nowhere, its decision failed or was cancelled): wait for the script's answer
        (at most ``RedisConnections.LATE_REPLY_S``), then undo what it did that the
        request did not follow.

        - Predicted entries: when it chose another replica, the entries it wrote there
          for the blocks past that replica's match (those nothing predicted before; the
          ones it refreshed stay) are dropped, and ``routed`` gets predicted entries for
          the request's blocks (TTL ``routed_ttl_s``), which the fallback did not write.
        - Its lease (this attempt's): ended when the request is no longer held here (the
          script ran after the request's release: the lease would stay for the router's
          life) or when it chose another replica (it ran after the fallback's
          reservation, which it released: the load would count its replica, not the
          request's). A later attempt's lease is never ended (``RedisLoadTracker.
          release_attempt``).
        - Its new-prefix placement (a prompt no candidate held): when it chose another
          replica, or the request's placement is counted by another decision since
          (decided again: a retry, there or elsewhere; or moved), taken back there
          (``LoadTracker.unplaced``, in Redis only: it was never mirrored here; the
          fallback counted the request's own in this router's counts); when it chose the
          request's replica, kept, and adopted here as the request's placement (in place
          of the fallback's local count of it, if any).

        Caveat: a request decided between the script and this correction that followed
        its entries to its replica loses them there (``routed`` has them too, and the
        engine's KV events bring that replica's exact entries back).

        Returns:
            ``same`` (it chose ``routed``), ``held`` (a head's script found a candidate
            holding the whole head: it decided and wrote nothing, so ``routed`` gets the
            predicted entries the fallback did not write), ``moved`` (another replica:
            corrected),
            ``lost`` (it failed, or no answer within the bound: nothing is known),
            ``dropped`` (it was cut at the deadline, ``MAX_LATE_CALLS`` being left running:
            whether it ran is not known, and nothing is undone; a Redis that answers
            hundreds of calls late is an outage, which more calls would not help).
        Raises:
            IndexUnavailable: a correction's call failed.
            asyncio.CancelledError: this settlement was cancelled.
        """
        if late.reply is None:
            return "dropped"
        await asyncio.wait((late.reply,))  # never cancels the call
        if late.reply.cancelled() or late.reply.exception() is not None:
            return "lost"
        res = late.reply.result()
        if int(res[0]) < 1:
            if routed is not None:
                await self.index.record_predicted(routed, late.block_hashes, routed_ttl_s,
                                                  maintenance=True)
            return "held"
        pick = int(res[0]) - 1
        chosen, matched = late.replicas[pick], int(res[1 + pick])
        moved = chosen != routed
        if moved or not self.load.holds(late.request_id):
            await self.load.release_attempt(late.request_id, late.owner, late.group)
        if placed_new_prefix(late.block_hashes, res[1:1 + len(late.replicas)]):
            # it counted a new prefix in Redis, never mirrored here
            window = self.load.mean_request_life_s()
            # not where the request went, or not the request's count any more (decided
            # again, or moved since: its placement is counted elsewhere, or shared by a
            # later decision): taken back. The request's own is the fallback's local count
            # there, or none.
            held = self.load.placement_of(late.request_id)
            if moved or held not in (None, (chosen, False)):
                await self.load.unplaced(chosen, window, mirror=False)
            else:  # where it went: it stays, and is the request's placement here too
                self.load.adopt_placement(
                    late.request_id if self.load.holds(late.request_id) else None,
                    chosen, window)
        if moved:
            await self.index.forget_predicted(chosen, late.block_hashes[matched:],
                                              maintenance=True)
            if routed is not None:
                await self.index.record_predicted(routed, late.block_hashes, routed_ttl_s,
                                                  maintenance=True)
        return "moved" if moved else "same"


def placed_new_prefix(block_hashes: Sequence[int], matched: Iterable) -> bool:
    """Whether a route script counted a new-prefix placement on its choice: blocks to
    match and none held by any of its candidates (``matched``: their matched blocks, as the
    script returns them), ``route.lua``'s ``new_prefix``."""
    return bool(block_hashes) and not any(int(m) for m in matched)


class LateRoute(LateCall):
    """A route script sent but not answered within the routing bound (``AtomicRoute.route``):
    the request is routed without it, and ``AtomicRoute.settle`` reads its answer when it
    comes, to undo what it did for a replica the request did not go to.

    Attributes:
        reply: the script call's task, or None (``LateCall.reply``).
        request_id / owner: the request and the attempt (``lease_owner``) the script
            reserved for.
        replicas: the script's candidates, in its order (its answer's index is 1-based).
        block_hashes: the blocks the script was given (none for a prompt not looked up).
        group: the shard group whose keys the script ran on (0 without groups).
    """

    def __init__(self, message: str, reply: asyncio.Future | None, request_id: str,
                 owner: str, replicas: list[str], block_hashes: Sequence[int], group: int):
        super().__init__(message, reply)
        self.request_id, self.owner, self.group = request_id, owner, group
        self.replicas, self.block_hashes = replicas, list(block_hashes)
