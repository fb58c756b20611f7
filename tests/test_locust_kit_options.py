"""The locust kit's handling of options it cannot use and of servers that do not answer as
it expects, run as load testers run it (locust's own command, as a process of its own:
gevent cannot patch the test process). No engine is needed: the host is down, or a
stand-in HTTP server on loopback answers as the router answers a refusal."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
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
    assert "the run ends" in log


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


class _Router(BaseHTTPRequestHandler):
    """Answers as the router answers a refusal of its own: a 400 with its server-timing
    and data-path headers and no ``x-routed-replica``; its model card names a folder."""

    root = ""

    def do_GET(self):
        self._json(200, {"object": "list", "data": [
            {"id": "tiny", "root": self.root, "max_model_len": 4096}]}, {})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self._json(400, {"error": {"message": "prompt of 5123 tokens", "code": 400}},
                   {"server-timing": "router;dur=0.4", "x-data-path": "direct"})

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


def test_the_routers_own_answers_are_not_counted_as_a_replica(tmp_path, model_dir):
    """The per-replica table had a row named after the router's address for its own 400s;
    and the served model's folder (``root``) is the tokenizer when none is given."""
    _Router.root = str(model_dir)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Router)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        rc, log = run_locust(tmp_path, "MultiTurnChatUser", "--host",
                             f"http://127.0.0.1:{server.server_address[1]}", "-u", "1",
                             "--think-time", "0.2", seconds=3)
    finally:
        server.shutdown()
    assert rc == 1, log[-2000:]
    rows = json.loads((tmp_path / "run_summary.json").read_text())["replicas"]
    assert [r["replica"] for r in rows] == ["(router, not routed)"], rows
    assert "no --tokenizer" not in log  # the model card's folder was taken
    failures = (tmp_path / "run_failures.csv").read_text()
    assert "prompt of N tokens" in failures, failures


def test_failure_kind_groups_http_errors_by_their_text_not_their_numbers():
    assert failure_kind('HTTP 400: {"message": "context is 8192 tokens, prompt 8193"}') == \
        'HTTP 400: {"message": "context is N tokens, prompt N"}'
    refused = "no answer: ConnectionError: HTTPConnectionPool(host='127.0.0.1', port=8999)"
    assert failure_kind(refused) == refused
