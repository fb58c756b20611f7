"""Policy benchmark: every routing policy on every workload, in virtual time.

One command runs the standard suite (each workload at one load point, plus the Mooncake
trace at its own pace) at 8 replicas and writes a Markdown table, a JSON file and PNG plots
(TTFT CDF per policy, hit rate against the ideals, load over time per replica under our
policy) under ``loadtest/results/``, and the tables to ``docs/benchmarks.md``::

    python -m loadtest.policy_bench                      # standard suite, 8 replicas
    python -m loadtest.policy_bench --replicas 8 16 32   # larger fleets
    python -m loadtest.policy_bench --workloads llmd_b2b --rates 3 15 30 60   # a rate sweep
    python -m loadtest.policy_bench --capacity constrained   # an eighth of the KV capacity
    python -m loadtest.policy_bench --workloads sglang_gsp \
        --policies prefix_aware:load_factor=1.25 prefix_aware:load_factor=inf \
        --section "Load bound trade-off"           # a policy with other parameters

A policy is named as in ``router.policy.make_policy``, optionally followed by
``:key=value,...`` keyword arguments (numbers; ``inf`` allowed).

Engines follow the H200 profile of a Qwen2.5-7B-shaped model (``replicas/sim/profiles``):
about 2.04 M tokens of KV cache per replica at 0.9 memory use ("h200"), or an eighth of it
("constrained", where eviction matters). The same seed gives the same numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from loadtest.report import RESULTS, write_benchmark_doc
from loadtest.sim import SimConfig, simulate
from loadtest.workloads import WORKLOADS
from replicas.sim.engine import EngineConfig
from replicas.sim.step_model import StepTimeModel

POLICIES = ["prefix_aware", "round_robin", "random", "least_loaded", "sglang_cache_aware",
            "ray_prefix_affinity", "dynamo_kv", "llmd_weighted", "kubeai_prefix_hash"]
KV_TOKENS = {"h200": 2_040_000, "constrained": 2_040_000 // 8}
# Load points of the standard suite (requests/s; users/s for multiturn; speed for the traces).
STANDARD = {"sglang_gsp": {"rate": 120.0}, "llmd_b2b": {"rate": 30.0},
            "multiturn": {"rate_users": 4.0}, "control": {"rate": 20.0},
            "bursty": {}, "mooncake": {"speed": 1.0}}
BLOCK_SIZE = {"mooncake": 512}


def parse_policy(spec: str) -> tuple[str, dict[str, float]]:
    """``"prefix_aware:load_factor=1.5"`` -> ``("prefix_aware", {"load_factor": 1.5})``.

    Raises:
        ValueError: a malformed ``key=value`` pair or a value that is not a number.
    """
    name, _, rest = spec.partition(":")
    kwargs = {}
    for pair in filter(None, rest.split(",")):
        key, sep, value = pair.partition("=")
        if not sep:
            raise ValueError(f"policy argument {pair!r} is not key=value")
        kwargs[key.strip()] = float(value)
    return name, kwargs


def workload(name: str, rate: float | None, seed: int):
    kwargs = dict(STANDARD[name])
    if rate is not None:
        key = "speed" if name == "mooncake" else ("rate_users" if name == "multiturn" else "rate")
        kwargs[key] = rate
    if name not in ("mooncake", "bursty"):
        kwargs["seed"] = seed
    return WORKLOADS[name](**kwargs), kwargs


def run_case(case: tuple, progress=None) -> dict:
    """One simulation of the suite: ``case`` = (replicas, workload, rate or None, policy
    spec, capacity, seed); returns its summary row."""
    n, wl, rate, spec, capacity, seed = case
    reqs, params = workload(wl, rate, seed)
    bs = BLOCK_SIZE.get(wl, 16)
    engine = EngineConfig(num_blocks=KV_TOKENS[capacity] // bs, block_size=bs,
                          max_num_batched_tokens=8192, max_num_seqs=256)
    pol, kwargs = parse_policy(spec)
    t0 = time.perf_counter()
    res = simulate(SimConfig(pol, replicas=n, engine=engine,
                             step_model=StepTimeModel.load("h200-qwen2.5-7b"), seed=seed,
                             policy_kwargs=kwargs), reqs, progress=progress)
    row = res.summary()
    row.update({"policy": spec, "workload": wl, "params": params, "replicas": n,
                "capacity": capacity, "wall_s": time.perf_counter() - t0,
                "machine": f"{platform.node()}: {os.cpu_count()} cores",
                "ttft_cdf": _cdf(res.ttft_s),
                "load_samples": res.load_samples[::10] if spec == "prefix_aware" else []})
    return row


def run_suite(workloads: list[str], replicas: list[int], policies: list[str],
              capacity: str, rates: list[float] | None, seed: int, progress=None,
              jobs: int = 1) -> list[dict]:
    """Every (replicas, workload, rate, policy) case, in that order; with ``jobs`` > 1 in
    that many processes (``progress`` then advances by a whole case's requests when it
    ends). The rows do not depend on ``jobs``: each case is its own seeded simulation."""
    cases = [(n, wl, rate, spec, capacity, seed) for n in replicas for wl in workloads
             for rate in (rates or [None]) for spec in policies]
    if jobs <= 1:
        return [run_case(c, progress) for c in cases]
    import multiprocessing as mp
    with mp.get_context("fork").Pool(jobs) as pool:
        rows = []
        for row in pool.imap(run_case, cases):
            if progress:
                progress(row["requests"])
            rows.append(row)
    return rows


def _cdf(xs: list[float], points: int = 200) -> list[tuple[float, float]]:
    xs = sorted(xs)
    if not xs:
        return []
    step = max(len(xs) // points, 1)
    return [(xs[i], (i + 1) / len(xs)) for i in range(0, len(xs), step)]


def markdown(rows: list[dict]) -> str:
    out = []
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["workload"], json.dumps(r["params"], sort_keys=True),
                           r["replicas"], r["capacity"]), []).append(r)
    for (wl, params, n, cap), rs in groups.items():
        ours = next((r for r in rs if r["policy"] == "prefix_aware"),
                    next((r for r in rs if r["policy"].startswith("prefix_aware")), None))
        out.append(f"### {wl} ({params}), {n} replicas, {cap} KV capacity\n")
        out.append(f"Ideal hit rate: unlimited cache {rs[0]['ideal_unlimited']:.1%}, one cache "
                   f"of the replicas' combined size {rs[0]['ideal_combined']:.1%}.\n")
        out.append("| policy | hit rate | of combined ideal | TTFT p50 (s) | TTFT p90 (s) | "
                   "TTFT p99 (s) | ITL p50 / p90 / p99 (ms) | TPOT p90 (ms) | queue p99 (s) | "
                   "preemptions | KV 95 % full | E2E p50 (s) | output tok/s | "
                   "imbalance (with drain) | decision p99 (µs) | ours' TTFT p90 / this |")
        out.append("|" + "---|" * 16)
        for r in sorted(rs, key=lambda r: r["ttft_p90_s"]):
            ratio = ours["ttft_p90_s"] / r["ttft_p90_s"] if ours and r["ttft_p90_s"] else 0
            itl = " / ".join(f"{r.get(k, float('nan')) * 1e3:.1f}"
                             for k in ("itl_p50_s", "itl_p90_s", "itl_p99_s"))
            out.append(f"| {r['policy']} | {r['hit_rate']:.1%} | {r['hit_vs_combined']:.1%} | "
                       f"{r['ttft_p50_s']:.3f} | {r['ttft_p90_s']:.3f} | {r['ttft_p99_s']:.3f} | "
                       f"{itl} | {r.get('tpot_p90_s', float('nan')) * 1e3:.1f} | "
                       f"{r.get('queue_p99_s', float('nan')):.3f} | {r.get('preemptions', 0)} | "
                       f"{r.get('kv_full_frac', 0.0):.1%} | "
                       f"{r['e2e_p50_s']:.2f} | {r['output_tok_s']:.0f} | {r['imbalance']:.2f} "
                       f"({r['imbalance_with_drain']:.2f}) |"
                       f" {r['decision_p99_us']:.0f} | {ratio:.2f} |")
        out.append("")
    return "\n".join(out)


def plots(rows: list[dict], stem: Path) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    workloads = sorted({r["workload"] for r in rows})
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        for r in rows:
            if r["workload"] == wl and r["ttft_cdf"]:
                xs, ys = zip(*r["ttft_cdf"])
                ax.plot(xs, ys, label=r["policy"], lw=2.2 if r["policy"] == "prefix_aware" else 1)
        ax.set_xscale("log")
        ax.set_title(f"TTFT CDF: {wl}")
        ax.set_xlabel("TTFT (s)")
        ax.grid(alpha=.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-ttft-cdf.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        rs = [r for r in rows if r["workload"] == wl]
        ax.barh([r["policy"] for r in rs], [r["hit_rate"] for r in rs])
        ax.axvline(rs[0]["ideal_combined"], color="k", ls="--", label="combined-size ideal")
        ax.axvline(rs[0]["ideal_unlimited"], color="r", ls=":", label="unlimited ideal")
        ax.set_title(f"hit rate: {wl}")
        ax.set_xlim(0, 1)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-hit-rate.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 3.5), squeeze=False)
    for ax, wl in zip(axes[0], workloads):
        r = next((r for r in rows if r["workload"] == wl and r["load_samples"]), None)
        if r:
            ts = [t for t, _ in r["load_samples"]]
            for k in range(len(r["load_samples"][0][1])):
                ax.plot(ts, [v[k] for _, v in r["load_samples"]], lw=.8)
        ax.set_title(f"in flight per replica (ours): {wl}")
        ax.set_xlabel("virtual time (s)")
    fig.tight_layout()
    paths.append(stem.with_name(stem.name + "-load.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workloads", nargs="+", default=list(STANDARD), choices=list(STANDARD))
    ap.add_argument("--replicas", nargs="+", type=int, default=[8])
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--capacity", choices=list(KV_TOKENS), default="h200")
    ap.add_argument("--rates", nargs="+", type=float, default=None,
                    help="load points (req/s; users/s for multiturn; speed for mooncake)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--section", default=None,
                    help="heading of the docs/benchmarks.md section to write (default: the "
                         "standard suite's, per capacity)")
    ap.add_argument("--jobs", type=int, default=1,
                    help="cases simulated at once, one process each (a many-core machine)")
    ap.add_argument("--raw", default=None, metavar="PATH",
                    help="only simulate and write the rows to PATH as JSON (no table, plots "
                         "or doc; for a machine without the plotting libraries)")
    ap.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                    help="render the rows of earlier --raw runs instead of simulating")
    a = ap.parse_args(argv)
    for spec in a.policies:
        try:
            parse_policy(spec)
        except ValueError as e:
            ap.error(str(e))
    t0 = time.time()
    if a.raw:
        rows = run_suite(a.workloads, a.replicas, a.policies, a.capacity, a.rates, a.seed,
                         jobs=a.jobs)
        Path(a.raw).write_text(json.dumps(rows))
        print(f"{len(rows)} cases in {time.time() - t0:.0f} s; wrote {a.raw}")
        return 0
    if a.from_json:
        rows = [r for path in a.from_json for r in json.loads(Path(path).read_text())]
        elapsed = sum(r["wall_s"] for r in rows)
    else:
        from rich.progress import Progress
        total = 0
        for wl in a.workloads:
            total += len(workload(wl, None, a.seed)[0]) * len(a.rates or [None])
        total *= len(a.policies) * len(a.replicas)
        with Progress() as bar:
            task = bar.add_task("simulating", total=total)
            rows = run_suite(a.workloads, a.replicas, a.policies, a.capacity, a.rates, a.seed,
                             progress=lambda k: bar.advance(task, k), jobs=a.jobs)
        elapsed = time.time() - t0
    RESULTS.mkdir(exist_ok=True)
    stem = RESULTS / f"policy-bench-{a.capacity}-{int(time.time())}"
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    stem.with_suffix(".md").write_text(table)
    pngs = plots(rows, stem)
    print(table)
    print(f"suite: {elapsed:.0f} s; wrote {stem}.json, .md and {', '.join(p.name for p in pngs)}")
    if not a.no_doc:
        cmd = "python -m loadtest.policy_bench " + " ".join(argv if argv is not None else
                                                            __import__("sys").argv[1:])
        write_benchmark_doc(a.section or
                            f"Routing policies in virtual time ({a.capacity} KV capacity)",
                            cmd.strip(), table + f"\nSuite wall time: {elapsed:.0f} s"
                            + (" (the cases' own, summed)" if a.from_json else "") + "."
                            + (" Simulated on " + ", ".join(sorted({r.get("machine", "?")
                                                                    for r in rows})) + "."
                               if a.from_json else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
