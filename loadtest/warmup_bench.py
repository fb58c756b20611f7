"""Warm-up and re-homing benchmark: hit rate and TTFT in the minute after a scale event,
with and without warm-up, in virtual time (``loadtest.sim``: the router's own routing,
index and warm-up code over simulated engines of the H200 profile).

Cases: each fleet size (8 and 32 replicas by default), each workload, each event (a replica
added, ``scale_out``; a replica removed, ``scale_in``: ``r0``), warm-up off and on, with
the settings' defaults (``warmup_top_prefixes``, ``warmup_tokens_per_s``,
``warmup_concurrency``, ``warmup_half_life_s``). The load grows with the fleet (rates times
replicas / 8), so each replica sees the same load at every size. Measured over the
requests that arrive in the minute after the event: all of them, and the affected ones
(scale-out: those the new replica served; scale-in: those whose conversation, or whose
shared system prompt for the shared-prefix workload, the removed replica served last
before the event)::

    python -m loadtest.warmup_bench                  # 8 and 32 replicas, both workloads
    python -m loadtest.warmup_bench --replicas 8 --jobs 2
    python -m loadtest.warmup_bench --doc            # also write docs/benchmarks.md

Workloads:

* ``multiturn``: MT-Bench chats (``loadtest.workloads.multiturn``): users arrive at 4/s per 8
  replicas for 300 s, 6 turns each about 20 s apart, a 1,000-token system prompt shared by
  all; the event at 150 s (steady state).
* ``shared_prefix``: the SGLang generated-shared-prefix shape (``loadtest.workloads.
  shared_prefix``) with 128 groups of a 2,048-token system prompt, 128-token questions and
  256 output tokens, at 60 requests/s per 8 replicas for 120 s; the event at 50 s.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

from loadtest.report import RESULTS, percentile, write_benchmark_doc
from loadtest.sim import ScaleEvent, SimConfig, simulate
from loadtest.workloads import multiturn, shared_prefix
from replicas.sim.engine import EngineConfig
from replicas.sim.step_model import StepTimeModel

WINDOW_S = 60.0
KV_TOKENS = 2_040_000  # the H200 profile's KV capacity per replica (policy_bench "h200")
BLOCK_SIZE = 16
SECTION = "Warm-up on scale-out and re-homing on scale-in (virtual time)"


def workload(name: str, replicas: int, seed: int = 0):
    """(requests, event time s) of workload ``name`` scaled to ``replicas``."""
    k = replicas / 8
    if name == "multiturn":
        rate = 4.0 * k
        return multiturn(users=int(rate * 300), rate_users=rate, seed=seed), 150.0
    if name == "shared_prefix":
        rate = 60.0 * k
        n = int(rate * 120)
        per_group = -(-n // 128)
        return shared_prefix(128, per_group, 2048, 128, 256, rate, seed), 50.0
    raise ValueError(f"unknown workload {name!r}")


def _group(r) -> object:
    """What ties a request to the replica that served its kind before: its session, or its
    first block (the shared system prompt)."""
    return r.session or (r.block_hashes[0] if r.block_hashes else None)


def run_case(case: tuple) -> dict:
    """One simulation: ``case`` = (replicas, workload, event, warm-up on, seed); returns its
    row (the window's measurements)."""
    n, wl, event, warm, seed = case
    reqs, t_event = workload(wl, n, seed)
    engine = EngineConfig(num_blocks=KV_TOKENS // BLOCK_SIZE, block_size=BLOCK_SIZE,
                          max_num_batched_tokens=8192, max_num_seqs=256)
    ev = ScaleEvent(t_event, "add" if event == "scale_out" else "remove", None)
    t0 = time.perf_counter()
    res = simulate(SimConfig("prefix_aware", replicas=n, engine=engine,
                             step_model=StepTimeModel.load("h200-qwen2.5-7b"), seed=seed,
                             scale_events=[ev], warmup=warm), reqs)
    ordered = sorted(reqs, key=lambda r: r.arrival_s)  # "q<i>" is the i-th by arrival
    last_before: dict[object, str] = {}
    for i, r in enumerate(ordered):
        if r.arrival_s < t_event:
            rep = res.request_log.get(f"q{i}", ("",))[0]
            last_before[_group(r)] = rep
    new = f"r{n}"
    window, affected = [], []
    for i, r in enumerate(ordered):
        rid = f"q{i}"
        if not (t_event <= r.arrival_s < t_event + WINDOW_S) or rid not in res.by_request:
            continue
        window.append(rid)
        rep = res.request_log[rid][0]
        if (event == "scale_out" and rep == new) or \
                (event == "scale_in" and last_before.get(_group(r)) == "r0"):
            affected.append(rid)

    def measure(rids):
        prompt = sum(res.request_log[r][2] for r in rids)
        cached = sum(res.by_request[r][1] for r in rids)
        ttft = [res.by_request[r][0] for r in rids]
        return {"requests": len(rids), "hit_rate": cached / max(prompt, 1),
                "ttft_p50_s": percentile(ttft, .5, float("nan")),
                "ttft_p90_s": percentile(ttft, .9, float("nan"))}

    return {"replicas": n, "workload": wl, "event": event, "warmup": warm, "seed": seed,
            "t_event_s": t_event, "window": measure(window), "affected": measure(affected),
            "warmup_stats": res.warmup, "whole_run_hit_rate": res.cached_tokens
            / max(res.prompt_tokens, 1), "wall_s": time.perf_counter() - t0,
            "machine": f"{platform.node()}: {os.cpu_count()} cores"}


def run_all(replicas: list[int], workloads: list[str], seed: int, jobs: int) -> list[dict]:
    """Every (replicas, workload, event, warm-up) case, in that order; ``jobs`` processes."""
    cases = [(n, wl, ev, warm, seed) for n in replicas for wl in workloads
             for ev in ("scale_out", "scale_in") for warm in (False, True)]
    if jobs <= 1:
        return [run_case(c) for c in cases]
    import multiprocessing as mp
    with mp.get_context("fork").Pool(jobs) as pool:
        return list(pool.imap(run_case, cases))


def markdown(rows: list[dict]) -> str:
    """The table: one line per case, the window's and the affected requests' figures."""
    out = ["| replicas | workload | event | warm-up | requests in the minute | hit rate | "
           "TTFT p50 (s) | TTFT p90 (s) | affected requests | their hit rate | their TTFT "
           "p90 (s) | warm-up requests (tokens) |", "|" + "---|" * 12]
    for r in rows:
        w, a = r["window"], r["affected"]
        st = r["warmup_stats"]
        reason = "scale_out" if r["event"] == "scale_out" else "rehome"
        warm = f"{st['started'][reason]} ({st['tokens'][reason]:,})" if st else "-"
        out.append(f"| {r['replicas']} | {r['workload']} | {r['event']} | "
                   f"{'on' if r['warmup'] else 'off'} | {w['requests']} | {w['hit_rate']:.1%} | "
                   f"{w['ttft_p50_s']:.3f} | {w['ttft_p90_s']:.3f} | {a['requests']} | "
                   f"{a['hit_rate']:.1%} | {a['ttft_p90_s']:.3f} | {warm} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", nargs="+", type=int, default=[8, 32])
    ap.add_argument("--workloads", nargs="+", default=["multiturn", "shared_prefix"],
                    choices=["multiturn", "shared_prefix"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jobs", type=int, default=1, help="cases simulated at once")
    ap.add_argument("--doc", action="store_true", help="write the table to docs/benchmarks.md")
    ap.add_argument("--raw", default=None, metavar="PATH", help="also write the rows as JSON")
    ap.add_argument("--from-json", nargs="+", default=None, metavar="PATH",
                    help="render the rows of earlier --raw runs instead of simulating")
    a = ap.parse_args(argv)
    t0 = time.time()
    if a.from_json:
        rows = [r for p in a.from_json for r in json.loads(open(p).read())]
    else:
        rows = run_all(a.replicas, a.workloads, a.seed, a.jobs)
    elapsed = time.time() - t0
    if a.raw:
        with open(a.raw, "w") as f:
            json.dump(rows, f, indent=1)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"warmup-bench-{int(time.time())}.json").write_text(json.dumps(rows, indent=1))
    table = markdown(rows)
    print(table)
    machines = ", ".join(sorted({r["machine"] for r in rows}))
    wall = sum(r["wall_s"] for r in rows)
    print(f"{len(rows)} cases, {wall:.0f} s of simulation ({elapsed:.0f} s wall) on {machines}")
    if a.doc:
        cmd = "python -m loadtest.warmup_bench " + " ".join(
            argv if argv is not None else __import__("sys").argv[1:])
        write_benchmark_doc(SECTION, cmd.strip(), table + f"\nSimulated on {machines}; "
                            f"{wall:.0f} s of simulation in all.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
