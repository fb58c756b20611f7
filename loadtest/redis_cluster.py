"""A throwaway Redis Cluster on loopback: the tests' and the cluster benchmark's.

``LocalRedisCluster(directory, masters)`` starts ``masters`` ``redis-server
--cluster-enabled yes`` processes on free loopback ports (each with a cluster bus port of
its own, ``cluster-port``, Redis 7.0+), without persistence, joins them with ``redis-cli
--cluster create ... --cluster-replicas 0 --cluster-yes`` (which gives each master an equal
run of the 16,384 slots) and waits until every node says ``cluster_state:ok``. ``stop``
kills every process it started; the object is also a context manager.

    with LocalRedisCluster(tmp_dir, masters=3) as cluster:
        url = cluster.url  # redis://127.0.0.1:<first node's port>/0
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

from loadtest.service import free_ports


def _die_with_parent() -> None:
    """In the child, before ``exec``: on Linux, ask for SIGKILL when the process that
    started it dies (``prctl(PR_SET_PDEATHSIG)``), so a test run killed outright leaves no
    node behind; elsewhere nothing (``stop`` still kills them)."""
    import ctypes
    import signal
    import sys

    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG


class LocalRedisCluster:
    """A Redis Cluster of ``masters`` masters and no replicas, on 127.0.0.1.

    Args:
        directory: where the nodes keep their ``nodes.conf`` (one sub-directory each).
        masters: number of master nodes (1 or more; ``redis-cli --cluster create`` needs 3
            or more, so 1 and 2 masters are joined with ``CLUSTER ADDSLOTSRANGE`` and
            ``CLUSTER MEET`` instead, the same slot split).
        timeout_s: bound on the start (s).
    Raises:
        FileNotFoundError: ``redis-server`` or ``redis-cli`` is not installed.
        RuntimeError: the cluster did not reach ``cluster_state:ok`` in time (the nodes
            started are killed first).
    """

    def __init__(self, directory: Path, masters: int = 3, timeout_s: float = 30.0):
        for tool in ("redis-server", "redis-cli"):
            if shutil.which(tool) is None:
                raise FileNotFoundError(f"{tool} is not installed (apt-get install redis)")
        if masters < 1:
            raise ValueError(f"masters must be >= 1, got {masters}")
        self.directory = Path(directory)
        self.masters = masters
        self.ports: list[int] = []
        self.bus_ports: list[int] = []
        self.procs: list[subprocess.Popen] = []
        try:
            self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """The first node's URL (a cluster client learns the others from it)."""
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def _start(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        ports = free_ports(2 * self.masters)  # a node's port and its bus port, all distinct
        for k in range(self.masters):
            port, bus = ports[2 * k], ports[2 * k + 1]
            self.bus_ports.append(bus)
            d = self.directory / f"node-{port}"
            d.mkdir(parents=True, exist_ok=True)
            self.ports.append(port)
            self.procs.append(subprocess.Popen(
                ["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                 "--cluster-enabled", "yes", "--cluster-port", str(bus),
                 "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout",
                 "5000", "--save", "", "--appendonly", "no", "--dir", str(d)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                preexec_fn=_die_with_parent))
        for port in self.ports:
            self._wait(lambda: self._cli(port, "ping") == "PONG", deadline,
                       f"redis-server on port {port}")
        if self.masters >= 3:
            subprocess.run(["redis-cli", "--cluster", "create",
                            *(f"127.0.0.1:{p}" for p in self.ports),
                            "--cluster-replicas", "0", "--cluster-yes"],
                           check=True, capture_output=True, timeout=timeout_s)
        else:  # redis-cli refuses fewer than 3 masters: the same even split by hand
            per = 16384 // self.masters
            for k, port in enumerate(self.ports):
                last = 16383 if k == self.masters - 1 else (k + 1) * per - 1
                self._cli(port, "cluster", "addslotsrange", str(k * per), str(last))
            for port in self.ports[1:]:
                self._cli(port, "cluster", "meet", "127.0.0.1", str(self.ports[0]),
                          str(self.bus_ports[0]))
        for port in self.ports:
            self._wait(lambda: "cluster_state:ok" in self._cli(port, "cluster", "info")
                       and self._known(port) == self.masters, deadline,
                       f"cluster_state:ok on port {port}")

    def _known(self, port: int) -> int:
        """Masters with slots as node ``port`` sees them."""
        out = self._cli(port, "cluster", "nodes")
        return sum(1 for line in out.splitlines()
                   if "master" in line.split()[2] and len(line.split()) > 8)

    @staticmethod
    def _cli(port: int, *args: str) -> str:
        r = subprocess.run(["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip()

    @staticmethod
    def _wait(predicate, deadline: float, what: str) -> None:
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except (subprocess.SubprocessError, OSError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"timed out waiting for {what}")

    def stop(self) -> None:
        """Kill every node started (idempotent)."""
        for p in self.procs:
            if p.poll() is None:
                p.kill()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []

    def __enter__(self) -> "LocalRedisCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
