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
from typing import Sequence

from router.index.base import IndexUnavailable
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
                    expected_output_tokens: float = 0.0) -> tuple[str, dict[str, int]]:
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
            u: uniform in [0, 1), the final tie-break (the policy's rng draws it).
        Returns:
            (chosen replica, matched blocks per replica). With shard groups, the matched
            blocks of the replicas outside the chosen group are 0 (not looked up).
        Raises:
            LateRoute: no answer within the routing bound; the script may still run
                (``settle``).
            IndexUnavailable: Redis failed; nothing was reserved in Redis.
        """
        load, groups = self.load, self.index.groups
        load.ensure_heartbeat()
        everyone = replicas
        group = 0
        if groups.tagged:
            parts = groups.split(replicas)
            group = self.first_level.choose(block_hashes, parts, request_id)
            ttl_of = dict(zip(replicas, ttls_s))
            replicas = parts[group]
            ttls_s = [ttl_of[r] for r in replicas]
            # a lease of this request in another group (Serve asked again) goes first
            await load.release_elsewhere(request_id, group)
            load.reserving(request_id, group)
        keys, lkeys = groups.keys[group], load.groups.keys[group]
        redis_keys = [k for r in replicas for k in keys.replica_entries(r)] + [
            keys.replicas, lkeys.load, lkeys.leases, load.heartbeat_key_of(group)]
        now_ms, ttls_ms = int(load.clock.now() * 1000), [int(t * 1000) for t in ttls_s]
        args = ["route", now_ms, len(replicas), pack_hashes(block_hashes),
                request_id, load.lease_owner(request_id), prompt_tokens, block_size, prefill_rate,
                work_weight, decode_step_s_per_seq, step_token_budget, tie_abs_s, tie_rel,
                min(load_factor, 1e9), u, int(load.heartbeat_ttl_s * 1000),
                int(max_inflight or 0), running_weight, interference, expected_output_tokens,
                *ttls_ms, *replicas]

        async def run(client):
            return await load.scripts.of(client).route(keys=redis_keys, args=args)

        try:
            res = await load.conn.call_or_leave(run)
        except LateCall as exc:
            raise LateRoute(str(exc), exc.reply, list(replicas), now_ms, ttls_ms,
                            group) from None
        chosen = replicas[int(res[0]) - 1]
        matched = {r: int(n) for r, n in zip(replicas, res[1:len(replicas) + 1])}
        cached = cached_tokens(matched[chosen], prompt_tokens, block_size)
        load.adopt(request_id, chosen, max(prompt_tokens - cached, 0))
        if groups.tagged:
            self.first_level.observe(group, block_hashes, int(res[len(replicas) + 1]))
            matched = {r: matched.get(r, 0) for r in everyone}
        return chosen, matched

    async def settle(self, late: "LateRoute", routed: str,
                     block_hashes: Sequence[int]) -> str | None:
        """After a late route (``LateRoute``) whose request went to ``routed``: wait for the
        script's answer (at most ``RedisConnections.LATE_REPLY_S``) and, when it chose
        another replica, take back the predicted entries it wrote there
        (``lua/retract_predicted.lua``: the fields holding exactly its expiry). Its lease
        needs nothing: the request's later reservation, or its release, ends it (leases
        carry their attempt, ``router.load.redis``).

        Returns:
            The script's choice, or None when it never answered (it failed, or ran out of
            time: then nothing is known, and nothing is taken back).
        Raises:
            IndexUnavailable: the retraction failed (the script's choice was another).
        """
        try:
            res = await late.reply
        except (IndexUnavailable, asyncio.CancelledError):
            return None
        chosen = late.replicas[int(res[0]) - 1]
        if chosen != routed:
            stamp = str(late.now_ms + late.ttls_ms[late.replicas.index(chosen)])
            pkey = self.index.groups.keys[late.group].replica_entries(chosen)[1]
            packed = pack_hashes(block_hashes)

            async def run(client):
                return await self.load.scripts.of(client).retract_predicted(
                    keys=[pkey], args=[stamp, packed])

            await self.load.conn.call(run, maintenance=True)
        return chosen


class LateRoute(LateCall):
    """A route script sent but not answered within the routing bound (``AtomicRoute.route``):
    the request is routed without it, and ``AtomicRoute.settle`` reads its answer when it
    comes, to take back what it wrote for a replica the request did not go to.

    Attributes:
        reply: the script call's task (``LateCall.reply``).
        replicas: the script's candidates, in its order (its answer's index is 1-based).
        now_ms: the script's clock (ms); ttls_ms: per candidate, the TTL of its predicted
            entries (ms). An entry the script wrote expires at exactly their sum.
        group: the shard group whose keys the script ran on (0 without groups).
    """

    def __init__(self, message: str, reply: asyncio.Future, replicas: list[str],
                 now_ms: int, ttls_ms: list[int], group: int):
        super().__init__(message, reply)
        self.replicas, self.now_ms, self.ttls_ms, self.group = replicas, now_ms, ttls_ms, group
