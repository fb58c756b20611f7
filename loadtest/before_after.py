"""The lookup and overhead benchmarks of two commits, side by side on one machine.

Checks that a change makes nothing slower: the benchmarks of ``loadtest.index_bench``
(``--only lookup``, ``--only overhead``) run in a checkout of ``--base`` and in this tree,
alternately (base, this, base, this... for ``--rounds``), on the same Redis, and the table
gives each case's p50 in both and their ratio (this / base; a round's median per case).
Results go to ``docs/benchmarks.md`` under ``--section`` (and ``loadtest/results/``).

    python -m loadtest.before_after --base 70fc188 --iters 1000
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from loadtest.report import RESULTS, ROOT, write_benchmark_doc


def run_bench(tree: Path, only: str, iters: int, redis_url: str) -> list[dict]:
    """The JSON rows ``index_bench --only <only>`` prints, run in ``tree`` (its own code:
    the tree's folder comes first on ``sys.path``).

    Raises:
        subprocess.CalledProcessError: the benchmark failed.
    """
    cmd = [sys.executable, "-m", "loadtest.index_bench", "--only", only, "--no-doc",
           "--iters", str(iters), "--redis-url", redis_url]
    if only == "overhead":
        cmd += ["--processes", "1"]
    out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _key(row: dict) -> tuple | None:
    if "scenario" in row:
        return ("lookup", row["scenario"], row["tokens"], row["replicas"])
    if "unique" in row:
        return ("overhead", "each its own" if row["unique"] else "shared prefix", row["tokens"])
    return None  # ingestion and concurrent rows: not compared


_METRICS = {"lookup": ("lookup_p50_ms", "route_p50_ms"),
            "overhead": ("prepare_p50_ms", "decide_p50_ms", "total_p50_ms")}


def compare(base_runs: list[list[dict]], head_runs: list[list[dict]]) -> str:
    """Markdown tables: per case and metric, the median over rounds of base and head, and
    head / base."""
    def medians(runs):
        acc: dict[tuple, dict[str, list[float]]] = {}
        for rows in runs:
            for r in rows:
                k = _key(r)
                if k is None:
                    continue
                for m in _METRICS[k[0]]:
                    acc.setdefault(k, {}).setdefault(m, []).append(r[m])
        return {k: {m: statistics.median(v) for m, v in ms.items()} for k, ms in acc.items()}

    b, h = medians(base_runs), medians(head_runs)
    ratios: list[float] = []
    lines = ["| benchmark | case | metric | base p50 (ms) | this p50 (ms) | this / base |",
             "|---|---|---|---|---|---|"]
    for k in sorted(set(b) & set(h), key=str):
        for m in _METRICS[k[0]]:
            ratio = h[k][m] / b[k][m] if b[k][m] else float("nan")
            ratios.append(ratio)
            case = " ".join(str(x) for x in k[1:])
            lines.append(f"| {k[0]} | {case} | {m.removesuffix('_p50_ms')} | {b[k][m]:.3f} | "
                         f"{h[k][m]:.3f} | {ratio:.2f} |")
    gm = statistics.geometric_mean(ratios) if ratios else float("nan")
    return "\n".join(lines) + (f"\n\nGeometric mean of this / base over {len(ratios)} cases: "
                               f"**{gm:.2f}**.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare with")
    ap.add_argument("--iters", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--section", default="Before and after a change: lookup and overhead")
    ap.add_argument("--no-doc", action="store_true")
    a = ap.parse_args(argv)
    cmd = "python -m loadtest.before_after " + " ".join(argv if argv is not None
                                                       else sys.argv[1:])
    base_rev = subprocess.run(["git", "rev-parse", "--short", a.base], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    head_rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, check=True,
                              capture_output=True, text=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "worktree", "add", "--detach", "-q", str(base_tree), a.base],
                       cwd=ROOT, check=True)
        if (ROOT / "models").is_dir():  # the generated test model (ignored by git)
            (base_tree / "models").symlink_to(ROOT / "models")
        try:
            base_runs, head_runs = [], []
            for rnd in range(a.rounds):
                for name, tree, runs in (("base", base_tree, base_runs),
                                         ("this", ROOT, head_runs)):
                    t0 = time.time()
                    rows = (run_bench(tree, "lookup", a.iters, a.redis_url)
                            + run_bench(tree, "overhead", a.iters, a.redis_url))
                    runs.append(rows)
                    print(f"round {rnd + 1}, {name}: {len(rows)} rows in "
                          f"{time.time() - t0:.0f} s", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(base_tree)], cwd=ROOT,
                           check=False)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"before-after-{int(time.time())}.json").write_text(
        json.dumps({"base": base_rev, "head": head_rev, "base_runs": base_runs,
                    "head_runs": head_runs}, indent=1))
    text = (f"Base `{base_rev}`, this tree `{head_rev}`, {a.rounds} round(s) each, alternately, "
            f"on one Redis:\n\n" + compare(base_runs, head_runs))
    print(text)
    if not a.no_doc:
        write_benchmark_doc(a.section, cmd.strip(), text,
                            "Reading: each case's p50 from `loadtest.index_bench` (lookup: the "
                            "Redis index's lookup and the atomic route; overhead: one request "
                            "through the ingress's prepare and decision, no engine). The "
                            "machine is shared: read a ratio against the spread between "
                            "rounds (`loadtest/results/before-after-*.json` keeps every "
                            "round).")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
