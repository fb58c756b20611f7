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
