"""The simulator against a recorded GPU run: the same workload, the same routing, TTFT side
by side.

A run of ``python -m loadtest.gpu_bench run --parts multiturn`` is recorded in
``loadtest/data/gpu/`` (per request: send time, conversation, turn, prompt and output tokens,
the engine's cached tokens, the measured TTFT, the replica that served it). Here it is
replayed in virtual time: every request at its recorded send time, on its recorded replica
(the policy is not re-run: the comparison is of the engine model), its prompt made of token
ids with the run's sharing (a team's system prompt, then its conversation's history, each
turn extending the last), on engines of the run's KV capacity and of the H200 profile
(``replicas/sim/profiles/h200-qwen2.5-7b.json``) time-sharing one GPU as the run's four did.

The simulator models the engines only; the router and the HTTP hops in front of them were
measured in the same run (``router_overhead_ms``: TTFT through the router minus straight to
an engine, on a cache hit, plus the engine's own HTTP server) and are added to every
simulated TTFT.

    python -m loadtest.calibration          # prints per policy: measured vs simulated
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from loadtest.report import percentile
from loadtest.sim import SimConfig, WorkloadRequest, simulate
from replicas.sim.engine import EngineConfig
from replicas.sim.step_model import StepTimeModel

RECORDED = Path(__file__).resolve().parent / "data" / "gpu" / "h200-4x7b-multiturn.json"
PROFILE = "h200-qwen2.5-7b"


def _stream(seed: str, n: int) -> list[int]:
    rng = random.Random(seed)
    return [100 + rng.randrange(30000) for _ in range(n)]


def recorded_workload(data: dict, policy: str) -> tuple[list[WorkloadRequest], list[dict]]:
    """The recorded run of ``policy`` as simulator requests (in send order) and the
    recorded rows beside them (dicts of ``data["columns"]``)."""
    cols = data["columns"]
    rows = sorted((dict(zip(cols, r)) for r in data["runs"][policy]), key=lambda r: r["t_s"])
    replicas = {rep: f"r{i}" for i, rep in enumerate(sorted({r["replica"] for r in rows}))}
    # a team's shared part: its system prompt (the template's few tokens around it are
    # counted in the conversation's own part, below a block of difference)
    system = data["settings"]["system_tokens"]
    longest = max(r["prompt_tokens"] for r in rows)
    teams: dict[str, list[int]] = {}
    convs: dict[str, list[int]] = {}
    out = []
    for r in rows:
        team = r["session"].split("-")[0]
        shared = teams.setdefault(team, _stream(f"team-{team}", system))
        own = convs.setdefault(r["session"], _stream(f"conv-{r['session']}", longest))
        full = shared + own
        n, m = r["prompt_tokens"], max(int(r["completion_tokens"]), 1)
        # the answer is the history's continuation, as the next turn's prompt holds it (the
        # engine caches the blocks it generates too)
        out.append(WorkloadRequest(r["t_s"], full[:n], m, output_plan=full[n:n + m],
                                   session=r["session"], replica=replicas[r["replica"]]))
    return out, rows


def compare(data: dict, policy: str) -> dict:
    """Simulated against measured TTFT (and cached tokens) per request of one recorded run.

    Returns:
        ``median_rel_error`` (median over requests of |simulated - measured| / measured),
        the medians and 90th percentiles of both (s), and the simulated and measured hit
        rates.
    """
    s = data["settings"]
    requests, rows = recorded_workload(data, policy)
    model = StepTimeModel.load(PROFILE)
    cfg = SimConfig(policy="prefix_aware", replicas=len({r.replica for r in requests}),
                    engine=EngineConfig(block_size=s["block_size"],
                                        num_blocks=s["kv_cache_tokens_per_engine"]
                                        // s["block_size"]),
                    step_model=model, engines_per_gpu=s["engines_per_gpu"])
    result = simulate(cfg, requests)
    front_s = (data["router_overhead_ms"]["direct_path_hit_p50"]
               + data["router_overhead_ms"]["engine_http_server_hit"]) / 1e3
    sim_ttft, measured, rel = [], [], []
    sim_cached = measured_cached = prompt = 0
    for i, row in enumerate(rows):
        ttft, cached = result.by_request[f"q{i}"]
        sim_ttft.append(ttft + front_s)
        measured.append(row["ttft_s"])
        rel.append(abs(sim_ttft[-1] - row["ttft_s"]) / row["ttft_s"])
        sim_cached += cached
        measured_cached += row["cached_tokens"]
        prompt += row["prompt_tokens"]

    return {"policy": policy, "requests": len(rows),
            "median_rel_error": statistics.median(rel),
            "measured_ttft_p50_s": percentile(measured, .5),
            "simulated_ttft_p50_s": percentile(sim_ttft, .5),
            "measured_ttft_p90_s": percentile(measured, .9),
            "simulated_ttft_p90_s": percentile(sim_ttft, .9),
            "measured_hit_rate": measured_cached / prompt, "simulated_hit_rate": sim_cached
            / prompt, "front_s": front_s}


def table(results: list[dict]) -> str:
    rows = ["| run (policy) | requests | TTFT p50 measured / simulated (ms) | TTFT p90 measured / "
            "simulated (ms) | median relative error per request | hit rate measured / "
            "simulated |", "|---|---|---|---|---|---|"]
    for r in results:
        rows.append(
            f"| {r['policy']} | {r['requests']} | {r['measured_ttft_p50_s'] * 1e3:.0f} / "
            f"{r['simulated_ttft_p50_s'] * 1e3:.0f} | {r['measured_ttft_p90_s'] * 1e3:.0f} / "
            f"{r['simulated_ttft_p90_s'] * 1e3:.0f} | {r['median_rel_error']:.1%} | "
            f"{r['measured_hit_rate']:.1%} / {r['simulated_hit_rate']:.1%} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recorded", default=str(RECORDED))
    ap.add_argument("--doc", action="store_true", help="write docs/benchmarks.md's section")
    a = ap.parse_args(argv)
    data = json.loads(Path(a.recorded).read_text())
    results = [compare(data, policy) for policy in data["runs"]]
    text = table(results)
    print(text)
    if a.doc:
        from loadtest.report import write_benchmark_doc
        write_benchmark_doc(
            "Simulator against the GPU run (calibration)", "python -m loadtest.calibration",
            text, f"Recorded run: {data['source']}. Every request replayed at its send time on "
                  f"its replica; the router's and the HTTP hops' measured time "
                  f"({results[0]['front_s'] * 1e3:.1f} ms) added to each simulated TTFT.")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
