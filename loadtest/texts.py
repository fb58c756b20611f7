"""Deterministic prompt text for the load tests, with no load-tool import (the locust kit,
the asyncio benchmarks and the GPU benchmark share it).

With a tokenizer (a model directory's ``tokenizer.json``), text is made of words that each
encode to exactly one token, so a prompt of ``n`` words is ``n`` tokens and blocks of text
stay aligned with the engine's KV blocks; without one, a fixed vocabulary of common words
(about one token each).
"""

from __future__ import annotations

import functools
import json
import logging
import random
from pathlib import Path

logger = logging.getLogger(__name__)

DATA = Path(__file__).resolve().parent / "data"
MT_BENCH = DATA / "mt-bench" / "question.jsonl"
MOONCAKE_CONVERSATION = DATA / "mooncake" / "conversation_trace.jsonl.gz"


@functools.lru_cache(maxsize=4)
def _word_tokens(tokenizer_dir: str | None) -> tuple[tuple[str, ...], bool]:
    """Words that each encode to exactly one token of the model's tokenizer (a space
    followed by 3-8 lowercase letters), and True; without a tokenizer, a fixed vocabulary
    of common words (about one token each in BPE vocabularies) and False."""
    if tokenizer_dir:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
        words = sorted(tok.decode([i]) for k, i in tok.get_vocab().items()
                       if k.startswith("\u0120") and k[1:].isalpha() and k[1:].islower()
                       and 3 <= len(k) - 1 <= 8)
        sample = "".join(random.Random(0).choice(words) for _ in range(512))
        if words and len(tok.encode(sample, add_special_tokens=False).ids) == 512:
            return tuple(words), True
        logger.warning("tokenizer %s: word tokens do not encode one to one; token counts of "
                       "generated prompts are approximate", tokenizer_dir)
    words = [w for q in mt_bench_turns()[:80] for w in q.lower().split() if w.isalpha()]
    return tuple(sorted({" " + w for w in words})), False


def words_text(n_tokens: int, seed: str, tokenizer_dir: str | None = None) -> str:
    """About ``n_tokens`` tokens of deterministic text for ``seed`` (exactly ``n_tokens``
    with a tokenizer: ``--tokenizer``). Equal seeds give equal text."""
    words, _ = _word_tokens(tokenizer_dir)
    rng = random.Random(seed)
    return "".join(rng.choice(words) for _ in range(max(n_tokens, 0)))


@functools.lru_cache(maxsize=1)
def mt_bench_turns() -> list[str]:
    """MT-Bench's questions, every turn (FastChat, Apache-2.0, ``loadtest/data/mt-bench``)."""
    out = []
    for line in MT_BENCH.read_text().splitlines():
        out.extend(json.loads(line)["turns"])
    return out


def trace_rows(path: str | Path) -> list[dict]:
    """A Mooncake-format trace (``.jsonl`` or ``.jsonl.gz``), sorted by ``timestamp``."""
    import gzip
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return sorted(rows, key=lambda r: r["timestamp"])


@functools.lru_cache(maxsize=8192)
def _block_words(block_id: int, n_tokens: int, tokenizer_dir: str | None,
                 seed: str) -> tuple[str, ...]:
    words, _ = _word_tokens(tokenizer_dir)
    rng = random.Random(f"mooncake-block-{seed}-{block_id}")
    return tuple(rng.choice(words) for _ in range(n_tokens))


def trace_prompt(hash_ids: list[int], input_length: int, block_tokens: int = 512,
                 tokenizer_dir: str | None = None, seed: str = "0") -> str:
    """The text of a trace row: one deterministic block of ``block_tokens`` words (tokens,
    exactly, with a tokenizer) per hash id, the same for the same id, the last block cut so
    the whole is ``input_length`` tokens; a row longer than its blocks ends in filler of
    its own. Another ``seed`` gives other text for the same ids (a run that must find
    nothing cached from an earlier one)."""
    parts: list[str] = []
    left = input_length
    for h in hash_ids:
        if left <= 0:
            break
        words = _block_words(h, block_tokens, tokenizer_dir, seed)
        parts.extend(words[:left])
        left -= min(block_tokens, left)
    if left > 0:
        parts.append(words_text(left, f"mooncake-tail-{seed}-{hash_ids}", tokenizer_dir))
    return "".join(parts)
