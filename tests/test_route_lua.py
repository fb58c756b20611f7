"""The atomic Redis decision (lua/route.lua) and load leases (lua/lease.lua), on the real
Redis and fakeredis: same choices as the Python policy, idempotent leases, dead routers'
leases swept, several routers serialised."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from router.clock import ManualClock
from router.config import Settings
from router.index.redis import RedisConnections, RedisPrefixIndex
from router.kv_events.wire import KVEvent
from router.load.redis import RedisLoadTracker
from router.policy import Candidate, PrefixAware, RouteRequest
from router.routing.atomic import AtomicRoute
from router.redis_keys import TABLE_FIELD, entries_in
from router.routing.core import RoutingCore
from router.routing.replica import ReplicaInfo
from tests.conftest import random_holdings

REDIS_URL = "redis://127.0.0.1:6379/0"
BS = 32


@pytest.fixture(params=["redis", "fakeredis", "redis-tls-acl"])
async def redis_pair(request):
    """The Redis index and load tracker on one Redis: the shared one, fakeredis, or a TLS
    Redis of the tests' own as the ACL user limited to the router's commands."""
    import time
    ns = f"t-{uuid.uuid4().hex[:8]}"
    url = REDIS_URL
    if request.param == "redis-tls-acl":
        secure = request.getfixturevalue("secure_redis")
        url = secure.url
        conn = RedisConnections(url, 2.0, secure.connection_kwargs)
    else:
        conn = RedisConnections(REDIS_URL, 2.0)
    if request.param == "fakeredis":
        import fakeredis
        fake = fakeredis.FakeAsyncRedis()
        conn.client = lambda *timeout: fake
    clock = ManualClock(time.time())
    index = RedisPrefixIndex(url, ns, clock=clock, connections=conn)
    load = RedisLoadTracker(conn, ns, clock=clock)
    yield index, load, clock
    await load.close()
    await index.flush()


def route_kwargs(policy: PrefixAware, u: float, rate=20000.0):
    return dict(block_size=BS, prefill_rate=rate, work_weight=policy.work_weight,
                decode_step_s_per_seq=0.005, step_token_budget=policy.step_token_budget,
                tie_abs_s=policy.tie_abs_s, tie_rel=policy.tie_rel, u=u,
                load_factor=policy.load_factor, max_inflight=policy.max_inflight,
                running_weight=policy.running_weight, interference=policy.interference)


async def test_lua_route_chooses_as_the_python_policy(redis_pair):
    index, load, clock = redis_pair
    rng = random.Random(7)
    replicas = ["r0", "r1", "r2", "r3"]
    for trial in range(40):
        # a random state: cached prefixes and loads
        prefix = [trial * 1000 + i for i in range(rng.randrange(1, 60))]
        await random_holdings(index, load, rng, replicas, prefix, f"bg{trial}", 4, 3000)
        prompt = len(prefix) * BS + rng.randrange(0, 40)
        u = rng.random()
        # every third trial with an admission bound (the load bound's cap)
        # every other trial with the running and interference terms, no load bound
        full = trial % 2 == 1
        policy = PrefixAware(random.Random(), max_inflight=rng.randrange(1, 4)
                             if trial % 3 == 0 else None, running_weight=1.0 if full else 0.0,
                             interference=1.0 if full else 0.0,
                             load_factor=None if full else 1.35)
        out = rng.randrange(0, 500)
        loads = await load.loads(replicas)
        matched = await index.lookup(prefix, replicas)
        cands = [Candidate(r, matched[r], loads[r], 20000.0, 0.005) for r in replicas]
        policy.rng = random.Random()
        policy.rng.random = lambda: u
        expected = policy.choose(RouteRequest(prompt, BS, len(prefix),
                                              expected_output_tokens=out), cands).replica
        chosen, lua_matched = await AtomicRoute(index, load).route(
            f"req{trial}", prompt, prefix, replicas, [15.0] * 4, **route_kwargs(policy, u),
            expected_output_tokens=out)
        assert lua_matched == matched
        assert chosen == expected, (trial, matched, loads)
        await load.release(f"req{trial}")


async def test_lua_breaks_a_near_tie_by_the_soonest_first_token_as_the_python_policy(
        redis_pair):
    """tests/test_policies.py's near-tie (``near_tie_with_a_queue``) through the script: of
    two replicas holding as much of the prompt at near-equal cost, the one with a prefill
    queued and fewer requests in flight loses to the one whose first token comes sooner,
    as in the Python policy; with a shorter queue, no tie, the cheaper wins in both."""
    from tests.test_policies import near_tie_with_a_queue
    index, load, clock = redis_pair
    prompt = [8 * 10**8 + i for i in range(188)]
    for trial, queued in enumerate([2000, 1000]):
        r, cands = near_tie_with_a_queue(queued)
        replicas = [f"{c.replica}{trial}" for c in cands]
        for c, name in zip(cands, replicas):
            await index.apply_events(name, [KVEvent("stored", prompt[:c.matched_blocks], None)])
            for i in range(c.load.inflight):
                await load.reserve(f"nt{trial}-{name}-{i}", name,
                                   c.load.prefill_tokens if i == 0 else 0)
        policy = PrefixAware(random.Random())
        policy.rng.random = lambda: 0.0
        expected = policy.choose(r, cands).replica
        chosen, _ = await AtomicRoute(index, load).route(
            f"nt{trial}", r.prompt_tokens, prompt, replicas, [15.0] * 2,
            block_size=r.block_size, prefill_rate=38000.0, work_weight=policy.work_weight,
            decode_step_s_per_seq=cands[0].decode_step_s_per_seq,
            step_token_budget=policy.step_token_budget, tie_abs_s=policy.tie_abs_s,
            tie_rel=policy.tie_rel, u=0.0, running_weight=policy.running_weight,
            interference=policy.interference,
            expected_output_tokens=r.expected_output_tokens)
        assert chosen == expected + str(trial)
        assert expected == ("b" if queued == 2000 else "a")


def _kv_pressure_state(rng, replicas):
    capacity = {r: rng.choice([None, 2048, 8192, 65536]) for r in replicas}
    usage = {r: rng.choice([None, 0.2, 0.9, 1.0]) for r in replicas}
    return {r: dict(kv_usage_frac=usage[r], kv_capacity_tokens=capacity[r]) for r in replicas}


def _eviction_state(rng, replicas):
    capacity = {r: rng.choice([None, 8192, 65536]) for r in replicas}
    cached = {r: rng.choice([None, 0, 8192, 65536]) for r in replicas}
    return {r: dict(kv_capacity_tokens=capacity[r], kv_cached_tokens=cached[r])
            for r in replicas}


# per KV term of PrefixAware: its seed and trials, the engines' random KV state, and the
# route script's argument that carries it
KV_TERMS = {
    "kv_pressure": (5, 80, _kv_pressure_state,
                    lambda cands: {"kv_free_tokens": [c.kv_free_tokens for c in cands]}),
    "eviction": (9, 80, _eviction_state,
                 lambda cands: {"kv_empty_tokens": [c.kv_empty_tokens for c in cands]}),
}


@pytest.mark.parametrize("term", list(KV_TERMS))
async def test_lua_charges_the_kv_terms_as_the_python_policy(redis_pair, term):
    """The KV terms: the KV that will not fit (``kv_pressure``,
    ``PrefixAware.kv_overflow_tokens``: engines with little free KV) and the cached
    prefixes a request evicts (``eviction``, ``PrefixAware.evicted_tokens``: caches full,
    nearly full or empty), some engines of unknown state; the script and the policy choose
    alike, and the term changes the choice in some trials (so this test fails if the
    script leaves it out). Each trial's loads are its own (accumulated, they would
    outweigh the terms)."""
    index, load, clock = redis_pair
    seed, trials, state, script_args = KV_TERMS[term]
    rng = random.Random(seed)
    replicas = ["r0", "r1", "r2", "r3"]
    moved = 0
    for trial in range(trials):
        prefix = [(seed + 1) * 10**8 + trial * 1000 + i for i in range(rng.randrange(4, 200))]
        await random_holdings(index, load, rng, replicas, prefix, f"{term}{trial}", 2, 800)
        prompt = len(prefix) * BS + rng.randrange(0, 40)
        out = rng.randrange(0, 60)
        kv = state(rng, replicas)
        u = rng.random()
        policy = PrefixAware(random.Random())
        policy.rng.random = lambda: u
        loads = await load.loads(replicas)
        matched = await index.lookup(prefix, replicas)
        cands = [Candidate(r, matched[r], loads[r], 20000.0, 0.005, **kv[r]) for r in replicas]
        req = RouteRequest(prompt, BS, len(prefix), expected_output_tokens=out)
        expected = policy.choose(req, cands).replica
        setattr(policy, term, 0.0)
        moved += policy.choose(req, cands).replica != expected
        setattr(policy, term, 1.0)
        chosen, _ = await AtomicRoute(index, load).route(
            f"req-{term}{trial}", prompt, prefix, replicas, [15.0] * 4,
            **route_kwargs(policy, u), expected_output_tokens=out, **{term: 1.0},
            **script_args(cands))
        assert chosen == expected, (trial, matched, loads, kv)
        for name in [f"req-{term}{trial}"] + [f"{term}{trial}-{r}-0" for r in replicas]:
            await load.release(name)
    assert moved >= 3, moved


async def test_lua_places_a_new_prefix_as_the_python_policy(redis_pair):
    """A prefix no replica holds: both count the candidates' decaying new-prefix
    placements alike (``PrefixAware.expected_inflight``), choose alike, and the choice's
    count grows by one, decayed to now."""
    import math
    index, load, clock = redis_pair
    clock.t = float(int(clock.t))  # whole milliseconds, as the script reads the clock
    rng = random.Random(11)
    replicas = ["r0", "r1", "r2", "r3"]
    moved = 0
    for trial in range(30):
        window_s = rng.choice([0.0, 0.5, 2.0, 10.0])
        for r in replicas:
            for _ in range(rng.randrange(0, 3)):
                await load.placed(r, window_s)
                clock.advance(rng.choice([0.0, 0.125, 0.625]))  # exact in binary
            for i in range(rng.randrange(0, 4)):
                await load.reserve(f"bg{trial}-{r}-{i}", r, 0)
        clock.advance(0.25)
        prefix = [10**9 + trial * 1000 + i for i in range(rng.randrange(2, 30))]
        prompt = len(prefix) * BS + 5
        out = rng.randrange(50, 500)
        u = rng.random()
        policy = PrefixAware(random.Random())
        policy.rng.random = lambda: u
        loads = await load.loads(replicas)
        cands = [Candidate(r, 0, loads[r], 20000.0, 0.005) for r in replicas]
        req = RouteRequest(prompt, BS, len(prefix), expected_output_tokens=out,
                           placement_window_s=window_s, now_s=clock.now())
        expected = policy.choose(req, cands).replica
        without = policy.choose(RouteRequest(prompt, BS, len(prefix),
                                             expected_output_tokens=out), cands).replica
        moved += expected != without
        chosen, _ = await AtomicRoute(index, load).route(
            f"new{trial}", prompt, prefix, replicas, [15.0] * 4, **route_kwargs(policy, u),
            expected_output_tokens=out, placement_window_s=window_s)
        assert chosen == expected, (trial, window_s, loads)
        after = (await load.loads([chosen]))[chosen]
        before = loads[chosen]
        decayed = before.placements * math.exp(-(clock.now() - before.placements_at_s)
                                               / window_s) if window_s else 0.0
        # the script's clock is whole milliseconds: a millisecond of decay apart at most
        assert after.placements == pytest.approx(decayed + 1, rel=1e-3)
        assert after.placements_at_s == pytest.approx(clock.now(), abs=0.002)
        for r in replicas:
            for i in range(4):
                await load.release(f"bg{trial}-{r}-{i}")
        await load.release(f"new{trial}")
    assert moved >= 3  # the placements changed the choice in several trials


async def test_the_new_prefix_term_agrees_at_its_edges_and_is_mirrored_locally(redis_pair):
    """The edges of the new-prefix term, Lua against Python: a window under a millisecond
    (the first requests after a start) is sent unrounded (rounded, the script read 0 and
    left the term off), and counts decayed to subnormals, whose sum is above 0 but whose
    mean is 0, leave the term off in both (the script divided by that mean). The script's
    placement is mirrored in the router's local counts (what a Redis outage falls back to)."""
    index, load, clock = redis_pair
    prefix = [10**9 + i for i in range(8)]
    prompt = len(prefix) * BS + 5

    async def both(replicas, window_s, rid):
        u = 0.3
        policy = PrefixAware(random.Random())
        policy.rng.random = lambda: u
        loads = await load.loads(replicas)
        cands = [Candidate(r, 0, loads[r], 20000.0, 0.005) for r in replicas]
        req = RouteRequest(prompt, BS, len(prefix), expected_output_tokens=100,
                           placement_window_s=window_s, now_s=clock.now())
        expected = policy.choose(req, cands).replica
        chosen, _ = await AtomicRoute(index, load).route(
            rid, prompt, prefix, replicas, [15.0] * len(replicas), **route_kwargs(policy, u),
            expected_output_tokens=100, placement_window_s=window_s)
        return expected, chosen

    # a 0.4 ms window: r0 has just taken three new prefixes, r1 one request
    for _ in range(3):
        await load.placed("r0", 0.0004)
    await load.reserve("x", "r1", 0)
    await load.release("x")
    expected, chosen = await both(["r0", "r1"], 0.0004, "sub-ms")
    assert chosen == expected == "r1"
    mirrored = load.local.loads_now([chosen])[chosen]
    assert mirrored.placements == pytest.approx(1.0) and mirrored.placements_at_s == clock.now()
    await load.release("sub-ms")
    # one placement on q0 744 windows ago (about 1e-323 now), the others busy
    await load.placed("q0", 1.0)
    clock.advance(744.0)
    for r in ("q1", "q2", "q3"):
        for i in range(2):
            await load.reserve(f"bg-{r}-{i}", r, 0)
    expected, chosen = await both(["q0", "q1", "q2", "q3"], 1.0, "subnormal")
    assert chosen == expected == "q0"
    for r in ("q1", "q2", "q3"):
        for i in range(2):
            await load.release(f"bg-{r}-{i}")
    await load.release("subnormal")


async def test_a_prefix_some_replica_holds_counts_no_placement(redis_pair):
    """Only a new prefix is counted; a request whose prefix a replica holds is not."""
    index, load, clock = redis_pair
    prefix = [7, 8, 9]
    await index.apply_events("r0", [KVEvent("stored", prefix, None)])
    policy = PrefixAware(random.Random(0))
    await AtomicRoute(index, load).route("held", 3 * BS + 1, prefix, ["r0", "r1"], [15.0] * 2,
                                         **route_kwargs(policy, 0.5),
                                         placement_window_s=5.0)
    loads = await load.loads(["r0", "r1"])
    assert loads["r0"].placements == loads["r1"].placements == 0
    await load.release("held")


async def test_route_reserves_once_and_writes_predicted_entries(redis_pair):
    index, load, clock = redis_pair
    p = PrefixAware()
    hashes = [1, 2, 3]
    chosen, _ = await AtomicRoute(index, load).route("q", 100, hashes, ["a", "b"], [15.0, 15.0],
                                 **route_kwargs(p, 0.0))
    again, _ = await AtomicRoute(index, load).route("q", 100, hashes, ["a", "b"], [15.0, 15.0],
                                **route_kwargs(p, 0.0))  # Serve asked twice
    loads = await load.loads(["a", "b"])
    assert sum(v.inflight for v in loads.values()) == 1
    assert (await index.lookup(hashes, [again]))[again] == 3
    await load.prefill_done("q")
    assert (await load.loads([again]))[again].prefill_tokens == 0
    await load.release("q")
    await load.release("q")  # idempotent
    loads = await load.loads(["a", "b"])
    assert all(v.inflight == 0 and v.prefill_tokens == 0 for v in loads.values())


async def test_a_heads_route_answers_without_deciding_when_a_candidate_holds_all_of_it(
        redis_pair):
    """``route_head`` mode (``AtomicRoute.route(head=True)``): where a candidate holds every
    block of a long prompt's head, the script reserves, counts and writes nothing and
    raises ``HeadHeld`` with the matches; where none does (one block short), it decides as
    ``route`` does, predicted entries and reservation included."""
    from router.index.base import HeadHeld
    index, load, clock = redis_pair
    p, route = PrefixAware(), AtomicRoute(index, load)
    head = [11, 12, 13, 14]
    await index.record_predicted("a", head, 60.0)
    await index.record_predicted("b", head[:3], 60.0)
    before = await _accounting(load)
    with pytest.raises(HeadHeld) as held:
        await route.route("h1", 4 * BS, head, ["a", "b"], [15.0, 15.0], head=True,
                          **route_kwargs(p, 0.0))
    assert held.value.matched == {"a": 4, "b": 3}
    assert await _accounting(load) == before  # no lease, no count
    assert (await index.lookup(head, ["b"]))["b"] == 3  # nothing written for b
    # one block short everywhere: decided on the head, as a plain route
    other = [21, 22, 23]
    await index.record_predicted("b", other[:2], 60.0)
    chosen, matched = await route.route("h2", 3 * BS, other, ["a", "b"], [15.0, 15.0],
                                        head=True, **route_kwargs(p, 0.0))
    assert (chosen, matched) == ("b", {"a": 0, "b": 2})
    assert (await index.lookup(other, ["b"]))["b"] == 3  # its predicted entries
    assert sum(v.inflight for v in (await load.loads(["a", "b"])).values()) == 1
    await load.release("h2")


async def test_predicted_entries_are_written_past_the_exact_run_and_expired_ones_swept(
        redis_pair):
    """The route writes predicted entries only for blocks the chosen replica does not hold
    exactly, and sweeps expired ones while it writes: a replica taking new prompts all the
    time keeps a bounded predicted hash (it only expires whole, and kept every field)."""
    index, load, clock = redis_pair
    p = PrefixAware()
    top = [(1 << 64) - 1 - k for k in range(4)]  # the high bit set: 8 bytes, not a sign
    await index.apply_events("a", [KVEvent("stored", top[:2], None)])
    atomic = AtomicRoute(index, load)
    chosen, matched = await atomic.route("q", 200, top, ["a"], [15.0], **route_kwargs(p, 0.0))
    assert chosen == "a" and matched == {"a": 2}
    client = index.conn.client()
    fields = list(await client.hgetall(index.keys.predicted("a")))
    assert sorted(fields) == sorted([TABLE_FIELD] + [h.to_bytes(8, "big") for h in top[2:]])
    assert (await index.lookup(top, ["a"]))["a"] == 4
    await load.release("q")
    for k in range(60):  # new prompts, each entry living 1 s, 1 s apart
        hashes = [random.getrandbits(64) for _ in range(8)]
        await atomic.route(f"n{k}", 8 * BS, hashes, ["a"], [1.0], **route_kwargs(p, 0.0))
        await load.release(f"n{k}")
        clock.advance(1.0)
    live_bound = 2 * 2 * 8 + 16  # a sweep covers twice what is written, plus 16
    assert entries_in(await client.hlen(index.keys.predicted("a"))) <= live_bound + 8


@pytest.mark.parametrize("writer", ["route", "record_predicted"])
async def test_a_finished_sweep_pass_pauses_a_second_by_the_routers_clock(redis_pair, writer):
    """A sweep pass over a small predicted hash (HSCAN returns a listpack whole) ends at
    once; the next starts a second later by the router's clock, not on every write. The
    pause is marked in a key of its own, so the cursor stays an HSCAN cursor for a router
    of an earlier version; a mark up to 10 s ahead (a router whose clock runs ahead) holds,
    one further ahead is due at once."""
    index, load, clock = redis_pair
    # Redis expires the hash itself by its own clock, at its latest entry's expiry: an
    # hour ahead of it, the hash outlives a slow run of the test (CI saw it gone)
    clock.advance(3600.0)
    p, atomic, client = PrefixAware(), AtomicRoute(index, load), index.conn.client()
    key = index.keys.predicted("a")
    n = 0

    async def write(ttl_s: float) -> None:
        nonlocal n
        n += 1
        hashes = [random.getrandbits(64) for _ in range(8)]
        if writer == "route":
            await atomic.route(f"s{n}", 8 * BS, hashes, ["a"], [ttl_s], **route_kwargs(p, 0.0))
            await load.release(f"s{n}")
        else:
            await index.record_predicted("a", hashes, ttl_s)

    await write(0.2)  # its pass ends at once: the next may start 1 s later
    clock.advance(0.5)
    await write(0.2)  # the first write's entries expired, but the sweep is paused
    assert entries_in(await client.hlen(key)) == 16
    clock.advance(1.3)
    # 1.8 s after the pass: a new pass removes both expired writes (an entry goes a second
    # after it expired: lua/sweep.lua SWEEP_SLACK_MS)
    await write(0.2)
    assert entries_in(await client.hlen(key)) == 8
    assert await client.get(key + ":cursor") == b"0"  # an HSCAN cursor, as before
    clock.advance(1.5)
    await client.set(key + ":swept", int(clock.now() * 1000) + 600_000)
    await write(0.2)  # a mark 10 minutes ahead is due at once
    assert entries_in(await client.hlen(key)) == 8
    clock.advance(0.5)
    await client.set(key + ":swept", int(clock.now() * 1000) + 5_000)
    await write(0.2)  # 5 s ahead (a router's clock running ahead): the pause holds
    assert entries_in(await client.hlen(key)) == 16


async def test_a_prompt_sent_again_refreshes_its_predicted_entries_once_per_half_ttl(
        redis_pair):
    """Predicted entries with half their TTL left are not written again: a conversation's
    next turn writes only its new blocks, and a prefix in use keeps living (it is written
    again once less than half its TTL is left). The new blocks expire with the prefix's
    last block (no later than their parent: the hash stays in order, lua/sweep.lua)."""
    index, load, clock = redis_pair
    p, atomic, client = PrefixAware(), AtomicRoute(index, load), index.conn.client()
    hashes = [101, 102, 103, 104]

    async def expiries() -> dict[int, int]:
        raw = await client.hgetall(index.keys.predicted("a"))
        return {int.from_bytes(k, "big"): int(v) for k, v in raw.items() if k != TABLE_FIELD}

    async def route(rid: str, blocks: list[int]) -> None:
        await atomic.route(rid, len(blocks) * BS, blocks, ["a"], [10.0],
                           **route_kwargs(p, 0.0))
        await load.release(rid)

    await route("t1", hashes)
    first = await expiries()
    assert sorted(first) == hashes and len(set(first.values())) == 1
    clock.advance(2.0)
    await route("t2", hashes + [105, 106])  # the next turn: two new blocks
    second = await expiries()
    assert {h: second[h] for h in hashes} == first  # not written again
    assert second[105] == second[106] == first[104]
    clock.advance(4.0)  # 6 s after the first write: under half of the 10 s TTL is left
    await route("t3", hashes)
    third = await expiries()
    assert all(third[h] == first[h] + 6000 for h in hashes)
    assert third[105] == second[105]  # not part of this prompt
    assert (await index.lookup(hashes + [105, 106], ["a"]))["a"] == 6


@pytest.mark.parametrize("seed", range(6))
async def test_the_held_prefix_walk_agrees_with_its_definition_on_mixed_entries(
        redis_pair, seed):
    """A candidate's match (lookup) and the predicted entries a route writes, on random
    mixes of exact entries and predicted ones (expired, expiring now, live with under half
    the TTL left or exactly half, live with more), alone or beside an exact entry, against
    the definitions: matched = the leading blocks held exactly or by a live predicted entry
    (expiry > now); the route writes every block past the leading blocks held exactly or
    predicted with more than half the TTL left (expiry > now + TTL / 2). The walk reads a
    chunk's exact or predicted entries first by where it is (lua/route.lua ``held_prefix``),
    so runs of each kind and switches between them mid-chunk are covered: prompts of up to
    150 blocks cross the 1, 16 and 64-block reads."""
    index, load, clock = redis_pair
    rng = random.Random(seed)
    client = index.conn.client()
    ttl_ms = 10_000
    now = int(clock.now() * 1000)
    expiry = {"p_fresh": now + ttl_ms * 3 // 4, "p_half": now + ttl_ms // 2,
              "p_stale": now + ttl_ms // 4, "p_now": now, "p_expired": now - 1}
    held = {"x", "p_fresh", "p_half", "p_stale"}  # with or without an exact entry beside
    fresh_kinds = {"x", "p_fresh"}
    kinds = ["x", "none", *expiry, *(f"x+{k}" for k in expiry)]
    atomic, p = AtomicRoute(index, load), PrefixAware()
    for case in range(10):
        n = rng.choice([1, 2, 17, 18, 80, 81, 150])
        hashes = [rng.getrandbits(64) for _ in range(n)]
        states, k = [], 0  # per block: runs of one state, then a switch
        while k < n:
            run = rng.choice([1, 3, 15, 16, 40, 70])
            kind = rng.choice(kinds)
            if kind in ("none", "p_now", "p_expired") and rng.random() < 0.7:
                kind = "p_fresh"  # keep most walks going past their first miss
            states += [kind] * min(run, n - k)
            k += run
        replica = f"r{seed}-{case}"
        x_fields, p_fields = {}, {}
        for h, kind in zip(hashes, states):
            field = h.to_bytes(8, "big")
            if kind == "x" or kind.startswith("x+"):
                x_fields[field] = 1
            if kind.removeprefix("x+") in expiry:
                p_fields[field] = expiry[kind.removeprefix("x+")]
        if x_fields:  # as the engine's events write them: a block after its parent, so
            # that exact runs past a gap count as orphans (lua/exact.lua) and are walked
            await index.apply_events(replica, [
                KVEvent("stored", [h], hashes[i - 1] if i else None)
                for i, h in enumerate(hashes) if h.to_bytes(8, "big") in x_fields])
        if p_fields:  # entries out of order, as the router marks them (lua/sweep.lua)
            mark = str(max(p_fields.values())).encode()
            await client.hset(index.keys.predicted(replica), mapping={
                **p_fields, TABLE_FIELD: mark + b"~" * (128 - len(mark))})
        # the writers name the replica among the root's holders (lua/roots.lua's format)
        await client.hset(index.keys.roots, hashes[0].to_bytes(8, "big"), f"\0{replica}\0")

        def run_of(ok) -> int:
            return next((i for i, kind in enumerate(states) if not ok(kind)), n)

        matched = run_of(lambda kind: kind.startswith("x") or kind in held)
        fresh = run_of(lambda kind: kind.startswith("x") or kind in fresh_kinds)
        assert (await index.lookup(hashes, [replica]))[replica] == matched, (case, states)
        chosen, got = await atomic.route(f"m{seed}-{case}", n * BS, hashes, [replica],
                                         [ttl_ms / 1000], **route_kwargs(p, 0.0))
        assert got == {replica: matched}
        after = await client.hgetall(index.keys.predicted(replica))
        values = {int.from_bytes(f, "big"): int(v) for f, v in after.items() if f != TABLE_FIELD}
        marked = int(after[TABLE_FIELD].split(b"~")[0] or 0) if after else 0
        # every block past the fresh run written with one expiry: that of the run's last
        # block where it is predicted past half the TTL (read by the walk), or a full TTL
        # with the hash marked out of order until then; the fresh run left as it was
        written = {values.get(h) for h in hashes[fresh:]}
        assert len(written) <= 1, (case, states)
        for h in hashes[:fresh]:  # (an expired one may be swept)
            v = p_fields.get(h.to_bytes(8, "big"))
            assert values.get(h) in ((v,) if v is None or v > now else (v, None)), (case, states)
        if written:
            (v,) = written
            bound = p_fields.get(hashes[fresh - 1].to_bytes(8, "big"), 0) if fresh else 0
            assert v == bound > now + ttl_ms // 2 or (v == now + ttl_ms and (
                fresh == 0 or marked >= v)), (case, states)
        await load.release(f"m{seed}-{case}")


async def test_leases_of_a_dead_router_are_swept(redis_pair):
    index, load, clock = redis_pair
    other = RedisLoadTracker(load.conn, load.ns, clock=clock)  # a second router process
    await other.reserve("x1", "a", 500)
    await other.reserve("x2", "a", 500)
    await load.reserve("mine", "a", 100)
    await asyncio.sleep(0.1)  # both heartbeats written
    assert await load.sweep() == 0
    assert (await load.loads(["a"]))["a"].inflight == 3
    await other.close()  # the other router process dies: its heartbeat expires
    await load.conn.call(lambda c: c.delete(f"{load.ns}:router:{other.router_id}"))
    assert await load.sweep() == 2
    after = (await load.loads(["a"]))["a"]
    assert (after.inflight, after.prefill_tokens) == (1, 100)


async def test_several_routers_do_not_all_pick_the_same_replica_for_a_burst(redis_pair):
    """docs/fault-cases.md 1.7 / 12.3: three routers deciding at once see each other's
    reservations."""
    index, load, clock = redis_pair
    routers = [load] + [RedisLoadTracker(load.conn, load.ns, clock=clock) for _ in range(2)]
    replicas = [f"r{i}" for i in range(4)]

    async def burst(k: int, tracker: RedisLoadTracker):
        out = []
        for i in range(8):
            chosen, _ = await AtomicRoute(index, tracker).route(f"b{k}-{i}", 1000, [10_000 * k + 100 * i + j for j in range(31)],
                replicas, [15.0] * 4, **route_kwargs(PrefixAware(), random.random()))
            out.append(chosen)
        return out

    picks = sum(await asyncio.gather(*(burst(k, t) for k, t in enumerate(routers))), [])
    counts = {r: picks.count(r) for r in replicas}
    assert max(counts.values()) <= 7, counts  # 24 cold requests over 4 replicas: ~6 each
    loads = await load.loads(replicas)
    assert sum(v.inflight for v in loads.values()) == 24


async def test_routing_core_uses_the_atomic_path_and_falls_back_when_redis_fails():
    ns = f"t-{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=REDIS_URL, index_namespace=ns)
    conn = RedisConnections(REDIS_URL, 0.5)
    index, load = RedisPrefixIndex(REDIS_URL, ns, connections=conn), RedisLoadTracker(conn, ns)
    core = RoutingCore(settings, index, load, PrefixAware(random.Random(0)),
                       atomic=AtomicRoute(index, load))
    assert core.atomic is not None
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    d1 = await core.decide("r1", 1400, list(range(40)), reps)
    d2 = await core.decide("r2", 1400, list(range(40)) + [99], reps)
    assert d2.replica == d1.replica and d2.reason == "cache"
    dead = RedisConnections("redis://127.0.0.1:1/0", 0.1)
    index, load = RedisPrefixIndex(REDIS_URL, ns, connections=dead), RedisLoadTracker(dead, ns)
    down = RoutingCore(settings, index, load, PrefixAware(random.Random(0)),
                       atomic=AtomicRoute(index, load))
    d3 = await down.decide("r3", 1400, list(range(40)), reps)
    assert d3.reason == "fallback" and not down.index_available
    await core.index.flush()


async def _settled(core_module) -> None:
    """Wait for the background tasks of the routing core (a late route's settlement)."""
    await asyncio.gather(*list(core_module._RELEASING))


def _late_setup(own_redis, ns="t"):
    settings = Settings(redis_url=own_redis.url, index_namespace=ns)
    conn = RedisConnections(own_redis.url, 0.05)
    index, load = RedisPrefixIndex(own_redis.url, ns, connections=conn), \
        RedisLoadTracker(conn, ns)
    core = RoutingCore(settings, index, load, PrefixAware(random.Random(0)),
                       atomic=AtomicRoute(index, load))
    return settings, conn, index, load, core


async def test_a_route_script_that_answers_late_has_its_prediction_moved_to_the_fallbacks_choice(
        own_redis):
    """The route script missed the deadline but Redis still ran it: it chose one replica and
    wrote predicted entries there, while the request went by the fallback to the other. Its
    new entries are dropped (those an earlier request had predicted there stay), the
    request's replica gets them, and its lease there ends with the request: so the
    conversation's next turn follows the request, not the script (an end-to-end test once
    failed on exactly this: its second turn went to the replica that had never seen the
    first)."""
    import redis as sync_redis
    from router.routing import core as core_module

    ns = "t"
    settings, conn, index, load, core = _late_setup(own_redis, ns)
    admin = sync_redis.Redis.from_url(own_redis.url)
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    hashes = list(range(1000, 1040))
    tokens = len(hashes) * settings.block_size
    # an earlier request predicted the first 10 blocks on a, with little of its TTL left
    await index.record_predicted("a", hashes[:10], 1.0)
    # Redis sees b busy: the script will choose a (10 blocks held); this router's own
    # recent decisions (the fallback's view) have the whole prompt on b: the fallback
    # chooses b
    await load.reserve("other", "b", 0)
    core.recent.record("b", hashes, settings.predicted_ttl_s)
    admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")  # reads are still answered
    d = await core.decide("q1", tokens, hashes, reps)
    assert (d.replica, d.reason) == ("b", "fallback")
    await _settled(core_module)  # the pause ends, the script runs, the settlement follows
    assert admin.hget(f"{ns}:load", "a:t") is not None  # the script did run, and chose a
    matched = await index.lookup(hashes, ["a", "b"])
    assert matched == {"a": 10, "b": len(hashes)}, matched
    assert int(admin.hget(f"{ns}:load", "a:n") or 0) == 0  # its lease on a is gone
    # the next turn goes where the first one went
    d2 = await core.decide("q2", tokens + 64, hashes + [2000, 2001], reps)
    assert (d2.replica, d2.reason) == ("b", "cache")
    await load.release("q1")
    await load.release("q2")
    await load.release("other")
    assert admin.hgetall(f"{ns}:leases") == {}
    assert all(int(v) == 0 for k, v in admin.hgetall(f"{ns}:load").items()
               if k.endswith((b":n", b":p")))
    await load.close()
    await conn.close()


async def test_a_late_heads_route_script_that_found_the_head_held_settles_as_held(
        own_redis, monkeypatch):
    """A long prompt's head decided while Redis pauses its writes: the fallback decides on
    the head (the index is not read) and sends it to ``b`` (``a`` is busy), and the script,
    once it runs, finds the whole head held on ``a`` and does nothing; its settlement
    (``AtomicRoute.settle``) is ``held``, and writes the predicted entries that neither it
    nor the fallback wrote for ``b``, so the conversation's next turn follows the request."""
    import redis as sync_redis
    from router.routing import core as core_module

    ns = "t"
    settings, conn, index, load, core = _late_setup(own_redis, ns)
    admin = sync_redis.Redis.from_url(own_redis.url)
    hashes = list(range(7000, 7010))
    await index.record_predicted("a", hashes, 60.0)
    await load.reserve("busy", "a", 100_000)
    outcomes, settle = [], core.atomic.settle

    async def recorded(*args, **kwargs):
        outcomes.append(await settle(*args, **kwargs))
        return outcomes[-1]
    monkeypatch.setattr(core.atomic, "settle", recorded)
    admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
    d = await core.decide("q1", len(hashes) * 32, hashes,
                          [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})], head=True)
    assert (d.reason, d.replica) == ("fallback", "b")
    await _settled(core_module)
    assert outcomes == ["held"]
    assert int(admin.hget(f"{ns}:load", "a:n")) == 1  # "busy" only: the script reserved none
    assert (await index.lookup(hashes, ["b"]))["b"] == len(hashes)
    await load.release("q1")
    await load.release("busy")
    assert admin.hgetall(f"{ns}:leases") == {}
    await load.close()
    await conn.close()


async def _late_first_decision(own_redis, ns: str, first_hash: int):
    """Request ``q1``, a new prefix of 20 blocks from ``first_hash``, decided while Redis
    pauses its writes: its route script is late and the fallback sends it to ``a``, the
    one candidate. Returns ``(conn, load, core, admin, hashes)``."""
    import redis as sync_redis
    settings, conn, index, load, core = _late_setup(own_redis, ns)
    admin = sync_redis.Redis.from_url(own_redis.url)
    hashes = list(range(first_hash, first_hash + 20))
    admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
    d = await core.decide("q1", len(hashes) * 32, hashes, [ReplicaInfo("a", {}, {})])
    assert (d.replica, d.reason) == ("a", "fallback")
    return conn, load, core, admin, hashes


async def test_a_late_route_script_that_chose_the_requests_replica_keeps_its_count(own_redis):
    """A new prefix, one replica: the late script and the fallback both place it there. The
    script's shared count stays (the placement happened), and this router takes it as the
    request's in place of the fallback's own local count: one count, shared, both in Redis
    and here; the request's later move takes it along."""
    from router.routing import core as core_module

    ns = "t"
    conn, load, core, admin, hashes = await _late_first_decision(own_redis, ns, 5000)
    assert load.placement_of("q1") == ("a", False)  # the fallback's, local only
    await _settled(core_module)
    # counts decay over the mean request life, here the 0.3 s of the pause: one count
    # each, decayed (two would be above 1, none 0)
    assert 0.2 < float(admin.hget(f"{ns}:load", "a:k")) <= 1.0
    assert 0.0 < load.local.loads_now(["a"])["a"].placements <= 1.0
    assert load.placement_of("q1") == ("a", True)
    await core.moved("q1", ReplicaInfo("b", {}, {}), len(hashes) * 32, hashes, 0)
    assert float(admin.hget(f"{ns}:load", "a:k")) == 0.0
    assert float(admin.hget(f"{ns}:load", "b:k")) == pytest.approx(1.0)
    await load.release("q1")
    await load.close()
    await conn.close()


async def test_a_late_route_script_of_a_request_decided_again_gives_its_count_back(
        own_redis):
    """A new prefix: the first decision's script is late (the fallback sends the request to
    a, as the script does), the attempt fails and the request is decided again among the
    others (b). The first script's count at a is not the request's any more: taken back
    when it settles, not adopted; the request counts once, at b."""
    from router.routing import core as core_module

    ns = "t"
    conn, load, core, admin, hashes = await _late_first_decision(own_redis, ns, 7000)
    d = await core.decide("q1", len(hashes) * 32, hashes, [ReplicaInfo("b", {}, {})])
    assert (d.replica, d.reason) == ("b", "fallback")
    await _settled(core_module)
    assert float(admin.hget(f"{ns}:load", "a:k")) == 0.0
    assert 0.2 < float(admin.hget(f"{ns}:load", "b:k")) <= 1.0
    assert load.placement_of("q1") == ("b", True)
    assert load.local.loads_now(["a"])["a"].placements == 0.0
    await load.release("q1")
    await load.close()
    await conn.close()


async def test_a_late_script_settling_after_a_retry_on_the_same_replica_counts_once(
        own_redis):
    """The retry of a request whose first script was late was decided in time, on the
    replica the late script chose: the retry's script counted the placement (shared). The
    late script's own count there is not the request's: taken back when it settles, not
    adopted as a second one."""
    import redis as sync_redis

    from router.routing.atomic import LateRoute

    ns = "t"
    settings, conn, index, load, core = _late_setup(own_redis, ns)
    load.mean_request_life_s = lambda: 30.0
    admin = sync_redis.Redis.from_url(own_redis.url)
    await load.placed("a", 30.0, "q1")  # the retry's placement, counted by its script
    await load._placement_op("placed", "a", 30.0)  # the late script's own: Redis only
    reply = asyncio.get_running_loop().create_future()
    reply.set_result([1, 0])  # it chose a, where no block was held
    late = LateRoute("late", reply, "q1", "r|0", ["a"], list(range(9000, 9004)), 0)
    assert await core.atomic.settle(late, "a") == "same"
    assert float(admin.hget(f"{ns}:load", "a:k")) == pytest.approx(1.0, abs=0.01)
    assert load.local.loads_now(["a"])["a"].placements == pytest.approx(1.0, abs=0.01)
    assert load.placement_of("q1") == ("a", True)
    await load.close()
    await conn.close()


async def test_a_late_route_script_of_a_request_that_went_nowhere_leaves_no_lease(own_redis):
    """A route script that ran after its decision had failed (here the fallback's policy
    raised; a cancelled request is the same) holds a lease that no release of the request
    would end while the router lives, and predicts blocks nobody will hold: the settlement
    ends the one and drops the other."""
    import redis as sync_redis
    from router.routing import core as core_module

    class Broken(PrefixAware):
        def choose(self, req, candidates):
            raise RuntimeError("a bug in the fallback")

    ns = "t"
    settings, conn, index, load, core = _late_setup(own_redis, ns)
    core.policy = Broken(random.Random(0))
    admin = sync_redis.Redis.from_url(own_redis.url)
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    hashes = list(range(3000, 3020))
    admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
    with pytest.raises(RuntimeError):
        await core.decide("q1", len(hashes) * 32, hashes, reps)
    await load.release("q1")  # the request's exit path
    await _settled(core_module)
    assert admin.hget(f"{ns}:load", "a:t") or admin.hget(f"{ns}:load", "b:t")  # it ran
    assert admin.hgetall(f"{ns}:leases") == {}
    # the counts are back to zero, the new-prefix placement the script counted included
    # (the request's fallback decision failed: it placed nothing anywhere)
    assert all(int(v) == 0 for k, v in admin.hgetall(f"{ns}:load").items()
               if k.endswith((b":n", b":p")))
    assert all(float(v) == 0 for k, v in admin.hgetall(f"{ns}:load").items()
               if k.endswith(b":k")), admin.hgetall(f"{ns}:load")
    assert await index.lookup(hashes, ["a", "b"]) == {"a": 0, "b": 0}
    await load.close()
    await conn.close()


async def test_a_call_left_running_is_bounded_and_cancelled_with_its_caller(own_redis):
    """``call_or_leave``: within the bound it answers; past it the call keeps running and its
    answer comes later; at most ``MAX_LATE_CALLS`` are left running (then it is cut, and
    its ``LateCall`` has no reply); a cancelled caller cancels its call."""
    import redis as sync_redis
    from router.index.redis import LateCall

    conn = RedisConnections(own_redis.url, 0.05)
    admin = sync_redis.Redis.from_url(own_redis.url)
    started: list = []

    async def incr(client):
        started.append(asyncio.current_task())
        return await client.incr("n")

    assert await conn.call_or_leave(incr) == 1
    admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
    with pytest.raises(LateCall) as late:
        await conn.call_or_leave(incr)
    assert await late.value.reply == 2  # answered once the pause ended
    conn.MAX_LATE_CALLS = 1
    admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
    with pytest.raises(LateCall) as late:
        await conn.call_or_leave(incr)
    with pytest.raises(LateCall) as cut:
        await conn.call_or_leave(incr)
    await asyncio.sleep(0.01)
    assert cut.value.reply is None and started[-1].cancelled()
    waiting = asyncio.ensure_future(conn.call_or_leave(incr))
    await asyncio.sleep(0.01)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.sleep(0.01)
    assert started[-1].cancelled()
    assert await late.value.reply >= 3
    await conn.close()


async def test_a_burst_of_prompts_with_nothing_to_look_up_spreads_evenly():
    """Prompts shorter than a block have no hash to look up, so they are decided by load
    alone; decided at once by several routers, each decision must see the others'
    reservations (the one script serialises them), or all pile onto the replica that
    looked least loaded to each. Here 3 routers decide 8 at once over 2 replicas, with
    the admission bound 4: 4 and 4. (CI saw 3 and 1 on a bound of 2 before.)"""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=REDIS_URL, index_namespace=ns, max_inflight_per_replica=4)
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    cores = []
    for _ in range(3):
        conn = RedisConnections(REDIS_URL, 2.0)
        index, load = RedisPrefixIndex(REDIS_URL, ns, connections=conn), \
            RedisLoadTracker(conn, ns)
        cores.append(RoutingCore(settings, index, load, PrefixAware(
            random.Random(), **settings.policy_kwargs("prefix_aware")),
            atomic=AtomicRoute(index, load)))
    decisions = await asyncio.gather(*(cores[i % 3].decide(f"s{i}", 12, [], reps)
                                       for i in range(8)))
    chosen = [d.replica for d in decisions]
    assert sorted(chosen.count(r) for r in "ab") == [4, 4], chosen
    for i, core in enumerate(cores):
        for k in range(i, 8, 3):
            await core.load.release(f"s{k}")
        await core.load.close()
    await cores[0].index.flush()


async def _warm_then_overload(routers: int) -> tuple[float, int]:
    """docs/fault-cases.md 1.7 on the shared Redis: ``routers`` routing cores (router processes)
    share one namespace; A holds prefix P_a, B holds P_b (from KV events). Clients are spread
    round-robin over the routers. (a) 40 concurrent requests, half on each prefix: the
    fraction sent to their warm replica. (b) 40 more long P_a requests: the total in flight
    when the first one spills to B."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    # an engine whose step grows 5 ms per decoding sequence (a CPU engine): A's load
    # outweighs its cache within the 40 extra requests
    settings = Settings(redis_url=REDIS_URL, index_namespace=ns, block_size=BS,
                        decode_step_s=0.005)
    conn = RedisConnections(REDIS_URL, 2.0)
    index = RedisPrefixIndex(REDIS_URL, ns, connections=conn)
    trackers = [RedisLoadTracker(conn, ns) for _ in range(routers)]
    cores = [RoutingCore(settings, index, t, PrefixAware(random.Random(k)),
                         atomic=AtomicRoute(index, t)) for k, t in enumerate(trackers)]
    for core in cores:  # answers of 16 tokens seen: the decode-interference term is known
        core.observe_output(16)
    p_a, p_b = list(range(1, 41)), list(range(1001, 1041))  # 40 blocks each: 1,280 tokens
    await index.apply_events("a", [KVEvent("stored", p_a, None)])
    await index.apply_events("b", [KVEvent("stored", p_b, None)])
    reps = [ReplicaInfo("a", {}, {}), ReplicaInfo("b", {}, {})]
    n = 0

    async def send(prefix: list[int]) -> str:
        nonlocal n
        n += 1
        core = cores[n % routers]
        suffix = [10**6 + n * 100 + i for i in range(4)]  # the request's own question
        d = await core.decide(f"q{n}", (len(prefix) + 4) * BS + 7, prefix + suffix, reps)
        return d.replica

    # (a) balanced: 40 at once, alternating prefixes, none finishing. The connections are
    # opened first: a decision on a new connection waits for its connect, and connects end
    # in any order, so the scripts would reach Redis in any order (all of one prefix first
    # is not a balanced load: its replica would rightly spill)
    await asyncio.gather(*(conn.call(lambda c: c.ping()) for _ in range(40)))
    picks = await asyncio.gather(*(send(p_a if i % 2 == 0 else p_b) for i in range(40)))
    warm = sum(p == ("a" if i % 2 == 0 else "b") for i, p in enumerate(picks)) / len(picks)
    # (b) overloaded A: long P_a requests, four at a time (one per client connection)
    spill_at = None
    for _ in range(10):
        picks = await asyncio.gather(*(send(p_a) for _ in range(4)))
        if "b" in picks and spill_at is None:
            loads = await cores[0].load.loads(["a", "b"])
            spill_at = sum(v.inflight for v in loads.values()) - (4 - picks.index("b"))
    loads = await cores[0].load.loads(["a", "b"])
    assert sum(v.inflight for v in loads.values()) == 80  # every router's requests counted
    for core in cores:
        await core.load.close()
    await index.flush()
    return warm, spill_at


async def test_several_routers_keep_affinity_and_spill_at_the_same_load_as_one():
    """docs/fault-cases.md 1.7: with 4 router processes each seeing a quarter of the requests, (a)
    at least 95 % of a balanced load goes to its warm replica, as with one router, and (b) the
    overloaded replica spills at the same total in flight (within 20 %): load is read from
    Redis, shared by the routers, not from each router's own memory."""
    warm_1, spill_1 = await _warm_then_overload(1)
    warm_4, spill_4 = await _warm_then_overload(4)
    assert warm_1 >= 0.95 and warm_4 >= 0.95, (warm_1, warm_4)
    assert spill_1 is not None and spill_4 is not None, (spill_1, spill_4)
    assert abs(spill_4 - spill_1) <= 0.2 * spill_1, (spill_1, spill_4)


async def test_a_new_routers_first_leases_survive_another_routers_sweep(redis_pair):
    """No lease exists without its router's heartbeat: the reservation writes both, so a
    sweep by another router that runs before the new router's heartbeat task (or while its
    heartbeat write failed) releases nothing. Found by CI: 22 of 24 leases left."""
    index, load, clock = redis_pair
    new = RedisLoadTracker(load.conn, load.ns, clock=clock)
    new.ensure_heartbeat = lambda: None  # its heartbeat task has not run yet
    await AtomicRoute(index, new).route("first", 1000, [1, 2, 3], ["a", "b"], [15.0, 15.0],
                    **route_kwargs(PrefixAware(), 0.5))
    await new.reserve("second", "b", 100)
    assert await load.sweep() == 0
    assert sum(v.inflight for v in (await load.loads(["a", "b"])).values()) == 2
    await new.close()


async def _accounting(load: RedisLoadTracker) -> tuple[dict, dict]:
    async def run(c):
        return await c.hgetall(load.keys[0]), await c.hgetall(load.keys[1])
    raw_load, leases = await load.conn.call(run)
    counts = {k.decode(): int(v) for k, v in raw_load.items()
              if k.decode().endswith((":n", ":p"))}
    return counts, {k.decode(): v.decode() for k, v in leases.items()}


async def test_leases_of_zero_prefill_tokens_are_released_exactly_once(redis_pair):
    """A request with no prompt tokens known (an empty or unparsed prompt) holds a lease of
    0 tokens. Its release negated 0 into -0, which the real Redis refuses in HINCRBY: the
    script stopped after decrementing the in-flight count and kept the lease, so every
    retry and every sweep decremented again (CI's counts at -8 and -20)."""
    index, load, clock = redis_pair
    other = RedisLoadTracker(load.conn, load.ns, clock=clock)
    await load.reserve("empty", "a", 0)
    await load.prefill_done("empty")
    await load.release("empty")
    await load.release("empty")
    await AtomicRoute(index, load).route("twice", 0, [], ["a", "b"], [15.0, 15.0],
                     **route_kwargs(PrefixAware(), 0.2))
    await AtomicRoute(index, load).route("twice", 0, [], ["a", "b"], [15.0, 15.0],
                     **route_kwargs(PrefixAware(), 0.7))  # re-reservation of a 0-token lease
    await load.release("twice")
    await other.reserve("orphan", "b", 0)  # then its router dies
    await other.close()
    await load.conn.call(lambda c: c.delete(f"{load.ns}:router:{other.router_id}"))
    assert await load.sweep() == 1
    assert await load.sweep() == 0
    counts, leases = await _accounting(load)
    assert leases == {} and set(counts.values()) <= {0}, (counts, leases)


async def test_a_lease_this_code_did_not_write_is_dropped_without_touching_counts(redis_pair):
    index, load, clock = redis_pair
    await load.reserve("ok", "a", 10)
    await load.conn.call(lambda c: c.hset(load.keys[1], "junk", "not a lease"))
    await load.release("junk")
    await load.sweep()
    counts, leases = await _accounting(load)
    assert leases == {"ok": leases["ok"]} and counts == {"a:n": 1, "a:p": 10}


async def test_a_release_that_fails_is_retried_until_redis_takes_it(own_redis):
    """docs/fault-cases.md 5.1 under load: a release that Redis does not take in time (here: writes
    paused on a server of the test's own for longer than the bound) must not leave the
    lease behind, since a live router's leases are never swept; it is retried with the
    heartbeat. A release slower than a routing call but within the longer bound of
    releases is not lost at all."""
    import redis as sync_redis
    conn = RedisConnections(own_redis.url, 0.05)  # the routing bound of the fault tests
    load = RedisLoadTracker(conn, "t", heartbeat_ttl_s=0.6)  # retries every 0.2 s
    admin = sync_redis.Redis.from_url(own_redis.url)
    await load.reserve("slow", "a", 100)
    await load.reserve("lost", "a", 100)
    admin.execute_command("CLIENT", "PAUSE", 300, "WRITE")
    await load.release("slow")  # 300 ms: past a routing call's bound, within a release's
    assert load.pending_releases == set()
    admin.execute_command("CLIENT", "PAUSE", int(conn.MAINTENANCE_TIMEOUT_S * 1000) + 1000,
                          "WRITE")
    await load.release("lost")
    assert load.pending_releases == {"lost"}  # Redis did not take it: kept for the heartbeat
    assert admin.hget("t:leases", "lost") is not None
    assert int(admin.hget("t:load", "a:n")) == 1  # Redis still counts the request ...
    assert (await load.loads(["a"]))["a"].inflight == 0  # ... this router knows it is over
    for _ in range(100):
        if not load.pending_releases:
            break
        await asyncio.sleep(0.1)
    assert load.pending_releases == set() and admin.hgetall("t:leases") == {}
    assert int(admin.hget("t:load", "a:n")) == 0 and int(admin.hget("t:load", "a:p")) == 0
    await load.close()
    await conn.close()


async def test_a_reservation_redis_did_not_take_in_time_still_counts_in_the_loads(own_redis):
    """A reservation whose write missed the routing bound is this router's alone: its loads
    count it anyway (admission's bound and the next decisions see the request), until its
    release; if the write landed late, the release ends it in Redis too."""
    import redis as sync_redis
    conn = RedisConnections(own_redis.url, 0.05)
    load = RedisLoadTracker(conn, "t")
    admin = sync_redis.Redis.from_url(own_redis.url)
    admin.execute_command("CLIENT", "PAUSE", 400, "WRITE")  # reads are still answered
    await load.reserve("w", "a", 100)
    assert admin.hget("t:load", "a:n") in (None, b"0")
    got = (await load.loads(["a"]))["a"]
    assert (got.inflight, got.prefill_tokens) == (1, 100)
    await load.prefill_done("w")
    assert (await load.loads(["a"]))["a"].prefill_tokens == 0
    await asyncio.sleep(0.5)  # the paused write has landed by now
    await load.release("w")
    # (whether the cancelled write ever reached Redis depends on the client library)
    assert int(admin.hget("t:load", "a:n") or 0) == 0 and admin.hgetall("t:leases") == {}
    assert (await load.loads(["a"]))["a"].inflight == 0
    await load.close()
    await conn.close()


async def test_a_pending_release_does_not_take_a_later_reservation_of_the_same_request(
        redis_pair):
    """A retry reserves the same request id again after its first attempt's release failed:
    the reservation replaces the old lease itself, so the pending release is dropped and
    the retry keeps its load. A release names the attempt it ends, so the pending release
    of the first attempt, retried by the heartbeat while the route script reserves the
    second (CI saw the heartbeat's retry land after it and take its load), or arriving
    after it, leaves the second attempt's lease alone."""
    index, load, clock = redis_pair
    route = AtomicRoute(index, load)
    kwargs = route_kwargs(PrefixAware(), 0.5)

    async def owner_in_redis(request_id):
        lease = await load.conn.call(lambda c: c.hget(load.redis_keys.leases, request_id))
        return lease.decode().split("|", 3)[3]

    async def inflight():
        return sum(v.inflight for v in (await load.loads(["a", "b"])).values())

    for retry_first in (False, True):
        await load.reserve("r", "a", 100)
        first = await owner_in_redis("r")
        load._unreleased["r"] = first  # the first attempt's release did not reach Redis
        steps = [route.route("r", 1000, [1, 2, 3], ["a", "b"], [15.0, 15.0], **kwargs),
                 load.retry_releases()]
        await asyncio.gather(*(steps[::-1] if retry_first else steps))
        assert await load.retry_releases() == 0
        assert await owner_in_redis("r") != first
        assert await inflight() == 1
        await load._release("r", first)  # the first attempt's release, arriving late
        assert await inflight() == 1
        load._unreleased["r"] = await owner_in_redis("r")
        await load.reserve("r", "b", 10)
        await load.retry_releases()
        assert (await load.loads(["b"]))["b"].inflight == 1
        await load.release("r")
        assert await inflight() == 0 and load.pending_releases == set()


async def test_a_stale_lease_of_an_earlier_attempt_goes_with_the_later_release(redis_pair):
    """A route script whose caller timed out may still run, after the fallback reserved the
    same request id as its next attempt: its lease (the earlier attempt's) must not
    outlive the request. The later attempt's release takes it; an earlier attempt's
    release never takes a later one's (the test above)."""
    index, load, clock = redis_pair
    stale = load.lease_owner("r")  # the timed-out script's attempt
    await load.reserve("r", "a", 10)  # the fallback's reservation: a later attempt
    await load.conn.call(lambda c: c.hset(load.redis_keys.leases, "r", f"b|5|0|{stale}"))
    await load.conn.call(lambda c: c.hincrby(load.redis_keys.load, "b:n", 1))
    await load.release("r")
    assert await load.conn.call(lambda c: c.hget(load.redis_keys.leases, "r")) is None
    assert (await load.loads(["b"]))["b"].inflight == 0
