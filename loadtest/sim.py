"""Virtual-time simulation: the router's real policy and index code over simulated engines.

A discrete-event loop on a virtual clock (``router.clock.ManualClock``): request arrivals
from a workload, one ``replicas.sim.engine.SimEngine`` per replica stepping with its
step-time model, KV events applied to the router's in-process index after
``event_delay_s``, and every routing decision made by ``router.routing.RoutingCore`` with the
policy under test (ours, the baselines or an anchor's re-implementation). The same seed gives
the same numbers. Pure-decode stretches are advanced in bulk (``SimEngine.decode_run``,
checked against the step-by-step model in ``tests/test_sim_engine.py``).

Metrics (``SimResult``): prompt-token hit rate against one unlimited cache and against one
LRU cache of the replicas' combined size (the ideals, computed on the same request stream),
TTFT and end-to-end latency percentiles, output tokens/s, imbalance (max/mean in-flight
requests per replica sampled every 100 ms of virtual time, averaged over the load period:
from the first arrival to the last, where any request is in flight; the drain after the last
arrival, where a handful of requests are left and max/mean of small counts is noise, is
reported apart as ``imbalance_with_drain``), and the wall time of each routing decision.
"""

from __future__ import annotations

import asyncio
import functools
import heapq
import random
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from replicas.sim.engine import EngineConfig, SimEngine, SimRequest
from replicas.sim.step_model import StepTimeModel
from router.clock import ManualClock
from router.config import Settings
from router.hashing import BlockHasher, HashSettings, to_block_hash
from router.index.memory import MemoryPrefixIndex
from router.load import MemoryLoadTracker
from router.policies import make_policy
from router.routing import ReplicaInfo, RoutingCore


@dataclass
class WorkloadRequest:
    """One request of a workload: arrival time (s), prompt tokens, output tokens, and the
    text the character-based anchors match on (one character per token: the structure of
    shared prefixes is the same in characters as in tokens)."""

    arrival_s: float
    token_ids: list[int]
    output_tokens: int
    first_user_text: str = ""
    output_plan: list[int] | None = None
    session: str | None = None
    block_hashes: list[int] = field(default_factory=list)

    @functools.cached_property
    def text(self) -> str:
        return tokens_to_text(self.token_ids)


def tokens_to_text(token_ids: Sequence[int]) -> str:
    """One printable character per token (distinct ids → distinct characters)."""
    return "".join(chr(0x4E00 + (t % 20000)) for t in token_ids)


@dataclass
class SimConfig:
    """One simulation run: ``replicas`` engines of ``engine`` capacity and ``step_model``
    speed, routed by ``policy``."""

    policy: str
    replicas: int = 8
    engine: EngineConfig = field(default_factory=EngineConfig)
    step_model: StepTimeModel | None = None
    seed: int = 0
    event_delay_s: float = 0.005
    sample_period_s: float = 0.1
    predicted_ttl_s: float = 15.0
    policy_kwargs: dict = field(default_factory=dict)


@dataclass
class SimResult:
    policy: str
    requests: int
    prompt_tokens: int
    cached_tokens: int
    ideal_unlimited_tokens: int
    ideal_combined_tokens: int
    ttft_s: list[float]
    e2e_s: list[float]
    output_tokens: int
    makespan_s: float
    imbalance: float
    imbalance_with_drain: float
    decision_s: list[float]
    per_replica_requests: dict[str, int]
    load_samples: list[tuple[float, list[int]]]

    def summary(self) -> dict:
        def pct(xs, p):
            xs = sorted(xs)
            return xs[min(int(p * len(xs)), len(xs) - 1)] if xs else float("nan")
        return {
            "policy": self.policy, "requests": self.requests,
            "hit_rate": self.cached_tokens / max(self.prompt_tokens, 1),
            "ideal_unlimited": self.ideal_unlimited_tokens / max(self.prompt_tokens, 1),
            "ideal_combined": self.ideal_combined_tokens / max(self.prompt_tokens, 1),
            "hit_vs_combined": self.cached_tokens / max(self.ideal_combined_tokens, 1),
            "ttft_p50_s": pct(self.ttft_s, .5), "ttft_p90_s": pct(self.ttft_s, .9),
            "ttft_p99_s": pct(self.ttft_s, .99), "e2e_p50_s": pct(self.e2e_s, .5),
            "e2e_p90_s": pct(self.e2e_s, .9), "output_tok_s": self.output_tokens
            / max(self.makespan_s, 1e-9), "imbalance": self.imbalance,
            "imbalance_with_drain": self.imbalance_with_drain,
            "decision_p50_us": pct(self.decision_s, .5) * 1e6,
            "decision_p99_us": pct(self.decision_s, .99) * 1e6,
            "per_replica_requests": self.per_replica_requests,
        }


def ideal_hits(requests: Sequence[WorkloadRequest], block_size: int,
               capacity_blocks: int | None) -> int:
    """Prompt tokens a single cache would serve: unlimited (``capacity_blocks`` None) or
    an LRU of ``capacity_blocks`` blocks, fed every request's blocks in arrival order (the
    same whole-block, ``prompt - 1`` cap as vLLM)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in sorted(requests, key=lambda r: r.arrival_s):
        hs = r.block_hashes
        cap = (len(r.token_ids) - 1) // block_size
        n = 0
        while n < min(len(hs), cap) and hs[n] in lru:
            n += 1
        hits += n * block_size
        for h in hs:
            lru[h] = None
            lru.move_to_end(h)
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return hits


class Simulation:
    """Runs one ``SimConfig`` over a workload."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.clock = ManualClock(0.0)
        bs = cfg.engine.block_size
        self.hash_settings = HashSettings(block_size=bs)
        self.hasher = BlockHasher(self.hash_settings)
        settings = Settings(policy="prefix_aware", block_size=bs,
                            predicted_ttl_with_events_s=cfg.predicted_ttl_s,
                            prefill_tokens_per_s=1.0 / (cfg.step_model.b_s_per_token or 1e-5),
                            decode_step_s=cfg.step_model.c_s_per_seq)
        self.index = MemoryPrefixIndex(clock=self.clock)
        self.load = MemoryLoadTracker(clock=self.clock)
        self.policy = make_policy(cfg.policy, random.Random(cfg.seed), **cfg.policy_kwargs)
        self.core = RoutingCore(settings, self.index, self.load, self.policy)
        self.names = [f"r{i}" for i in range(cfg.replicas)]
        self.engines = {n: SimEngine(cfg.engine, cfg.step_model, self.hash_settings)
                        for n in self.names}
        self.busy = {n: False for n in self.names}
        self.inflight = {n: 0 for n in self.names}
        self.active_blocks = {n: 0 for n in self.names}

    def hash_workload(self, requests: Sequence[WorkloadRequest]) -> None:
        for r in requests:
            if not r.block_hashes:
                r.block_hashes = self.hasher.block_hashes(r.token_ids)

    async def run(self, requests: Sequence[WorkloadRequest],
                  progress: Callable[[int], None] | None = None) -> SimResult:
        cfg = self.cfg
        self.hash_workload(requests)
        heap: list = []
        seq = 0

        def push(t, kind, payload):
            nonlocal seq
            heapq.heappush(heap, (t, seq, kind, payload))
            seq += 1

        arrivals = sorted(requests, key=lambda r: r.arrival_s)
        next_arrival = 0  # arrivals are read in order, outside the heap
        ttft, e2e, decision = [], [], []
        meta: dict[str, tuple] = {}
        per_replica = {n: 0 for n in self.names}
        cached = prompt = out_tokens = 0
        samples: list[tuple[float, list[int]]] = []
        next_sample = arrivals[0].arrival_s if arrivals else 0.0
        last_t = 0.0
        bs = cfg.engine.block_size

        while heap or next_arrival < len(arrivals):
            t_arr = arrivals[next_arrival].arrival_s if next_arrival < len(arrivals) \
                else float("inf")
            if heap and heap[0][0] <= t_arr:
                t, _, kind, payload = heapq.heappop(heap)
            else:
                t, kind, payload = t_arr, "arrive", (next_arrival, arrivals[next_arrival])
                next_arrival += 1
            # in-flight counts change only at events: sample the state before this one
            while next_sample <= t:
                samples.append((next_sample, [self.inflight[n] for n in self.names]))
                next_sample += cfg.sample_period_s
            self.clock.t = t
            last_t = max(last_t, t)
            if kind == "arrive":
                i, r = payload
                rid = f"q{i}"
                infos = [ReplicaInfo(n, {}, {"waiting": self.engines[n].num_waiting,
                                             "kv_usage_frac": self.engines[n].pool.usage,
                                             "active_blocks": self.active_blocks[n]})
                         for n in self.names]
                t0 = time.perf_counter()
                d = await self.core.decide(rid, len(r.token_ids), r.block_hashes, infos,
                                           text=r.text if self.policy.name in _TEXT else "",
                                           first_user_text=r.first_user_text)
                decision.append(time.perf_counter() - t0)
                rep = d.replica
                per_replica[rep] += 1
                self.inflight[rep] += 1
                nb = -(-len(r.token_ids) // bs)
                self.active_blocks[rep] += nb
                sreq = SimRequest(rid, r.token_ids, max(r.output_tokens, 1),
                                  block_hashes=list(r.block_hashes), arrival_s=t,
                                  output_plan=r.output_plan)
                meta[rid] = (rep, t, nb)
                self.engines[rep].add_request(sreq)
                if not self.busy[rep]:
                    self.busy[rep] = True
                    push(t, "step", rep)
            elif kind == "step":
                rep = payload
                eng = self.engines[rep]
                if not eng.has_work:
                    self.busy[rep] = False
                    continue
                # Only an arrival can change this engine's batch before its next step: run
                # pure decode in bulk up to the next arrival.
                t_next = arrivals[next_arrival].arrival_s if next_arrival < len(arrivals) \
                    else float("inf")
                res = eng.decode_run(1_000_000, t_next - t) or eng.step()
                push(t + max(res.duration_s, 1e-6), "step_end", (rep, res))
            elif kind == "step_end":
                rep, res = payload
                eng = self.engines[rep]
                for req in res.first_tokens:
                    ttft.append(t - req.arrival_s)
                    await self.load.prefill_done(req.request_id)
                    cached += max(req.num_cached_tokens, 0)
                    prompt += req.prompt_tokens
                out_tokens += len(res.new_tokens)
                for req in res.finished:
                    e2e.append(t - req.arrival_s)
                    await self.load.release(req.request_id)
                    _, _, nb = meta.pop(req.request_id)
                    self.inflight[rep] -= 1
                    self.active_blocks[rep] -= nb
                    if progress:
                        progress(1)
                events = eng.take_events()
                if events:
                    push(t + cfg.event_delay_s, "events", (rep, events))
                push(t, "step", rep)
            elif kind == "events":
                rep, events = payload
                self.index.apply_events_now(rep, events)

        last_arrival = max((r.arrival_s for r in requests), default=0.0)
        ratios = [max(v) / (sum(v) / len(v)) for t, v in samples
                  if sum(v) > 0 and t <= last_arrival]
        with_drain = [max(v) / (sum(v) / len(v)) for _, v in samples if sum(v) > 0]
        capacity = cfg.engine.num_blocks * cfg.replicas
        return SimResult(
            policy=cfg.policy, requests=len(requests), prompt_tokens=prompt,
            cached_tokens=cached,
            ideal_unlimited_tokens=ideal_hits(requests, bs, None),
            ideal_combined_tokens=ideal_hits(requests, bs, capacity),
            ttft_s=ttft, e2e_s=e2e, output_tokens=out_tokens,
            makespan_s=last_t - min((r.arrival_s for r in requests), default=0.0),
            imbalance=statistics.fmean(ratios) if ratios else 1.0,
            imbalance_with_drain=statistics.fmean(with_drain) if with_drain else 1.0,
            decision_s=decision,
            per_replica_requests=per_replica, load_samples=samples)


# Policies that match on characters (the others never read the text; skip building it).
_TEXT = {"sglang_cache_aware", "ray_prefix_affinity"}


def simulate(cfg: SimConfig, requests: Sequence[WorkloadRequest],
             progress: Callable[[int], None] | None = None) -> SimResult:
    """Run one simulation to completion (deterministic for a given ``cfg.seed``)."""
    return asyncio.run(Simulation(cfg).run(requests, progress))


def block_tokens(block_id: int, n: int, vocab: int = 30000) -> list[int]:
    """``n`` deterministic token ids standing for a trace's block ``block_id``."""
    rng = random.Random(block_id * 7919 + 17)
    return [100 + rng.randrange(vocab) for _ in range(n)]


__all__ = ["SimConfig", "SimResult", "Simulation", "WorkloadRequest", "simulate",
           "block_tokens", "ideal_hits", "to_block_hash"]
