"""The benchmark on real engines: the same service compared under each routing policy, by
the load testers' own tools.

Three subcommands, so the engines start once and every policy runs on the same engines:

    python -m loadtest.gpu_bench start --config deploy/gpu-shared.yaml [--redis-server PATH]
    python -m loadtest.gpu_bench run --url http://127.0.0.1:8000 --out DIR [--parts ...]
    python -m loadtest.gpu_bench stop

``start`` starts Redis (``--redis-server``: a redis-server binary to run beside the service;
or the config's ``redis_url`` names one already running), a Ray head (``ray start``, its
processes in a session of their own, so they outlive this command), and the Serve
application of the config file; it returns once ``/replicas`` lists every configured replica
with a live engine. ``run`` measures, for each of ``--policies`` (``x-routing-policy``; the
router refuses the header unless ``allow_policy_override`` is on, and every response names
the policy it applied, which the clients check):

* ``multiturn``: locust ``MultiTurnChatUser`` (``loadtest/openai_users.py``): ``--users``
  users in groups of ``--group-size`` sharing a system prompt of ``--system-tokens``,
  ``--turns`` turns, each adding ``--question-tokens`` + ``--answer-tokens`` to the history;
* ``trace``: locust ``TraceReplayUser``: the Mooncake conversation trace's first
  ``--trace-rows`` rows at ``--trace-speed`` times its pace;
* ``vllm``: vLLM's own ``vllm bench serve`` (dataset ``prefix_repetition``) through the
  router, and once straight to one engine;
* ``overhead``: ``loadtest.data_path`` (TTFT, ITL and throughput per data path against the
  engines direct).

Each run uses prompts of its own (a seed per run), so no policy profits from another's
cache. Per run: TTFT p50/p90/p99, ITL p50/p90, output tokens/s, the engines' own hit rate
(``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries`` deltas), how busy the engines
were (share of 0.5 s samples with a request running or waiting), requests per replica, and
the share of requests whose predicted cached tokens equal the engine's ``cached_tokens``.
Results go to ``--out`` (JSON, locust CSVs, every request's figures) and, with ``--doc``, to
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

from loadtest.report import percentile

ROOT = Path(__file__).resolve().parent.parent
STATE = Path(os.environ.get("ROUTER_BENCH_STATE", "/tmp/prefix-router-bench.json"))


# ---------------------------------------------------------------------------------------------
# start / stop
# ---------------------------------------------------------------------------------------------


def _ray_cli(*args: str) -> list[str]:
    """``ray ARGS`` through Python (the ``ray`` script may not be installed: bundles on
    ``PYTHONPATH`` bring no console scripts)."""
    return [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; "
            "sys.argv[0] = 'ray'; main()", *args]


def _replicas(url: str) -> list[dict]:
    try:
        return httpx.get(url + "/replicas", timeout=10).json()["replicas"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []


def wait_ready(url: str, n: int, timeout_s: float) -> list[dict]:
    """Wait until ``/replicas`` lists ``n`` replicas whose engines are alive and ``/health``
    answers 200 (``/health`` alone answers while some replicas still start).

    Raises:
        TimeoutError: not ready within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        reps = _replicas(url)
        alive = [r for r in reps if (r.get("routing_stats") or {}).get("engine_alive")]
        if len(alive) >= n:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    return reps
            except httpx.HTTPError:
                pass
        time.sleep(2)
    raise TimeoutError(f"{url}: {len(_replicas(url))} of {n} replicas up after {timeout_s} s")


def start(config: str, redis_server: str | None, ray_port: int, timeout_s: float,
          overrides: dict, ha_proxy: bool = False) -> dict:
    """Start Redis (optional), a Ray head and the Serve application of ``config``; return
    once every replica serves. Writes what it started to ``STATE`` for ``stop``.

    ``ha_proxy``: Ray Serve's HAProxy mode (``RAY_SERVE_ENABLE_HA_PROXY``, set before Ray
    starts): HAProxy on the HTTP port, forwarding to ingress replicas that serve HTTP
    themselves."""
    import yaml

    if ha_proxy:
        os.environ["RAY_SERVE_ENABLE_HA_PROXY"] = "1"
        os.environ.setdefault("RAY_SERVE_HAPROXY_NBTHREAD",
                              "4" if (os.cpu_count() or 1) >= 8 else "1")
    cfg = yaml.safe_load(Path(config).read_text())
    app = cfg["applications"][0]
    args = {**(app.get("args") or {}), **overrides}
    http = cfg.get("http_options") or {}
    port = int(http.get("port", 8000))
    host = http.get("host", "127.0.0.1")
    state: dict = {"ray_port": ray_port, "url": f"http://127.0.0.1:{port}"}
    logs = Path(os.environ.get("ROUTER_BENCH_LOGS", "/tmp/prefix-router-bench"))
    logs.mkdir(parents=True, exist_ok=True)
    if redis_server:
        env = dict(os.environ)
        libs = Path(redis_server).resolve().parent / "lib"
        if libs.is_dir():
            env["LD_LIBRARY_PATH"] = f"{libs}:{env.get('LD_LIBRARY_PATH', '')}"
        rport = int(str(args.get("redis_url", "redis://127.0.0.1:6379/0")).rsplit(":", 1)[1]
                    .split("/")[0])
        subprocess.run([redis_server, "--port", str(rport), "--bind", "127.0.0.1",
                        "--save", "", "--appendonly", "no", "--daemonize", "yes",
                        "--logfile", str(logs / "redis.log"),
                        "--pidfile", str(logs / "redis.pid")], env=env, check=True)
        state["redis_pidfile"] = str(logs / "redis.pid")
        args.setdefault("redis_url", f"redis://127.0.0.1:{rport}/0")
    # ray start's processes live in a session of their own (setsid): they outlive this
    # command, so the next command finds the same engines
    subprocess.run(["setsid", *_ray_cli("start", "--head", "--port", str(ray_port),
                                        "--node-ip-address", "127.0.0.1",
                                        "--include-dashboard=false", "--disable-usage-stats")],
                   check=True, stdout=open(logs / "ray-start.log", "w"),
                   stderr=subprocess.STDOUT, start_new_session=True)
    import ray
    from ray import serve

    from router.app import build_app
    ray.init(address=f"127.0.0.1:{ray_port}", log_to_driver=False)
    serve.start(http_options={"host": host, "port": port},
                proxy_location=cfg.get("proxy_location", "HeadOnly"))
    t0 = time.monotonic()
    serve.run(build_app(args), name=app.get("name", "prefix-router"),
              route_prefix=app.get("route_prefix", "/"), blocking=False)
    reps = wait_ready(state["url"], int(args.get("num_replicas", 2)), timeout_s)
    state["ready_after_s"] = time.monotonic() - t0
    state["settings"] = args
    STATE.write_text(json.dumps(state))
    print(json.dumps({"ready_after_s": state["ready_after_s"], "replicas": [
        {"id": r["replica_id"], "engine_url": r["metadata"].get("engine_url"),
         "hash_probe": r["metadata"].get("hash_probe")} for r in reps]}), flush=True)
    ray.shutdown()  # the driver goes; the application (detached actors) stays
    return state


def stop() -> None:
    """Shut the Serve application and the Ray head down, and the Redis ``start`` began."""
    state = json.loads(STATE.read_text()) if STATE.exists() else {}
    try:
        import ray
        from ray import serve
        ray.init(address=f"127.0.0.1:{state.get('ray_port', 6390)}", log_to_driver=False)
        serve.shutdown()
        ray.shutdown()
    except Exception as exc:  # noqa: BLE001 - stop what can be stopped
        print(f"serve shutdown: {exc}", file=sys.stderr)
    subprocess.run(_ray_cli("stop", "--force"), check=False)
    pidfile = state.get("redis_pidfile")
    if pidfile and Path(pidfile).exists():
        subprocess.run(["kill", Path(pidfile).read_text().strip()], check=False)
    STATE.unlink(missing_ok=True)


# ---------------------------------------------------------------------------------------------
# engine metrics while a run goes on
# ---------------------------------------------------------------------------------------------


class EngineWatch:
    """Polls every engine's ``/metrics`` every ``period_s`` during a run: busy share (a
    request running or waiting) and the prefix-cache counters' deltas."""

    NAMES = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
             "vllm:generation_tokens_total", "vllm:num_requests_running",
             "vllm:num_requests_waiting")

    def __init__(self, engines: list[str], period_s: float = 0.5):
        self.engines = engines
        self.period_s = period_s
        self.busy = {e: [0, 0] for e in engines}
        self.first: dict[str, dict] = {}
        self.last: dict[str, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _scrape(self, c: httpx.Client, e: str) -> dict | None:
        from prometheus_client.parser import text_string_to_metric_families
        try:
            text = c.get(e + "/metrics", timeout=5).text
        except httpx.HTTPError:
            return None
        out = dict.fromkeys(self.NAMES, 0.0)
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in out:
                    out[s.name] += s.value
        return out

    def _run(self) -> None:
        with httpx.Client() as c:
            while not self._stop.is_set():
                for e in self.engines:
                    m = self._scrape(c, e)
                    if m is None:
                        continue
                    self.first.setdefault(e, m)
                    self.last[e] = m
                    b = self.busy[e]
                    b[1] += 1
                    b[0] += int(m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"]
                                > 0)
                self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def result(self) -> dict:
        def delta(name):
            return sum(self.last[e][name] - self.first[e][name] for e in self.last)
        q, h = delta("vllm:prefix_cache_queries_total"), delta("vllm:prefix_cache_hits_total")
        return {"engine_hit_rate": h / q if q else None, "prefix_cache_queries": q,
                "prefix_cache_hits": h,
                "busy_share": {e: b[0] / b[1] if b[1] else None for e, b in self.busy.items()},
                "busy_share_mean": statistics.fmean(b[0] / b[1] for b in self.busy.values()
                                                    if b[1]) if any(
                    b[1] for b in self.busy.values()) else None}


# ---------------------------------------------------------------------------------------------
# locust runs
# ---------------------------------------------------------------------------------------------


def summarise_samples(path: Path, wall_s: float) -> dict:
    """Figures of one run from its per-request JSON lines (``--samples-jsonl``, one file per
    locust worker). Rates are over the span from the first request's send to the last one's
    end (locust's start-up, ramp and drain left out); ``wall_s`` when there is none."""
    rows = []
    for p in sorted(path.parent.glob(path.stem + "*" + path.suffix)):
        rows += [json.loads(line) for line in p.read_text().splitlines() if line.strip()]
    ok = [r for r in rows if r["ok"]]
    if rows:
        wall_s = max(r["t_start"] + r["e2e_s"] for r in rows) - min(r["t_start"] for r in rows)
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    itl = [g for r in ok for g in r["itl_s"]]
    per_replica: dict[str, int] = {}
    for r in ok:
        per_replica[r["replica"]] = per_replica.get(r["replica"], 0) + 1
    predicted = [r for r in ok if r["predicted_cached_tokens"] >= 0 and r["prompt_tokens"]]
    exact = sum(r["predicted_cached_tokens"] == r["cached_tokens"] for r in predicted)
    routing = [r["routing_s"] for r in ok if r.get("routing_s") is not None]
    prompt = sum(r["prompt_tokens"] for r in ok)
    out_tokens = sum(r["completion_tokens"] for r in ok)
    ms = lambda x: None if x is None else x * 1e3  # noqa: E731
    return {"requests": len(rows), "ok": len(ok), "failed": len(rows) - len(ok),
            "errors": sorted({r["error"][:120] for r in rows if not r["ok"]})[:5],
            "wall_s": wall_s, "requests_per_s": len(ok) / wall_s if wall_s else None,
            "ttft_ms": {q: ms(percentile(ttft, v)) for q, v in (("p50", .5), ("p90", .9),
                                                          ("p99", .99))},
            "itl_ms": {q: ms(percentile(itl, v)) for q, v in (("p50", .5), ("p90", .9))},
            "output_tokens_per_s": out_tokens / wall_s if wall_s else None,
            "client_hit_rate": sum(r["cached_tokens"] for r in ok) / prompt if prompt else None,
            "prompt_tokens_mean": prompt / len(ok) if ok else None,
            "requests_per_replica": dict(sorted(per_replica.items())),
            "exact_predictions": exact / len(predicted) if predicted else None,
            "predicted_requests": len(predicted), "exact_requests": exact,
            "router_own_ms_p50": ms(percentile(routing, 0.5)),
            "router_own_ms_p90": ms(percentile(routing, 0.9))}


def run_locust(url: str, out: Path, name: str, user_class: str, users: int, seconds: float,
               policy: str | None, extra: list[str], engines: list[str]) -> dict:
    """One headless locust run of ``user_class``; its summary with the engines' figures."""
    prefix = out / name
    samples = out / f"{name}.samples.jsonl"
    for old in out.glob(f"{name}.samples*.jsonl"):  # a run again into the same folder
        old.unlink()
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
           user_class, "--headless", "--host", url, "-u", str(users),
           "-r", str(max(users / 10, 1)), "-t", f"{int(seconds)}s", "--stop-timeout", "30",
           "--csv", str(prefix), "--samples-jsonl", str(samples), "--only-summary", *extra]
    if policy:
        cmd += ["--routing-policy", policy]
    print(f"[{time.strftime('%X')}] {name}: {' '.join(cmd[3:])}", flush=True)
    with EngineWatch(engines) as watch:
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out,
                              timeout=seconds + 300)
        wall = time.monotonic() - t0
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    s = summarise_samples(samples, wall)
    if not s["requests"]:
        print((proc.stdout + proc.stderr)[-3000:], file=sys.stderr, flush=True)
    s.update(watch.result())
    s.update({"policy": policy or "-", "users": users, "locust_exit": proc.returncode})
    print(json.dumps(s), flush=True)
    return s


def run_vllm_bench(url: str, out: Path, name: str, policy: str | None, tokenizer: str,
                   model: str, a: argparse.Namespace, engines: list[str]) -> dict:
    """``vllm bench serve`` (vLLM's ``vllm.benchmarks.serve``), dataset prefix_repetition."""
    seed = abs(hash((name, time.time()))) % 100000
    cmd = [sys.executable, "-c", "import sys; from vllm.benchmarks.serve import add_cli_args, "
           "main; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
           "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))",
           "--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", tokenizer,
           "--dataset-name", "prefix_repetition",
           "--prefix-repetition-prefix-len", str(a.vllm_prefix_len),
           "--prefix-repetition-suffix-len", str(a.vllm_suffix_len),
           "--prefix-repetition-num-prefixes", str(a.vllm_num_prefixes),
           "--prefix-repetition-output-len", str(a.vllm_output_len),
           "--num-prompts", str(a.vllm_prompts), "--request-rate", str(a.vllm_rate),
           "--max-concurrency", str(a.vllm_concurrency), "--seed", str(seed), "--ignore-eos",
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
           "--save-result", "--result-dir", str(out), "--result-filename", f"{name}.json"]
    if policy:
        cmd += ["--header", f"x-routing-policy={policy}"]
    print(f"[{time.strftime('%X')}] {name}: vllm bench serve {policy or 'direct'}", flush=True)
    with EngineWatch(engines) as watch:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=out, timeout=900)
    (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
    try:
        r = json.loads((out / f"{name}.json").read_text())
    except (OSError, ValueError):
        return {"name": name, "error": (proc.stdout + proc.stderr)[-1500:]}
    keep = ("completed", "failed", "request_throughput", "output_throughput", "duration",
            "median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p90_itl_ms",
            "median_tpot_ms")
    s = {k: r.get(k) for k in keep}
    s["tokenize_alignment_skipped"] = "/tokenize unavailable" in proc.stdout + proc.stderr
    s.update(watch.result())
    s["policy"] = policy or "engine direct"
    print(json.dumps(s), flush=True)
    return s


def run(a: argparse.Namespace) -> dict:
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    a.tokenizer = str(Path(a.tokenizer).resolve())  # the runs' working directory is ``out``
    reps = wait_ready(a.url, a.replicas or 1, 60)
    engines = [r["metadata"]["engine_url"] for r in reps]
    model = httpx.get(a.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results.setdefault("meta", {}).update({
        "replicas": len(engines), "model": model, "tokenizer": a.tokenizer,
        "machine": a.machine or platform.node(), "date": time.strftime("%Y-%m-%d")})
    policies = a.policies.split(",")
    tag = uuid.uuid4().hex[:4]
    for part in a.parts.split(","):
        if part == "overhead":
            import asyncio

            from loadtest import data_path
            results["overhead"] = asyncio.run(data_path.run(
                a.url, model, a.overhead_iters, a.overhead_prompt_tokens, 3, 256,
                a.overhead_concurrency, a.overhead_throughput_s, a.tokenizer))
            print(data_path.table(results["overhead"]), flush=True)
        for i, policy in enumerate(policies):
            if part == "multiturn":
                growth = a.question_tokens + a.answer_tokens
                results.setdefault("multiturn", {})[policy] = run_locust(
                    a.url, out, f"multiturn-{policy}", "MultiTurnChatUser", a.users,
                    a.multiturn_s, policy,
                    ["--tokenizer", a.tokenizer, "--turns", str(a.turns),
                     "--groups", str(max(a.users // a.group_size, 1)),
                     "--system-tokens", str(a.system_tokens),
                     "--question-tokens", str(a.question_tokens),
                     "--answer-tokens", str(a.answer_tokens),
                     "--think-time", str(a.think_time), "--prompt-seed", f"{tag}{i}"],
                    engines) | {"history_growth_tokens_per_turn": growth}
                results_path.write_text(json.dumps(results, indent=1))
            elif part == "trace":
                results.setdefault("trace", {})[policy] = run_locust(
                    a.url, out, f"trace-{policy}", "TraceReplayUser", a.trace_users,
                    a.trace_s, policy,
                    ["--tokenizer", a.tokenizer, "--trace-limit", str(a.trace_rows),
                     "--trace-speed", str(a.trace_speed), "--prompt-seed", f"{tag}{i}",
                     "--max-output-tokens", str(a.trace_max_output),
                     "--trace-max-input-tokens", str(a.trace_max_input)], engines)
                results_path.write_text(json.dumps(results, indent=1))
            elif part == "vllm":
                results.setdefault("vllm", {})[policy] = run_vllm_bench(
                    a.url, out, f"vllm-{policy}", policy, a.tokenizer, model, a, engines)
        if part == "vllm" and a.vllm_direct:
            results["vllm"]["engine direct"] = run_vllm_bench(
                engines[0], out, "vllm-engine-direct", None, a.tokenizer, model, a,
                engines[:1])
        results_path.write_text(json.dumps(results, indent=1))
    results_path.write_text(json.dumps(results, indent=1))
    return results


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


def _f(x, fmt="{:.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def tables(results: dict) -> str:
    """Markdown tables of a results file."""
    parts = []
    for kind, title in (("multiturn", "Multi-turn chat (locust MultiTurnChatUser)"),
                        ("trace", "Mooncake conversation trace (locust TraceReplayUser)")):
        runs = results.get(kind)
        if not runs:
            continue
        rows = [f"**{title}**", "",
                "| policy | requests ok (failed) | req/s | TTFT p50 / p90 / p99 (ms) | ITL p50 / "
                "p90 (ms) | output tok/s | engine hit rate | engines busy | exact predictions "
                "| router's own p50 (ms) | requests per replica |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for policy, r in runs.items():
            t, i = r["ttft_ms"], r["itl_ms"]
            rows.append(
                f"| {policy} | {r['ok']} ({r['failed']}) | {_f(r['requests_per_s'], '{:.2f}')} | "
                f"{_f(t['p50'])} / {_f(t['p90'])} / {_f(t['p99'])} | "
                f"{_f(i['p50'], '{:.1f}')} / {_f(i['p90'], '{:.1f}')} | "
                f"{_f(r['output_tokens_per_s'])} | {_f(r['engine_hit_rate'], '{:.1%}')} | "
                f"{_f(r['busy_share_mean'], '{:.0%}')} | {_f(r['exact_predictions'], '{:.1%}')}"
                f" | {_f(r['router_own_ms_p50'], '{:.1f}')} | "
                f"{', '.join(str(v) for v in r['requests_per_replica'].values())} |")
        parts.append("\n".join(rows))
    runs = results.get("vllm")
    if runs:
        rows = ["**vLLM's `vllm bench serve`, dataset `prefix_repetition`**", "",
                "| target | completed (failed) | req/s | output tok/s | TTFT p50 / p90 / p99 (ms) "
                "| ITL p50 / p90 (ms) | engine hit rate |", "|---|---|---|---|---|---|---|"]
        for name, r in runs.items():
            if "error" in r:
                rows.append(f"| {name} | error: {r['error'][-200:]!r} | | | | | |")
                continue
            rows.append(
                f"| {name} | {r['completed']} ({r['failed']}) | "
                f"{_f(r['request_throughput'], '{:.2f}')} | {_f(r['output_throughput'])} | "
                f"{_f(r['median_ttft_ms'])} / {_f(r['p90_ttft_ms'])} / {_f(r['p99_ttft_ms'])} | "
                f"{_f(r['median_itl_ms'], '{:.1f}')} / {_f(r['p90_itl_ms'], '{:.1f}')} | "
                f"{_f(r['engine_hit_rate'], '{:.1%}')} |")
        parts.append("\n".join(rows))
    if results.get("overhead"):
        from loadtest.data_path import table
        parts.append("**Router overhead per data path**\n\n" + table(results["overhead"]))
    return "\n\n".join(parts)


def plot(results_dir: Path, png: Path) -> None:
    """TTFT distributions per policy (multi-turn and trace, from the runs' per-request
    figures) and the vLLM benchmark's TTFT percentiles, in one PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = json.loads((results_dir / "results.json").read_text())
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, kind, title in ((axes[0], "multiturn", "multi-turn chat"),
                            (axes[1], "trace", "Mooncake trace")):
        for policy in results.get(kind, {}):
            rows = [json.loads(line) for f in results_dir.glob(f"{kind}-{policy}.samples*.jsonl")
                    for line in f.read_text().splitlines() if line.strip()]
            xs = sorted(r["ttft_s"] * 1e3 for r in rows if r["ok"] and r["ttft_s"] is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=policy)
        ax.set_xscale("log")
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title(f"{title}: TTFT CDF")
        ax.grid(alpha=0.3)
        ax.legend()
    runs = results.get("vllm", {})
    names = [n for n in runs if "error" not in runs[n]]
    for k, q in enumerate(("median_ttft_ms", "p90_ttft_ms", "p99_ttft_ms")):
        axes[2].bar([i + k * 0.27 for i in range(len(names))], [runs[n][q] for n in names],
                    width=0.27, label=q.split("_")[0])
    axes[2].set_xticks([i + 0.27 for i in range(len(names))], names, rotation=15)
    axes[2].set_ylabel("TTFT (ms)")
    axes[2].set_title("vllm bench serve, prefix_repetition")
    axes[2].legend()
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--config", required=True, help="a Serve config file (deploy/*.yaml)")
    s.add_argument("--redis-server", help="start this redis-server binary beside the service")
    s.add_argument("--ray-port", type=int, default=6390, help="(6379 is Redis's)")
    s.add_argument("--timeout-s", type=float, default=480)
    s.add_argument("--ha-proxy", action="store_true",
                   help="Ray Serve's HAProxy mode in front of the ingress replicas")
    s.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="override a setting of the config's args (value parsed as JSON)")
    sub.add_parser("stop")
    r = sub.add_parser("run")
    r.add_argument("--url", default="http://127.0.0.1:8000")
    r.add_argument("--out", required=True)
    r.add_argument("--tokenizer", required=True, help="the served model's directory")
    r.add_argument("--replicas", type=int, default=0, help="wait for this many first")
    r.add_argument("--parts", default="overhead,multiturn,trace,vllm")
    r.add_argument("--policies", default="prefix_aware,round_robin,least_loaded")
    r.add_argument("--machine", default="")
    r.add_argument("--users", type=int, default=32)
    r.add_argument("--group-size", type=int, default=4)
    r.add_argument("--turns", type=int, default=8)
    r.add_argument("--system-tokens", type=int, default=2000)
    r.add_argument("--question-tokens", type=int, default=300)
    r.add_argument("--answer-tokens", type=int, default=256)
    r.add_argument("--think-time", type=float, default=1.0)
    r.add_argument("--multiturn-s", type=float, default=60)
    r.add_argument("--trace-users", type=int, default=64)
    r.add_argument("--trace-rows", type=int, default=200)
    r.add_argument("--trace-speed", type=float, default=1.0)
    r.add_argument("--trace-s", type=float, default=60)
    r.add_argument("--trace-max-output", type=int, default=256)
    r.add_argument("--trace-max-input", type=int, default=30000)
    r.add_argument("--vllm-prefix-len", type=int, default=2048)
    r.add_argument("--vllm-suffix-len", type=int, default=128)
    r.add_argument("--vllm-num-prefixes", type=int, default=16)
    r.add_argument("--vllm-output-len", type=int, default=128)
    r.add_argument("--vllm-prompts", type=int, default=256)
    r.add_argument("--vllm-rate", type=float, default=16)
    r.add_argument("--vllm-concurrency", type=int, default=64)
    r.add_argument("--vllm-direct", action=argparse.BooleanOptionalAction, default=True)
    r.add_argument("--overhead-iters", type=int, default=10)
    r.add_argument("--overhead-prompt-tokens", type=int, default=4000)
    r.add_argument("--overhead-concurrency", type=int, default=8)
    r.add_argument("--overhead-throughput-s", type=float, default=20)
    rep = sub.add_parser("report", help="print (and with --doc write) the tables of a run")
    rep.add_argument("results")
    rep.add_argument("--doc", default="", help="section title in docs/benchmarks.md")
    rep.add_argument("--command", default="")
    rep.add_argument("--notes", default="")
    rep.add_argument("--plot", default="", help="write the TTFT plots to this PNG")
    a = ap.parse_args(argv)
    if a.cmd == "start":
        start(a.config, a.redis_server, a.ray_port, a.timeout_s,
              {k: json.loads(v) for k, v in (x.split("=", 1) for x in a.set)}, a.ha_proxy)
    elif a.cmd == "stop":
        stop()
    elif a.cmd == "run":
        print(tables(run(a)))
    else:
        results = json.loads(Path(a.results).read_text())
        text = tables(results)
        print(text)
        if a.plot:
            plot(Path(a.results).parent, Path(a.plot))
        if a.doc:
            from loadtest.report import write_benchmark_doc
            write_benchmark_doc(a.doc, a.command, text, a.notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
