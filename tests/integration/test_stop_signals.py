"""Stopping the service by a signal, as systemd, container runtimes and a terminal's Ctrl-C
send it, leaves no process behind: ``bash deploy/run.sh`` in a session of its own, then
SIGTERM or SIGINT to its whole process group."""

from __future__ import annotations

import os
import signal
import subprocess

import pytest

from tests.conftest import ROOT, free_port, wait_until

pytestmark = pytest.mark.integration


def _ours(pgid_before: set[int]) -> list[str]:
    """Processes of the service still running: engines, their guards, Ray, serve run."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    keys = ("replicas.sim.server", "replicas.engine_guard", "VLLM::", "vllm.entrypoints",
            "raylet", "gcs_server", "serve run")
    return [line for line in out.splitlines()[1:]
            if any(k in line for k in keys) and int(line.split()[0]) not in pgid_before]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_run_commands_process_group_leaves_no_process(tmp_path, sig):
    before = {int(line.split()[0]) for line in _ours(set())}  # e.g. other tests' Ray
    port = free_port()
    config = tmp_path / "sim.yaml"
    config.write_text((ROOT / "deploy" / "cpu.yaml").read_text()
                      .replace("port: 8000", f"port: {port}"))
    env = {**os.environ, "PREFIX_ROUTER_ENGINE": "sim", "RAY_AUTH_MODE": "disabled"}
    log = open(tmp_path / "run.log", "w")
    proc = subprocess.Popen(["bash", "deploy/run.sh", str(config)], cwd=ROOT, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_until(lambda: "is ready" in (tmp_path / "run.log").read_text(), 300, 1.0,
                   "the service to print its ready line")
        assert any("replicas.sim.server" in p for p in _ours(before))
        os.killpg(proc.pid, sig)
        proc.wait(120)
        wait_until(lambda: not _ours(before), 60, 1.0,
                   f"every process of the service to be gone after {sig.name}")
    finally:
        for line in _ours(before):
            os.kill(int(line.split()[0]), signal.SIGKILL)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
