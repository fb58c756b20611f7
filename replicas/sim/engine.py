"""The simulated engine's core: vLLM-style continuous batching over a prefix-caching block pool.

One ``SimEngine.step()`` is one engine step, as vLLM v1's scheduler does it
(``vllm/v1/core/sched/scheduler.py``, simplified):

1. Running requests first: a decoding request takes 1 token of the step's token budget
   (``max_num_batched_tokens``), a request still in prefill takes a chunk of what is left
   (chunked prefill). A request that needs a new block when none is free preempts the most
   recently admitted running request (recompute: its blocks are freed, it re-queues first).
2. Then waiting requests in arrival order while the budget and ``max_num_seqs`` allow: at
   admission the longest cached prefix is found (capped at ``prompt_tokens - 1``, in whole
   blocks) and reused; ``num_cached_tokens`` is what vLLM reports as ``cached_tokens``.
3. The step lasts ``StepTimeModel.step_s(prefill tokens, decode seqs, context tokens)``;
   at its end a request whose prefill completed emits its first token, a decoding request
   one more, newly full blocks are cached (``BlockStored``), finished requests free their
   blocks tail first.

The engine has no clock: the real-time server sleeps each step's duration, the virtual-time
simulator advances its clock by it. Both drive the same object.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from replicas.sim.block_pool import BlockPool, KVCacheBlock
from replicas.sim.step_model import StepTimeModel
from router.hashing import BlockHasher, HashSettings, to_block_hash
from router.policy.base import max_cached_blocks


@dataclass
class SimRequest:
    """A request inside the simulated engine.

    Attributes:
        request_id: caller's id.
        prompt_token_ids: the prompt's token ids.
        max_tokens: output tokens to produce (no EOS: exactly this many).
        block_hashes: the prompt's full-block hashes (computed on admission if empty; a
            trace replay may pass them directly).
        cache_salt: mixed into block 0's hash.
        output_plan: the token ids to "generate" (a trace's next turn then reuses the
            blocks the engine cached for this answer); random ids when None.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    block_hashes: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    arrival_s: float = 0.0
    digests: list[bytes] = field(default_factory=list)
    output_plan: list[int] | None = None
    # state
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    blocks: list[KVCacheBlock] = field(default_factory=list)
    num_cached_blocks: int = 0
    finished: bool = False
    aborted: bool = False
    first_token_step: int | None = None
    scheduled_s: float | None = None  # engine time it first ran (its queueing ends)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def in_prefill(self) -> bool:
        """Whether the next step computes more than the last sampled token (the prompt, or
        a recompute after preemption)."""
        return not self.output_token_ids or self.num_tokens - self.num_computed_tokens > 1


@dataclass
class StepResult:
    """What one step did: its duration (s), token counts, requests that got their first
    token, every (request, new token) pair, and requests that finished. A run of pure
    decode steps (``SimEngine.decode_run``) is one result with ``step_durations_s``, each
    of its steps' modelled time in order (they sum to ``duration_s``)."""

    duration_s: float
    prefill_tokens: int
    decode_seqs: int
    first_tokens: list[SimRequest]
    new_tokens: list[tuple[SimRequest, int]]
    finished: list[SimRequest]
    step_durations_s: list[float] | None = None


@dataclass
class EngineConfig:
    """Capacity and scheduling limits of one simulated engine."""

    num_blocks: int = 32768
    block_size: int = 32
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    vocab_size: int = 8000


def _token_span(req: SimRequest, start: int, end: int) -> list[int]:
    """Tokens ``start:end`` of the request's prompt followed by its output (without
    building the whole sequence: trace prompts are materialised lazily)."""
    p = len(req.prompt_token_ids)
    out = list(req.prompt_token_ids[start:min(end, p)]) if start < p else []
    if end > p:
        out += req.output_token_ids[max(start - p, 0):end - p]
    return out


class SimEngine:
    """One simulated engine (block pool + scheduler + step-time model)."""

    def __init__(self, config: EngineConfig, step_model: StepTimeModel,
                 hash_settings: HashSettings | None = None):
        self.config = config
        self.step_model = step_model
        self.hasher = BlockHasher(hash_settings or HashSettings(block_size=config.block_size))
        self.pool = BlockPool(config.num_blocks)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.steps = 0
        # Prometheus-style totals (vllm:prompt_tokens_total etc.)
        self.prompt_tokens_total = 0
        self.prompt_tokens_cached_total = 0
        self.generation_tokens_total = 0
        self.prefix_cache_queries_total = 0
        self.prefix_cache_hits_total = 0
        self.prefill_time_sum_s = 0.0
        self.requests_finished_total = 0  # vllm:request_success_total (any reason)
        self.preemptions_total = 0  # vllm:num_preemptions_total
        self.now_s = 0.0  # the caller's clock at the start of the next step (queueing time)

    # --- requests --------------------------------------------------------------------
    def add_request(self, req: SimRequest) -> None:
        if not req.block_hashes:
            req.digests = self.hasher.digests(req.prompt_token_ids, cache_salt=req.cache_salt)
            req.block_hashes = [to_block_hash(d) for d in req.digests]
        self.waiting.append(req)

    def abort(self, request_id: str) -> None:
        """Stop a request (client gone): its blocks are freed at once."""
        for req in list(self.running):
            if req.request_id == request_id:
                self.running.remove(req)
                self._finish(req, aborted=True)
                return
        for req in list(self.waiting):
            if req.request_id == request_id:
                self.waiting.remove(req)
                req.aborted = req.finished = True
                self.requests_finished_total += 1
                return

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- one step --------------------------------------------------------------------
    def _blocks_needed(self, req: SimRequest, num_new_tokens: int) -> int:
        total = req.num_computed_tokens + num_new_tokens
        return max(math.ceil(total / self.config.block_size) - len(req.blocks), 0)

    def _admit(self, req: SimRequest) -> bool:
        """Prefix hit and first allocation of a waiting request; False if no room."""
        bs = self.config.block_size
        max_hit_blocks = max_cached_blocks(req.prompt_tokens, bs)
        hit = self.pool.longest_cached_prefix(req.block_hashes[:max_hit_blocks])
        # free blocks needed beyond the hit blocks that are themselves in the free queue
        hit_free = sum(1 for b in hit if b.ref_cnt == 0)
        if self.pool.num_free_blocks - hit_free < 1:
            return False
        self.pool.touch(hit)
        req.blocks = list(hit)
        req.num_cached_blocks = len(hit)
        req.num_computed_tokens = len(hit) * bs
        if req.num_cached_tokens < 0:  # first admission (not a preemption re-admit)
            req.num_cached_tokens = req.num_computed_tokens
            self.prompt_tokens_total += req.prompt_tokens
            self.prompt_tokens_cached_total += req.num_cached_tokens
            self.prefix_cache_queries_total += req.prompt_tokens
            self.prefix_cache_hits_total += req.num_cached_tokens
        return True

    def _allocate(self, req: SimRequest, num_new_tokens: int) -> bool:
        need = self._blocks_needed(req, num_new_tokens)
        if need > self.pool.num_free_blocks:
            return False
        if need:
            req.blocks.extend(self.pool.get_new_blocks(need))
        return True

    def _preempt_one(self, keep: SimRequest) -> bool:
        for victim in reversed(self.running):
            if victim is keep:
                continue
            self.running.remove(victim)
            self.preemptions_total += 1
            self.pool.free_blocks(reversed(victim.blocks))
            victim.blocks = []
            victim.num_cached_blocks = 0
            victim.num_computed_tokens = 0
            self.waiting.appendleft(victim)
            return True
        return False

    def schedule(self) -> tuple[list[tuple[SimRequest, int]], int, int, int]:
        """Pick this step's work: ``[(request, tokens)]``, prefill tokens, decode sequences
        and context tokens."""
        budget = self.config.max_num_batched_tokens
        scheduled: list[tuple[SimRequest, int]] = []
        for req in list(self.running):
            if budget <= 0:
                break
            if req not in self.running:
                continue  # preempted by an earlier request this step
            n = min(req.num_tokens - req.num_computed_tokens, budget) if req.in_prefill else 1
            while not self._allocate(req, n):
                if not self._preempt_one(keep=req):
                    n = 0
                    break
            if n:
                scheduled.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            if not self._admit(req):
                break
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate(req, n):
                self.pool.free_blocks(reversed(req.blocks))
                req.blocks = []
                break
            self.waiting.popleft()
            self.running.append(req)
            if req.scheduled_s is None:  # first time it runs: its queueing ends
                req.scheduled_s = self.now_s
            scheduled.append((req, n))
            budget -= n
        prefill = sum(n for r, n in scheduled if r.in_prefill)
        decode = sum(1 for r, n in scheduled if not r.in_prefill)
        context = sum(r.num_computed_tokens + n for r, n in scheduled)
        return scheduled, prefill, decode, context

    def step(self) -> StepResult:
        """Run one step; returns what happened (duration from the step-time model)."""
        scheduled, prefill, decode, context = self.schedule()
        duration = self.step_model.step_s(prefill, decode, context) if scheduled else 0.0
        if prefill:
            self.prefill_time_sum_s += duration
        self.steps += 1
        first, new_tokens, finished = [], [], []
        for req, n in scheduled:
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_tokens:
                self._cache_blocks(req)
                continue  # more prefill chunks to go
            tok = self._next_token(req)
            req.output_token_ids.append(tok)
            self.generation_tokens_total += 1
            new_tokens.append((req, tok))
            if req.first_token_step is None:
                req.first_token_step = self.steps
                first.append(req)
            self._cache_blocks(req)
            if len(req.output_token_ids) >= req.max_tokens:
                self.running.remove(req)
                self._finish(req)
                finished.append(req)
        return StepResult(duration, prefill, decode, first, new_tokens, finished)

    def _next_token(self, req: SimRequest) -> int:
        k = len(req.output_token_ids)
        if req.output_plan is not None and k < len(req.output_plan):
            return req.output_plan[k]
        # Deterministic "sampling": a function of the request and position (ids 100.. avoid
        # special tokens of the generated tokenizer).
        x = (hash((req.request_id, k)) & 0x7FFFFFFF)
        return 100 + x % max(self.config.vocab_size - 200, 1)

    def decode_run(self, max_steps: int, max_duration_s: float = math.inf
                   ) -> StepResult | None:
        """Advance up to ``max_steps`` pure-decode steps (lasting at most ``max_duration_s``
        together) at once, exactly as step by step would: only when nothing waits and every
        running request decodes, for as many steps as no request finishes and the pool has
        the blocks; the duration is the sum of the steps' modelled times (context grows by one
        token per sequence per step). Returns None when a single step is needed instead."""
        if self.waiting or not self.running or max_steps < 2:
            return None
        if any(r.in_prefill for r in self.running):
            return None
        n = len(self.running)
        ctx0 = sum(r.num_computed_tokens + 1 for r in self.running)
        m = self.step_model

        def duration(k: int) -> float:
            return (k * (m.a_s + m.c_s_per_seq * n)
                    + m.d_s_per_context_token * (k * ctx0 + n * k * (k - 1) / 2))

        k = min(max_steps, min(r.max_tokens - len(r.output_token_ids) for r in self.running))
        if duration(k) > max_duration_s:
            lo, hi = 0, k  # largest k with duration(k) <= max_duration_s
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if duration(mid) <= max_duration_s:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        if k < 2:
            return None
        bs = self.config.block_size
        need = sum(max(math.ceil((r.num_computed_tokens + k) / bs) - len(r.blocks), 0)
                   for r in self.running)
        if need > self.pool.num_free_blocks:
            return None
        new_tokens, finished = [], []
        for req in list(self.running):
            self._allocate(req, k)
            for _ in range(k):
                req.num_computed_tokens += 1
                tok = self._next_token(req)
                req.output_token_ids.append(tok)
                new_tokens.append((req, tok))
            self.generation_tokens_total += k
            self._cache_blocks(req)
            if len(req.output_token_ids) >= req.max_tokens:
                self.running.remove(req)
                self._finish(req)
                finished.append(req)
        self.steps += k
        steps = [m.a_s + m.c_s_per_seq * n + m.d_s_per_context_token * (ctx0 + n * j)
                 for j in range(k)]  # duration(k) term by term
        return StepResult(duration(k), 0, n, [], new_tokens, finished, steps)

    def _cache_blocks(self, req: SimRequest) -> None:
        """Cache the request's newly full blocks (prompt and generated tokens)."""
        bs = self.config.block_size
        full = req.num_computed_tokens // bs
        if full <= req.num_cached_blocks:
            return
        while len(req.block_hashes) < full:  # blocks of generated tokens extend the chain
            i = len(req.block_hashes)
            tokens = _token_span(req, i * bs, (i + 1) * bs)
            parent = req.digests[-1] if len(req.digests) == i and i > 0 \
                else (req.block_hashes[-1].to_bytes(8, "big") if i > 0 else None)
            digest = self.hasher.block_digest(parent, tokens)
            if len(req.digests) == i:
                req.digests.append(digest)
            req.block_hashes.append(to_block_hash(digest))
        start = req.num_cached_blocks
        parent_hash = req.block_hashes[start - 1] if start > 0 else None
        self.pool.cache_full_blocks(req.blocks[start:full], req.block_hashes[start:full],
                                    parent_hash)
        req.num_cached_blocks = full

    def _finish(self, req: SimRequest, aborted: bool = False) -> None:
        self.requests_finished_total += 1
        req.finished = True
        req.aborted = aborted
        self.pool.free_blocks(reversed(req.blocks))
        req.blocks = []

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self):
        return self.pool.take_events()
