"""Stopping the service by a signal, as systemd, container runtimes and a terminal's Ctrl-C
send it, leaves no process behind: ``bash deploy/run.sh`` in a session of its own, then
SIGTERM or SIGINT to its whole process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx

import pytest

from tests.conftest import ROOT, free_port, wait_until

pytestmark = pytest.mark.integration


def _ours(pgid_before: set[int]) -> list[str]:
    """Processes of the service still running: engines, their guards, Ray, serve run."""
    out = subprocess.run(["ps", "-ww", "-eo", "pid,args"], capture_output=True,  # whole lines
                         text=True).stdout
    keys = ("replicas.sim.server", "replicas.engine_guard", "VLLM::", "vllm.entrypoints",
            "raylet", "gcs_server", "serve run")
    return [line for line in out.splitlines()[1:]
            if any(k in line for k in keys) and int(line.split()[0]) not in pgid_before]


def _start(tmp_path, **env_extra) -> tuple[subprocess.Popen, int]:
    """``bash deploy/run.sh`` with simulated engines in a session of its own, as a
    terminal or a supervisor runs it (SIGINT not ignored); returns it and its HTTP port once
    it printed its ready line."""
    port = free_port()
    config = tmp_path / "sim.yaml"
    config.write_text((ROOT / "deploy" / "cpu.yaml").read_text()
                      .replace("port: 8000", f"port: {port}"))
    env = {**os.environ, "PREFIX_ROUTER_ENGINE": "sim", "RAY_AUTH_MODE": "disabled",
           **env_extra}
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(["bash", "deploy/run.sh", str(config)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_until(lambda: "is ready" in (tmp_path / "run.log").read_text(), 300, 1.0,
                   "the service to print its ready line")
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return proc, port


def _gcs_address(pgid: int) -> str:
    """The Ray cluster that ``deploy/run.sh`` (process group ``pgid``) started: its GCS's
    ``host:port``. The test session may run a Ray cluster of its own, which
    ``ray.init("auto")`` could find instead. Read from the GCS server's
    ``--session-dir`` and ``--node-ip-address`` and the port file Ray keeps there."""
    out = subprocess.run(["ps", "-ww", "-eo", "pgid,args"], capture_output=True,
                         text=True).stdout
    for line in out.splitlines()[1:]:
        group, _, args = line.strip().partition(" ")
        if int(group) == pgid and "gcs_server" in args.split(" ", 1)[0]:
            opts = dict(a.split("=", 1) for a in args.split() if a.startswith("--") and "=" in a)
            (port_file,) = Path(opts["--session-dir"]).glob("gcs_server_port_*")
            return f"{opts['--node-ip-address']}:{port_file.read_text().strip()}"
    raise AssertionError("no GCS server in the service's process group")


def _stop(proc: subprocess.Popen, sig: int, before: set[int]) -> None:
    """``sig`` to the service's process group; every process of it gone."""
    try:
        os.killpg(proc.pid, sig)
        proc.wait(120)
        wait_until(lambda: not _ours(before), 60, 1.0,
                   f"every process of the service to be gone after {signal.Signals(sig).name}")
    finally:
        for line in _ours(before):
            os.kill(int(line.split()[0]), signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_run_commands_process_group_leaves_no_process(tmp_path, sig):
    before = {int(line.split()[0]) for line in _ours(set())}  # e.g. other tests' Ray
    proc, _ = _start(tmp_path)
    try:
        assert any("replicas.sim.server" in p for p in _ours(before))
    finally:
        _stop(proc, sig, before)


def test_the_stop_command_lets_a_stream_in_flight_finish(tmp_path):
    """Found by a new user's trial: Ctrl-C cut a stream in flight (Serve kills its HTTP
    proxies first). ``python -m deploy.stop`` deletes the application instead: the stream
    ends whole, then a signal stops the rest. The service runs with ``START_REDIS=1`` and
    that signal is a SIGTERM to the command's pid alone (``kill <pid>``): the redis-server
    it started stops too (an operator's review found it left running under init, and a
    later start would have taken it and its keys)."""
    before = {int(line.split()[0]) for line in _ours(set())}
    rport = free_port()

    def redis_running() -> bool:
        out = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True,
                             text=True).stdout
        return any(line.startswith("redis-server") and f":{rport}" in line
                   for line in out.splitlines())

    # 20 ms a step: a 400-token answer streams for about 8 s
    proc, port = _start(tmp_path, PREFIX_ROUTER_EXTRA_ENGINE_ARGS=json.dumps(
        ["--step-model", "0.02,0.00002,0.0005,0"]), START_REDIS="1", REDIS_PORT=str(rport))
    try:
        assert redis_running()
        out: dict = {}

        def stream() -> None:
            body = {"model": "tiny-qwen2", "max_tokens": 400, "stream": True,
                    "messages": [{"role": "user", "content": "hello " * 20}]}
            with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions",
                              json=body, timeout=120) as r:
                out["status"] = r.status_code
                out["body"] = b"".join(r.iter_bytes())
        t = threading.Thread(target=stream)
        t.start()
        wait_until(lambda: "status" in out, 30, 0.05, "the stream to start")
        stopped = subprocess.run([sys.executable, "-m", "deploy.stop", "--address",
                                  _gcs_address(proc.pid)], cwd=ROOT,
                                 capture_output=True, text=True, timeout=180,
                                 env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        t.join(60)
        assert stopped.returncode == 0 and "deleted" in stopped.stdout, stopped.stderr[-2000:]
        assert out["status"] == 200 and out["body"].endswith(b"data: [DONE]\n\n"), \
            out["body"][-300:]
        assert b'"finish_reason": "length"' in out["body"].replace(b'":"', b'": "')
        proc.send_signal(signal.SIGTERM)  # the command's pid alone, not its group
        proc.wait(120)
        wait_until(lambda: not redis_running() and not _ours(before), 60, 1.0,
                   "the service and its redis-server gone after a SIGTERM to its pid")
    finally:
        if proc.poll() is None or _ours(before):
            _stop(proc, signal.SIGINT, before)
        if redis_running():
            subprocess.run(["redis-cli", "-p", str(rport), "shutdown", "nosave"],
                           capture_output=True)
