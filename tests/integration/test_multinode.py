"""Two Ray nodes, as on two hosts: the head in this machine's network namespace and a worker
node in a network namespace of its own, joined by a veth pair (each "host" has its own
address, loopback and ports, so nothing crosses between them but TCP over the link).

One engine replica runs on each node (``max_replicas_per_node: 1``), the engines bind every
interface (``engine_host: 0.0.0.0``) and so publish their KV events on TCP, Serve runs an
HTTP proxy on every node (``proxy_location: EveryNode``) and each of the two ingress
processes keeps its own in-process index, fed by both engines' events: whichever node an
ingress runs on, one of the engines is on the other node. The test shows exact routing
across nodes: once the predicted entries have expired, a repeat of each conversation, sent
through either node's proxy, goes to the replica that holds its prefix, as the index learnt
it from that engine's events, and the engine reports the prefix cached.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from replicas.engine import free_port
from tests.conftest import make_text, wait_until

pytestmark = pytest.mark.integration

RAY = str(Path(sys.executable).with_name("ray"))
ENV = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}

DRIVER = """
import json, sys
import ray
from ray import serve
ray.init(address=sys.argv[1])
serve.start(http_options={"host": "0.0.0.0", "port": int(sys.argv[2]),
                          "location": "EveryNode"})
from router.app import build_app
serve.run(build_app(json.loads(sys.argv[3])), name="multinode", route_prefix="/",
          blocking=False)
"""


@dataclass
class TwoNodes:
    head_ip: str
    worker_ip: str
    gcs_address: str
    netns: str


def _sh(*cmd: str, timeout: float = 120, netns: str | None = None) -> str:
    full = (["ip", "netns", "exec", netns] if netns else []) + list(cmd)
    out = subprocess.run(full, env=ENV, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(full)} failed ({out.returncode}):\n{out.stdout}\n"
                           f"{out.stderr}")
    return out.stdout


def _cluster_pids(marks: list[str], netns: str) -> set[int]:
    """Every process of the test's cluster: those in the worker's namespace, and those on
    the head whose command line names the cluster's temp folder or GCS address."""
    pids = set()
    ns = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    pids |= {int(p) for p in ns.stdout.split()}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            args = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in args for m in marks):
            pids.add(int(proc.name))
    pids.discard(os.getpid())
    return pids


def _kill_all(marks: list[str], netns: str, grace_s: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _cluster_pids(marks, netns):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while _cluster_pids(marks, netns) and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.fixture(scope="module")
def two_nodes():
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.fail("the two-node test makes a network namespace: it needs root and iproute2")
    tag = f"{os.getpid() % 100_000}"
    netns, veth = f"prt{tag}", f"prv{tag}"
    octet = 20 + os.getpid() % 200
    head_ip, worker_ip = f"10.213.{octet}.1", f"10.213.{octet}.2"
    temp_dir = tempfile.mkdtemp(prefix="prt", dir="/tmp")  # short: Unix socket paths
    gcs_port = free_port()
    marks = [temp_dir, f"{head_ip}:{gcs_port}"]
    try:
        _sh("ip", "netns", "add", netns)
        _sh("ip", "link", "add", f"{veth}h", "type", "veth", "peer", "name", f"{veth}n")
        _sh("ip", "link", "set", f"{veth}n", "netns", netns)
        _sh("ip", "addr", "add", f"{head_ip}/24", "dev", f"{veth}h")
        _sh("ip", "link", "set", f"{veth}h", "up")
        _sh("ip", "addr", "add", f"{worker_ip}/24", "dev", f"{veth}n", netns=netns)
        _sh("ip", "link", "set", f"{veth}n", "up", netns=netns)
        _sh("ip", "link", "set", "lo", "up", netns=netns)
        common = ["--num-cpus", "3", "--disable-usage-stats"]
        _sh(RAY, "start", "--head", "--node-ip-address", head_ip, "--port", str(gcs_port),
            "--temp-dir", temp_dir, "--include-dashboard=false",
            "--ray-client-server-port", str(free_port()),
            "--dashboard-agent-listen-port", str(free_port()),
            "--resources", json.dumps({"head_node": 1}), *common)
        _sh(RAY, "start", "--address", f"{head_ip}:{gcs_port}", "--node-ip-address",
            worker_ip, "--resources", json.dumps({"worker_node": 1}), *common, netns=netns)
        yield TwoNodes(head_ip, worker_ip, f"{head_ip}:{gcs_port}", netns)
    finally:
        _kill_all(marks, netns)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{veth}h"], capture_output=True)
        shutil.rmtree(temp_dir, ignore_errors=True)
        # `ray start` records the cluster for later ray.init() calls without an address;
        # a record of this one, gone, must not send them to it
        record = Path("/tmp/ray/ray_current_cluster")
        if record.exists() and record.read_text().strip() == f"{head_ip}:{gcs_port}":
            record.unlink()


def test_engines_on_two_nodes_are_routed_exactly_from_their_kv_events_over_tcp(
        two_nodes, model_dir, tokenizer):
    port = free_port()
    settings = {"engine": "sim", "model": str(model_dir), "num_replicas": 2,
                "max_replicas_per_node": 1, "engine_host": "0.0.0.0", "ingress_replicas": 2,
                "replica_num_cpus": 1, "ingress_num_cpus": 0.5,
                "predicted_ttl_with_events_s": 1.0, "index_namespace": "multinode"}
    _sh(sys.executable, "-c", DRIVER, two_nodes.gcs_address, str(port), json.dumps(settings),
        timeout=300)
    proxies = [f"http://{two_nodes.head_ip}:{port}", f"http://{two_nodes.worker_ip}:{port}"]
    clients = [httpx.Client(base_url=u, timeout=60) for u in proxies]

    def ready(c: httpx.Client) -> bool:
        try:
            h = c.get("/health", timeout=5).json()
            return h.get("ready") is True and h.get("replicas") == 2
        except (httpx.HTTPError, ValueError):
            return False

    for c in clients:
        wait_until(lambda c=c: ready(c), 300, 1.0, f"{c.base_url} ready with 2 replicas")

    replicas = clients[0].get("/replicas").json()["replicas"]
    nodes = {r["metadata"]["node_ip"]: r for r in replicas}
    assert set(nodes) == {two_nodes.head_ip, two_nodes.worker_ip}, replicas
    for ip, r in nodes.items():
        md = r["metadata"]
        assert md["engine_url"].startswith(f"http://{ip}:"), md
        assert md["kv_events_endpoint"].startswith(f"tcp://{ip}:"), md
        assert md["hash_probe"] == "ok", md  # the replica's own feed, over TCP too

    def chat(c: httpx.Client, i: int, turns: int) -> httpx.Response:
        messages = [{"role": "system", "content": make_text(300, f"node-conv-{i}", tokenizer)}]
        for t in range(turns):
            messages.append({"role": "user", "content": f"question {t} of conversation {i}"})
        r = c.post("/v1/chat/completions", json={"model": "tiny-qwen2", "max_tokens": 4,
                                                 "messages": messages})
        assert r.status_code == 200, r.text
        return r

    first = {i: chat(clients[i % 2], i, 1) for i in range(6)}
    homes = {i: r.headers["x-routed-replica"] for i, r in first.items()}
    assert set(homes.values()) == {r["replica_id"] for r in replicas}, homes
    time.sleep(2.5)  # every predicted entry (1 s) has expired: only KV events are left

    for i in range(6):
        for c in clients:  # through the proxy of each node
            r = chat(c, i, 2)
            assert r.headers["x-routed-replica"] == homes[i], (i, c.base_url, r.headers)
            assert r.headers["x-routing-reason"] == "cache", r.headers
            assert int(r.headers["x-predicted-cached-tokens"]) > 0, r.headers
            cached = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= int(r.headers["x-predicted-cached-tokens"]) > 0, (cached, r.headers)
    for c in clients:
        c.close()
