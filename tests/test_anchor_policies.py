"""Each anchor re-implementation makes the decisions its source's rules give, on small
hand-made cases (rules and sources in docs/reference.md section 5)."""

from __future__ import annotations

import random

import xxhash

from router.load.base import ReplicaLoad
from router.policy import Candidate, RouteRequest
from router.policy.anchors import (
    CharRadixTree,
    DynamoKVCost,
    KubeAIPrefixHash,
    LlmdWeightedScorers,
    RayPrefixCacheAffinity,
    SGLangCacheAware,
)

BS = 16


def req(text="", tokens=160, first_user="", lora=None):
    return RouteRequest(tokens, BS, tokens // BS, text=text, first_user_text=first_user,
                        lora=lora)


def cand(r, inflight=0, matched=0, waiting=0, kv=0.0, prefill=0, active_blocks=0):
    return Candidate(r, matched_blocks=matched,
                     load=ReplicaLoad(inflight=inflight, prefill_tokens=prefill),
                     waiting=waiting, kv_usage_frac=kv, active_blocks=active_blocks)


def test_radix_tree_matches_prefixes_and_splits_edges():
    t = CharRadixTree()
    t.insert("hello world", "a", 1.0)
    t.insert("help me", "b", 2.0)
    assert t.match("hello there") == (6, ["a"])
    assert t.match("help me now")[0] == 7
    assert sorted(t.match("hel")[1]) == ["a", "b"]
    assert t.char_count == {"a": 11, "b": 4 + 3}


def test_sglang_sends_a_match_above_threshold_to_its_tenant_and_a_miss_to_min_load():
    p = SGLangCacheAware(random.Random(0))
    cands = [cand("w0", inflight=3), cand("w1", inflight=1)]
    p.on_routed(req("system prompt ABC then question"), "w0", 1.0)
    # 70 % of the text matches w0's entry: cache wins over load (w1 is less loaded)
    assert p.choose(req("system prompt ABC then other"), cands).replica == "w0"
    # nothing matches: the min-load worker
    assert p.choose(req("zzz totally different"), cands).replica == "w1"


def test_sglang_imbalance_overrides_cache():
    p = SGLangCacheAware(random.Random(0))
    p.on_routed(req("shared prefix text here"), "w0", 1.0)
    cands = [cand("w0", inflight=100), cand("w1", inflight=10)]
    # 100 - 10 > 64 and 100 > 1.5 * 10: imbalanced → min load
    assert p.choose(req("shared prefix text here!"), cands).replica == "w1"
    cands = [cand("w0", inflight=60), cand("w1", inflight=10)]  # 50 <= 64: balanced
    assert p.choose(req("shared prefix text here!"), cands).replica == "w0"


def test_sglang_min_load_ties_break_on_processed_requests_then_index():
    p = SGLangCacheAware(random.Random(0))
    p.processed = {"w0": 5, "w1": 2}
    assert p.choose(req("x"), [cand("w0"), cand("w1")]).replica == "w1"
    p.processed = {}
    assert p.choose(req("x"), [cand("w0"), cand("w1")]).replica == "w0"


def test_ray_low_match_goes_to_the_smallest_tenant_then_lowest_queue():
    p = RayPrefixCacheAffinity(random.Random(0))
    cands = [cand("a", inflight=0), cand("b", inflight=2), cand("c", inflight=1)]
    p.on_routed(req("aaaaaaaaaa" * 5), "a", 1.0)
    p.on_routed(req("bbbb"), "b", 1.0)
    # no match: tenants with the fewest characters in the tree (c has none)
    assert p.choose(req("zzzz"), cands).replica == "c"
    # a match above 10 %: the tenant of the node reached
    assert p.choose(req("aaaaaaaaaa" * 5 + "q"), cands).replica == "a"


def test_ray_matched_tenants_are_ranked_by_queue_length():
    p = RayPrefixCacheAffinity(random.Random(0))
    p.on_routed(req("common prefix one"), "a", 1.0)
    p.on_routed(req("common prefix two"), "b", 1.0)
    cands = [cand("a", inflight=5), cand("b", inflight=1)]
    assert p.choose(req("common prefix three"), cands).replica == "b"


def test_dynamo_cost_subtracts_overlap_and_adds_decode_blocks():
    p = DynamoKVCost(random.Random(0))
    r = req(tokens=1600)  # 100 blocks
    a = cand("a", matched=80, prefill=0, active_blocks=50)    # 100-80 + 50+100 = 170
    b = cand("b", matched=0, prefill=0, active_blocks=0)      # 100 + 100 = 200
    assert p.cost(r, a) == 170 and p.cost(r, b) == 200
    assert p.choose(r, [a, b]).replica == "a"
    c = cand("c", matched=80, prefill=3200, active_blocks=50)  # 300-80 + 150 = 370
    assert p.choose(r, [c, b]).replica == "b"


def test_dynamo_exact_ties_are_random():
    p = DynamoKVCost(random.Random(1))
    picks = {p.choose(req(), [cand("a"), cand("b")]).replica for _ in range(50)}
    assert picks == {"a", "b"}


def test_llmd_score_is_3_prefix_plus_2_queue_plus_2_kv():
    p = LlmdWeightedScorers(random.Random(0))
    r = req(tokens=160)  # 10 blocks
    cands = [cand("a", matched=10, waiting=4, kv=0.5), cand("b", matched=0, waiting=0, kv=0.0)]
    s = p.scores(r, cands)
    assert s == {"a": 3 * 1.0 + 2 * 0.0 + 2 * 0.5, "b": 0.0 + 2 * 1.0 + 2 * 1.0}
    # 4.0 against 4.0: the picker's shuffle decides
    assert {LlmdWeightedScorers(random.Random(k)).choose(r, cands).replica
            for k in range(20)} == {"a", "b"}
    cands[0] = cand("a", matched=10, waiting=4, kv=0.2)   # 3 + 0 + 1.6 = 4.6 > 4.0
    assert p.choose(r, cands).replica == "a"


def test_kubeai_ring_walk_and_bounded_load():
    p = KubeAIPrefixHash(random.Random(0))
    names = ["e0", "e1", "e2"]
    key = "hello user question"
    points = sorted((xxhash.xxh64_intdigest(f"{n}{i}".encode()), n)
                    for n in names for i in range(256))
    h = xxhash.xxh64_intdigest(key.encode())
    first = next((n for x, n in points if x >= h), points[0][1])
    cands = [cand(n) for n in names]
    assert p.choose(req(first_user=key), cands).replica == first
    # first owner over (total+1)/n * 1.25: the walk moves on to the next endpoint
    cands = [cand(n, inflight=9 if n == first else 0) for n in names]
    assert p.choose(req(first_user=key), cands).replica != first
    # only the first 100 characters of the first user message form the key
    assert p.choose(req(first_user=key + "x" * 200), [cand(n) for n in names]).replica == \
        p.choose(req(first_user=(key + "x" * 200)[:100] + "different tail"),
                 [cand(n) for n in names]).replica
