"""Overload soak: the fleet offered more than it can serve, by locust, for minutes.

The service runs on loopback with simulated engines in real time (each decode step takes
``--step-s``, so a request holds its slot for about ``--answer-tokens`` steps), the Redis
index, and admission on (``max_inflight_per_replica``, a short ``queue_timeout_s``). The
fleet's capacity is measured first: the mean time one request takes alone, so capacity =
replicas x bound / that time (requests/s). Then locust's ``PacedChatUser`` offers
``--low`` x capacity for ``--low-minutes`` and ``--high`` x capacity for ``--high-minutes``.
Reported per phase: the statuses (every request must end in a 200 or a 429, no 5xx), the p99
time of a 429 as the client sees it and the router's own part of it (the 429's
``Server-Timing``, from the handler's start to the answer), the TTFT percentiles of the
admitted requests, and, sampled every 10 s, the resident memory of the ingress process and
Redis's ``used_memory`` (flat: within 10 % between minute 2 and the end)::

    python -m loadtest.overload [--high 2 --high-minutes 10 --low 0.8 --low-minutes 2] [--doc]
    python -m loadtest.overload --high 0.9 --high-minutes 30 --doc   # the soak below capacity

Run on a quiet machine: the router's own CPU must not be the bottleneck (the defaults keep
the offered rate at a few tens of requests per second).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from loadtest.report import percentile, write_benchmark_doc

ROOT = Path(__file__).resolve().parent.parent


def _ingress_rss_bytes() -> int:
    """Resident memory of the ingress actor process(es) of this machine (bytes)."""
    import psutil

    total = 0
    for p in psutil.process_iter(["cmdline"]):
        cmd = " ".join(p.info.get("cmdline") or [])
        if "ServeReplica" in cmd and "Ingress" in cmd:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                pass
    return total


class Sampler(threading.Thread):
    """Samples the ingress RSS and Redis's used_memory every ``period_s``."""

    def __init__(self, redis_url: str, period_s: float = 10.0):
        super().__init__(daemon=True)
        import redis
        self.redis = redis.Redis.from_url(redis_url, socket_timeout=5)
        self.period_s = period_s
        self.samples: list[tuple[float, int, int]] = []  # (t, rss, redis used_memory)
        self._halt = threading.Event()

    def run(self) -> None:
        t0 = time.monotonic()
        while not self._halt.is_set():
            self.samples.append((time.monotonic() - t0, _ingress_rss_bytes(),
                                 int(self.redis.info("memory")["used_memory"])))
            self._halt.wait(self.period_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)


def _locust(url: str, users: int, minutes: float, pacing_s: float, answer_tokens: int,
            out: Path) -> list[dict]:
    """One locust run of ``PacedChatUser``; returns every request's sample."""
    samples = out.with_suffix(".jsonl")
    cmd = [sys.executable, "-m", "locust", "-f", str(ROOT / "loadtest" / "locustfile.py"),
           "PacedChatUser", "--host", url, "-u", str(users), "-r", str(max(users, 1)),
           "-t", f"{int(minutes * 60)}s", "--headless", "--only-summary",
           "--csv", str(out), "--pacing-s", str(pacing_s), "--answer-tokens",
           str(answer_tokens), "--system-tokens", "300", "--samples-jsonl", str(samples),
           "--stop-timeout", "30"]
    subprocess.run(cmd, cwd=ROOT, check=False, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in samples.read_text().splitlines() if line.strip()]


def _phase_row(name: str, offered: float, samples: list[dict], wall_s: float) -> dict:
    statuses: dict[int, int] = {}
    for s in samples:
        statuses[s["status"]] = statuses.get(s["status"], 0) + 1
    refused = [s["e2e_s"] for s in samples if s["status"] == 429]
    # the router's own part of each 429 (its Server-Timing: handler start to the answer)
    refused_router = [s["routing_s"] for s in samples
                      if s["status"] == 429 and s.get("routing_s") is not None]
    ttft = [s["ttft_s"] for s in samples if s["status"] == 200 and s.get("ttft_s") is not None]
    ok = sum(1 for s in samples if s["status"] == 200 and s["ok"])
    return {"phase": name, "offered_rps": round(offered, 1), "requests": len(samples),
            "statuses": dict(sorted(statuses.items())),
            "served_rps": round(ok / wall_s, 2),
            "broken_200": sum(1 for s in samples if s["status"] == 200 and not s["ok"]),
            "other": sum(v for k, v in statuses.items() if k not in (200, 429)),
            "p50_429_ms": round(1000 * percentile(refused, 0.5, 0.0), 1),
            "p99_429_ms": round(1000 * percentile(refused, 0.99, 0.0), 1),
            "p99_429_router_ms": round(1000 * percentile(refused_router, 0.99, 0.0), 1),
            "ttft_p50_ms": round(1000 * percentile(ttft, 0.5, 0.0), 1),
            "ttft_p99_ms": round(1000 * percentile(ttft, 0.99, 0.0), 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--bound", type=int, default=16, help="max_inflight_per_replica")
    ap.add_argument("--queue-timeout-s", type=float, default=0.25)
    ap.add_argument("--step-s", type=float, default=0.2, help="simulated decode step (s)")
    ap.add_argument("--answer-tokens", type=int, default=20)
    ap.add_argument("--pacing-s", type=float, default=6.0,
                    help="seconds between one user's requests (longer than an answer)")
    ap.add_argument("--low", type=float, default=0.8)
    ap.add_argument("--low-minutes", type=float, default=2.0)
    ap.add_argument("--high", type=float, default=2.0)
    ap.add_argument("--high-minutes", type=float, default=10.0)
    ap.add_argument("--engine-num-blocks", type=int, default=None,
                    help="KV capacity of each simulated engine in blocks (its --num-blocks; "
                         "default the engine's 32,768): a small one fills within the first "
                         "minutes, so the index's size reaches its steady state in the run")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--doc", action="store_true")
    a = ap.parse_args(argv)

    from loadtest.service import start_service
    url = start_service(a.replicas, a.redis_url, engine="sim", replica_num_cpus=0.1,
                        ingress_num_cpus=0.1, max_inflight_per_replica=a.bound,
                        queue_timeout_s=a.queue_timeout_s,
                        extra_engine_args=["--step-model", f"{a.step_s},0,0,0"] + (
                            ["--num-blocks", str(a.engine_num_blocks)]
                            if a.engine_num_blocks else []))
    rows, memory = [], []
    try:
        body = {"model": "tiny-qwen2", "max_tokens": a.answer_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": "how long does one answer take?"}]}
        alone = []
        with httpx.Client(base_url=url, timeout=60) as c:
            for _ in range(8):
                t0 = time.perf_counter()
                assert c.post("/v1/chat/completions", json=body).status_code == 200
                alone.append(time.perf_counter() - t0)
        service_s = statistics.median(alone)
        capacity = a.replicas * a.bound / service_s
        print(f"one request alone: {service_s:.3f} s; capacity {capacity:.1f} requests/s")
        tmp = Path(tempfile.mkdtemp(prefix="overload-"))
        for name, factor, minutes in (("low", a.low, a.low_minutes),
                                      ("high", a.high, a.high_minutes)):
            users = max(1, round(factor * capacity * a.pacing_s))
            sampler = Sampler(a.redis_url) if name == "high" else None
            if sampler:
                sampler.start()
            t0 = time.monotonic()
            samples = _locust(url, users, minutes, a.pacing_s, a.answer_tokens, tmp / name)
            wall = time.monotonic() - t0
            if sampler:
                sampler.stop()
                memory = sampler.samples
            row = _phase_row(f"{factor:g} x capacity, {minutes:g} min", users / a.pacing_s,
                             samples, wall)
            rows.append(row)
            print(json.dumps(row))
    finally:
        import ray
        from ray import serve
        serve.shutdown()
        ray.shutdown()

    def at(minute: float) -> tuple[int, int]:
        near = min(memory, key=lambda s: abs(s[0] - 60 * minute))
        return near[1], near[2]

    rss2, redis2 = at(2.0)
    rss_end, redis_end = memory[-1][1], memory[-1][2]
    growth = {"ingress_rss_mib": (round(rss2 / 2**20, 1), round(rss_end / 2**20, 1)),
              "redis_used_memory_mib": (round(redis2 / 2**20, 2), round(redis_end / 2**20, 2))}
    print("memory at minute 2 and at the end:", growth)
    if a.doc:
        low, high = rows
        table = "\n".join(
            ["| phase | offered req/s | requests | statuses | served req/s | 429 p50 / p99 ms "
             "| router's own time of a 429, p99 ms "
             "| admitted TTFT p50 / p99 ms | broken 200s | other statuses |",
             "|---|---|---|---|---|---|---|---|---|---|"]
            + [f"| {r['phase']} | {r['offered_rps']} | {r['requests']} | {r['statuses']} | "
               f"{r['served_rps']} | {r['p50_429_ms']} / {r['p99_429_ms']} | "
               f"{r['p99_429_router_ms']} | "
               f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['broken_200']} | "
               f"{r['other']} |" for r in rows])
        ratio = high["ttft_p99_ms"] / low["ttft_p99_ms"] if low["ttft_p99_ms"] else float("nan")
        notes = (
            f"Capacity: {a.replicas} replicas x bound {a.bound} / {service_s:.3f} s per request "
            f"alone = {capacity:.1f} requests/s (simulated engines, a {a.step_s} s decode step, "
            f"{a.answer_tokens} output tokens; queue_timeout_s {a.queue_timeout_s}). "
            f"Admitted TTFT p99 at {a.high:g} x against {a.low:g} x: {ratio:.2f} x. "
            f"Memory during the {a.high:g} x phase, at minute 2 and at the end: ingress RSS "
            f"{growth['ingress_rss_mib'][0]} and {growth['ingress_rss_mib'][1]} MiB, Redis "
            f"used_memory {growth['redis_used_memory_mib'][0]} and "
            f"{growth['redis_used_memory_mib'][1]} MiB. Machine: {platform.node()}, "
            f"{os.cpu_count()} cores.")
        title = f"Overload: fast refusals instead of queues (bound {a.bound}, " \
            f"queue_timeout_s {a.queue_timeout_s:g})" if a.high > 1 else \
            f"Soak at {a.high:g} x capacity for {a.high_minutes:g} minutes (bound {a.bound}, " \
            f"queue_timeout_s {a.queue_timeout_s:g}" + (
                f", {a.engine_num_blocks} KV blocks per engine)" if a.engine_num_blocks else ")")
        write_benchmark_doc(title,
                            "python -m loadtest.overload " + " ".join(argv or sys.argv[1:]),
                            table, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
