"""Routing policies and RoutingCore decisions with the in-process index and load tracker."""

from __future__ import annotations

import asyncio
import random

import pytest

from router.clock import ManualClock
from router.config import Settings
from router.index.base import IndexUnavailable
from router.index.memory import MemoryPrefixIndex
from router.load.base import ReplicaLoad
from router.load.memory import MemoryLoadTracker
from router.policy import (
    Candidate,
    LeastLoaded,
    PrefixAware,
    RoundRobin,
    RouteRequest,
    cached_tokens,
    make_policy,
)
from router.routing.core import RoutingCore
from router.routing.replica import ReplicaInfo

BS = 32


def req(tokens: int) -> RouteRequest:
    return RouteRequest(prompt_tokens=tokens, block_size=BS, num_blocks=tokens // BS)


def make_core(policy="prefix_aware", seed=0, index=None):
    clock = ManualClock(1000.0)
    settings = Settings(policy=policy)
    core = RoutingCore(settings, index or MemoryPrefixIndex(clock=clock),
                       MemoryLoadTracker(clock=clock), make_policy(policy, random.Random(seed)))
    return core, clock


def replicas(*ids):
    return [ReplicaInfo(r, {}, {}) for r in ids]


def hashes(prefix: int, n: int) -> list[int]:
    return [prefix * 1_000_000 + i for i in range(n)]


def test_cached_tokens_follow_the_engines_cap_at_prompt_minus_one():
    assert cached_tokens(3, 96, 32) == 64      # a fully cached 3-block prompt reports 2
    assert cached_tokens(3, 97, 32) == 96
    assert cached_tokens(10, 100, 32) == 96
    assert cached_tokens(0, 0, 32) == 0


def test_round_robin_cycles_in_replica_order():
    p = RoundRobin()
    cands = [Candidate("b"), Candidate("a"), Candidate("c")]
    assert [p.choose(req(10), cands).replica for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_takes_the_less_loaded_of_two():
    p = LeastLoaded(random.Random(1))
    cands = [Candidate("a", load=ReplicaLoad(inflight=5)), Candidate("b", load=ReplicaLoad())]
    assert all(p.choose(req(10), cands).replica == "b" for _ in range(10))


def test_prefix_aware_prefers_the_replica_holding_the_prefix():
    p = PrefixAware(random.Random(0))
    cands = [Candidate("a", matched_blocks=60), Candidate("b")]
    d = p.choose(req(2000), cands)
    assert d.replica == "a" and d.reason == "cache"
    assert d.predicted_cached_tokens == {"a": 1920, "b": 0}


def test_prefix_aware_leaves_a_warm_replica_whose_queue_costs_more_than_the_hit_saves():
    p = PrefixAware(random.Random(0))
    cands = [Candidate("a", matched_blocks=30, load=ReplicaLoad(inflight=20,
                                                                prefill_tokens=200_000)),
             Candidate("b")]
    assert p.choose(req(1000), cands).replica == "b"


def test_prefix_aware_charges_the_kv_a_request_cannot_fit():
    """A miss of 6,000 tokens with 400 output tokens expected: "a" has 2,000 tokens of KV
    free, "b" has room but a request in flight. Without the KV state "a" (idle) wins; with
    it "a" is charged the 4,400 tokens that will not fit, recomputed or waited for
    (``PrefixAware.kv_overflow_tokens``), and "b" wins. A hit that fits stays put."""
    p = PrefixAware(random.Random(0))
    r = RouteRequest(6000, BS, 6000 // BS, expected_output_tokens=400)
    unknown = [Candidate("a"), Candidate("b", load=ReplicaLoad(inflight=1))]
    assert p.choose(r, unknown).replica == "a"
    full = [Candidate("a", kv_capacity_tokens=100_000, kv_usage_frac=0.98),
            Candidate("b", load=ReplicaLoad(inflight=1), kv_capacity_tokens=100_000,
                      kv_usage_frac=0.5)]
    assert p.kv_overflow_tokens(r, full[0]) == pytest.approx(6000 + 400 - 2000)
    assert p.kv_overflow_tokens(r, full[1]) == 0
    assert p.choose(r, full).replica == "b"
    # queued prefill routed there takes its share of the free KV first
    queued = Candidate("b", load=ReplicaLoad(prefill_tokens=49_000), kv_capacity_tokens=100_000,
                       kv_usage_frac=0.0)
    assert p.kv_overflow_tokens(r, queued) == 0
    over = Candidate("b", load=ReplicaLoad(prefill_tokens=99_000), kv_capacity_tokens=100_000,
                     kv_usage_frac=0.0)
    assert p.kv_overflow_tokens(r, over) == 6000 + 400 - 1000
    held = [Candidate("a", matched_blocks=180, kv_capacity_tokens=100_000, kv_usage_frac=0.98),
            Candidate("b", kv_capacity_tokens=100_000, kv_usage_frac=0.0)]
    assert p.choose(RouteRequest(5800, BS, 5800 // BS, expected_output_tokens=400),
                    held).replica == "a"
    p.kv_pressure = 0.0
    assert p.choose(r, full).replica == "a"


def test_prefix_aware_charges_the_cached_prefixes_a_request_evicts():
    """A prompt of 6,000 tokens whose first 1,600 "a" holds: without the caches' state
    "a" wins (its hit). With "a"'s cache full of other prefixes and "b"'s empty, "a"
    would evict 4,400 cached tokens and "b" none
    (``PrefixAware.evicted_tokens``), and "b" wins. The prefill queued on a replica takes
    its empty blocks first; an unknown state charges nothing."""
    p = PrefixAware(random.Random(0))
    r = RouteRequest(6000, BS, 6000 // BS, expected_output_tokens=100)
    a = dict(matched_blocks=50)
    assert p.choose(r, [Candidate("a", **a), Candidate("b")]).replica == "a"
    full = Candidate("a", **a, kv_capacity_tokens=100_000, kv_cached_tokens=100_000)
    empty = Candidate("b", kv_capacity_tokens=100_000, kv_cached_tokens=0)
    assert full.kv_empty_tokens == 0 and empty.kv_empty_tokens == 100_000
    assert p.evicted_tokens(r, full) == 6000 - 1600
    assert p.evicted_tokens(r, empty) == 0
    assert p.choose(r, [full, empty]).replica == "b"
    queued = Candidate("b", load=ReplicaLoad(prefill_tokens=97_000),
                       kv_capacity_tokens=100_000, kv_cached_tokens=0)
    assert p.evicted_tokens(r, queued) == 6000 - 3000
    assert p.evicted_tokens(r, Candidate("b", kv_capacity_tokens=100_000)) == 0
    assert p.evicted_tokens(r, Candidate("b", kv_cached_tokens=0)) == 0
    p.eviction = 0.0
    assert p.choose(r, [full, empty]).replica == "a"


async def test_misses_are_decided_by_load_not_by_cache_size():
    """docs/fault-cases.md 1.1: new prompts go to the idle replica holding a big cache, not to the
    busy replica whose index entry is small."""
    core, clock = make_core()
    await core.index.record_predicted("A", hashes(1, 128), ttl_s=600)   # A: 4k-token prompt
    for i in range(30):                                                  # B: 30 long requests
        await core.load.reserve(f"busy{i}", "B", 0)
    chosen = []
    for i in range(20):
        d = await core.decide(f"new{i}", 1000, hashes(100 + i, 31), replicas("A", "B"))
        chosen.append(d.replica)
        await core.load.release(f"new{i}")
    assert chosen.count("A") >= 18, chosen


async def test_paced_sessions_split_cold_starts_and_keep_affinity():
    """docs/fault-cases.md 1.4: one request in flight at a time; first turns still spread (the
    rotating tie-break), follow-ups stay on their session's replica."""
    core, clock = make_core()
    firsts, affinity = [], []
    for s in range(40):
        history = hashes(s + 1, 32)
        first = None
        for turn in range(5):
            history = history + hashes(1000 * (s + 1) + turn, 4)
            d = await core.decide(f"s{s}t{turn}", len(history) * BS + 10, history,
                                  replicas("A", "B"))
            await core.load.release(f"s{s}t{turn}")
            clock.advance(1.0)
            if turn == 0:
                first = d.replica
                firsts.append(first)
            else:
                affinity.append(d.replica == first)
    assert 16 <= firsts.count("A") <= 24, firsts
    assert sum(affinity) / len(affinity) >= 0.9


async def test_a_hot_replica_elsewhere_does_not_switch_off_affinity():
    """docs/fault-cases.md 1.6: D overloaded; requests warm on A still go to A, none to D."""
    core, clock = make_core()
    await core.index.record_predicted("A", hashes(7, 64), ttl_s=600)
    for i in range(50):
        await core.load.reserve(f"d{i}", "D", 4000)
    got = []
    for i in range(20):
        d = await core.decide(f"q{i}", 2100, hashes(7, 64) + hashes(70 + i, 1),
                              replicas("A", "B", "C", "D"))
        got.append((d.replica, d.predicted_cached_tokens[d.replica]))
        await core.load.release(f"q{i}")
    assert all(r == "A" for r, _ in got), got
    assert sum(c for _, c in got) >= 20 * 1900


async def test_burst_of_siblings_lands_together_before_any_engine_event():
    """Predicted entries: request 2 of a new prefix sees request 1's blocks at once."""
    core, clock = make_core()
    shared = hashes(9, 40)
    d1 = await core.decide("r1", 1400, shared + hashes(90, 3), replicas("A", "B"))
    d2 = await core.decide("r2", 1400, shared + hashes(91, 3), replicas("A", "B"))
    assert d2.replica == d1.replica and d2.reason == "cache"


class _DownIndex(MemoryPrefixIndex):
    async def lookup(self, block_hashes, replicas):
        raise IndexUnavailable("down")

    async def record_predicted(self, replica, block_hashes, ttl_s):
        raise IndexUnavailable("down")


async def test_index_outage_falls_back_to_load_and_is_reported():
    errors = []
    core, clock = make_core(index=_DownIndex())
    core.on_index_error = lambda exc, op: errors.append(op)
    await core.load.reserve("x", "A", 5000)
    d = await core.decide("r", 1000, hashes(1, 30), replicas("A", "B"))
    assert d.reason == "fallback" and d.replica == "B"
    assert errors == ["lookup"] and not core.index_available


class _FlakyIndex(MemoryPrefixIndex):
    down = False

    async def lookup(self, block_hashes, replicas):
        if self.down:
            raise IndexUnavailable("timed out")
        return await super().lookup(block_hashes, replicas)


async def test_index_outage_keeps_a_conversation_where_this_router_sent_it():
    """docs/fault-cases.md 8.1: a lookup that times out between two turns of a conversation
    does not scatter it; the next turn goes where this router sent the last one (its own
    recent decisions), and a new prefix is still decided by load."""
    index = _FlakyIndex()
    core, clock = make_core(index=index)
    turn1 = hashes(3, 20)
    d1 = await core.decide("t1", 700, turn1, replicas("A", "B"))
    await core.load.release("t1")
    await core.load.reserve("busy", d1.replica, 50)  # the warm replica is a little busier
    index.down = True
    d2 = await core.decide("t2", 800, turn1 + hashes(30, 5), replicas("A", "B"))
    assert d2.reason == "fallback" and d2.replica == d1.replica
    assert d2.predicted_cached_tokens[d1.replica] == 20 * core.hash_settings.block_size
    d3 = await core.decide("t3", 800, hashes(50, 25), replicas("A", "B"))
    assert d3.reason == "fallback" and d3.replica != d1.replica  # a new prefix: by load


async def test_an_outage_is_logged_once_at_each_end(caplog):
    """An operator's review: the outage's start was logged, its end was not."""
    index = _FlakyIndex()
    core, clock = make_core(index=index)
    index.down = True
    with caplog.at_level("WARNING", logger="router"):
        for i in range(3):
            assert (await core.decide(f"d{i}", 700, hashes(i, 20), replicas("A", "B"))
                    ).reason == "fallback"
        index.down = False
        for i in range(3):
            assert (await core.decide(f"u{i}", 700, hashes(i, 20), replicas("A", "B"))
                    ).reason != "fallback"
    lines = [r.getMessage() for r in caplog.records]
    assert sum("prefix index unavailable" in m for m in lines) == 1, lines
    assert sum("prefix index available again" in m for m in lines) == 1, lines
    assert core.index_available


async def test_replica_with_other_hash_settings_is_excluded():
    core, clock = make_core()
    bad = ReplicaInfo("B", {"hash_algo": "sha256_cbor", "block_size": 32, "seed": "0",
                            "extra_key_encoding": "vllm-0.32"}, {})
    good = ReplicaInfo("A", {"hash_algo": "xxhash_cbor", "block_size": 32, "seed": "0",
                             "extra_key_encoding": "vllm-0.32"}, {})
    for i in range(10):
        d = await core.decide(f"r{i}", 500, hashes(i, 15), [good, bad])
        assert d.replica == "A"


def test_unknown_policy_name_is_refused():
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")


def near_tie_with_a_queue(queued: int) -> tuple[RouteRequest, list[Candidate]]:
    """The slowest requests of the simulated RAG workload at 8 replicas (docs/benchmarks.md,
    "Near-ties by the first token"): a 3,008-token prompt whose first 400 tokens both
    replicas hold; "a" has 4 requests in flight and ``queued`` prefill tokens queued, "b"
    5 in flight and none queued."""
    r = RouteRequest(3008, 16, 188, expected_output_tokens=200)
    return r, [Candidate("a", matched_blocks=25,
                         load=ReplicaLoad(inflight=4, prefill_tokens=queued),
                         prefill_tokens_per_s=38000.0),
               Candidate("b", matched_blocks=25, load=ReplicaLoad(inflight=5),
                         prefill_tokens_per_s=38000.0)]


def test_near_ties_holding_as_much_go_to_the_soonest_first_token():
    """Of two near-ties (costs within 5 %) holding as much of the prompt, the one with fewer
    requests in flight ("a": each of the fewer decodes bears the new prefill, which levels
    the sum of seconds) has a prefill queued ahead: the request goes where its own first
    token comes sooner ("b"), not to the fewest in flight. Not a near-tie, the cost
    decides."""
    p = PrefixAware(random.Random(0))
    r, cands = near_tie_with_a_queue(2000)
    a, b = (p.cost_s(r, c) for c in cands)
    assert a < b <= a * (1 + p.tie_rel)  # a near-tie, "a" the cheaper
    assert p.expected_ttft_s(r, cands[1]) < p.expected_ttft_s(r, cands[0])
    d = p.choose(r, cands)
    assert d.replica == "b"
    assert d.expected_ttft_s == {c.replica: p.expected_ttft_s(r, c) for c in cands}
    r, cands = near_tie_with_a_queue(1000)
    a, b = (p.cost_s(r, c) for c in cands)
    assert a * (1 + p.tie_rel) < b  # no tie: the queue is short enough
    assert p.choose(r, cands).replica == "a"


def test_a_negative_shared_count_does_not_draw_every_request():
    """Seen in CI: a replica's shared in-flight count at -8 made "fewest in flight" send
    every new conversation there. Counts below zero count as zero in the tie-break."""
    p = PrefixAware(random.Random(0))
    cands = [Candidate("a", load=ReplicaLoad(inflight=-8, last_assigned_s=5.0)),
             Candidate("b", load=ReplicaLoad(inflight=0, last_assigned_s=1.0))]
    req = RouteRequest(prompt_tokens=300, block_size=32, num_blocks=9)
    assert p.choose(req, cands).replica == "b"  # tie at zero: the oldest assignment


def test_assignments_one_redis_millisecond_apart_tie_as_in_the_route_script():
    """Seen in CI (the shadow test's live copy chose another replica than lua/route.lua):
    Redis keeps the last assignment in integer ms and the script ties stamps 1 ms apart;
    here they arrive as ``ms / 1000``, and 3 pairs in 10 differed by just over 0.001 s in
    a float. Both stamps must be finalists, so the draw picks as the script's does."""
    base = 1_764_829_680_000
    pairs = [(base + i, base + i + 1) for i in range(200)
             if (base + i + 1) / 1000 > (base + i) / 1000 + 0.001]  # the float's rounding
    assert pairs  # such stamps exist at today's epoch
    req = RouteRequest(prompt_tokens=300, block_size=32, num_blocks=9)
    for early, late in pairs[:20]:
        cands = [Candidate("a", load=ReplicaLoad(0, 0, early / 1000)),
                 Candidate("b", load=ReplicaLoad(0, 0, late / 1000))]
        # u = 0.9 picks the second finalist: "b" only when both are finalists
        picks = {PrefixAware(_FixedDraw(0.9)).choose(req, cands).replica}
        assert picks == {"b"}, (early, late)
    far = [Candidate("a", load=ReplicaLoad(0, 0, base / 1000)),
           Candidate("b", load=ReplicaLoad(0, 0, (base + 2) / 1000))]
    assert PrefixAware(_FixedDraw(0.9)).choose(req, far).replica == "a"  # 2 ms: no tie


class _FixedDraw(random.Random):
    """A random source whose every draw is ``u``."""

    def __init__(self, u: float):
        super().__init__(0)
        self.u = u

    def random(self) -> float:
        return self.u


def test_the_admission_bound_caps_the_load_bound():
    """With max_inflight (the admission bound), a replica at it is passed over while another
    has a free slot, even where its cache makes it the cheapest: admission counted that
    free slot for this request."""
    from router.policy.prefix_aware import PrefixAware as PA
    warm = Candidate("warm", 10, ReplicaLoad(2, 0, 0.0), 20000.0, 0.005)
    cold = Candidate("cold", 0, ReplicaLoad(1, 0, 0.0), 20000.0, 0.005)
    req = RouteRequest(prompt_tokens=10 * 16, block_size=16, num_blocks=10)
    assert PA().choose(req, [warm, cold]).replica == "warm"
    assert PA(max_inflight=2).choose(req, [warm, cold]).replica == "cold"
    full = Candidate("cold", 0, ReplicaLoad(2, 0, 0.0), 20000.0, 0.005)
    assert PA(max_inflight=2).choose(req, [warm, full]).replica == "warm"  # none free: cost


def test_a_new_prefix_passes_over_a_replica_whose_new_prefixes_have_not_sent_their_requests():
    """``PrefixAware``: r0 runs fewer requests, but three new prefixes were just placed
    there and their later requests will follow them; a prefix no replica holds goes to r1.
    A prefix r0 holds still goes to r0, and without a placement window (no request has
    lived yet) the counts are not read."""
    now = 100.0
    loads = {"r0": ReplicaLoad(2, 0, now - 1, placements=3.0, placements_at_s=now),
             "r1": ReplicaLoad(3, 0, now - 1)}

    def choose(matched_r0: int, window_s: float) -> str:
        cands = [Candidate(r, matched_r0 if r == "r0" else 0, loads[r], 20000.0, 0.005)
                 for r in ("r0", "r1")]
        req = RouteRequest(64 * 32 + 5, 32, 64, expected_output_tokens=200,
                           placement_window_s=window_s, now_s=now)
        return PrefixAware(random.Random(0)).choose(req, cands).replica

    policy = PrefixAware(random.Random(0))
    req = RouteRequest(2053, 32, 64, expected_output_tokens=200, placement_window_s=10.0,
                       now_s=now)
    cands = [Candidate(r, 0, loads[r]) for r in ("r0", "r1")]
    # mean n with this request (2 + 3 + 1) / 2 = 3, r0's placements 2 x the mean: 6
    assert policy.expected_inflight(req, cands) == {"r0": 6.0, "r1": 3.0}
    assert choose(0, 10.0) == "r1"
    assert choose(0, 0.0) == "r0"
    assert choose(64, 10.0) == "r0"


async def test_the_core_counts_a_new_prefix_where_it_went_and_a_held_one_nowhere():
    """``RoutingCore`` (in-process path): a decision that places a prefix no replica holds
    counts one placement on its replica; the same prefix again (now predicted there) and a
    policy that does not read the counts count none."""
    core, clock = make_core()
    d = await core.decide("first", 20 * BS, hashes(5, 20), replicas("A", "B"))
    loads = await core.load.loads(["A", "B"])
    assert loads[d.replica].placements == 1.0
    assert loads[d.replica].placements_at_s == clock.now()
    clock.advance(0.5)
    again = await core.decide("again", 20 * BS + 3, hashes(5, 20), replicas("A", "B"))
    assert again.reason == "cache"
    after = await core.load.loads(["A", "B"])
    assert sum(v.placements for v in after.values()) == 1.0
    rr, _ = make_core("round_robin")
    await rr.decide("x", 20 * BS, hashes(6, 20), replicas("A", "B"))
    assert all(v.placements == 0 for v in (await rr.load.loads(["A", "B"])).values())


async def test_a_request_serve_sends_elsewhere_takes_its_new_prefix_count_along():
    """``RoutingCore.moved`` (Serve chose another replica): the placement the decision
    counted follows the request, as its reservation does."""
    core, clock = make_core()
    d = await core.decide("first", 20 * BS, hashes(5, 20), replicas("A", "B"))
    other = "B" if d.replica == "A" else "A"
    await core.moved("first", ReplicaInfo(other, {}, {}), 20 * BS, hashes(5, 20), 0)
    loads = await core.load.loads(["A", "B"])
    assert loads[d.replica].placements == 0.0 and loads[other].placements == 1.0
    assert loads[other].inflight == 1 and loads[d.replica].inflight == 0


async def test_a_retry_decided_elsewhere_counts_its_new_prefix_once():
    """The retry of a failed first attempt is decided again among the other replicas
    (``route_request`` leaves the failed one out): the first decision's new-prefix count
    goes, the retry's counts where it went, once in all."""
    core, clock = make_core()
    d = await core.decide("first", 20 * BS, hashes(5, 20), replicas("A", "B"))
    other = "B" if d.replica == "A" else "A"
    retry = await core.decide("first", 20 * BS, hashes(5, 20), replicas(other))
    assert retry.replica == other
    from router.routing.core import _RELEASING
    await asyncio.gather(*_RELEASING)  # the earlier count is taken back in the background
    loads = await core.load.loads(["A", "B"])
    assert loads[d.replica].placements == 0.0 and loads[other].placements == 1.0
    assert core.load.placement_of("first") == (other, True)


async def test_a_fallback_decision_counts_its_new_prefix_too():
    """With the index down the policy decides on this router's recent decisions, new-prefix
    term included: its placements are counted as well, or the term would read counts that
    no decision of the outage writes."""

    class DownIndex(MemoryPrefixIndex):
        async def lookup(self, block_hashes, replica_ids):
            raise IndexUnavailable("down")

    clock = ManualClock(1000.0)
    core, _ = make_core(index=DownIndex(clock=clock))
    core.load.clock = clock
    for i in range(4):
        clock.advance(0.01)
        d = await core.decide(f"q{i}", 20 * BS, hashes(10 + i, 20), replicas("A", "B"))
        assert d.reason == "fallback"
    loads = await core.load.loads(["A", "B"])
    assert sum(v.placements for v in loads.values()) > 3.0  # four placements, decaying
    again = await core.decide("again", 20 * BS + 3, hashes(10, 20), replicas("A", "B"))
    assert again.reason == "fallback"  # held by one (recent decisions): not new, not counted
    assert sum(v.placements for v in (await core.load.loads(["A", "B"])).values()) \
        == pytest.approx(sum(v.placements for v in loads.values()), rel=0.05)


def test_a_kv_usage_that_is_not_a_number_is_unknown():
    """An engine reporting NaN usage: its free KV is unknown (no KV term), the decision
    still ranks it (a NaN cost would leave no candidate within the bound)."""
    p = PrefixAware(random.Random(0))
    cands = [Candidate("a", kv_capacity_tokens=1000, kv_usage_frac=float("nan")),
             Candidate("b", load=ReplicaLoad(inflight=3))]
    assert cands[0].kv_free_tokens is None
    assert p.choose(RouteRequest(6000, BS, 6000 // BS, expected_output_tokens=400),
                    cands).replica == "a"


async def test_an_index_that_flaps_logs_one_outage_per_interval_and_counts_the_rest(caplog):
    """An index whose calls fail and succeed by turns logs one outage's two ends per
    ``OUTAGE_LOG_INTERVAL_S``, not a pair of lines per request; the next start logged says
    how many were not; one going on past the interval is logged at its next failure."""
    index = _FlakyIndex()
    core, clock = make_core(index=index)

    async def decide(i: int) -> str:
        return (await core.decide(f"f{i}", 700, hashes(i, 20), replicas("A", "B"))).reason

    with caplog.at_level("WARNING", logger="router"):
        for i in range(5):  # five short outages within a second
            index.down = True
            assert await decide(2 * i) == "fallback"
            index.down = False
            assert await decide(2 * i + 1) != "fallback"
            clock.advance(0.1)
        lines = [r.getMessage() for r in caplog.records]
        assert sum("prefix index unavailable" in m for m in lines) == 1, lines
        assert sum("prefix index available again" in m for m in lines) == 1, lines
        index.down = True
        assert await decide(100) == "fallback"  # still within the interval: counted
        clock.advance(core.OUTAGE_LOG_INTERVAL_S)
        assert await decide(101) == "fallback"  # the same outage, past it: logged now
        lines = [r.getMessage() for r in caplog.records]
        assert sum("prefix index unavailable" in m for m in lines) == 2, lines
        # the four short ones after the first (logged); not the one this line logs
        assert "4 shorter outages since the last line were not logged" in lines[-1], lines
        index.down = False
        assert await decide(102) != "fallback"
    lines = [r.getMessage() for r in caplog.records]
    assert sum("prefix index available again" in m for m in lines) == 2, lines
    assert core.index_available
