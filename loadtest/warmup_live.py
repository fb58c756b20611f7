"""Warm-up on the CPU service: hit rate and TTFT p90 in the minute after a scale event, with
and without warm-up, through Ray Serve, on simulated engines in real time.

The service runs on loopback with 2 simulated engine replicas (each step takes
``a + b * prefill tokens + c * decoding sequences`` seconds, ``--step-model``, so a miss of a
1,200-token system prompt costs its prefill and a hit does not), the Redis index, and
``warmup_enabled`` off or on. ``--users`` clients hold multi-turn conversations, each
opened on one of ``--system-prompts`` shared system prompts, ``--turns`` turns each, one
second apart, streamed (TTFT is the first content chunk). Per mode:

1. ``--minutes`` of traffic on 2 replicas;
2. scale-out to 3: the config's ``deployments:`` section sets the engine deployment's
   ``num_replicas`` alone, as an operator's ``serve deploy`` does, so the 2 replicas that
   stay keep their caches (a deploy of a Python-built application would replace them);
   the minute after the third serves is measured;
3. a drain: an operator drains the replica that served the most conversations in the
   last minute (``POST /admin/replicas/{id}/drain``: left out as a replica that Serve
   stops, and its hot prefixes re-homed); the minute after is measured;
4. scale-in to 2, after the drained replica is undrained and has served for 30 s: Serve
   picks the replica it stops; the minute after it has left is measured.

Reported per window: every request (hit rate = engine-reported cached / prompt tokens,
TTFT p50 and p90), and the affected ones: after scale-out, the requests the new replica
served; after the drain and the scale-in, the requests of the conversations whose last turn
the drained (removed) replica served::

    python -m loadtest.warmup_live [--minutes 1] [--users 8] [--doc]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import threading
import time
from collections import defaultdict

import httpx

from loadtest.openai_stream import Sample, read_stream
from loadtest.report import percentile, write_benchmark_doc
from loadtest.service import free_port
from loadtest.texts import words_text
from router.config import DEFAULT_MODEL_DIR

MODEL_DIR = str(DEFAULT_MODEL_DIR)


class Traffic:
    """``users`` threads, each holding conversations one after another on ``url``; every
    request's ``Sample`` kept with its send time (``t_start``) and conversation
    (``session``)."""

    def __init__(self, url: str, users: int, system_prompts: list[str], turns: int,
                 think_s: float, max_tokens: int, seed: int = 0):
        self.url, self.prompts, self.turns = url, system_prompts, turns
        self.think_s, self.max_tokens = think_s, max_tokens
        self.samples: list[Sample] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._user, args=(u, seed), daemon=True)
                        for u in range(users)]

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _user(self, u: int, seed: int) -> None:
        rng = random.Random(f"{seed}-{u}")
        n = 0
        with httpx.Client(base_url=self.url, timeout=60) as c:
            while not self.stop.is_set():
                session = f"u{u}-c{n}"
                n += 1
                messages = [{"role": "system", "content": rng.choice(self.prompts)}]
                for turn in range(self.turns):
                    if self.stop.is_set():
                        return
                    messages.append({"role": "user", "content": words_text(
                        40, f"{session}-{turn}", MODEL_DIR)})
                    s = self._one(c, messages, session, turn)
                    self.samples.append(s)
                    messages.append({"role": "assistant", "content": s.text or "ok"})
                    time.sleep(self.think_s)

    def _one(self, c: httpx.Client, messages: list, session: str, turn: int) -> Sample:
        s = Sample(route="chat", status=0, ok=False, t_start=time.time(), session=session,
                   turn=turn)
        body = {"model": "tiny-qwen2", "messages": messages, "max_tokens": self.max_tokens,
                "stream": True, "stream_options": {"include_usage": True},
                "ignore_eos": True}
        t0 = time.perf_counter()
        try:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                s.status, s.replica = r.status_code, r.headers.get("x-routed-replica", "")
                s.ok = r.status_code == 200
                if s.ok:
                    read_stream(r.iter_lines(), s, t0)
                else:
                    r.read()
        except httpx.HTTPError as exc:
            s.ok, s.error = False, type(exc).__name__
        s.e2e_s = time.perf_counter() - t0
        return s


def _figures(samples: list[Sample]) -> dict:
    ok = [s for s in samples if s.ok and s.ttft_s is not None]
    prompt = sum(s.prompt_tokens for s in ok)
    ttfts = sorted(s.ttft_s for s in ok)
    return {"requests": len(samples), "failed": len(samples) - len(ok),
            "hit_rate": round(sum(s.cached_tokens for s in ok) / prompt, 3) if prompt else None,
            "ttft_p50_ms": round(1000 * percentile(ttfts, 0.5), 1) if ttfts else None,
            "ttft_p90_ms": round(1000 * percentile(ttfts, 0.9), 1) if ttfts else None}


def _replicas(c: httpx.Client) -> set[str]:
    try:
        return {r["replica_id"] for r in c.get("/replicas").json()["replicas"]}
    except (httpx.HTTPError, ValueError, KeyError):
        return set()


def _wait(pred, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.5)


def run_mode(warmup: bool, a) -> list[dict]:
    """One service, one mode: the rows of the two windows (all and affected requests)."""
    import ray
    from ray import serve

    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema

    args = {"engine": "sim", "num_replicas": 2, "redis_url": a.redis_url,
            "index_namespace": f"warmup-live-{int(time.time())}", "warmup_enabled": warmup,
            "drain_timeout_s": 10, "replica_num_cpus": 0.1, "ingress_num_cpus": 0.1,
            "extra_engine_args": ["--step-model", a.step_model]}

    def deploy(engines: int) -> None:
        """The application as a Serve config deploys it, with the engine deployment's
        num_replicas set in its deployments: section."""
        _get_global_client().deploy_apps(ServeDeploySchema.model_validate({
            "applications": [{"name": "warmup", "route_prefix": "/",
                              "import_path": "router.app:build_app", "args": args,
                              "deployments": [{"name": "EngineReplica",
                                               "num_replicas": engines}]}]}))

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    url = f"http://127.0.0.1:{port}"
    rows = []
    try:
        deploy(2)
        c = httpx.Client(base_url=url, timeout=30)
        _wait(lambda: len(_replicas(c)) == 2, 300, "2 replicas")
        prompts = [words_text(a.system_tokens, f"system-{i}", MODEL_DIR)
                   for i in range(a.system_prompts)]
        traffic = Traffic(url, a.users, prompts, a.turns, a.think_s, a.max_tokens)
        traffic.start()
        time.sleep(60 * a.minutes)
        before = _replicas(c)
        deploy(3)
        _wait(lambda: len(_replicas(c)) == 3, 300, "the third replica")
        t_out = time.time()
        (new,) = _replicas(c) - before  # the two that stay are the same replicas
        time.sleep(60)
        recent = [s for s in traffic.samples if s.ok and s.t_start > time.time() - 60]
        served = defaultdict(set)
        for s in recent:
            served[s.replica].add(s.session)
        gone = max(served, key=lambda r: len(served[r]))
        c.post(f"/admin/replicas/{gone}/drain").raise_for_status()
        t_in = time.time()
        time.sleep(60)
        c.post(f"/admin/replicas/{gone}/undrain").raise_for_status()
        time.sleep(30)
        three = _replicas(c)
        deploy(2)
        _wait(lambda: len(_replicas(c)) == 2, 300, "a replica to leave")
        t_scale_in = time.time()
        (removed,) = three - _replicas(c)
        time.sleep(60)
        traffic.join()
    finally:
        serve.shutdown()
        ray.shutdown()
    samples = traffic.samples
    def window(t0: float) -> list[Sample]:
        return [s for s in samples if t0 <= s.t_start < t0 + 60]

    def homed_on(replica: str, before: float) -> set[str]:
        """The conversations whose last turn before ``before`` ``replica`` served."""
        last: dict[str, str] = {}
        for s in sorted(samples, key=lambda s: s.t_start):
            if s.t_start < before and s.ok:
                last[s.session] = s.replica
        return {k for k, r in last.items() if r == replica}

    label = "on" if warmup else "off"
    drained, scaled_in = homed_on(gone, t_in), homed_on(removed, t_scale_in)
    for event, w, affected in (
            ("scale-out 2 -> 3", window(t_out),
             [s for s in window(t_out) if s.replica == new]),
            ("drain of the busiest of 3", window(t_in),
             [s for s in window(t_in) if s.session in drained]),
            ("scale-in 3 -> 2", window(t_scale_in),
             [s for s in window(t_scale_in) if s.session in scaled_in])):
        rows.append({"event": event, "warmup": label, "all": _figures(w),
                     "affected": _figures(affected)})
    by_status = defaultdict(int)
    for s in samples:
        by_status[s.status] += 1
    print(f"warm-up {label}: {len(samples)} requests, statuses {dict(by_status)}")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=1.0, help="traffic before the first event")
    ap.add_argument("--users", type=int, default=8)
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--system-tokens", type=int, default=1200)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--think-s", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--step-model", default="0.005,0.00005,0.0005,0",
                    help="the simulated engines' step time 'a,b,c,d' (s)")
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--doc", action="store_true")
    a = ap.parse_args(argv)
    rows = run_mode(False, a) + run_mode(True, a)
    lines = ["| event | warm-up | requests (all) | hit rate (all) | TTFT p50 / p90 ms (all) | "
             "affected requests | hit rate (affected) | TTFT p50 / p90 ms (affected) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["event"], r["warmup"])):
        al, af = r["all"], r["affected"]
        lines.append(f"| {r['event']} | {r['warmup']} | {al['requests']} | {al['hit_rate']} | "
                     f"{al['ttft_p50_ms']} / {al['ttft_p90_ms']} | {af['requests']} | "
                     f"{af['hit_rate']} | {af['ttft_p50_ms']} / {af['ttft_p90_ms']} |")
    table = "\n".join(lines)
    print(table)
    if a.doc:
        write_benchmark_doc(
            "Warm-up on the CPU service (simulated engines in real time)",
            "python -m loadtest.warmup_live " + " ".join(sys.argv[1:] if argv is None
                                                         else argv), table,
            f"The minute after each event. {a.users} users, {a.system_prompts} shared system "
            f"prompts of {a.system_tokens} tokens, {a.turns} turns {a.think_s:g} s apart, "
            f"{a.max_tokens} output tokens, step model {a.step_model}; Ray Serve on "
            f"{platform.node()}, {os.cpu_count()} cores. Affected: after scale-out, the "
            "requests the new replica served; after the drain and the scale-in, those of "
            "conversations whose last turn the drained (removed) replica served. Failed "
            "requests: "
            + ", ".join(f"{r['event']} {r['warmup']} {r['all']['failed']}" for r in rows)
            + ".")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
