"""The simulator against a recorded GPU run (4 vLLM 0.26 engines sharing one H200, the
multi-turn benchmark under three policies, ``loadtest/data/gpu/``): same requests, same
routing, the H200 step-time profile, engines time-sharing the GPU."""

from __future__ import annotations

import json

import pytest

from loadtest.calibration import RECORDED, compare


@pytest.fixture(scope="module")
def results():
    data = json.loads(RECORDED.read_text())
    return {policy: compare(data, policy) for policy in data["runs"]}


def test_the_simulated_hit_rate_is_the_engines_within_a_point(results):
    for r in results.values():
        assert abs(r["simulated_hit_rate"] - r["measured_hit_rate"]) < 0.01, r


def test_the_simulated_ttft_is_within_the_stated_error_of_the_measured(results):
    """docs/benchmarks.md states the figures; the bound catches a model that drifts."""
    for r in results.values():
        assert r["median_rel_error"] < 0.35, r


def test_the_simulator_orders_the_policies_as_the_gpu_did(results):
    sim = {p: r["simulated_ttft_p50_s"] for p, r in results.items()}
    measured = {p: r["measured_ttft_p50_s"] for p, r in results.items()}
    assert sorted(sim, key=sim.get) == sorted(measured, key=measured.get)
