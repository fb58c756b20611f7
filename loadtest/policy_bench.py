"""Policy benchmark: every routing policy on every workload, in virtual time.

One command runs the standard suite (each workload at one load point, plus the Mooncake
trace at its own pace) at 8 replicas and writes a Markdown table, a JSON file and PNG plots
(TTFT CDF per policy, hit rate against the ideals, load over time per replica under our
policy) under ``loadtest/results/``, and the tables to ``docs/benchmarks.md``::

    python -m loadtest.policy_bench                      # standard suite, 8 replicas
    python -m loadtest.policy_bench --replicas 8 16 32   # larger fleets
    python -m loadtest.policy_bench --workloads llmd_b2b --rates 3 15 30 60   # a rate sweep
    python -m loadtest.policy_bench --capacity constrained   # an eighth of the KV capacity
    python -m loadtest.policy_bench --from-json a.json b.json --targets   # against the anchors
    python -m loadtest.policy_bench --workloads sglang_gsp \
        --policies prefix_aware:load_factor=1.25 prefix_aware:load_factor=inf \
        --section "Load bound trade-off"           # a policy with other parameters

On a many-core machine without this project's environment (only a Python), the simulator
needs its few dependencies beside the checkout, for example for Python 3.12::

    pip install --target .simdeps --python-version 3.12 --only-binary=:all: \
        --platform manylinux2014_x86_64 pydantic pydantic-settings msgspec xxhash cbor2 \
        python-dotenv
    PYTHONPATH=.simdeps:. python3 -m loadtest.policy_bench --raw rows.json --jobs 16 ...
    python -m loadtest.policy_bench --from-json rows.json --targets   # here, with matplotlib

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
import statistics
import time
from pathlib import Path

from loadtest.report import RESULTS, percentile, write_benchmark_doc
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
            "bursty": {}, "mooncake": {"speed": 1.0}, "agentic": {"rate_tasks": 3.0},
            "rag": {"rate": 40.0}}
# The keyword a workload's load point goes into (``--rates``); the rest take ``rate``.
RATE_KEY = {"mooncake": "speed", "multiturn": "rate_users", "agentic": "rate_tasks"}
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
        kwargs[RATE_KEY.get(name, "rate")] = rate
    if name not in ("mooncake", "bursty"):
        kwargs["seed"] = seed
    return WORKLOADS[name](**kwargs), kwargs


def simulate_case(case: tuple, progress=None):
    """One simulation of the suite: ``case`` = (replicas, workload, rate or None, policy
    spec, capacity, seed); returns its ``SimResult`` and the workload's parameters."""
    n, wl, rate, spec, capacity, seed = case
    reqs, params = workload(wl, rate, seed)
    bs = BLOCK_SIZE.get(wl, 16)
    engine = EngineConfig(num_blocks=KV_TOKENS[capacity] // bs, block_size=bs,
                          max_num_batched_tokens=8192, max_num_seqs=256)
    pol, kwargs = parse_policy(spec)
    res = simulate(SimConfig(pol, replicas=n, engine=engine,
                             step_model=StepTimeModel.load("h200-qwen2.5-7b"), seed=seed,
                             policy_kwargs=kwargs), reqs, progress=progress)
    return res, params


def run_case(case: tuple, progress=None) -> dict:
    """One simulation of the suite (``simulate_case``); returns its summary row."""
    n, wl, rate, spec, capacity, seed = case
    t0 = time.perf_counter()
    res, params = simulate_case(case, progress)
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
    # the largest fleets first, so that no long case starts last and runs alone
    order = sorted(range(len(cases)), key=lambda i: -cases[i][0])
    with mp.get_context("fork").Pool(jobs) as pool:
        rows: list[dict] = [{}] * len(cases)
        for i, row in zip(order, pool.imap(run_case, [cases[i] for i in order])):
            if progress:
                progress(row["requests"])
            rows[i] = row
    return rows


def tail_anatomy(results: dict, ours: str, share: float = 0.01, shown: int = 12) -> str:
    """What the slowest ``share`` of ``ours``'s requests by TTFT had in cache, against the
    same requests under every other policy of ``results`` (policy spec -> ``SimResult`` of
    one case): the Markdown of a summary per policy (TTFT p99; of ours's tail, the
    requests it served with more cached tokens; the mean uncached prompt tokens of ours's
    tail there and under ours) and of ours's ``shown`` slowest requests.

    Raises:
        KeyError: ``ours`` is not in ``results``.
    """
    mine = results[ours]
    ids = sorted(mine.by_request, key=lambda k: -mine.by_request[k][0])
    tail = ids[:max(int(len(ids) * share), 1)]

    def uncached(res, k):
        return res.request_log[k][2] - res.by_request[k][1]

    lines = [f"{ours}'s slowest {share:.0%} by TTFT: {len(tail)} of {len(ids)} requests, "
             f"mean {statistics.mean(uncached(mine, k) for k in tail):,.0f} uncached prompt "
             f"tokens (mean prompt {statistics.mean(mine.request_log[k][2] for k in tail):,.0f})"
             f"; TTFT p99 {percentile(mine.ttft_s, 0.99):.3f} s.", "",
             "| policy | TTFT p99 (s) | of those requests, served with more cached tokens | "
             "their mean uncached tokens there | their mean TTFT there (s) |",
             "|---|---|---|---|---|"]
    others = [p for p in results if p != ours]
    for p in others:
        res = results[p]
        got = [k for k in tail if k in res.by_request]
        more = sum(res.by_request[k][1] > mine.by_request[k][1] for k in got)
        lines.append(f"| {p} | {percentile(res.ttft_s, 0.99):.3f} | {more} of {len(got)} | "
                     f"{statistics.mean(uncached(res, k) for k in got):,.0f} | "
                     f"{statistics.mean(res.by_request[k][0] for k in got):.3f} |")
    head = "| request | prompt tokens | " + " | ".join(
        f"{p}: TTFT (s) / cached" for p in [ours] + others) + " |"
    lines += ["", head, "|---|---|" + "---|" * (1 + len(others))]
    for k in tail[:shown]:
        cells = []
        for p in [ours] + others:
            t, cached = results[p].by_request.get(k, (float("nan"), 0))
            cells.append(f"{t:.3f} / {cached:,}")
        lines.append(f"| {k} | {mine.request_log[k][2]:,} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


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


# Targets of one configuration against the best anchor of each case (issue "one default that
# wins everywhere"): metric -> (label, the anchors' best is the min or the max, tolerance).
TARGETS = {"ttft_p90_s": ("TTFT p90", min, 0.02), "ttft_p99_s": ("TTFT p99", min, 0.02),
           "itl_p90_s": ("ITL p90", min, 0.05), "output_tok_s": ("tok/s", max, 0.0)}
HIT_TARGET = 0.97  # of the combined-size ideal


def is_ours(policy: str) -> bool:
    """A configuration of the project's policy (``prefix_aware`` with or without arguments),
    as opposed to an anchor or a baseline."""
    return policy.split(":")[0] == "prefix_aware"


def case_misses(rows: list[dict], ours: str) -> dict[tuple, list[str]]:
    """For every case (capacity, replicas, workload, load point) holding configuration
    ``ours``: the targets it misses against the best of the other policies that are not
    ours, e.g. ``["TTFT p99 0.158/0.151", "hit 96.2% of ideal"]`` (empty: every target met).

    TTFT p90 and p99 within 2 % of the best, ITL p90 within 5 %, output tokens/s no lower
    (strictly), hit rate at least 97 % of one cache of the replicas' combined size (not
    counted where that ideal is under 1 %: nothing is shared)."""
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["capacity"], r["replicas"], r["workload"],
               json.dumps(r["params"], sort_keys=True))
        cases.setdefault(key, []).append(r)
    out = {}
    for key, rs in sorted(cases.items(), key=lambda kv: (kv[0][0] != "h200", kv[0][1:])):
        mine = next((r for r in rs if r["policy"] == ours), None)
        anchors = [r for r in rs if not is_ours(r["policy"])]
        if mine is None or not anchors:
            continue
        misses = []
        for metric, (label, best_of, tol) in TARGETS.items():
            best = best_of(r[metric] for r in anchors)
            ok = (mine[metric] <= best * (1 + tol) if best_of is min
                  else mine[metric] >= best * (1 - tol))
            if not ok:
                unit, k = ("ms", 1e3) if metric.startswith("itl") else ("", 1)
                fmt = ".0f" if metric == "output_tok_s" else (".1f" if unit else ".3f")
                misses.append(f"{label} {mine[metric] * k:{fmt}}/{best * k:{fmt}}"
                              + (f" {unit}" if unit else ""))
        if mine["ideal_combined"] >= 0.01 and mine["hit_vs_combined"] < HIT_TARGET:
            misses.append(f"hit {mine['hit_vs_combined']:.1%} of ideal")
        out[key] = misses
    return out


def dominating(rows: list[dict], ours: str) -> dict[tuple, list[str]]:
    """Per case: the policies not ours that are no worse than ``ours`` on every target metric
    at once (TTFT p90 and p99, ITL p90, output tokens/s, hit rate), i.e. that a user would
    take instead whatever they weigh; empty where ours is on the trade-off frontier."""
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault((r["capacity"], r["replicas"], r["workload"],
                          json.dumps(r["params"], sort_keys=True)), []).append(r)
    out = {}
    for key, rs in cases.items():
        mine = next((r for r in rs if r["policy"] == ours), None)
        if mine is None:
            continue
        out[key] = [r["policy"] for r in rs if not is_ours(r["policy"]) and all(
            (r[m] <= mine[m]) if best_of is min else (r[m] >= mine[m])
            for m, (_, best_of, _) in TARGETS.items()) and r["hit_rate"] >= mine["hit_rate"]]
    return out


def targets_markdown(rows: list[dict]) -> str:
    """The targets table: how many cases each configuration of ours meets in full, then
    each case of the plain default (``prefix_aware``) with what it misses (ours / the best
    of the others, per metric) and the policies that are no worse on every metric at once
    (``dominating``)."""
    configs = sorted({r["policy"] for r in rows if is_ours(r["policy"])},
                     key=lambda p: (p != "prefix_aware", p))
    per = {c: case_misses(rows, c) for c in configs}
    lines = ["| configuration | cases meeting every target |", "|---|---|"]
    for c in configs:
        met = sum(not m for m in per[c].values())
        lines.append(f"| `{c}` | {met} of {len(per[c])} |")
    dom = dominating(rows, "prefix_aware")
    lines += ["", "| KV capacity | replicas | workload | `prefix_aware` (the default) | "
              "no worse on every metric at once |", "|---|---|---|---|---|"]
    for key, misses in per.get("prefix_aware", {}).items():
        cap, n, wl, _ = key
        lines.append(f"| {cap} | {n} | {wl} | "
                     + ("missed: " + "; ".join(misses) if misses else "met") + " | "
                     + (", ".join(dom.get(key, [])) or "none") + " |")
    return "\n".join(lines) + "\n"


def tradeoff_plot(rows: list[dict], path: Path, ours: str = "prefix_aware") -> Path | None:
    """Every policy on the ITL/TTFT plane (TTFT p90 against ITL p90, and p99 against p99),
    one panel per case where ``ours`` misses a target; None when it misses none."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    missed = [k for k, m in case_misses(rows, ours).items() if m]
    if not missed:
        return None
    cols = 4
    nrows = -(-len(missed) // cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 3.4 * nrows), squeeze=False)
    policies = sorted({r["policy"] for r in rows})
    others = [p for p in policies if p != ours]
    colours = {p: plt.cm.tab10(i % 10) for i, p in enumerate(others)} | {ours: "black"}
    for ax, key in zip(axes.flat, missed):
        for r in rows:
            if (r["capacity"], r["replicas"], r["workload"],
                    json.dumps(r["params"], sort_keys=True)) != key:
                continue
            big = r["policy"] == ours
            ax.scatter(r["ttft_p90_s"], r["itl_p90_s"] * 1e3, color=colours[r["policy"]],
                       marker="*" if big else "o", s=120 if big else 30, label=r["policy"],
                       zorder=3 if big else 2)
            ax.scatter(r["ttft_p99_s"], r["itl_p99_s"] * 1e3, facecolors="none",
                       edgecolors=colours[r["policy"]], marker="*" if big else "o",
                       s=120 if big else 30)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"{key[2]}, {key[1]} replicas, {key[0]}", fontsize=9)
        ax.set_xlabel("TTFT (s): p90 filled, p99 hollow", fontsize=8)
        ax.set_ylabel("ITL (ms)", fontsize=8)
        ax.grid(alpha=.3)
    for ax in list(axes.flat)[len(missed):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 7), fontsize=8)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


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
                    help="load points (req/s; users/s for multiturn; tasks/s for agentic; "
                         "speed for mooncake)")
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
    ap.add_argument("--targets", action="store_true",
                    help="with --from-json (rows of any capacities): the targets table of "
                         "our configurations against the best anchor per case, and the "
                         "ITL/TTFT plane of the cases missed (docs/img/policy-tradeoff.png)")
    ap.add_argument("--tail", action="store_true",
                    help="one workload at one replica count: what the first policy's "
                         "slowest 1 %% of requests by TTFT had in cache, against the same "
                         "requests under the other policies (printed, no doc)")
    a = ap.parse_args(argv)
    if a.tail and (len(a.workloads) != 1 or len(a.replicas) != 1 or len(a.policies) < 2):
        ap.error("--tail compares one workload at one replica count over two or more "
                 "policies")
    for spec in a.policies:
        try:
            parse_policy(spec)
        except ValueError as e:
            ap.error(str(e))
    t0 = time.time()
    if a.tail:
        rate = a.rates[0] if a.rates else None
        results = {spec: simulate_case((a.replicas[0], a.workloads[0], rate, spec, a.capacity,
                                        a.seed))[0] for spec in a.policies}
        print(f"### {a.workloads[0]}, {a.replicas[0]} replicas, {a.capacity} KV capacity\n")
        print(tail_anatomy(results, a.policies[0]))
        return 0
    if a.raw:
        rows = run_suite(a.workloads, a.replicas, a.policies, a.capacity, a.rates, a.seed,
                         jobs=a.jobs)
        Path(a.raw).write_text(json.dumps(rows))
        print(f"{len(rows)} cases in {time.time() - t0:.0f} s; wrote {a.raw}")
        return 0
    if a.targets and not a.from_json:
        ap.error("--targets renders the rows of --from-json")
    if a.from_json:
        rows = [r for path in a.from_json for r in json.loads(Path(path).read_text())]
        if a.targets:
            return _render_targets(a, rows, argv)
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


def _render_targets(a, rows: list[dict], argv: list[str] | None) -> int:
    table = targets_markdown(rows)
    print(table)
    img = ROOT_DOCS / "img" / "policy-tradeoff.png"
    plotted = tradeoff_plot(rows, img)
    if plotted:
        print(f"wrote {plotted}")
    if not a.no_doc:
        cmd = "python -m loadtest.policy_bench " + " ".join(
            argv if argv is not None else __import__("sys").argv[1:])
        machines = ", ".join(sorted({r.get("machine", "?") for r in rows}))
        notes = (f"Rows simulated on {machines}. " + TARGETS_NOTE
                 + (f"\n\nThe ITL/TTFT plane of every policy in each case missed: "
                    f"[policy-tradeoff.png](img/policy-tradeoff.png)." if plotted else ""))
        write_benchmark_doc(a.section or "One default against every anchor: the targets",
                            cmd.strip(), table, notes)
    return 0


ROOT_DOCS = Path(__file__).resolve().parent.parent / "docs"
TARGETS_NOTE = (
    "Targets (each case against the best anchor of that case, per metric: SGLang's "
    "cache-aware, Ray's prefix affinity, Dynamo's KV router, llm-d's weighted scorer, "
    "KubeAI's prefix hash, round robin, random, least loaded): TTFT p90 and p99 within 2 %, "
    "ITL p90 within 5 %, output tokens/s no lower (strictly), hit rate at least 97 % of one "
    "cache of the replicas' combined size (not counted where nothing is shared). Every "
    "workload of the standard suite, both capacities, 8 to 64 replicas, one configuration.")


if __name__ == "__main__":
    raise SystemExit(main())
