"""Start-up checks that keep the router from routing on hashes that cannot match
(docs/fault-cases.md 3.2, 8.2)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from replicas.engine import EnginePorts, EngineProcess
from router.config import Settings
from router.prompt.render import PromptRenderer


def test_router_without_a_loadable_tokenizer_refuses_to_start(tmp_path):
    """docs/fault-cases.md 8.2: a tokenizer that cannot load fails the ingress at start-up,
    loudly."""
    with pytest.raises((OSError, ValueError)):
        PromptRenderer(str(tmp_path / "no-such-model"))


def test_every_engine_is_started_with_the_pinned_hash_settings():
    """docs/fault-cases.md 3.2: PYTHONHASHSEED, the hash algorithm and the block size are always set
    on the engine, whatever the environment of the replica."""
    s = Settings(hash_seed="42", block_size=64, hash_algo="sha256_cbor")
    proc = EngineProcess(s, EnginePorts(1, "ipc:///tmp/a", "ipc:///tmp/b"), "t", "cpu")
    env, cmd = proc.env(), proc.command()
    assert env["PYTHONHASHSEED"] == "42"
    assert cmd[cmd.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    assert cmd[cmd.index("--block-size") + 1] == "64"
    assert "--enable-prefix-caching" in cmd and "--enable-prompt-tokens-details" in cmd


def test_router_hashes_are_identical_across_processes():
    """docs/fault-cases.md 3.2: two router processes (different Python hash seeds) and a restart
    give the same block hashes for the same tokens (no process-local hash())."""
    code = ("from router.hashing import BlockHasher, HashSettings;"
            "print(BlockHasher(HashSettings()).block_hashes(list(range(128))))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env={"PYTHONHASHSEED": seed, "PATH": "/usr/bin:/bin"},
                           cwd=str(__import__("pathlib").Path(__file__).parent.parent)
                           ).stdout for seed in ("1", "2", "random")}
    assert len(outs) == 1 and outs.pop().startswith("[3933666952306121906, 1283280737430802979")


def test_the_start_up_heap_is_frozen_out_of_the_collectors_walks(model_dir, monkeypatch):
    """An ingress process ends its start-up by freezing what it holds (``gc.freeze``): a
    full collection then walks only what was made since, not the 0.6 M objects of the
    imports (about 300 ms each on the VM, the process serving nothing meanwhile)."""
    import asyncio
    import gc

    from router import app as router_app

    held = [[k] for k in range(1000)]  # objects alive at the end of start-up
    try:
        frozen = router_app.freeze_startup_heap()
        assert frozen >= len(held) and gc.get_freeze_count() >= len(held)
        assert not any(o is held[0] for o in gc.get_objects())  # out of every generation
    finally:
        gc.unfreeze()
    # the ingress calls it as its start-up's last step, unless the setting is off
    calls = []
    cls = router_app.Ingress.func_or_class.__mro__[1]  # the class @serve.ingress wraps
    # (Serve's decorator copies the class: its methods see a copy of the module's globals)
    monkeypatch.setitem(cls.__init__.__globals__, "freeze_startup_heap",
                        lambda: calls.append(1) or 0)

    async def start(**settings):
        ingress = cls({"model": str(model_dir), **settings}, None)
        ingress._warmup.cancel()
        await ingress.core.close()

    asyncio.run(start())
    asyncio.run(start(gc_freeze_at_start=False))
    assert calls == [1]


async def test_the_ingress_opens_its_redis_connections_at_start_and_survives_a_dead_redis(
        model_dir):
    """``IngressCore.open_connections``: ``redis_warm_connections`` connections in the
    loop's pool; a Redis that does not answer is logged, not raised (the ingress starts and
    opens connections on demand)."""
    import logging
    import uuid

    from router.serve import state
    from router.serve.ingress import IngressCore
    from tests.conftest import REDIS_URL

    ns = f"warm-{uuid.uuid4().hex[:8]}"
    core = IngressCore(Settings(model=str(model_dir), redis_url=REDIS_URL, index_namespace=ns,
                                redis_warm_connections=5), engine_handle=None)
    try:
        assert await core.open_connections() == 5
    finally:
        await state.redis_connections(core.settings).close()
        await core.close()
    dead = IngressCore(Settings(model=str(model_dir), redis_url="redis://127.0.0.1:1/0",
                                index_namespace=ns, redis_timeout_s=0.05), engine_handle=None)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logger = logging.getLogger("ray.serve.router.serve.ingress")  # router.logs.get_logger
    logger.addHandler(handler)
    try:
        assert await dead.open_connections() == 0
        assert any("could not open 16 connections to Redis" in m for m in logged)
    finally:
        logger.removeHandler(handler)
        await state.redis_connections(dead.settings).close()
        await dead.close()
    off = IngressCore(Settings(model=str(model_dir), redis_url=REDIS_URL, index_namespace=ns,
                               redis_warm_connections=0), engine_handle=None)
    assert await off.open_connections() == 0
    await off.close()
    import redis
    redis.Redis.from_url(REDIS_URL).delete(f"{ns}:layouts")  # the one key the checks wrote
