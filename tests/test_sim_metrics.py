"""What the simulator measures beyond TTFT (loadtest/sim.py): inter-token latency and time
per output token against the step-time model they come from, queueing, preemptions and
KV-capacity pressure."""

from __future__ import annotations

import math
import random

import pytest

from loadtest.sim import LogHistogram, SimConfig, WorkloadRequest, simulate
from replicas.sim.engine import EngineConfig
from replicas.sim.step_model import StepTimeModel

A, C, D = 0.010, 0.001, 2e-7  # fixed step cost, per decoding sequence, per context token


def requests(n: int, prompt: int, out: int, at: float = 0.0) -> list[WorkloadRequest]:
    rng = random.Random(n * 1000 + prompt)
    return [WorkloadRequest(at, [rng.randrange(100, 7000) for _ in range(prompt)], out)
            for _ in range(n)]


def run(reqs, engine=EngineConfig(), d=D):
    model = StepTimeModel(a_s=A, b_s_per_token=1e-6, c_s_per_seq=C, d_s_per_context_token=d)
    return simulate(SimConfig(policy="round_robin", replicas=1, engine=engine,
                              step_model=model), reqs).summary()


def test_a_lone_request_decodes_at_the_profiles_step_time():
    s = run(requests(1, 64, 200))
    # step j of its decode: a + c + d x (context), context from 65 to 264 tokens
    mean_ctx = 64 + 1 + 199 / 2
    assert s["tpot_p50_s"] == pytest.approx(A + C + D * mean_ctx, rel=0.002)
    assert s["itl_p50_s"] == pytest.approx(A + C + D * mean_ctx, rel=0.01)
    assert s["queue_p99_s"] == 0 and s["preemptions"] == 0


def test_a_busy_replica_decodes_slower_by_the_per_sequence_term():
    alone, busy = run(requests(1, 64, 100), d=0.0), run(requests(16, 64, 100), d=0.0)
    assert alone["itl_p50_s"] == pytest.approx(A + C, rel=0.006)
    assert busy["itl_p50_s"] == pytest.approx(A + 16 * C, rel=0.006)
    assert busy["tpot_p50_s"] == pytest.approx(A + 16 * C, rel=0.01)
    # the slowdown of a busy replica is the profile's: (a + 16c) / (a + c)
    assert busy["tpot_p50_s"] / alone["tpot_p50_s"] == pytest.approx((A + 16 * C) / (A + C),
                                                                      rel=0.01)


def test_requests_past_max_num_seqs_queue_in_the_engine():
    s = run(requests(8, 64, 50), engine=EngineConfig(max_num_seqs=4))
    # four wait for the first four to finish: about 50 decode steps of 4 sequences
    assert s["queue_p99_s"] > 40 * (A + 4 * C)


def test_a_full_kv_cache_preempts_and_shows_as_pressure():
    # 16 requests growing to 64 + 400 tokens need 16 x 15 blocks of 32; the pool has 120
    s = run(requests(16, 64, 400), engine=EngineConfig(num_blocks=120))
    assert s["preemptions"] > 0
    assert s["kv_full_frac"] > 0.2 and s["kv_usage_mean"] > 0.5
    roomy = run(requests(16, 64, 400))
    assert roomy["preemptions"] == 0 and roomy["kv_full_frac"] == 0


def test_log_histogram_percentiles_are_within_its_resolution():
    rng = random.Random(0)
    xs = [rng.lognormvariate(-4, 1) for _ in range(20000)]
    h = LogHistogram()
    for x in xs:
        h.add(x)
    xs.sort()
    for p in (0.5, 0.9, 0.99):
        exact = xs[math.ceil(p * len(xs)) - 1]
        assert h.percentile(p) == pytest.approx(exact, rel=0.006)
    w = LogHistogram()
    w.add(1.0, 99)
    w.add(2.0, 1)
    assert w.percentile(0.5) == pytest.approx(1.0, rel=0.005)
    assert w.percentile(0.999) == pytest.approx(2.0, rel=0.005)
    assert math.isnan(LogHistogram().percentile(0.5))
