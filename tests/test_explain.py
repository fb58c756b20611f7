"""``RoutingCore.explain``: the decision a request would get now, with its candidates'
matches, loads and costs, and nothing reserved, written or drawn."""

from __future__ import annotations

import random

from router.clock import ManualClock
from router.config import Settings
from router.index.memory import MemoryPrefixIndex
from router.load.memory import MemoryLoadTracker
from router.policy import PrefixAware
from router.routing.core import RoutingCore
from router.routing.drain import DrainedReplicas
from router.routing.replica import ReplicaInfo

REPS = [ReplicaInfo(r, {}, {}) for r in ("A", "B", "C")]
BLOCKS = list(range(1000, 1010))  # 10 blocks of 32 tokens


async def test_explain_ranks_the_holder_first_and_changes_nothing():
    clock = ManualClock(100.0)
    index, load = MemoryPrefixIndex(clock=clock), MemoryLoadTracker(clock=clock)
    policy = PrefixAware(random.Random(7))
    drains = DrainedReplicas()
    core = RoutingCore(Settings(block_size=32), index, load, policy, drains=drains)
    await index.record_predicted("B", BLOCKS[:8], 60.0)
    await load.reserve("busy", "C", 500)
    await drains.set("A", True)
    state = policy.rng.getstate()

    out = await core.explain(330, BLOCKS, REPS)

    assert out["choice"] == "B" and out["reason"] == "cache" and out["blocks"] == 10
    rows = {r["replica"]: r for r in out["candidates"]}
    assert [r["replica"] for r in out["candidates"]][0] == "B"
    assert rows["B"]["matched_blocks"] == 8 and rows["B"]["predicted_cached_tokens"] == 256
    assert rows["C"]["inflight"] == 1 and rows["C"]["prefill_tokens_queued"] == 500
    assert rows["B"]["cost_s"] < rows["C"]["cost_s"]
    assert rows["A"]["drained"] and not rows["A"]["candidate"] and rows["A"]["inflight"] is None
    # nothing reserved, written or drawn
    loads = await load.loads(["A", "B", "C"])
    assert (loads["A"].inflight, loads["B"].inflight, loads["C"].inflight) == (0, 0, 1)
    assert (await index.lookup(BLOCKS, ["A", "C"])) == {"A": 0, "C": 0}
    assert policy.rng.getstate() == state
    assert (await core.explain(330, BLOCKS, REPS))["choice"] == "B"  # the same again
