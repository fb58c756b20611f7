"""The locust kit (``loadtest/locustfile.py``) run as load testers run it: locust's own
command, headless, CSV out. Locust runs as its own process (gevent cannot patch a process
that has imported Ray or vLLM)."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import ROOT, EngineServer, free_port

pytestmark = pytest.mark.integration

LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"


def run_locust(host: str, out, *args: str, seconds: int = 15) -> tuple[int, dict, str]:
    """Run the kit headless for ``seconds``; returns (exit code, stats rows by (type, name),
    output)."""
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless", "--host", host,
           "--csv", str(out / "run"), "-t", f"{seconds}s", "--stop-timeout", "30", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120,
                          cwd=out)
    with open(out / "run_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    return proc.returncode, rows, proc.stdout + proc.stderr


def test_a_headless_run_against_the_router_has_ttft_and_itl_samples_and_no_failures(
        service, model_dir, tmp_path):
    rc, rows, log = run_locust(
        service.url, tmp_path, "MultiTurnChatUser", "-u", "3", "-r", "3",
        "--tokenizer", str(model_dir), "--system-tokens", "150", "--question-tokens", "20",
        "--answer-tokens", "8", "--think-time", "0.3", "--turns", "3",
        "--routing-policy", "prefix_aware", seconds=20)
    assert rc == 0, log[-3000:]
    for kind in ("TTFT", "ITL", "TPOT", "POST"):
        row = rows[(kind, "chat")]
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
        assert float(row["Average Response Time"]) > 0, row
    assert int(rows[("", "Aggregated")]["Failure Count"]) == 0
    with open(tmp_path / "run_replicas.csv") as f:
        replicas = list(csv.DictReader(f))
    # the CSV's counts are taken when the users stop; a user's request in flight then may
    # finish (--stop-timeout) after them: at most one per user (3)
    counted = sum(int(r["requests"]) for r in replicas)
    assert abs(counted - int(rows[("POST", "chat")]["Request Count"])) <= 3
    assert len(replicas) == 2 and all(r["replica"] != "?" for r in replicas)
    assert sum(int(r["predicted_requests"]) for r in replicas) > 0
    assert sum(int(r["cached_tokens"]) for r in replicas) > 0  # later turns hit
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["ttft_ms"]["n"] > 0 and summary["hit_rate"] > 0
    # the inference requests, as the replicas' rows count them (not a user's GET /v1/models)
    assert summary["requests"] == int(rows[("POST", "chat")]["Request Count"])
    assert (tmp_path / "run_summary.png").stat().st_size > 0


@pytest.fixture
def sim_engine(model_dir):
    engine = EngineServer.sim(model_dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    yield engine.url
    engine.stop()


def test_streams_dropped_after_k_chunks_count_as_failures(sim_engine, tmp_path):
    r = httpx.post(sim_engine + "/sim/faults", json={"drop_after_chunks": 2}, timeout=5)
    assert r.status_code == 200
    rc, rows, log = run_locust(sim_engine, tmp_path, "MultiTurnChatUser", "-u", "2", "-r", "2",
                               "--system-tokens", "100", "--answer-tokens", "8",
                               "--think-time", "0.1", seconds=6)
    post = rows[("POST", "chat")]
    assert int(post["Request Count"]) > 0
    assert int(post["Failure Count"]) == int(post["Request Count"]), post
    assert rc != 0  # locust's exit code on failures
    failures = (tmp_path / "run_failures.csv").read_text()
    assert "stream broke" in failures or "[DONE]" in failures, failures


def test_the_same_run_works_against_one_engine_directly(sim_engine, tmp_path):
    """A single OpenAI-compatible server (no router headers) counts as one replica named
    after its address: the comparison with the router is one --host away."""
    rc, rows, log = run_locust(sim_engine, tmp_path, "MultiTurnChatUser", "-u", "2", "-r", "2",
                               "--system-tokens", "100", "--answer-tokens", "8",
                               "--question-tokens", "20", "--think-time", "0.1",
                               "--samples-jsonl", str(tmp_path / "samples.jsonl"), seconds=5)
    assert rc == 0, log[-2000:]
    with open(tmp_path / "run_replicas.csv") as f:
        replicas = list(csv.DictReader(f))
    assert [r["replica"] for r in replicas] == [sim_engine.split("//")[1]]
    assert int(rows[("TTFT", "chat")]["Request Count"]) > 0
    # no --tokenizer: the served model's folder (root in /v1/models) is taken, so a first
    # turn is its 100 + 20 tokens, a question and the template's (the generated model's
    # tokenizer splits the fallback words into about 3.5 tokens each: 420 and more)
    first = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()
             if json.loads(line)["turn"] == 0]
    assert first and max(s["prompt_tokens"] for s in first) < 300, first


def test_trace_replay_keeps_the_traces_pace_and_shares_prefixes(sim_engine, tmp_path):
    """The first 40 Mooncake rows at 200x their pace: rows sharing hash ids hit the cache."""
    t0 = time.monotonic()
    rc, rows, log = run_locust(sim_engine, tmp_path, "TraceReplayUser", "-u", "8", "-r", "8",
                               "--trace-limit", "40", "--trace-speed", "200",
                               "--max-output-tokens", "4", seconds=60)
    assert rc == 0, log[-2000:]
    assert int(rows[("POST", "trace")]["Request Count"]) == 40
    assert time.monotonic() - t0 < 55  # the users stop when the trace ends
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["cached_tokens"] > 0


def test_distributed_mode_merges_the_workers_per_replica_counts(sim_engine, tmp_path):
    """locust's own distribution: a master and two workers; the master's replica table and
    summary add up what the workers counted."""
    port = free_port()
    common = ["-f", str(LOCUSTFILE), "MultiTurnChatUser", "--system-tokens", "100",
              "--answer-tokens", "8", "--think-time", "0.1"]
    master = subprocess.Popen(
        [sys.executable, "-m", "locust", *common, "--master", "--master-bind-host",
         "127.0.0.1", "--master-bind-port", str(port), "--expect-workers", "2", "--headless",
         "-u", "4", "-r", "4", "-t", "8s", "--host", sim_engine, "--csv",
         str(tmp_path / "run")], cwd=tmp_path, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    workers = [subprocess.Popen(
        [sys.executable, "-m", "locust", *common, "--worker", "--master-host", "127.0.0.1",
         "--master-port", str(port)], cwd=tmp_path, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL) for _ in range(2)]
    try:
        out, _ = master.communicate(timeout=120)
    finally:
        for w in workers:
            w.terminate()
            w.wait(30)
    assert master.returncode == 0, out[-2000:]
    with open(tmp_path / "run_stats.csv") as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    posted = int(rows[("POST", "chat")]["Request Count"])
    with open(tmp_path / "run_replicas.csv") as f:
        counted = sum(int(r["requests"]) for r in csv.DictReader(f))
    assert posted > 0 and abs(counted - posted) <= 4  # a request per user may straddle the end
    assert int(rows[("TTFT", "chat")]["Request Count"]) > 0
