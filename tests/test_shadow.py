"""Shadow evaluation (router/routing/shadow.py) on the real Redis's atomic path and on the
in-process index: the live policy's shadow figure is the live prediction, and each shadow
policy's figure is the index's match, at decision time, on the replica it would choose."""

from __future__ import annotations

import random
import uuid

import pytest

from router.config import Settings
from router.index.memory import MemoryPrefixIndex
from router.index.redis import RedisConnections, RedisPrefixIndex
from router.load.memory import MemoryLoadTracker
from router.load.redis import RedisLoadTracker
from router.policy import LeastLoaded, PrefixAware, cached_tokens
from router.routing.atomic import AtomicRoute
from router.routing.core import RoutingCore
from router.routing.replica import ReplicaInfo
from router.routing.shadow import ShadowEvaluator

REDIS_URL = "redis://127.0.0.1:6379/0"
SHADOWS = ["round_robin", "least_loaded", "random"]


@pytest.fixture(params=["redis-atomic", "memory"])
async def core(request):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    shadow = ShadowEvaluator(SHADOWS, 1.0, rng=random.Random(1))
    if request.param == "memory":
        settings = Settings()
        c = RoutingCore(settings, MemoryPrefixIndex(), MemoryLoadTracker(),
                        PrefixAware(random.Random(0)), shadow=shadow)
        yield c
        return
    settings = Settings(redis_url=REDIS_URL, index_namespace=ns)
    conn = RedisConnections(REDIS_URL, 2.0)
    index, load = RedisPrefixIndex(REDIS_URL, ns, connections=conn), RedisLoadTracker(conn, ns)
    c = RoutingCore(settings, index, load, PrefixAware(random.Random(0)),
                    atomic=AtomicRoute(index, load), shadow=shadow)
    yield c
    await load.close()
    await index.flush()


async def test_shadow_figures_are_the_index_match_on_each_policys_choice(core):
    reps = [ReplicaInfo(f"r{i}", {}, {}) for i in range(4)]
    ids = [r.replica_id for r in reps]
    bs = core.hash_settings.block_size
    rng = random.Random(7)
    conversations = [[rng.getrandbits(63) for _ in range(8)] for _ in range(6)]
    open_requests: list[str] = []
    disagreements = 0
    for k in range(60):
        conv = conversations[rng.randrange(len(conversations))]
        conv.extend(rng.getrandbits(63) for _ in range(rng.randrange(1, 4)))  # a new turn
        hashes = list(conv)
        tokens = len(hashes) * bs + 5
        state = await core.index.lookup(hashes, ids)  # what the decision will see
        d = await core.decide(f"q{k}", tokens, hashes, reps)
        assert d.shadow is not None and set(d.shadow) == {*SHADOWS, "prefix_aware"}
        live = d.shadow["prefix_aware"]
        # the live policy's copy chose as the live decision did, on the same state
        assert live.replica == d.replica and live.agrees
        assert live.cached_tokens == d.predicted_cached_tokens[d.replica]
        for name, sc in d.shadow.items():
            assert sc.cached_tokens == cached_tokens(state[sc.replica], tokens, bs), name
            assert sc.agrees == (sc.replica == d.replica)
            disagreements += not sc.agrees
        open_requests.append(f"q{k}")
        if rng.random() < 0.6:  # some requests finish, so the loads vary
            await core.load.release(open_requests.pop(rng.randrange(len(open_requests))))
    assert disagreements > 0  # the alternatives did differ (the figures were tested)


async def test_unsampled_fallback_and_pinned_decisions_have_no_shadow():
    index, load = MemoryPrefixIndex(), MemoryLoadTracker()
    never = RoutingCore(Settings(), index, load, PrefixAware(random.Random(0)),
                        shadow=ShadowEvaluator(SHADOWS, 0.0))
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    assert (await never.decide("x", 100, [1, 2, 3], reps)).shadow is None
    always = RoutingCore(Settings(), index, load, PrefixAware(random.Random(0)),
                         shadow=ShadowEvaluator(SHADOWS, 1.0))
    assert (await always.decide("y", 10, [], reps)).shadow is None  # nothing to look up
    assert (await always.decide("z", 100, [1, 2, 3], reps,
                                cacheable=False)).shadow is None


def test_the_sample_rate_is_honoured():
    ev = ShadowEvaluator(["least_loaded"], 0.1, rng=random.Random(3))
    n = sum(ev.sampled() for _ in range(20000))
    assert 1700 < n < 2300
    assert isinstance(ev.policies["least_loaded"], LeastLoaded)
    with pytest.raises(ValueError):
        ShadowEvaluator(["no_such_policy"], 0.1)


async def test_a_failing_shadow_evaluation_leaves_the_decision_standing():
    class Broken(ShadowEvaluator):
        def evaluate(self, *args, **kwargs):
            raise RuntimeError("broken shadow")

    core = RoutingCore(Settings(), MemoryPrefixIndex(), MemoryLoadTracker(),
                       PrefixAware(random.Random(0)), shadow=Broken(SHADOWS, 1.0))
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    d = await core.decide("x", 100, [1, 2, 3], reps)
    assert d.replica in ("a", "b") and d.reason in ("cache", "load") and d.shadow is None
    assert (await core.load.loads(["a", "b"]))[d.replica].inflight == 1  # still reserved
