"""Request bodies decoded: CPU per body, ``json.loads`` against the ingress's
``decode_json_body`` (msgspec first, ``json.loads`` for what msgspec refuses).

Why: the ingress decodes every request body on its event loop (or a render thread), holding
the GIL, before it can route; a burst of long prompts takes those turns one after another
(docs/fault-cases.md 10.1). This measures the decoding alone, in one process: chat bodies of
``--tokens`` tokens each (the system prompt of ``loadtest.router_throughput``'s burst, 134 KB
at 32k tokens, and its 2k-token turns), ``--bodies`` distinct bodies per run, each decoded
``--repeat`` times; the figure is ``time.process_time`` per body. The two decoders alternate
for ``--rounds`` rounds; the median is kept. Each run first checks that both give the same
value.

    python -m loadtest.body_decode_bench --doc
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from loadtest.report import write_benchmark_doc
from router.serve.ingress import decode_json_body

DECODERS = {"json.loads": json.loads, "decode_json_body": decode_json_body}


def chat_bodies(tokens: int, n: int) -> list[bytes]:
    """``n`` chat bodies with a system prompt of about ``tokens`` tokens each (words of the
    generated model's vocabulary, as the router throughput benchmark sends)."""
    from deploy.make_model import ensure_model
    from loadtest.router_throughput import MODEL_NAME, words_text
    from router.config import DEFAULT_MODEL_DIR

    ensure_model(DEFAULT_MODEL_DIR)
    return [json.dumps({"model": MODEL_NAME, "max_tokens": 1, "stream": True, "messages": [
        {"role": "system", "content": words_text(tokens, f"decode-{tokens}-{i}",
                                                 str(DEFAULT_MODEL_DIR))},
        {"role": "user", "content": "Summarise."}]}).encode() for i in range(n)]


def cpu_per_body(decode, bodies: list[bytes], repeat: int) -> float:
    """Microseconds of this process's CPU per body decoded by ``decode``."""
    t = time.process_time()
    for _ in range(repeat):
        for b in bodies:
            decode(b)
    return (time.process_time() - t) / (repeat * len(bodies)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[2048, 32768])
    ap.add_argument("--bodies", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--doc", action="store_true", help="write the docs/benchmarks.md section")
    a = ap.parse_args()
    rows = ["| prompt tokens | body (KB) | decoder | CPU per body (us), median | runs (us) |",
            "|---|---|---|---|---|"]
    for tokens in a.tokens:
        bodies = chat_bodies(tokens, a.bodies)
        for b in bodies:
            assert repr(decode_json_body(b)) == repr(json.loads(b))
        runs: dict[str, list[float]] = {name: [] for name in DECODERS}
        for _ in range(a.rounds):
            for name, fn in DECODERS.items():
                runs[name].append(cpu_per_body(fn, bodies, a.repeat))
                print(f"{tokens} tokens, {name}: {runs[name][-1]:.1f} us", flush=True)
        kb = statistics.mean(map(len, bodies)) / 1000
        for name, r in runs.items():
            rows.append(f"| {tokens:,} | {kb:.0f} | {name} | {statistics.median(r):.1f} | "
                        f"{', '.join(f'{c:.1f}' for c in r)} |")
    table = "\n".join(rows)
    print(table)
    if a.doc:
        write_benchmark_doc(
            "Request bodies decoded by msgspec",
            "python -m loadtest.body_decode_bench " + " ".join(
                ["--tokens", *map(str, a.tokens), "--bodies", str(a.bodies), "--repeat",
                 str(a.repeat), "--rounds", str(a.rounds), "--doc"]),
            f"{a.bodies} distinct chat bodies per size, each decoded {a.repeat} times a run; "
            "this process's CPU per body:\n\n" + table,
            "Reading: `decode_json_body` (router.serve.ingress) is what the ingress decodes "
            "every request body with: msgspec's strict decoder, then `json.loads` for the "
            "bodies msgspec refuses (NaN, numbers beyond a float's range, lone surrogate "
            "escapes, a byte order mark, UTF-16 and UTF-32), so that it accepts, refuses and "
            "decodes exactly what `json.loads` does (tests/test_ingress_input.py). Each body "
            "is decoded holding the GIL, so in a burst every request of a process waits for "
            "the others' decoding: at 32k tokens the saving is per request of the burst.")


if __name__ == "__main__":
    main()
