"""Router overhead as docs/fault-cases.md 10.1 defines it: time to first token through the router
minus time to first token sent straight to an engine, for the same kind of prompt.

Starts Ray Serve with the router and 2 simulated engines (``replicas/sim/server.py``, the
project's engine stand-in: vLLM's HTTP API and KV events, and a step time fitted on an H200
running Qwen2.5-7B, ``replicas/sim/profiles/h200-qwen2.5-7b.json``). Every prompt is a chat
request with a system prompt of its own (nothing cached anywhere), streamed, 1 output token.

* One at a time, for prompts of about 1k, 32k and 120k tokens: each size alternates a
  request through the router and one straight to an engine (the engines alternate too);
  overhead = median TTFT through the router - median TTFT direct (and the same at p99).
* 32 prompts of about 32k tokens at once, 3 rounds: in each, 32 straight to the engines
  (16 each), then 32 others through the router; overhead p50 / p99 = the difference of the
  two paths' p50 / p99 over all rounds. The engines' queues are part of both, as in
  production: a request that the router dispatches later also waits less in its engine's
  queue.
* Every response through the router carries the router's own arrival-to-dispatch time
  (``server-timing: routing;dur=``); its p50 / p99 under the same load are reported too.

The arrival-to-dispatch time inside the router with no engine and no Ray at all is measured
by ``python -m loadtest.index_bench --only overhead``; this benchmark shows what a client
sees.

    python -m loadtest.overhead_e2e                 # writes docs/benchmarks.md
    python -m loadtest.overhead_e2e --iters 3 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx

from loadtest.index_bench import text_of
from loadtest.report import percentile as pct
from loadtest.report import write_benchmark_doc
from loadtest.service import start_service
from router.serve.protocol import parse_server_timing

PROFILE = "h200-qwen2.5-7b"


async def ttft(client: httpx.AsyncClient, url: str,
               system: str) -> tuple[float, float | None, str | None]:
    """Seconds from sending a streamed chat request to its first SSE data line, the
    router's own arrival-to-dispatch time (s) from its ``server-timing`` header, and the
    replica that served it (both None straight to an engine).

    Raises:
        RuntimeError: the answer was not 200.
    """
    body = {"model": "tiny-qwen2", "max_tokens": 1, "stream": True,
            "messages": [{"role": "system", "content": system},
                         {"role": "user", "content": "Summarise."}]}
    t0 = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:200]!r}")
        replica = r.headers.get("x-routed-replica")
        routing = parse_server_timing(r.headers.get("server-timing")).get("routing")
        first = None
        async for line in r.aiter_lines():  # read to the end: the request completes
            if first is None and line.startswith("data: {"):
                first = time.perf_counter() - t0
    if first is None:
        raise RuntimeError(f"{url}: stream ended without data")
    return first, routing, replica


async def single(router: str, engines: list[str], tokens: int, iters: int, tokenizer,
                 tag: str) -> dict:
    via, direct, routing = [], [], []
    async with httpx.AsyncClient(timeout=600) as c:
        for i in range(iters):
            direct.append((await ttft(c, engines[i % 2],
                                      text_of(tokens, f"{tag}-d{tokens}-{i}", tokenizer)))[0])
            t, r, _ = await ttft(c, router, text_of(tokens, f"{tag}-r{tokens}-{i}", tokenizer))
            via.append(t)
            routing.append(r)
    return {"tokens": tokens, "iters": iters, **_routing(routing),
            "direct_p50_ms": statistics.median(direct) * 1e3,
            "router_p50_ms": statistics.median(via) * 1e3,
            "overhead_p50_ms": (statistics.median(via) - statistics.median(direct)) * 1e3,
            "overhead_p99_ms": (pct(via, 0.99) - pct(direct, 0.99)) * 1e3}


def _routing(seconds: list[float | None]) -> dict:
    """p50/p99 (ms) of the router's own arrival-to-dispatch times (``server-timing``)."""
    got = [s for s in seconds if s is not None]
    if len(got) != len(seconds):
        raise RuntimeError("a response through the router had no server-timing header")
    return {"routing_p50_ms": pct(got, 0.5) * 1e3, "routing_p99_ms": pct(got, 0.99) * 1e3}


async def concurrent(router: str, engines: list[str], tokens: int, n: int, rounds: int,
                     tokenizer, tag: str) -> dict:
    """``rounds`` rounds of ``n`` requests at once straight to the engines, then ``n``
    others through the router; percentiles over all rounds' requests."""
    direct, via, routing, split = [], [], [], []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=None)) as c:
        for k in range(rounds):
            direct_prompts = [text_of(tokens, f"{tag}-cd{k}-{i}", tokenizer) for i in range(n)]
            router_prompts = [text_of(tokens, f"{tag}-cr{k}-{i}", tokenizer) for i in range(n)]
            direct += [t for t, _, _ in await asyncio.gather(
                *(ttft(c, engines[i % 2], p) for i, p in enumerate(direct_prompts)))]
            got = await asyncio.gather(*(ttft(c, router, p) for p in router_prompts))
            via += [t for t, _, _ in got]
            routing += [r for _, r, _ in got]
            served = [rep for _, _, rep in got]
            split.append(sorted((served.count(x) for x in set(served)), reverse=True))
    return {"tokens": tokens, "concurrency": n, "rounds": rounds, "split": split,
            **_routing(routing),
            "direct_p50_ms": pct(direct, 0.5) * 1e3, "direct_p99_ms": pct(direct, 0.99) * 1e3,
            "router_p50_ms": pct(via, 0.5) * 1e3, "router_p99_ms": pct(via, 0.99) * 1e3,
            "overhead_p50_ms": (pct(via, 0.5) - pct(direct, 0.5)) * 1e3,
            "overhead_p99_ms": (pct(via, 0.99) - pct(direct, 0.99)) * 1e3}


def table(singles: list[dict], conc: dict) -> str:
    rows = ["| prompt tokens | requests | TTFT direct p50 (ms) | TTFT via router p50 (ms) | "
            "overhead p50 (ms) | overhead p99 (ms) | router's own time p50 / p99 (ms) |",
            "|---|---|---|---|---|---|---|"]
    for s in singles:
        rows.append(f"| {s['tokens']} | {s['iters']} + {s['iters']}, one at a time | "
                    f"{s['direct_p50_ms']:.1f} | {s['router_p50_ms']:.1f} | "
                    f"{s['overhead_p50_ms']:.1f} | {s['overhead_p99_ms']:.1f} | "
                    f"{s['routing_p50_ms']:.1f} / {s['routing_p99_ms']:.1f} |")
    rows.append(f"| {conc['tokens']} | {conc['rounds']} x ({conc['concurrency']} + "
                f"{conc['concurrency']}), {conc['concurrency']} at once | "
                f"{conc['direct_p50_ms']:.0f} (p99 {conc['direct_p99_ms']:.0f}) | "
                f"{conc['router_p50_ms']:.0f} (p99 {conc['router_p99_ms']:.0f}) | "
                f"{conc['overhead_p50_ms']:.1f} | {conc['overhead_p99_ms']:.1f} | "
                f"{conc['routing_p50_ms']:.1f} / {conc['routing_p99_ms']:.1f} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=10, help="requests per size and path")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 32768, 122880])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of concurrent requests")
    ap.add_argument("--no-write", action="store_true", help="print only")
    ap.add_argument("--suffix", default="",
                    help="appended to the section title (another machine's section)")
    ap.add_argument("--num-cpus", type=int, default=4, help="Ray's logical CPUs")
    ap.add_argument("--ingress-replicas", type=int, default=1, help="router processes")
    ap.add_argument("--redis-url", default=None,
                    help="shared index and load (needed for several router processes to "
                         "see each other's load); default: the in-process index")
    a = ap.parse_args(argv)

    from deploy.make_model import ensure_model
    from router.config import DEFAULT_MODEL_DIR as MODEL_DIR
    from router.prompt.render import PromptRenderer
    ensure_model(MODEL_DIR)
    tokenizer = PromptRenderer(str(MODEL_DIR)).tokenizer
    router = start_service(2, a.redis_url, num_cpus=a.num_cpus, ingress_replicas=a.ingress_replicas,
                           engine="sim", max_model_len=200_000,
                           extra_engine_args=["--step-model", PROFILE,
                                              "--num-blocks", "63750"])
    engines = [r["metadata"]["engine_url"]
               for r in httpx.get(router + "/replicas", timeout=30).json()["replicas"]]
    tag = f"e2e{int(time.time())}"

    async def run():
        async with httpx.AsyncClient(timeout=600) as c:  # warm both paths
            for url in engines + [router, router]:
                await ttft(c, url, text_of(512, f"{tag}-warm-{url}", tokenizer))
        singles = [await single(router, engines, t, a.iters, tokenizer, tag)
                   for t in a.sizes]
        for s in singles:
            print(json.dumps(s), flush=True)
        conc = await concurrent(router, engines, 32768, a.concurrency, a.rounds, tokenizer,
                                tag)
        print(json.dumps(conc), flush=True)
        return singles, conc

    singles, conc = asyncio.run(run())
    text = table(singles, conc)
    print(text)
    if not a.no_write:
        cmd = "python -m loadtest.overhead_e2e" + (" " + " ".join(argv or sys.argv[1:])
                                                   if (argv or sys.argv[1:]) else "")
        single32 = next((s for s in singles if s["tokens"] == 32768), None)
        ratio = (f"{conc['overhead_p99_ms'] / single32['overhead_p50_ms']:.2f}"
                 if single32 and single32["overhead_p50_ms"] > 0 else "n/a")
        write_benchmark_doc(
            "Router overhead as seen by a client (docs/fault-cases.md 10.1)" + a.suffix, cmd, text,
            "Overhead = TTFT through the router - TTFT straight to an engine (2 simulated "
            f"engines with the {PROFILE} step time, prompts of their own, 1 output token). "
            f"Under {conc['concurrency']}-way concurrency the overhead p99 is "
            f"{conc['overhead_p99_ms']:.1f} ms, {ratio} x the single-request p50 at 32k "
            "(docs/fault-cases.md 10.1 asks for at most 3 x). The router's own arrival-to-dispatch "
            "time, without engines, is in 'Router overhead (docs/fault-cases.md 10.1)'.\n\n"
            "Reading: the overhead holds Ray Serve's hops (HTTP proxy, ingress, engine "
            "replica: most of the 1k row) and the router's own time (last column, from each "
            "response's server-timing header: render, head tokenization, hashing, index). A "
            "new long prompt costs the router little more than a short one: it is tokenized "
            "only up to its head. With 32 at once, the client, Ray's proxy, the router and "
            "both engines (which tokenize every 32k prompt again, as vLLM does) share the "
            "machine's cores, and the router's time is CPU queueing behind all of them; for "
            "any router whose work is CPU-bound, the last of N simultaneous requests waits "
            "about N / cores renders, so the ratio to the single-request time falls only "
            "with more cores (see 'Router overhead (docs/fault-cases.md 10.1)'). The router "
            "calls no replica's /tokenize.")
    import ray
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
