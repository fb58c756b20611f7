"""Virtual-time simulation: the router's real policy and index code over simulated engines.

A discrete-event loop on a virtual clock (``router.clock.ManualClock``): request arrivals
from a workload, one ``replicas.sim.engine.SimEngine`` per replica stepping with its
step-time model, KV events applied to the router's in-process index after
``event_delay_s``, and every routing decision made by ``router.routing.core.RoutingCore`` with the
policy under test (ours, the baselines or an anchor's re-implementation). The same seed gives
the same numbers. Pure-decode stretches are advanced in bulk (``SimEngine.decode_run``,
checked against the step-by-step model in ``tests/test_sim_engine.py``).

Metrics (``SimResult``): prompt-token hit rate against one unlimited cache and against one
LRU cache of the replicas' combined size (the ideals, computed on the same request stream),
TTFT and end-to-end latency percentiles, output tokens/s, imbalance (max/mean in-flight
requests per replica sampled every 100 ms of virtual time, averaged over the load period:
from the first arrival to the last, where any request is in flight; the drain after the last
arrival, where a handful of requests are left and max/mean of small counts is noise, is
reported apart as ``imbalance_with_drain``), the wall time of each routing decision, and
what users feel beyond the first token: inter-token latency (every gap between two tokens
of a request, weighted per token: ``LogHistogram``), time per output token per request
((end - first token) / (output tokens - 1)), queueing time in the engine (arrival to first
admission), preemptions (vLLM's ``num_preemptions``) and KV-capacity pressure (every
replica's block-pool usage sampled with the load: mean, and the fraction of samples in
which some replica is 95 % full).

Scale events (``SimConfig.scale_events``): a replica added or removed at a virtual time, as
Serve's ``update_replicas`` shows it to the router. A removed replica takes no new request,
its index entries are purged, and its requests in flight finish. With ``SimConfig.warmup``
the router's own warm-up code (``router.routing.warmup``: the hot-prefix record, the
planner, the pacer) warms a replica that joins and re-homes what a leaving one alone held,
its requests served by the simulated engines like any other (and left out of the request
metrics); ``SimResult.request_log`` gives each request's replica and arrival for windowed
measurements (``loadtest.warmup_bench``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import heapq
import math
import random
import statistics
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Sequence

from loadtest.report import percentile
from replicas.sim.engine import EngineConfig, SimEngine, SimRequest
from replicas.sim.step_model import StepTimeModel
from router.clock import ManualClock
from router.config import Settings
from router.hashing import BlockHasher, HashSettings, to_block_hash
from router.index.memory import MemoryPrefixIndex
from router.load.memory import MemoryLoadTracker
from router.policy import make_policy, max_cached_blocks
from router.routing.core import RoutingCore
from router.routing.replica import ReplicaInfo, ReplicaMetadata, RoutingStats
from router.routing.warmup import HotPrefixes, MemoryWarmupLease, Warmer, WarmupPacer

_NO_METADATA = ReplicaMetadata()


class LogHistogram:
    """Weighted values in log-spaced bins of ratio ``1 + resolution`` (0.5 %: a percentile
    read from it is within 0.5 % of the exact one), for distributions with too many values
    to keep (every inter-token gap of a run). Values at or below ``floor`` share one bin."""

    def __init__(self, resolution: float = 0.005, floor: float = 1e-7):
        self._log_ratio = math.log1p(resolution)
        self.floor = floor
        self.bins: dict[int, float] = {}
        self.total = 0.0

    def add(self, value: float, weight: float = 1.0) -> None:
        """Count ``value`` ``weight`` times."""
        k = 0 if value <= self.floor else 1 + int(math.log(value / self.floor) / self._log_ratio)
        self.bins[k] = self.bins.get(k, 0.0) + weight
        self.total += weight

    def percentile(self, p: float, default: float = float("nan")) -> float:
        """The value below which a fraction ``p`` (0..1) of the weight lies (its bin's
        geometric middle); ``default`` when empty."""
        if self.total <= 0:
            return default
        need, acc = p * self.total, 0.0
        for k in sorted(self.bins):
            acc += self.bins[k]
            if acc >= need:
                return self.floor if k == 0 else \
                    self.floor * math.exp((k - 0.5) * self._log_ratio)
        return self.floor * math.exp((max(self.bins) - 0.5) * self._log_ratio)


@dataclass
class WorkloadRequest:
    """One request of a workload: arrival time (s), prompt tokens, output tokens, and the
    text the character-based anchors match on (one character per token: the structure of
    shared prefixes is the same in characters as in tokens). ``replica`` pins the request to
    a replica (``r0``...): a recorded run's routing replayed, the policy bypassed."""

    arrival_s: float
    token_ids: list[int]
    output_tokens: int
    first_user_text: str = ""
    output_plan: list[int] | None = None
    session: str | None = None
    block_hashes: list[int] = field(default_factory=list)
    replica: str | None = None
    digests: list[bytes] = field(default_factory=list)
    cached_block_hashes: list[int] = field(default_factory=list)

    @functools.cached_property
    def text(self) -> str:
        return tokens_to_text(self.token_ids)


def tokens_to_text(token_ids: Sequence[int]) -> str:
    """One printable character per token (distinct ids → distinct characters)."""
    return "".join(chr(0x4E00 + (t % 20000)) for t in token_ids)


@dataclass(frozen=True)
class ScaleEvent:
    """A change of the replica set at virtual time ``t_s``: ``add`` a replica (named
    ``r<k>``, the next number), or ``remove`` ``replica`` (default: ``r0``)."""

    t_s: float
    action: str
    replica: str | None = None

    def __post_init__(self) -> None:
        if self.action not in ("add", "remove"):
            raise ValueError(f"scale action must be 'add' or 'remove', not {self.action!r}")


@dataclass
class SimConfig:
    """One simulation run: ``replicas`` engines of ``engine`` capacity and ``step_model``
    speed, routed by ``policy``.

    ``engines_per_gpu``: engines ``r0..r{k-1}``, ``r{k}..`` share one GPU each. Engines on
    one GPU time-share it: a step lasts its modelled time times the number of that GPU's
    engines with work when it starts (a GPU runs one engine's kernels at a time; checked
    against 4 vLLM engines on one H200: ITL 21.1 ms measured, 20.5 modelled).
    """

    policy: str
    replicas: int = 8
    engine: EngineConfig = field(default_factory=EngineConfig)
    step_model: StepTimeModel | None = None
    seed: int = 0
    event_delay_s: float = 0.005
    sample_period_s: float = 0.1
    predicted_ttl_s: float = 15.0
    policy_kwargs: dict = field(default_factory=dict)
    engines_per_gpu: int = 1
    scale_events: list[ScaleEvent] = field(default_factory=list)
    warmup: bool = False
    warmup_settings: dict = field(default_factory=dict)  # Settings.warmup_* overrides
    holders_refresh_s: float = 5.0  # how often the warm-up record asks who holds what


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
    by_request: dict[str, tuple[float, int]] = field(default_factory=dict)
    itl: LogHistogram = field(default_factory=LogHistogram)
    tpot_s: list[float] = field(default_factory=list)
    queue_s: list[float] = field(default_factory=list)
    preemptions: int = 0
    kv_samples: list[list[float]] = field(default_factory=list)
    # "q<i>" -> (replica, arrival s, prompt tokens), the i-th request by arrival
    request_log: dict[str, tuple[str, float, int]] = field(default_factory=dict)
    warmup: dict = field(default_factory=dict)  # WarmupStats as a dict, when warm-up is on

    def summary(self) -> dict:
        def pct(xs, p):
            return percentile(xs, p, float("nan"))
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
            "itl_p50_s": self.itl.percentile(.5), "itl_p90_s": self.itl.percentile(.9),
            "itl_p99_s": self.itl.percentile(.99),
            "tpot_p50_s": pct(self.tpot_s, .5), "tpot_p90_s": pct(self.tpot_s, .9),
            "tpot_p99_s": pct(self.tpot_s, .99),
            "queue_p50_s": pct(self.queue_s, .5), "queue_p99_s": pct(self.queue_s, .99),
            "preemptions": self.preemptions,
            "kv_usage_mean": statistics.fmean(u for v in self.kv_samples for u in v)
            if self.kv_samples else 0.0,
            "kv_full_frac": sum(1 for v in self.kv_samples if max(v) >= 0.95)
            / max(len(self.kv_samples), 1),
            "decision_p50_us": pct(self.decision_s, .5) * 1e6,
            "decision_p99_us": pct(self.decision_s, .99) * 1e6,
            "per_replica_requests": self.per_replica_requests,
        }


def ideal_hits(requests: Sequence[WorkloadRequest], block_size: int,
               capacity_blocks: int | None) -> int:
    """Prompt tokens a single cache would serve: unlimited (``capacity_blocks`` None) or
    an LRU of ``capacity_blocks`` blocks, fed every request's blocks in arrival order (the
    same whole-block, ``prompt - 1`` cap as vLLM), its answer's blocks included when the
    answer is known (``output_plan``: an engine caches the blocks it generates, and a
    conversation's next turn holds them)."""
    lru: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in sorted(requests, key=lambda r: r.arrival_s):
        hs = r.block_hashes
        cap = max_cached_blocks(len(r.token_ids), block_size)
        n = 0
        while n < min(len(hs), cap) and hs[n] in lru:
            n += 1
        hits += n * block_size
        for h in r.cached_block_hashes or hs:
            lru[h] = None
            lru.move_to_end(h)
        if capacity_blocks is not None:
            while len(lru) > capacity_blocks:
                lru.popitem(last=False)
    return hits


@dataclass
class _Run:
    """The state of one ``Simulation.run``: the event heap, the arrivals read so far, and
    what is measured."""

    arrivals: list
    per_replica: dict[str, int]
    progress: Callable[[int], None] | None = None
    heap: list = field(default_factory=list)
    seq: int = 0
    next_arrival: int = 0
    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    decision_s: list[float] = field(default_factory=list)
    by_request: dict[str, tuple[float, int]] = field(default_factory=dict)  # "q<i>": TTFT, cached
    meta: dict[str, tuple] = field(default_factory=dict)  # in flight: replica, arrival, blocks
    samples: list[tuple[float, list[int]]] = field(default_factory=list)
    kv_samples: list[list[float]] = field(default_factory=list)
    itl: LogHistogram = field(default_factory=LogHistogram)
    tpot_s: list[float] = field(default_factory=list)
    queue_s: list[float] = field(default_factory=list)
    token_t: dict[str, float] = field(default_factory=dict)  # in flight: its last token's time
    first_t: dict[str, float] = field(default_factory=dict)  # in flight: its first token's time
    request_log: dict[str, tuple[str, float, int]] = field(default_factory=dict)
    cached: int = 0
    prompt: int = 0
    out_tokens: int = 0

    def push(self, t: float, kind: str, payload) -> None:
        heapq.heappush(self.heap, (t, self.seq, kind, payload))
        self.seq += 1

    def next_arrival_s(self) -> float:
        return self.arrivals[self.next_arrival].arrival_s \
            if self.next_arrival < len(self.arrivals) else float("inf")


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
                            decode_step_s=cfg.step_model.c_s_per_seq,
                            warmup_enabled=cfg.warmup, **cfg.warmup_settings)
        self.settings = settings
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
        self.active = list(self.names)  # the replicas routing sees (not those removed)
        self.hot: HotPrefixes | None = None
        self.warmer: Warmer | None = None
        self._run: _Run | None = None
        self._warm_due: float | None = None  # the pending "warm" event's time
        if cfg.warmup:
            self.hot = HotPrefixes(bs, settings.warmup_half_life_s,
                                   settings.warmup_record_tokens, 16384, self.clock)
            self.warmer = Warmer(self.core, self.hot,
                                 WarmupPacer(settings.warmup_tokens_per_s,
                                             settings.warmup_concurrency, self.clock),
                                 MemoryWarmupLease(self.clock), self._warm_send,
                                 settings.warmup_top_prefixes)

    def _infos(self) -> list[ReplicaInfo]:
        """The active replicas as routing sees them; an engine's cached tokens are the
        block hashes its pool holds, as its replica's event feed counts them."""
        bs = self.cfg.engine.block_size
        return [ReplicaInfo(n, _NO_METADATA, RoutingStats(
                    waiting=self.engines[n].num_waiting,
                    kv_usage_frac=self.engines[n].pool.usage,
                    kv_capacity_tokens=self.cfg.engine.num_blocks * bs,
                    kv_cached_tokens=len(self.engines[n].pool.cached) * bs,
                    active_blocks=self.active_blocks[n])) for n in self.active]

    def _gpu_share(self, replica: str) -> int:
        """Engines with work on ``replica``'s GPU (itself included): its step's slowdown."""
        k = max(self.cfg.engines_per_gpu, 1)
        g = self.names.index(replica) // k
        return max(sum(1 for n in self.names[g * k:(g + 1) * k] if self.engines[n].has_work), 1)

    def hash_workload(self, requests: Sequence[WorkloadRequest]) -> None:
        """Each request's block hashes, with the full digests they are cut from: the engine
        chains the blocks it generates onto the prompt's last digest, so an answer's blocks
        match the next turn's prompt only when that chain is the same as hashing it."""
        for r in requests:
            if not r.block_hashes:
                r.digests = self.hasher.digests(r.token_ids)
                r.block_hashes = [to_block_hash(d) for d in r.digests]
                if r.output_plan:  # what the engine holds after it: prompt and answer
                    whole = list(r.token_ids) + list(r.output_plan)
                    r.cached_block_hashes = self.hasher.block_hashes(whole[:-1])

    async def run(self, requests: Sequence[WorkloadRequest],
                  progress: Callable[[int], None] | None = None) -> SimResult:
        """Replay ``requests`` in virtual time to the last completion.

        Events are arrivals (read in order beside the heap), ``step`` (an engine starts its
        next step, or a run of pure decode steps up to the next arrival), ``step_end`` (its
        results: first tokens, finished requests, KV events) and ``events`` (KV events
        reaching the index ``event_delay_s`` later); each kind has its handler.
        """
        cfg = self.cfg
        self.hash_workload(requests)
        run = _Run(arrivals=sorted(requests, key=lambda r: r.arrival_s),
                   per_replica={n: 0 for n in self.names}, progress=progress)
        self._run = run
        handlers = {"arrive": self._on_arrive, "step": self._on_step,
                    "step_end": self._on_step_end, "events": self._on_events,
                    "scale": self._on_scale, "warm": self._on_warm,
                    "holders": self._on_holders}
        for ev in cfg.scale_events:
            run.push(ev.t_s, "scale", ev)
        if self.warmer is not None and run.arrivals:
            run.push(run.arrivals[0].arrival_s + cfg.holders_refresh_s, "holders", None)
        next_sample = run.arrivals[0].arrival_s if run.arrivals else 0.0
        last_t = 0.0
        while run.heap or run.next_arrival < len(run.arrivals):
            t_arr = run.next_arrival_s()
            if run.heap and run.heap[0][0] <= t_arr:
                t, _, kind, payload = heapq.heappop(run.heap)
            else:
                t, kind = t_arr, "arrive"
                payload = (run.next_arrival, run.arrivals[run.next_arrival])
                run.next_arrival += 1
            # in-flight counts change only at events: sample the state before this one
            while next_sample <= t:
                run.samples.append((next_sample, [self.inflight[n] for n in self.active]))
                run.kv_samples.append([self.engines[n].pool.usage for n in self.active])
                next_sample += cfg.sample_period_s
            self.clock.t = t
            last_t = max(last_t, t)
            await handlers[kind](run, t, payload)
        return self._result(run, requests, last_t)

    async def _on_arrive(self, run: "_Run", t: float, payload) -> None:
        """A request arrives: route it (or replay its recorded replica) and queue it."""
        i, r = payload
        rid = f"q{i}"
        infos = self._infos()
        if self.hot is not None and r.replica is None:
            self.hot.observe(r.block_hashes, r.token_ids)
        t0 = time.perf_counter()
        if r.replica is not None:  # a recorded run's routing, replayed
            rep = r.replica
            await self.load.reserve(rid, rep, len(r.token_ids))
        else:
            d = await self.core.decide(rid, len(r.token_ids), r.block_hashes, infos,
                                       text=r.text if self.policy.uses_text else "",
                                       first_user_text=r.first_user_text)
            rep = d.replica
        run.decision_s.append(time.perf_counter() - t0)
        if self.hot is not None and r.replica is None:
            self.hot.routed(r.block_hashes, rep)
        run.request_log[rid] = (rep, t, len(r.token_ids))
        run.per_replica[rep] = run.per_replica.get(rep, 0) + 1
        self.inflight[rep] += 1
        nb = -(-len(r.token_ids) // self.cfg.engine.block_size)
        self.active_blocks[rep] += nb
        sreq = SimRequest(rid, r.token_ids, max(r.output_tokens, 1),
                          block_hashes=list(r.block_hashes), arrival_s=t,
                          output_plan=r.output_plan, digests=list(r.digests))
        run.meta[rid] = (rep, t, nb)
        self.engines[rep].add_request(sreq)
        if not self.busy[rep]:
            self.busy[rep] = True
            run.push(t, "step", rep)

    async def _on_step(self, run: "_Run", t: float, rep: str) -> None:
        """Engine ``rep`` starts a step (or goes idle)."""
        eng = self.engines[rep]
        if not eng.has_work:
            self.busy[rep] = False
            return
        # Only an arrival can change this engine's batch before its next step: run pure
        # decode in bulk up to the next arrival.
        share = self._gpu_share(rep)
        eng.now_s = t
        res = eng.decode_run(1_000_000, (run.next_arrival_s() - t) / share) or eng.step()
        run.push(t + max(res.duration_s * share, 1e-6), "step_end", (rep, res, share))

    async def _on_step_end(self, run: "_Run", t: float, payload) -> None:
        """A step's results: first tokens, finished requests, and the KV events it made."""
        rep, res, share = payload
        eng = self.engines[rep]
        self._token_times(run, t, res, share)
        for req in res.first_tokens:
            if req.request_id.startswith("warm-"):  # a warm-up request: not a user's
                continue
            run.ttft_s.append(t - req.arrival_s)
            run.queue_s.append((req.scheduled_s or req.arrival_s) - req.arrival_s)
            run.by_request[req.request_id] = (t - req.arrival_s, max(req.num_cached_tokens, 0))
            await self.load.prefill_done(req.request_id)
            run.cached += max(req.num_cached_tokens, 0)
            run.prompt += req.prompt_tokens
        run.out_tokens += len(res.new_tokens)
        for req in res.finished:
            if req.request_id.startswith("warm-"):
                _, _, nb = run.meta.pop(req.request_id)
                self.inflight[rep] -= 1
                self.active_blocks[rep] -= nb
                await self.warmer.finished(req.request_id, True)
                await self._pump(run, t)
                continue
            run.e2e_s.append(t - req.arrival_s)
            self.core.observe_output(len(req.output_token_ids))
            first = run.first_t.pop(req.request_id, t)
            run.token_t.pop(req.request_id, None)
            if len(req.output_token_ids) > 1:
                run.tpot_s.append((t - first) / (len(req.output_token_ids) - 1))
            await self.load.release(req.request_id)
            _, _, nb = run.meta.pop(req.request_id)
            self.inflight[rep] -= 1
            self.active_blocks[rep] -= nb
            if run.progress:
                run.progress(1)
        events = eng.take_events()
        if events:
            run.push(t + self.cfg.event_delay_s, "events", (rep, events))
        run.push(t, "step", rep)

    @staticmethod
    def _token_times(run: "_Run", t: float, res, share: int) -> None:
        """Inter-token gaps of the tokens a step (or a run of decode steps) produced, ending
        at ``t``: a request's first gap in it is from its previous token; within a run of
        ``k`` steps every request's next gaps are the steps' durations (times ``share``,
        the GPU's engines with work)."""
        seen: dict[str, int] = {}
        for req, _ in res.new_tokens:
            seen[req.request_id] = seen.get(req.request_id, 0) + 1
        steps = res.step_durations_s
        start = t - res.duration_s * share
        first_end = start + (steps[0] if steps else res.duration_s) * share
        for rid in seen:
            last = run.token_t.get(rid)
            if last is None:
                run.first_t[rid] = first_end
            else:
                run.itl.add(first_end - last)
            run.token_t[rid] = t
        if steps and len(steps) > 1:
            for d in steps[1:]:
                run.itl.add(d * share, len(seen))

    async def _on_scale(self, run: "_Run", t: float, ev: ScaleEvent) -> None:
        """A replica joins or leaves (what Serve's ``update_replicas`` shows the router)."""
        if ev.action == "add":
            name = f"r{len(self.engines)}"
            self.names.append(name)
            self.engines[name] = SimEngine(self.cfg.engine, self.cfg.step_model,
                                           self.hash_settings)
            self.busy[name], self.inflight[name], self.active_blocks[name] = False, 0, 0
            run.per_replica.setdefault(name, 0)
            self.active.append(name)
            if self.warmer is not None:
                await self.warmer.replica_joined(name)
        else:
            name = ev.replica or "r0"
            if name not in self.active or len(self.active) < 2:
                raise ValueError(f"cannot remove replica {name!r} from {self.active}")
            self.active.remove(name)
            if self.warmer is not None:
                self.warmer.forget_replica(name)
                await self.warmer.replica_left(name, self.active)
            await self.core.remove_replica(name)  # its requests in flight finish there
            if self.hot is not None:
                self.hot.forget_replica(name)
        await self._pump(run, t)

    async def _pump(self, run: "_Run", t: float) -> None:
        """Start the warm-up requests the pacer allows now; schedule the next pump."""
        if self.warmer is None:
            return
        wait = await self.warmer.pump(self._infos())
        if wait is not None and math.isfinite(wait):
            due = t + max(wait, 1e-6)
            if self._warm_due is None or due < self._warm_due:
                self._warm_due = due
                run.push(due, "warm", None)

    async def _on_warm(self, run: "_Run", t: float, payload) -> None:
        if self._warm_due is not None and t < self._warm_due:
            return  # superseded by an earlier pump
        self._warm_due = None
        await self._pump(run, t)

    async def _on_holders(self, run: "_Run", t: float, payload) -> None:
        """Every ``holders_refresh_s``: the record asks the index who holds its hottest
        prefixes (what a replica that leaves held is read from there), as the ingress's
        warm-up loop does."""
        await self.hot.refresh_holders(self.index, self.active, self.warmer.top_prefixes,
                                       self.warmer.min_count)
        if run.next_arrival < len(run.arrivals):
            run.push(t + self.cfg.holders_refresh_s, "holders", None)

    def _warm_send(self, job, info: ReplicaInfo, cached: int) -> None:
        """The ``Warmer``'s sender: a prefill-only request (one output token) of the
        prefix's token ids, on the replica its decision chose."""
        run, t, rep = self._run, self.clock.now(), info.replica_id
        sreq = SimRequest(job.request_id, list(job.prefix.token_ids), 1,
                          block_hashes=list(job.prefix.hashes), arrival_s=t)
        nb = len(job.prefix.hashes)
        run.meta[job.request_id] = (rep, t, nb)
        self.inflight[rep] += 1
        self.active_blocks[rep] += nb
        self.engines[rep].add_request(sreq)
        if not self.busy[rep]:
            self.busy[rep] = True
            run.push(t, "step", rep)

    async def _on_events(self, run: "_Run", t: float, payload) -> None:
        """KV events reach the index."""
        rep, events = payload
        self.index.apply_events_now(rep, events)

    def _result(self, run: "_Run", requests: Sequence[WorkloadRequest],
                last_t: float) -> SimResult:
        cfg, bs = self.cfg, self.cfg.engine.block_size
        samples, per_replica = run.samples, run.per_replica
        ttft, e2e, decision, by_request = run.ttft_s, run.e2e_s, run.decision_s, run.by_request
        prompt, cached, out_tokens = run.prompt, run.cached, run.out_tokens
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
            per_replica_requests=per_replica, load_samples=samples, by_request=by_request,
            itl=run.itl, tpot_s=run.tpot_s, queue_s=run.queue_s,
            preemptions=sum(e.preemptions_total for e in self.engines.values()),
            kv_samples=run.kv_samples, request_log=run.request_log,
            warmup=dataclasses.asdict(self.warmer.stats) if self.warmer else {})


def simulate(cfg: SimConfig, requests: Sequence[WorkloadRequest],
             progress: Callable[[int], None] | None = None) -> SimResult:
    """Run one simulation to completion (deterministic for a given ``cfg.seed``)."""
    return asyncio.run(Simulation(cfg).run(requests, progress))


def block_tokens(block_id: int, n: int, vocab: int = 30000) -> list[int]:
    """``n`` deterministic token ids standing for a trace's block ``block_id``."""
    rng = random.Random(block_id * 7919 + 17)
    return [100 + rng.randrange(vocab) for _ in range(n)]


__all__ = ["ScaleEvent", "SimConfig", "SimResult", "Simulation", "WorkloadRequest", "simulate",
           "block_tokens", "ideal_hits", "to_block_hash"]
