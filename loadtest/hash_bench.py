"""What hashing a prompt's blocks costs the router (``router.hashing.BlockHasher``).

Every routed prompt is cut into blocks and hashed exactly as vLLM hashes them (a digest of
the CBOR of ``(parent digest, block's token ids, extra keys)`` per block, chained), on the
ingress's CPU and holding the GIL. Two cases, each timed both ways in the same run:

- **new prompt**: nothing of it in the hasher's cache of recent prompts (the first turn of
  a conversation, or its next turn on an ingress process that did not see the last one):
  every block is hashed. ``bulk`` is ``BlockHasher.block_hashes`` (the ids of the blocks
  encoded together, ``cbor_token_blocks``); ``per block`` is one ``cbor2.dumps`` call per
  block (``BlockHasher.block_digest`` chained), the way every block was hashed before.
- **next turn**: the same conversation with 3 new blocks, its last turn in the cache:
  only the new blocks and those up to the next checkpoint are hashed.

Usage: ``python -m loadtest.hash_bench [--tokens 2048 8192 32768 131072] [--doc]``
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from loadtest.report import markdown_table, write_benchmark_doc
from router.hashing import BlockHasher, HashSettings

VOCAB = 151_936  # Qwen2.5's vocabulary: ids of 1, 2, 3 and 5 bytes in CBOR


def _per_block(hasher: BlockHasher, ids: list[int]) -> list[bytes]:
    bs, parent, out = hasher.settings.block_size, None, []
    for i in range(len(ids) // bs):
        parent = hasher.block_digest(parent, ids[i * bs:(i + 1) * bs])
        out.append(parent)
    return out


def bench(tokens: int, rounds: int = 5, seed: int = 0) -> dict:
    """Median milliseconds per prompt of ``tokens`` tokens over ``rounds`` alternating
    rounds (each round hashes ``max(1, 2**17 // tokens)`` new prompts each way, then as
    many next turns), and the speed-up of ``bulk`` over ``per block``.

    Raises:
        AssertionError: the two ways disagree on a digest (they must not).
    """
    rng = random.Random(seed)
    settings = HashSettings(block_size=32, hash_algo="xxhash_cbor", seed="0")
    per = max(1, 2 ** 17 // tokens)
    bulk_ms, block_ms, turn_ms = [], [], []
    for _ in range(rounds):
        prompts = [[rng.randrange(VOCAB) for _ in range(tokens)] for _ in range(per)]
        hasher = BlockHasher(settings)
        t0 = time.perf_counter()
        got = [hasher.digests(p) for p in prompts]
        t1 = time.perf_counter()
        want = [_per_block(hasher, p) for p in prompts]
        t2 = time.perf_counter()
        assert got == want
        turns = [p + [rng.randrange(VOCAB) for _ in range(3 * 32)] for p in prompts]
        t3 = time.perf_counter()
        for p in turns:
            hasher.digests(p)
        t4 = time.perf_counter()
        bulk_ms.append((t1 - t0) / per * 1e3)
        block_ms.append((t2 - t1) / per * 1e3)
        turn_ms.append((t4 - t3) / per * 1e3)
    bulk, block = statistics.median(bulk_ms), statistics.median(block_ms)
    return {"tokens": tokens, "blocks": tokens // 32, "bulk_ms": bulk, "per_block_ms": block,
            "speedup": block / bulk, "next_turn_ms": statistics.median(turn_ms),
            "bulk_us_per_block": bulk * 1e3 / (tokens // 32),
            "per_block_us_per_block": block * 1e3 / (tokens // 32)}


def table(rows: list[dict]) -> str:
    """``bench``'s rows as a markdown table."""
    return markdown_table(
        ["prompt tokens", "blocks", "new prompt, per block (ms)", "new prompt, bulk (ms)",
         "speed-up", "us per block: per block / bulk", "next turn, 3 new blocks (ms)"],
        [[f"{r['tokens']:,}", f"{r['blocks']:,}", f"{r['per_block_ms']:.3f}",
          f"{r['bulk_ms']:.3f}", f"{r['speedup']:.2f} x",
          f"{r['per_block_us_per_block']:.2f} / {r['bulk_us_per_block']:.2f}",
          f"{r['next_turn_ms']:.3f}"] for r in rows])


NOTES = """Block size 32, `xxhash_cbor`, ids drawn uniformly from a 151,936-token vocabulary
(1-, 2-, 3- and 5-byte CBOR ints). Medians of 5 rounds, each timing both ways on the
same new prompts; the two give the same digests (checked on every prompt). "Per block" is the digest chain
alone (`BlockHasher.block_digest`, one `cbor2.dumps` per block), which is what
`block_hashes` spent per block before the bulk encoding, without its cache's upkeep;
"bulk" is `block_hashes` itself, upkeep included, so the speed-up understates the change.
Prompts with fewer than `BlockHasher.BULK_MIN_BLOCKS` blocks to hash are still hashed
block by block."""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", nargs="+", type=int, default=[2048, 8192, 32768, 131072])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--doc", action="store_true", help="write the docs/benchmarks.md section")
    args = ap.parse_args(argv)
    rows = [bench(t, args.rounds) for t in args.tokens]
    text = table(rows)
    print(text)
    if args.doc:
        write_benchmark_doc("Block hashes: what hashing a prompt costs the router",
                            "python -m loadtest.hash_bench --doc", text, NOTES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
