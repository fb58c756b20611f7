"""Workloads for the policy benchmark, each a list of ``WorkloadRequest`` (deterministic per
seed). Shapes follow their sources:

* ``sglang_gsp``: SGLang ``bench_serving --dataset-name generated-shared-prefix`` defaults:
  64 groups x 16 prompts, 2,048-token system prompt, 128-token question, 256 output tokens.
* ``llmd_b2b``: llm-d's "B2B SaaS" capacity benchmark (llm-d/llm-d-kv-cache
  ``benchmarking/73-capacity``): 150 groups x 5 prompts, 6,000-token system prompt,
  1,200-token question, 1,000 output tokens; Poisson arrivals.
* ``mooncake``: Mooncake FAST'25 conversation trace (``loadtest/data/mooncake``, Apache-2.0):
  its timestamps (optionally sped up), lengths and 512-token hash blocks. Block hashes are
  taken from the trace's block ids (exact at that granularity: run it with block size 512).
* ``multiturn``: MT-Bench questions (FastChat, Apache-2.0) as growing multi-turn chats of many
  concurrent users; each answer's tokens are part of the next turn's prompt.
* ``control``: unique prompts, nothing shared.
* ``bursty``: arrival times and lengths of the Azure LLM inference 2023 code trace
  (``loadtest/data/azure-llm-2023``, CC-BY-4.0) over 20 shared repository contexts.
* ``agentic``: tool-using agents (ReAct, Yao et al. ICLR 2023; SWE-agent, Yang et al.
  NeurIPS 2024): each task a loop of steps whose prompt is the agent's long, fixed
  system prompt with its tool definitions, then the whole history, every earlier action and
  tool observation; the next step follows the previous answer after the tool runs, with no
  human think time. Lengths calibrated to Mooncake's tool&agent trace (FAST'25, Table 2:
  8,596 input and 182 output tokens on average, "lengthy system prompts that are fully
  repetitive").
* ``rag``: retrieval-augmented questions: a shared instruction, then the top ``k`` chunks a
  retriever returned for the question, in its relevance order, then the question. Chunk
  popularity is skewed (RAGCache, Jin et al. 2024, arXiv:2404.12457, section 3: a small
  share of the documents takes most retrievals) and one chunk comes at a different rank
  from one question to the next, so prefix caching reuses only up to the first chunk that
  differs (CacheBlend, Yao et al. EuroSys 2025, section 2).
"""

from __future__ import annotations

import csv
import functools
import itertools
import json
import math
import random
from datetime import datetime
from pathlib import Path
from typing import Sequence

from loadtest.sim import WorkloadRequest, block_tokens

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "loadtest" / "data"
MT_BENCH = ROOT / "loadtest" / "data" / "mt-bench" / "question.jsonl"


def _poisson_times(n: int, rate: float, rng: random.Random) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [100 + rng.randrange(30000) for _ in range(n)]


def shared_prefix(groups: int, per_group: int, system: int, question: int, output: int,
                  rate: float, seed: int) -> list[WorkloadRequest]:
    """Groups sharing a system prompt; prompts shuffled over time; Poisson arrivals."""
    rng = random.Random(seed)
    systems = [_tokens(rng, system) for _ in range(groups)]
    prompts = [(g, _tokens(rng, question)) for g in range(groups) for _ in range(per_group)]
    rng.shuffle(prompts)
    times = _poisson_times(len(prompts), rate, rng)
    return [WorkloadRequest(t, systems[g] + q, output, first_user_text=_text(q))
            for t, (g, q) in zip(times, prompts)]


def sglang_gsp(rate: float = 8.0, seed: int = 0) -> list[WorkloadRequest]:
    return shared_prefix(64, 16, 2048, 128, 256, rate, seed)


def llmd_b2b(rate: float = 15.0, seed: int = 0) -> list[WorkloadRequest]:
    return shared_prefix(150, 5, 6000, 1200, 1000, rate, seed)


def control(rate: float = 10.0, n: int = 1000, seed: int = 0) -> list[WorkloadRequest]:
    rng = random.Random(seed)
    times = _poisson_times(n, rate, rng)
    out = []
    for t in times:
        toks = _tokens(rng, rng.randrange(256, 4096))
        out.append(WorkloadRequest(t, toks, 128, first_user_text=_text(toks)))
    return out


def _text(tokens: Sequence[int]) -> str:
    from loadtest.sim import tokens_to_text
    return tokens_to_text(tokens[:100])


def _words_to_tokens(text: str) -> list[int]:
    import zlib
    return [100 + zlib.crc32(w.encode()) % 30000 for w in text.split()]


def multiturn(users: int = 128, turns: int = 6, rate_users: float = 4.0,
              think_s: float = 20.0, output: int = 200, system_tokens: int = 1000,
              seed: int = 0) -> list[WorkloadRequest]:
    """Users arrive at ``rate_users``/s; each holds a chat of ``turns`` MT-Bench questions
    with ~``think_s`` s between turns; a system prompt shared by all users."""
    rng = random.Random(seed)
    questions = [t for line in MT_BENCH.read_text().splitlines()
                 for t in json.loads(line)["turns"]]
    system = _tokens(rng, system_tokens)
    out = []
    starts = _poisson_times(users, rate_users, rng)
    for u, t0 in enumerate(starts):
        history = list(system)
        t = t0
        for k in range(turns):
            q = _words_to_tokens(rng.choice(questions)) * 3  # ~ tokens of a question
            prompt = history + q
            answer = _tokens(rng, output)
            out.append(WorkloadRequest(t, prompt, output, first_user_text=_text(q),
                                       output_plan=answer, session=f"u{u}"))
            history = prompt + answer
            t += think_s * (0.5 + rng.random())
    return out


MOONCAKE_CONVERSATION = DATA / "mooncake" / "conversation_trace.jsonl.gz"


def mooncake_rows(path: Path | None = None) -> list[dict]:
    """The rows of a Mooncake-format trace (``.jsonl`` or ``.jsonl.gz``; default: the
    FAST'25 conversation trace in ``loadtest/data/mooncake``, Apache-2.0): ``timestamp``
    (ms), ``input_length`` / ``output_length`` (tokens), ``hash_ids`` (512-token blocks)."""
    import gzip
    path = Path(path or MOONCAKE_CONVERSATION)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def mooncake(speed: float = 1.0, limit: int | None = None,
             path: Path | None = None) -> list[WorkloadRequest]:
    """The conversation trace at ``speed`` times its pace (block size 512)."""
    out = []
    for row in mooncake_rows(path)[:limit]:
        n = row["input_length"]
        ids = row["hash_ids"]
        toks = LazyBlockTokens(ids, n, 512)
        full = n // 512
        out.append(WorkloadRequest(row["timestamp"] / 1000.0 / speed, toks,
                                   max(row["output_length"], 1),
                                   first_user_text=f"mc{ids[0]}",
                                   block_hashes=[h + 1 for h in ids[:full]]))
    return out


@functools.lru_cache(maxsize=4096)
def _cached_block(block_id: int, n: int) -> tuple[int, ...]:
    return tuple(block_tokens(block_id, n))


class LazyBlockTokens(Sequence[int]):
    """A trace prompt's token ids, materialised per 512-token block only when read."""

    def __init__(self, block_ids: list[int], length: int, block_size: int):
        self.block_ids, self.length, self.bs = block_ids, length, block_size

    def __len__(self) -> int:
        return self.length

    def __iter__(self):
        for b in range(-(-self.length // self.bs)):
            yield from self._block(b)[:self.length - b * self.bs]

    def _block(self, b: int) -> list[int]:
        return _cached_block(self.block_ids[b] if b < len(self.block_ids) else -1 - b, self.bs)

    def __getitem__(self, i):
        if isinstance(i, slice):
            start, stop, step = i.indices(self.length)
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            out: list[int] = []
            b = start // self.bs
            while start < stop:
                blk = self._block(b)
                lo = start - b * self.bs
                hi = min(stop - b * self.bs, self.bs)
                out += list(blk[lo:hi])
                start = (b + 1) * self.bs
                b += 1
            return out
        if i < 0:
            i += self.length
        return self._block(i // self.bs)[i % self.bs]

    def __add__(self, other):
        return list(self) + list(other)


def bursty(n: int | None = 2000, contexts: int = 20, seed: int = 0,
           path: Path | None = None) -> list[WorkloadRequest]:
    """Azure code-trace arrivals and lengths; prompts start with one of ``contexts`` shared
    repository contexts (up to 3,000 tokens) and end with a unique part."""
    path = path or DATA / "azure-llm-2023" / "AzureLLMInferenceTrace_code.csv"
    rng = random.Random(seed)
    ctx = [_tokens(rng, rng.randrange(1000, 3000)) for _ in range(contexts)]
    rows = list(csv.DictReader(path.open()))
    if n is not None:
        rows = rows[:n]
    t0 = _ts(rows[0]["TIMESTAMP"])
    out = []
    for row in rows:
        total = int(row["ContextTokens"])
        c = ctx[rng.randrange(contexts)]
        shared = c[:min(len(c), total // 2)]
        toks = shared + _tokens(rng, max(total - len(shared), 1))
        out.append(WorkloadRequest(_ts(row["TIMESTAMP"]) - t0, toks,
                                   max(int(row["GeneratedTokens"]), 1),
                                   first_user_text=_text(toks[len(shared):])))
    return out


def agentic(rate_tasks: float = 3.0, tasks: int = 400, agents: int = 16,
            system_tokens: tuple[int, int] = (2500, 6500), steps: tuple[int, int] = (2, 14),
            output_mean: float = 182.0, observation_median: float = 400.0,
            tool_s: tuple[float, float] = (0.5, 3.0), seed: int = 0) -> list[WorkloadRequest]:
    """Agent tasks arriving at ``rate_tasks``/s (Poisson), ``tasks`` of them.

    Each task belongs to one of ``agents`` agents (popularity ~ 1/rank), whose system prompt
    (tool definitions) is ``system_tokens`` long (uniform in the range) and shared by all of
    its tasks. A task runs ``steps`` steps (uniform); step ``i``'s prompt is the system
    prompt, the task (64-512 tokens) and steps ``0..i-1``'s actions (the model's output,
    exponential with mean ``output_mean`` tokens, 16-1024) and tool observations
    (log-normal, median ``observation_median`` tokens, sigma 1, at most 4,096). Step ``i+1``
    arrives after step ``i``'s expected answer time (``output`` x 10 ms) plus the tool's
    run time (uniform ``tool_s``). With the defaults the mean prompt is about 8.6k tokens
    and the mean output 182, Mooncake's tool&agent averages (FAST'25, Table 2).
    """
    rng = random.Random(seed)
    systems = [_tokens(rng, rng.randrange(*system_tokens)) for _ in range(agents)]
    weights = [1.0 / (k + 1) for k in range(agents)]
    out = []
    for task, t in enumerate(_poisson_times(tasks, rate_tasks, rng)):
        history = systems[rng.choices(range(agents), weights)[0]] + _tokens(
            rng, rng.randrange(64, 512))
        new = history[-64:]
        for _ in range(rng.randint(*steps)):
            n_out = min(max(int(rng.expovariate(1.0 / output_mean)), 16), 1024)
            action = _tokens(rng, n_out)
            out.append(WorkloadRequest(t, list(history), n_out, first_user_text=_text(new),
                                       output_plan=action, session=f"a{task}"))
            new = _tokens(rng, min(int(rng.lognormvariate(math.log(observation_median), 1.0)),
                                   4096) + 1)
            history = history + action + new
            t += n_out * 0.010 + rng.uniform(*tool_s)
    out.sort(key=lambda r: r.arrival_s)
    return out


def rag(rate: float = 40.0, n: int = 3000, chunks: int = 2000, k: int = 5,
        chunk_tokens: int = 512, instruction_tokens: int = 400,
        question: tuple[int, int] = (16, 96), output: int = 128, zipf_s: float = 1.1,
        seed: int = 0) -> list[WorkloadRequest]:
    """``n`` retrieval-augmented questions at ``rate``/s (Poisson).

    Prompt: a shared instruction (``instruction_tokens``), then ``k`` distinct chunks of
    ``chunk_tokens`` from a corpus of ``chunks``, drawn with Zipf popularity (exponent
    ``zipf_s``: chunk ``j`` weighs ``1 / (j + 1) ** zipf_s``) and ordered by a relevance
    score drawn per question (so a hot chunk appears at every rank), then the question
    (uniform in ``question`` tokens); ``output`` tokens answered.
    """
    rng = random.Random(seed)
    corpus = [_tokens(rng, chunk_tokens) for _ in range(chunks)]
    instruction = _tokens(rng, instruction_tokens)
    cum = list(itertools.accumulate(1.0 / (j + 1) ** zipf_s for j in range(chunks)))
    out = []
    for t in _poisson_times(n, rate, rng):
        picked: list[int] = []
        while len(picked) < k:
            j = rng.choices(range(chunks), cum_weights=cum)[0]
            if j not in picked:
                picked.append(j)
        # the retriever's relevance order: independent of popularity
        rng.shuffle(picked)
        q = _tokens(rng, rng.randint(*question))
        toks = list(instruction)
        for j in picked:
            toks += corpus[j]
        out.append(WorkloadRequest(t, toks + q, output, first_user_text=_text(q)))
    return out


def _ts(s: str) -> float:
    return datetime.strptime(s[:26], "%Y-%m-%d %H:%M:%S.%f").timestamp()


WORKLOADS = {"sglang_gsp": sglang_gsp, "llmd_b2b": llmd_b2b, "multiturn": multiturn,
             "control": control, "bursty": bursty, "mooncake": mooncake,
             "agentic": agentic, "rag": rag}
