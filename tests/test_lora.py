"""LoRA adapters: which replicas load which, the engine's arguments, the router's hashes
against vLLM's own, and adapter blocks in KV events."""

from __future__ import annotations

import json

import msgspec
import pytest
from pydantic import ValidationError

from replicas.engine import EnginePorts, EngineProcess
from router.app import with_adapters
from router.config import Settings
from router.hashing import BlockHasher, to_block_hash
from router.kv_events.wire import decode_batch


def test_adapters_with_a_replica_count_spread_over_the_ranks():
    s = Settings(lora_adapters=[{"name": "all", "path": "/a"},
                                {"name": "one", "path": "/o", "replicas": 1},
                                {"name": "two", "path": "/t", "replicas": 2}])
    loaded = [[a.name for a in s.adapters_for(rank, 4)] for rank in range(4)]
    assert all("all" in names for names in loaded)
    assert sum("one" in names for names in loaded) == 1
    assert sum("two" in names for names in loaded) == 2
    assert [a.name for a in s.adapters_for(0, 1)] == ["all", "one", "two"]  # one replica


def test_adapter_names_must_be_their_own_and_vllm_must_serve_them():
    with pytest.raises(ValidationError, match="names of their own"):
        Settings(lora_adapters=[{"name": "x", "path": "/a"}, {"name": "x", "path": "/b"}])
    with pytest.raises(ValidationError, match="names of their own"):
        Settings(served_model_name="m", lora_adapters=[{"name": "m", "path": "/a"}])
    with pytest.raises(ValidationError, match="engine 'vllm'"):
        Settings(engine="sim", lora_adapters=[{"name": "x", "path": "/a"}])
    with pytest.raises(ValidationError):
        Settings(lora_adapters=[{"name": "x", "path": "/a", "replicas": 0}])


def test_an_engine_that_loads_adapters_starts_with_lora_enabled():
    s = Settings(lora_adapters=[{"name": "x", "path": "/a"}], max_lora_rank=8)
    ports = EnginePorts(8100, "ipc:///tmp/a", "ipc:///tmp/b")
    cmd = EngineProcess(s, ports, "t", "cpu", lora_adapters=s.adapters_for(0, 1)).command()
    assert "--enable-lora" in cmd and cmd[cmd.index("--max-lora-rank") + 1] == "8"
    assert cmd[cmd.index("--lora-modules") + 1] == "x=/a"
    assert "--enable-lora" not in EngineProcess(s, ports, "t", "cpu").command()


def test_the_routers_adapter_hashes_are_vllms(monkeypatch):
    """vLLM 0.32's own ``hash_block_tokens`` with the extra keys its
    ``generate_block_hash_extra_keys`` makes for a LoRA request (and a salt), seeded as the
    replicas start their engines (``PYTHONHASHSEED``)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import hash_block_tokens, init_none_hash

    s = Settings()
    monkeypatch.setenv("PYTHONHASHSEED", s.hash_seed)
    fn = get_hash_fn_by_name(s.hash_algo)
    init_none_hash(fn)
    hasher = BlockHasher(s.hash_settings)
    tokens = list(range(3 * s.block_size))
    ours = hasher.block_hashes(tokens, lora_name="x", lora_path="/a", cache_salt="salt")
    parent = None
    for i in range(3):
        extra = [("lora", "x", "/a")] + ([("cache_salt", "salt")] if i == 0 else [])
        parent = hash_block_tokens(fn, parent, tokens[i * s.block_size:(i + 1) * s.block_size],
                                   tuple(extra))
        assert ours[i] == to_block_hash(parent)
    assert ours != hasher.block_hashes(tokens, cache_salt="salt")


def test_adapter_blocks_in_kv_events_are_taken_by_their_hashes():
    """vLLM publishes an adapter's name untagged in ``extra_keys`` (a bare string, as a
    salt or a multimodal identifier would be): the router keys blocks by the engine's own
    hashes and never re-derives them from those keys, so adapter blocks match."""
    from vllm.distributed.kv_events import BlockStored, KVEventBatch
    batch = KVEventBatch(ts=1.0, events=[BlockStored(
        block_hashes=[11, 12], parent_block_hash=None, token_ids=[0] * 64, block_size=32,
        lora_id=1, medium="GPU", lora_name="x", extra_keys=[("x",), ("x",)])])
    _, events = decode_batch(msgspec.msgpack.Encoder().encode(batch))
    assert [(e.kind, e.block_hashes) for e in events] == [("stored", [11, 12])]


def test_the_model_list_gets_a_card_for_every_adapter():
    listing = {"object": "list", "data": [{"id": "base", "object": "model", "root": "/m",
                                           "parent": None, "max_model_len": 4096}]}
    adapters = Settings(lora_adapters=[{"name": "x", "path": "/a"}]).lora_adapters
    got = json.loads(with_adapters(json.dumps(listing).encode(), adapters))["data"]
    assert got[1] == {"id": "x", "object": "model", "root": "/a", "parent": "base",
                      "max_model_len": 4096}
    assert with_adapters(b"not json", adapters) == b"not json"
    listing["data"].append(got[1])  # an engine that loads it lists it itself: no copy
    assert len(json.loads(with_adapters(json.dumps(listing).encode(), adapters))["data"]) == 2
