"""The ingress's warm-up (``router.serve.warmup``) against real simulated engines, each in a
process of its own: requests through ``IngressCore`` on the direct path make a system
prompt hot; a replica that joins the replica set is warmed with it over HTTP (a
``/v1/completions`` of its token ids, ``max_tokens`` 1), so its engine reports the prompt
cached on its very first request; the index predicts it there at dispatch."""

from __future__ import annotations

import asyncio
import json
import uuid

import httpx

from router.config import Settings
from router.routing.replica import ReplicaInfo
from router.serve import state
from router.serve.ingress import IngressCore
from tests.conftest import EngineServer

SYSTEM = ("You are the support assistant of a cloud storage company. Answer questions about "
          "accounts, billing, storage plans, file sharing, backups and security. ") * 6


def _body(question: str) -> bytes:
    return json.dumps({"model": "tiny-qwen2", "max_tokens": 2, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]}).encode()


def _info(rid: str, sim: EngineServer) -> ReplicaInfo:
    return ReplicaInfo(rid, {"engine_url": sim.url, "block_size": 32},
                       {"engine_alive": True})


async def _cached_on(sim: EngineServer, body: bytes) -> int:
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(sim.url + "/v1/chat/completions", content=body,
                         headers={"content-type": "application/json"})
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


async def _run(model_dir, a: EngineServer, b: EngineServer, warm: bool) -> tuple[int, dict]:
    state.put("replica_infos", (_info("a", a),))
    core = IngressCore(Settings(model=str(model_dir), warmup_enabled=warm,
                                index_namespace=f"warmup-live-{uuid.uuid4().hex[:6]}"),
                       engine_handle=None)
    try:
        for i in range(4):  # the system prompt becomes hot
            resp = await core.handle("/v1/chat/completions", _body(f"question {i}?"), 0.0)
            assert resp.status_code == 200
        state.put("replica_infos", (_info("a", a), _info("b", b)))  # b joins
        stats = {}
        if warm:
            for _ in range(100):
                await asyncio.sleep(0.1)
                stats = core.warmup.warmer.stats
                if stats.started["scale_out"] and not core.warmup.warmer.running:
                    break
            req = await core.prepare("/v1/chat/completions", _body("anything"))
            matched = await core.routing_core().index.lookup(req.block_hashes, ["b"])
            assert matched["b"] > 0  # predicted there at dispatch
        return await _cached_on(b, _body("a first question on b")), stats
    finally:
        if core.warmup is not None and core.warmup._task is not None:
            core.warmup._task.cancel()
        await core.close()
        state.put("replica_infos", None)


async def test_a_joining_replica_is_warmed_with_the_hot_system_prompt(model_dir):
    a, b_cold, b_warm = EngineServer.sims(model_dir, [], [], [])
    try:
        cold, _ = await _run(model_dir, a, b_cold, warm=False)
        warm, stats = await _run(model_dir, a, b_warm, warm=True)
    finally:
        for sim in (a, b_cold, b_warm):
            sim.stop()
    assert cold == 0
    assert stats.started["scale_out"] >= 1 and stats.failed["scale_out"] == 0
    assert warm >= 32 * 4  # the system prompt's blocks (block size 32)
