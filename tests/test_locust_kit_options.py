"""The locust kit's handling of options it cannot use and of servers that do not answer as
it expects, run as load testers run it (locust's own command, as a process of its own:
gevent cannot patch the test process). No engine is needed: the host is down, or a
stand-in HTTP server on loopback answers as the router answers a refusal."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from loadtest.openai_stream import failure_kind
from tests.conftest import ROOT, free_port

LOCUSTFILE = ROOT / "loadtest" / "locustfile.py"


def run_locust(tmp_path, *args: str, seconds: int = 20) -> tuple[int, str]:
    """The kit headless for at most ``seconds``: (exit code, output)."""
    cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
           "-t", f"{seconds}s", "--csv", str(tmp_path / "run"), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, cwd=tmp_path)
    return p.returncode, p.stdout + p.stderr


@pytest.mark.parametrize("args, says", [
    (["--trace", "/nonexistent/trace.jsonl"], "not a readable Mooncake-format trace"),
    (["--trace", str(ROOT / "README.md")], "not a readable Mooncake-format trace"),
    (["--trace-speed", "0"], "--trace-speed must be above 0"),
    (["--trace-max-input-tokens", "10"], "no trace rows to replay"),
])
def test_a_trace_it_cannot_replay_ends_the_run_with_one_line(tmp_path, args, says):
    """A helper's review: a bad trace logged its traceback some 15,000 times in 10 s (and
    ran forever without -t); a trace with no row to replay hung."""
    rc, log = run_locust(tmp_path, "TraceReplayUser", "--host",
                         f"http://127.0.0.1:{free_port()}", "-u", "2", "--model", "m", *args,
                         seconds=60)
    assert rc == 2, log[-2000:]
    assert log.count(says) == 1 and "Traceback" not in log, log[-2000:]
    assert "locust ends" in log  # before any user started


def test_a_host_that_is_not_a_url_ends_locust_before_any_user(tmp_path):
    rc, log = run_locust(tmp_path, "MultiTurnChatUser", "--host", "127.0.0.1:8000", "-u", "2")
    assert rc == 2 and "is not an http:// or https:// URL" in log, log[-2000:]
    assert "Traceback" not in log and "No connection adapters" not in log


def test_a_host_that_is_down_is_named_with_the_reason_and_the_run_fails(tmp_path):
    """No traceback per attempt, the refusal's reason in the failure, and exit code 1 when
    no inference request finished (the summary's failures count the inference requests)."""
    rc, log = run_locust(tmp_path, "MultiTurnChatUser", "--host",
                         f"http://127.0.0.1:{free_port()}", "-u", "2", seconds=4)
    assert rc == 1, log[-2000:]
    assert "Traceback" not in log, log[-3000:]
    assert "no answer from http://127.0.0.1:" in log and "Connection refused" in log
    assert "no inference request finished" in log
    summary = json.loads((tmp_path / "run_summary.json").read_text())
    assert summary["requests"] == 0 and summary["failures"] == 0
    assert summary["other_failures"] > 0


class _Server(BaseHTTPRequestHandler):
    """A stand-in OpenAI server on loopback. ``GET /v1/models`` answers 503 to its first
    ``cards_refused`` asks, then a card of ``root`` and ``max_model_len``; a POST is
    recorded and answered as ``post`` says: "refuse" (the router's own 400: its
    server-timing and data-path headers, no replica), "stream" (one content delta, usage,
    ``[DONE]``) or "hang" (no answer)."""

    cards_refused = 0
    root = ""
    max_model_len = 4096
    post = "refuse"
    bodies: list = []
    card_asks = 0

    def do_GET(self):
        cls = type(self)
        cls.card_asks += 1
        if cls.card_asks <= cls.cards_refused:
            return self._json(503, {"error": {"message": "starting", "code": 503}}, {})
        self._json(200, {"object": "list", "data": [
            {"id": "tiny", "root": cls.root, "max_model_len": cls.max_model_len}]}, {})

    def do_POST(self):
        cls = type(self)
        cls.bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
        if cls.post == "refuse":
            return self._json(400, {"error": {"message": "prompt of 5123 tokens", "code": 400}},
                              {"server-timing": "router;dur=0.4", "x-data-path": "direct"})
        if cls.post == "hang":
            time.sleep(30)
            return
        events = [{"choices": [{"index": 0, "delta": {"content": "ok"}}]},
                  {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 1}}]
        data = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("content-length", str(len(data)))
        self.send_header("x-routed-replica", "r1")
        self.end_headers()
        self.wfile.write(data.encode())

    def _json(self, status, body, headers):
        data = json.dumps(body).encode()
        self.send_response(status)
        for k, v in {"content-type": "application/json", **headers}.items():
            self.send_header(k, v)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    """A ``_Server`` subclass of its own (its settings and records) and its base URL."""
    handler = type("Handler", (_Server,), {"bodies": [], "card_asks": 0})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield handler, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_the_routers_own_answers_are_not_counted_as_a_replica(tmp_path, model_dir, stand_in):
    """The per-replica table had a row named after the router's address for its own 400s;
    and the served model's folder (``root``) is the tokenizer when none is given."""
    handler, url = stand_in
    handler.root = str(model_dir)
    rc, log = run_locust(tmp_path, "MultiTurnChatUser", "--host", url, "-u", "1",
                         "--think-time", "0.2", seconds=3)
    assert rc == 1, log[-2000:]
    rows = json.loads((tmp_path / "run_summary.json").read_text())["replicas"]
    assert [r["replica"] for r in rows] == ["(router, not routed)"], rows
    assert "no --tokenizer" not in log  # the model card's folder was taken
    failures = (tmp_path / "run_failures.csv").read_text()
    assert "prompt of N tokens" in failures, failures


def test_a_server_still_starting_changes_no_conversation_and_fails_no_run(tmp_path, model_dir,
                                                                          stand_in):
    """A review: each retry while /v1/models failed added a user message to the
    conversation, and with --model a failed card was kept for the whole run (no
    tokenizer, no context) and failed the run."""
    handler, url = stand_in
    handler.root, handler.cards_refused, handler.post = str(model_dir), 2, "stream"
    rc, log = run_locust(tmp_path, "MultiTurnChatUser", "--host", url, "-u", "1",
                         "--think-time", "0.1", "--turns", "2", seconds=4)
    assert rc == 0 or "/v1/models" in log, log[-2000:]
    first = handler.bodies[0]["messages"]
    assert [m["role"] for m in first] == ["system", "user"], first
    # with --model: the card is asked again until it answers, outside locust's table
    handler.bodies.clear()
    handler.card_asks, handler.cards_refused = 0, 1
    rc, log = run_locust(tmp_path, "MultiTurnChatUser", "--host", url, "-u", "1",
                         "--model", "tiny", "--think-time", "0.1", "--turns", "2",
                         seconds=8)
    assert rc == 0, log[-2000:]
    assert handler.card_asks >= 2 and "GET /v1/models: HTTP 503" in log
    assert json.loads((tmp_path / "run_summary.json").read_text())["other_failures"] == 0


def test_requests_in_flight_at_the_end_are_reported(tmp_path, stand_in):
    handler, url = stand_in
    handler.post = "hang"
    rc, log = run_locust(tmp_path, "MultiTurnChatUser", "--host", url, "-u", "2",
                         "--model", "tiny", seconds=3)
    assert rc == 1, log[-2000:]
    assert "2 requests still in flight when the test stopped" in log, log[-2000:]
    assert "no inference request finished" in log


def test_a_trace_with_numbers_as_text_is_replayed_and_rows_past_the_context_left_out(
        tmp_path, stand_in):
    handler, url = stand_in
    handler.post, handler.max_model_len = "stream", 1000
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(json.dumps(
        {"timestamp": str(10 * i), "input_length": str(n), "output_length": "4",
         "hash_ids": [i]}) for i, n in enumerate([100, 5000, 200])))
    rc, log = run_locust(tmp_path, "TraceReplayUser", "--host", url, "-u", "2",
                         "--trace", str(trace), "--trace-block-tokens", "100", seconds=30)
    assert rc == 0, log[-2000:]
    assert "Traceback" not in log
    assert "1 trace rows left out" in log and "trace replayed: 2 rows" in log
    assert len(handler.bodies) == 2


def test_distributed_a_bad_option_or_a_workers_error_ends_the_run_with_2(tmp_path, stand_in):
    """A review: the trace was checked on the workers only, so the master ended with 1
    ("no inference request finished") and never said why."""
    handler, url = stand_in
    port = free_port()
    common = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "TraceReplayUser"]
    master = subprocess.run([*common, "--master", "--master-bind-host", "127.0.0.1",
                             "--master-bind-port", str(port), "--expect-workers", "1",
                             "--headless", "-u", "1", "-t", "20s", "--host", url,
                             "--trace-speed", "0"], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path)
    assert master.returncode == 2, master.stderr[-2000:]
    assert "--trace-speed must be above 0" in master.stderr
    # every row longer than the served model's context: found by the worker, told the master
    handler.max_model_len = 10
    master = subprocess.Popen([*common, "--master", "--master-bind-host", "127.0.0.1",
                               "--master-bind-port", str(port), "--expect-workers", "1",
                               "--headless", "-u", "1", "-t", "30s", "--host", url,
                               "--trace-limit", "3"], cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    worker = subprocess.Popen([*common, "--worker", "--master-host", "127.0.0.1",
                               "--master-port", str(port)], cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out, _ = master.communicate(timeout=60)
    finally:
        worker.terminate()
        worker.wait(30)
    assert master.returncode == 2, out[-2000:]
    assert "a worker: no trace rows to replay" in out, out[-2000:]


def test_failure_kind_groups_http_errors_by_their_text_not_their_numbers():
    assert failure_kind('HTTP 400: {"message": "context is 8192 tokens, prompt 8193"}') == \
        'HTTP 400: {"message": "context is N tokens, prompt N"}'
    refused = "no answer: ConnectionError: HTTPConnectionPool(host='127.0.0.1', port=8999)"
    assert failure_kind(refused) == refused


def test_the_masters_in_flight_count_is_the_last_tests():
    """The web UI runs several tests in one process: the master summed every test's
    requests in flight at its stop, and a worker's count of an earlier test that reached
    the master after a new test started stayed. Run in a process of its own (importing
    locust patches the process with gevent)."""
    script = """
import loadtest.openai_users as k
k._worker_report("w1", {"prefix_router_in_flight": 3})
k._worker_report("w2", {"prefix_router_in_flight": 2})
assert sum(k._WORKERS_IN_FLIGHT.values()) == 5
k._new_test(environment=None)                            # the master starts a new test
assert k._WORKERS_IN_FLIGHT == {}
k._worker_report("w1", {"prefix_router_in_flight": 3})   # late: the earlier test's count
data = {}
k._report("w1", data)                                    # the worker's next report
assert data["prefix_router_in_flight"] == 0, data
k._worker_report("w1", data)
assert sum(k._WORKERS_IN_FLIGHT.values()) == 0, k._WORKERS_IN_FLIGHT
print("ok")
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stdout + p.stderr
