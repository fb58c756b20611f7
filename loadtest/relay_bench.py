"""The ingress's streamed answer: CPU per response, Starlette's ``StreamingResponse`` against
the router's ``RelayResponse`` (``router.serve.dispatch``).

Why: every answer the ingress streams (the direct data path's relay of its engine, the
keep-alive stream of a waiting request) goes through one of them on the ingress's event loop.
Under ASGI spec 2.3, which uvicorn and Ray Serve report, Starlette runs the relay and a
disconnect watcher in an anyio task group; ``RelayResponse`` relays in the calling task and
watches with one plain asyncio task. This measures that alone, in one process on uvloop (as
Ray runs its replicas): ``--responses`` responses of three SSE chunks each, sent to an ASGI
``send`` that does nothing, with a ``receive`` that never reports a disconnect; the figure is
``time.process_time`` per response. The two alternate for ``--rounds`` rounds; the median is
kept.

    python -m loadtest.relay_bench --doc
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from starlette.responses import StreamingResponse

from loadtest.report import write_benchmark_doc
from router.serve.dispatch import RelayResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
CHUNKS = (b'data: {"choices":[{"delta":{"content":"x"}}]}\n\n',
          b'data: {"choices":[],"usage":{"prompt_tokens":2000}}\n\n', b"data: [DONE]\n\n")


async def _body():
    for chunk in CHUNKS:
        yield chunk


async def _cpu_per_response(cls: type, n: int) -> float:
    """Microseconds of this process's CPU per response of ``cls``."""
    never = asyncio.Event()
    sent = 0

    async def receive():
        await never.wait()

    async def send(message):
        nonlocal sent
        sent += 1

    t = time.process_time()
    for _ in range(n):
        await cls(_body(), media_type="text/event-stream")(SCOPE, receive, send)
    cpu = time.process_time() - t
    assert sent == n * (len(CHUNKS) + 2), sent  # start, the chunks, the end: all sent
    return cpu / n * 1e6


RESPONSES = {"starlette StreamingResponse": StreamingResponse, "RelayResponse": RelayResponse}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--responses", type=int, default=20000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--doc", action="store_true", help="write the docs/benchmarks.md section")
    a = ap.parse_args()
    try:
        import uvloop
        run = uvloop.run
    except ImportError:
        run = asyncio.run
    runs: dict[str, list[float]] = {name: [] for name in RESPONSES}
    for _ in range(a.rounds):
        for name, cls in RESPONSES.items():
            runs[name].append(run(_cpu_per_response(cls, a.responses)))
            print(f"{name}: {runs[name][-1]:.1f} us CPU per response", flush=True)
    rows = ["| response class | CPU per response (us), median | runs (us) |", "|---|---|---|"]
    for name, r in runs.items():
        rows.append(f"| {name} | {statistics.median(r):.1f} | "
                    f"{', '.join(f'{c:.1f}' for c in r)} |")
    table = "\n".join(rows)
    print(table)
    if a.doc:
        write_benchmark_doc(
            "The streamed answer: Starlette's StreamingResponse against RelayResponse",
            f"python -m loadtest.relay_bench --responses {a.responses} --rounds {a.rounds} "
            "--doc",
            f"{a.responses} responses of {len(CHUNKS)} SSE chunks per run, ASGI spec 2.3, "
            "uvloop; this process's CPU per response:\n\n" + table,
            "Reading: under spec 2.3 Starlette relays in an anyio task group with a "
            "disconnect watcher; `RelayResponse` relays in the calling task and watches with "
            "one asyncio task (`router.serve.dispatch.relay_until_disconnect`). The "
            "difference is paid once per streamed answer by the ingress process.")


if __name__ == "__main__":
    main()
