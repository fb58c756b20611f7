"""The direct path's engine client: CPU per streamed engine call, httpx against aiohttp.

Why the direct data path dispatches with aiohttp (``router.serve.engine_client``): each
request's call to its engine and the relay of the answer run on the ingress's event loop, so
their CPU is the router's. This measures that CPU alone: one process sends ``--calls``
streamed chat requests (an 8 KB body, ``stream: true``) to a zero-time engine
(``loadtest.router_throughput``'s ``ZeroEngine``, one token per answer, in a process of its
own), ``--concurrency`` at a time over pooled keep-alive connections, and reads every answer
to its end, as ``DirectAttempt`` does: the head, the hop-by-hop-filtered headers, the raw body.
The figure is the calling process's CPU time (``time.process_time``) per call, after 50
warm-up calls; the two clients alternate for ``--rounds`` rounds and the median is kept.

    python -m loadtest.engine_client_bench --doc
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time

from loadtest.report import write_benchmark_doc
from loadtest.router_throughput import _engine_main

BODY = json.dumps({"model": "tiny-qwen2", "max_tokens": 1, "stream": True,
                   "messages": [{"role": "user", "content": "x " * 4000}]}).encode()
HEADERS = {"content-type": "application/json"}


async def _httpx_calls(url: str, calls: int, concurrency: int) -> tuple[float, float]:
    import httpx

    client = httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=1024))

    async def one() -> None:
        resp = await client.send(client.build_request("POST", url, content=BODY,
                                                      headers=HEADERS), stream=True)
        dict(resp.headers.items())
        async for _ in resp.aiter_raw():
            pass
        await resp.aclose()

    try:
        return await _drive(one, calls, concurrency)
    finally:
        await client.aclose()


async def _aiohttp_calls(url: str, calls: int, concurrency: int) -> tuple[float, float]:
    from router.serve.engine_client import EngineClient

    client = EngineClient(60.0)

    async def one() -> None:
        resp = await client.open("POST", url, BODY, HEADERS)
        async for _ in resp.chunks():
            pass
        await resp.close()

    try:
        return await _drive(one, calls, concurrency)
    finally:
        await client.close()


async def _drive(one, calls: int, concurrency: int) -> tuple[float, float]:
    """(CPU ms per call, calls/s) of ``calls`` calls, ``concurrency`` at a time."""
    for _ in range(50):
        await one()
    left = iter(range(calls))

    async def worker() -> None:
        for _ in left:
            await one()

    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return (time.process_time() - cpu) / calls * 1e3, calls / (time.perf_counter() - wall)


CLIENTS = {"httpx": _httpx_calls, "aiohttp (router.serve.engine_client)": _aiohttp_calls}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--port", type=int, default=18911)
    ap.add_argument("--doc", action="store_true", help="write the docs/benchmarks.md section")
    a = ap.parse_args()
    engine = mp.get_context("spawn").Process(target=_engine_main, args=(a.port,), daemon=True)
    engine.start()
    url = f"http://127.0.0.1:{a.port}/v1/chat/completions"
    try:
        time.sleep(3.0)
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in CLIENTS}
        for _ in range(a.rounds):
            for name, fn in CLIENTS.items():
                runs[name].append(asyncio.run(fn(url, a.calls, a.concurrency)))
                print(f"{name}: {runs[name][-1][0]:.3f} ms CPU per call, "
                      f"{runs[name][-1][1]:,.0f} calls/s", flush=True)
    finally:
        engine.terminate()
        engine.join(5)
    rows = ["| client | CPU per call (ms), median | runs (ms) | calls/s, median |",
            "|---|---|---|---|"]
    for name, r in runs.items():
        rows.append(f"| {name} | {statistics.median(c for c, _ in r):.3f} | "
                    f"{', '.join(f'{c:.3f}' for c, _ in r)} | "
                    f"{statistics.median(s for _, s in r):,.0f} |")
    table = "\n".join(rows)
    print(table)
    if a.doc:
        write_benchmark_doc(
            "The engine client: httpx against aiohttp",
            f"python -m loadtest.engine_client_bench --calls {a.calls} --concurrency "
            f"{a.concurrency} --rounds {a.rounds} --doc",
            f"{a.calls} streamed chat calls (8 KB body, one-token answer) per run to a "
            f"zero-time engine, {a.concurrency} at a time over keep-alive connections; "
            "the calling process's CPU per call:\n\n" + table,
            "Reading: the dispatch and the relay of every request run on the ingress's "
            "event loop, so this CPU is the router's own. httpx parses HTTP in pure Python "
            "(h11) over anyio; aiohttp parses it in C. The direct data path "
            "(`DirectAttempt`, `router.serve.engine_client`) and the engine replicas' relay "
            "on Serve's path use aiohttp since this measurement; httpx stays for the "
            "control calls (scrapes, probes), a few per second.")


if __name__ == "__main__":
    main()
