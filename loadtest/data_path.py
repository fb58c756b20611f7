"""Router overhead per data path, against the same engines sent to directly.

Three targets on one running service (``allow_policy_override``, which also honours the
``x-data-path`` header):

* ``engine``: straight to the engines' own HTTP servers (their URLs from ``/replicas``);
* ``direct``: through Serve's proxy and the ingress, which decides and streams from the
  chosen engine itself (``data_path: direct``);
* ``serve``: through Serve's proxy, the ingress, a Serve handle call and the replica actor,
  which proxies to its engine (``data_path: serve``).

Measured, with the targets interleaved so that drift hits all of them alike:

1. TTFT of a streamed chat request with one output token, for a cache hit (a prompt of
   ``--prompt-tokens`` sent once, then repeated: the router sends the repeat where it is
   cached) and a cold prompt (new each time); overhead = a path's median TTFT - the engine's.
   Split per hop: the router's own arrival-to-dispatch time (``server-timing``); Serve's
   proxy and the ingress's HTTP handling (``direct`` - engine - router's own time); the
   handle call and replica actor (``serve`` - ``direct``); and, for vLLM, the engine's own
   HTTP server (client-side TTFT straight to it minus the engine's internal
   ``vllm:time_to_first_token_seconds``, mean over the same requests).
2. Inter-token latency: answers of ``--itl-tokens`` tokens one at a time, every gap between
   content deltas.
3. Throughput: ``--concurrency`` clients per engine sending prompts of 512 tokens (a
   shared 256-token prefix) for 64 output tokens, for ``--throughput-s`` seconds: straight to
   the engines (clients spread evenly over them) against the same number of clients
   through each path; requests/s and output tokens/s, and their ratio.

    python -m loadtest.data_path --engine sim            # starts its own service (CPU)
    python -m loadtest.data_path --url http://HOST:8000  # a running service

Prints a table, writes ``loadtest/results/data-path-<time>.json`` and, unless
``--no-doc``, a section of ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from dataclasses import dataclass, field

import httpx

from loadtest.report import percentile
from loadtest.texts import words_text
from router.serve.protocol import parse_server_timing

PATHS = ("engine", "direct", "serve")
NAN = float("nan")


@dataclass
class Shot:
    """One streamed request's client-side figures (s)."""

    ttft_s: float
    e2e_s: float
    itl_s: list[float] = field(default_factory=list)
    routing_s: float | None = None
    replica: str = ""
    cached_tokens: int = 0
    completion_tokens: int = 0


class Targets:
    """Where each path's requests go: the router URL with an ``x-data-path`` header, or an
    engine URL (the engines in turn)."""

    def __init__(self, router: str, engines: list[str], model: str):
        self.router = router.rstrip("/")
        self.engines = engines
        self.model = model
        self._next = 0

    def url_headers(self, path: str, engine: int | None = None) -> tuple[str, dict]:
        if path == "engine":
            if engine is None:
                engine, self._next = self._next % len(self.engines), self._next + 1
            return self.engines[engine % len(self.engines)], {}
        return self.router, {"x-data-path": path}


async def shot(client: httpx.AsyncClient, url: str, headers: dict, model: str,
               messages: list[dict], max_tokens: int) -> Shot:
    """One streamed chat request.

    Raises:
        RuntimeError: a status other than 200, or a stream without content.
    """
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    usage: dict = {}
    async with client.stream("POST", url + "/v1/chat/completions", json=body,
                             headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        routing = parse_server_timing(r.headers.get("server-timing")).get("routing")
        replica = r.headers.get("x-routed-replica", url)
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            if any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or []):
                now = time.perf_counter()
                if first is None:
                    first = now
                else:
                    gaps.append(now - last)
                last = now
    if first is None:
        raise RuntimeError(f"{url}: stream without content")
    details = usage.get("prompt_tokens_details") or {}
    return Shot(first - t0, time.perf_counter() - t0, gaps, routing, replica,
                int(details.get("cached_tokens") or 0), int(usage.get("completion_tokens") or 0))


def _chat(system: str, user: str = "Summarise the text above.") -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def engine_ttft_means(client: httpx.AsyncClient, engines: list[str]) -> tuple[float, float]:
    """Sum and count of ``vllm:time_to_first_token_seconds`` over the engines (0, 0 for an
    engine that does not export it)."""
    from prometheus_client.parser import text_string_to_metric_families
    total = count = 0.0
    for e in engines:
        try:
            text = (await client.get(e + "/metrics", timeout=10)).text
        except httpx.HTTPError:
            continue
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == "vllm:time_to_first_token_seconds_sum":
                    total += s.value
                elif s.name == "vllm:time_to_first_token_seconds_count":
                    count += s.value
    return total, count


async def ttft_phase(t: Targets, iters: int, prompt_tokens: int, tokenizer: str | None,
                     tag: str) -> dict:
    """Cache-hit and cold TTFT per path (interleaved), and the engines' internal TTFT of
    the direct requests."""
    out: dict = {p: {"hit": [], "cold": [], "routing_hit": [], "routing_cold": [],
                     "cached_hit": []} for p in PATHS}
    internal: dict = {}
    async with httpx.AsyncClient(timeout=600) as c:
        warm = {p: words_text(prompt_tokens, f"{tag}-hit-{p}", tokenizer) for p in PATHS}
        for p in PATHS:
            for e in (range(len(t.engines)) if p == "engine" else [None]):
                url, h = t.url_headers(p, e)
                await shot(c, url, h, t.model, _chat(warm[p]), 1)
        for kind in ("hit", "cold"):
            for i in range(iters):
                for p in PATHS:
                    text = warm[p] if kind == "hit" else \
                        words_text(prompt_tokens, f"{tag}-cold-{p}-{i}", tokenizer)
                    url, h = t.url_headers(p, i if p == "engine" else None)
                    if p == "engine":
                        before = await engine_ttft_means(c, [url])
                    s = await shot(c, url, h, t.model, _chat(text), 1)
                    if p == "engine":
                        after = await engine_ttft_means(c, [url])
                        if after[1] > before[1]:
                            internal.setdefault(kind, []).append(
                                (after[0] - before[0]) / (after[1] - before[1]))
                    out[p][kind].append(s.ttft_s)
                    if s.routing_s is not None:
                        out[p][f"routing_{kind}"].append(s.routing_s)
                    if kind == "hit":
                        out[p]["cached_hit"].append(s.cached_tokens)
    out["engine_internal"] = internal
    return out


async def itl_phase(t: Targets, iters: int, tokens: int, tokenizer: str | None,
                    tag: str) -> dict:
    out: dict = {p: [] for p in PATHS}
    async with httpx.AsyncClient(timeout=600) as c:
        for i in range(iters):
            for p in PATHS:
                url, h = t.url_headers(p, i if p == "engine" else None)
                s = await shot(c, url, h, t.model,
                               _chat(words_text(64, f"{tag}-itl-{p}-{i}", tokenizer),
                                     "Write a long story."), tokens)
                out[p].extend(s.itl_s)
    return out


async def throughput_phase(t: Targets, per_engine: int, seconds: float,
                           tokenizer: str | None, tag: str) -> dict:
    """Closed-loop clients for ``seconds`` per path: requests/s and output tokens/s."""
    prefix = words_text(256, f"{tag}-tp-prefix", tokenizer)
    out = {}
    n = per_engine * len(t.engines)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=n + 8)
    for p in PATHS:
        done = [0, 0, 0]  # requests, output tokens, failures
        itl: list[float] = []
        stop = time.perf_counter() + seconds
        async with httpx.AsyncClient(timeout=600, limits=limits) as c:
            async def client(k: int):
                i = 0
                while time.perf_counter() < stop:
                    url, h = t.url_headers(p, k if p == "engine" else None)
                    text = prefix + words_text(256, f"{tag}-tp-{p}-{k}-{i}-{uuid.uuid4()}",
                                               tokenizer)
                    try:
                        s = await shot(c, url, h, t.model, _chat(text), 64)
                    except (RuntimeError, httpx.HTTPError):
                        done[2] += 1
                        i += 1
                        continue
                    done[0] += 1
                    done[1] += s.completion_tokens or len(s.itl_s) + 1
                    itl.extend(s.itl_s)
                    i += 1
            t0 = time.perf_counter()
            await asyncio.gather(*(client(k) for k in range(n)))
            wall = time.perf_counter() - t0
        out[p] = {"clients": n, "requests": done[0], "failed": done[2], "wall_s": wall,
                  "requests_per_s": done[0] / wall, "output_tokens_per_s": done[1] / wall,
                  "itl_p50_ms": percentile(itl, 0.5, NAN) * 1e3}
    for p in ("direct", "serve"):
        out[p]["ratio_to_engine"] = out[p]["output_tokens_per_s"] / \
            out["engine"]["output_tokens_per_s"]
    return out


def summarise(ttft: dict, itl: dict, tp: dict | None) -> dict:
    s: dict = {"ttft_ms": {}, "itl_ms": {}, "overhead_ms": {}, "hops_ms": {}}
    for p in PATHS:
        s["ttft_ms"][p] = {k: {"p50": percentile(ttft[p][k], 0.5, NAN) * 1e3,
                               "p90": percentile(ttft[p][k], 0.9, NAN) * 1e3}
                           for k in ("hit", "cold")}
        s["itl_ms"][p] = {"p50": percentile(itl[p], 0.5, NAN) * 1e3,
                          "p90": percentile(itl[p], 0.9, NAN) * 1e3,
                          "mean": statistics.fmean(itl[p]) * 1e3 if itl[p] else NAN}
    for p in ("direct", "serve"):
        s["overhead_ms"][p] = {k: s["ttft_ms"][p][k]["p50"] - s["ttft_ms"]["engine"][k]["p50"]
                               for k in ("hit", "cold")}
        s["overhead_ms"][p]["itl_p50"] = s["itl_ms"][p]["p50"] - s["itl_ms"]["engine"]["p50"]
    for k in ("hit", "cold"):
        routing = percentile(ttft["direct"][f"routing_{k}"], 0.5, NAN) * 1e3
        internal = ttft["engine_internal"].get(k)
        s["hops_ms"][k] = {
            "router_own": routing,
            "proxy_and_ingress_http": s["overhead_ms"]["direct"][k] - routing,
            "handle_and_replica_actor": s["ttft_ms"]["serve"][k]["p50"]
            - s["ttft_ms"]["direct"][k]["p50"],
            "engine_http_server": (statistics.fmean(ttft["engine"][k]) * 1e3
                                   - statistics.fmean(internal) * 1e3) if internal else None}
    s["cached_tokens_on_hits"] = {p: statistics.median(ttft[p]["cached_hit"])
                                  for p in PATHS if ttft[p]["cached_hit"]}
    if tp:
        s["throughput"] = tp
    return s


def table(s: dict) -> str:
    rows = ["| path | TTFT hit p50 / p90 (ms) | TTFT cold p50 / p90 (ms) | overhead hit / cold "
            "p50 (ms) | ITL p50 / p90 (ms) | ITL overhead p50 (ms) | output tok/s (x engine) |",
            "|---|---|---|---|---|---|---|"]
    for p in PATHS:
        t, i = s["ttft_ms"][p], s["itl_ms"][p]
        o = s["overhead_ms"].get(p)
        tp = s.get("throughput", {}).get(p)
        rows.append(
            f"| {p} | {t['hit']['p50']:.1f} / {t['hit']['p90']:.1f} | {t['cold']['p50']:.1f} / "
            f"{t['cold']['p90']:.1f} | "
            + (f"{o['hit']:+.1f} / {o['cold']:+.1f}" if o else "-")
            + f" | {i['p50']:.2f} / {i['p90']:.2f} | "
            + (f"{o['itl_p50']:+.2f}" if o else "-") + " | "
            + (f"{tp['output_tokens_per_s']:.0f}"
               + (f" ({tp['ratio_to_engine']:.2f})" if "ratio_to_engine" in tp else "")
               if tp else "-") + " |")
    rows += ["", "| hop (p50, ms) | cache hit | cold |", "|---|---|---|"]
    for hop in ("router_own", "proxy_and_ingress_http", "handle_and_replica_actor",
                "engine_http_server"):
        vals = [s["hops_ms"][k][hop] for k in ("hit", "cold")]
        rows.append(f"| {hop.replace('_', ' ')} | " + " | ".join(
            "-" if v is None else f"{v:.1f}" for v in vals) + " |")
    return "\n".join(rows)


async def run(url: str, model: str, iters: int, prompt_tokens: int, itl_iters: int,
              itl_tokens: int, per_engine: int, seconds: float, tokenizer: str | None) -> dict:
    async with httpx.AsyncClient(timeout=30) as c:
        reps = (await c.get(url + "/replicas")).json()["replicas"]
    engines = [r["metadata"]["engine_url"] for r in reps]
    t = Targets(url, engines, model)
    tag = uuid.uuid4().hex[:6]
    ttft = await ttft_phase(t, iters, prompt_tokens, tokenizer, tag)
    itl = await itl_phase(t, itl_iters, itl_tokens, tokenizer, tag)
    tp = await throughput_phase(t, per_engine, seconds, tokenizer, tag) if seconds > 0 else None
    s = summarise(ttft, itl, tp)
    s["replicas"] = len(engines)
    return s


def main(argv: list[str] | None = None) -> int:
    import platform
    import sys

    from loadtest.report import RESULTS, write_benchmark_doc
    from loadtest.service import start_service

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", help="a running service (allow_policy_override on)")
    ap.add_argument("--engine", default="sim", choices=("sim", "vllm"),
                    help="engines of the service this starts without --url")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--model", default="tiny-qwen2")
    ap.add_argument("--tokenizer", default="models/tiny-qwen2",
                    help="model directory: prompts of exact token counts")
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--prompt-tokens", type=int, default=4000)
    ap.add_argument("--itl-iters", type=int, default=3)
    ap.add_argument("--itl-tokens", type=int, default=256)
    ap.add_argument("--concurrency", type=int, default=4, help="throughput clients per engine")
    ap.add_argument("--throughput-s", type=float, default=20.0, help="0: skip")
    ap.add_argument("--machine", default="", help="machine description for the doc")
    ap.add_argument("--section", default="Router overhead per data path")
    ap.add_argument("--no-doc", action="store_true")
    a = ap.parse_args(argv)
    url = a.url or start_service(a.replicas, None, engine=a.engine,
                                 extra_engine_args=["--step-model", "0.00185,0.0000261,"
                                                    "0.0000301,0.000000021"]
                                 if a.engine == "sim" else [])
    s = asyncio.run(run(url, a.model, a.iters, a.prompt_tokens, a.itl_iters, a.itl_tokens,
                        a.concurrency, a.throughput_s, a.tokenizer))
    tab = table(s)
    print(tab)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"data-path-{int(time.time())}.json").write_text(json.dumps(s, indent=1))
    if not a.no_doc:
        cmd = "python -m loadtest.data_path " + " ".join(argv if argv is not None
                                                         else sys.argv[1:])
        notes = (f"{s['replicas']} replicas; machine: {a.machine or platform.node()}. "
                 "Overhead = the path's median TTFT minus the engines' own (prompts of "
                 f"{a.prompt_tokens} tokens, 1 output token); throughput: {a.concurrency} "
                 "clients per engine, 512-token prompts, 64 output tokens.")
        write_benchmark_doc(a.section, cmd.strip(), tab, notes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
