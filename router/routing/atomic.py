"""The prefix_aware decision in one Redis round trip: match, score, choose, reserve and
predict, atomically (``router/lua/route.lua``).

Several routers deciding at once are serialised by Redis, so a burst does not pile onto
one replica (docs/architecture.md, decision 3). The script's cost rule is
``router.policy.prefix_aware.PrefixAware``'s, line for line; ``tests/test_route_lua.py``
checks that both choose alike.
"""

from __future__ import annotations

import math
from typing import Sequence

from router.index.redis import RedisPrefixIndex
from router.load.redis import RedisLoadTracker
from router.policy.base import Policy, cached_tokens
from router.policy.prefix_aware import PrefixAware
from router.redis_keys import pack_hashes


class AtomicRoute:
    """One-round-trip decisions over a Redis index and the Redis load tracker of the same
    Redis (built with them by ``router.serve.state.make_routing_core``).

    Args:
        index: the Redis prefix index (its keys hold the candidates' entries).
        load: the Redis load tracker (its leases, counts, router id and heartbeat).
    """

    def __init__(self, index: RedisPrefixIndex, load: RedisLoadTracker):
        self.index = index
        self.load = load

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
            (chosen replica, matched blocks per replica).
        Raises:
            IndexUnavailable: Redis failed; nothing was reserved in Redis.
        """
        load, keys = self.load, self.index.keys
        load.ensure_heartbeat()
        redis_keys = [k for r in replicas for k in keys.replica_entries(r)] + [
            keys.replicas, load.redis_keys.load, load.redis_keys.leases, load.heartbeat_key]
        args = ["route", int(load.clock.now() * 1000), len(replicas), pack_hashes(block_hashes),
                request_id, load.lease_owner(request_id), prompt_tokens, block_size, prefill_rate,
                work_weight, decode_step_s_per_seq, step_token_budget, tie_abs_s, tie_rel,
                min(load_factor, 1e9), u, int(load.heartbeat_ttl_s * 1000),
                int(max_inflight or 0), running_weight, interference, expected_output_tokens,
                *(int(t * 1000) for t in ttls_s), *replicas]

        async def run(client):
            return await load.scripts.of(client).route(keys=redis_keys, args=args)

        res = await load.conn.call(run)
        chosen = replicas[int(res[0]) - 1]
        matched = {r: int(n) for r, n in zip(replicas, res[1:])}
        cached = cached_tokens(matched[chosen], prompt_tokens, block_size)
        load.adopt(request_id, chosen, max(prompt_tokens - cached, 0))
        return chosen, matched
