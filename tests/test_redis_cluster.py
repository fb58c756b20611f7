"""The Redis Cluster mode on a real local cluster (``conftest.redis_cluster``: three
masters): shard groups' keys in one slot and spread over the masters, the atomic route on
one group as the Python policy chooses, leases across groups, a prefix's follow-up reaching
the replica that holds it from any router, and the keys tied to no group (sessions, drained
set, rate limits, warm-up leases) on the cluster."""

from __future__ import annotations

import asyncio
import random
import time
import uuid

import pytest
import redis

from router.clock import ManualClock
from router.config import Settings
from router.index.base import IndexUnavailable
from router.index.redis import RedisConnections, RedisPrefixIndex
from router.kv_events.wire import KVEvent
from router.load.redis import RedisLoadTracker
from router.policy import Candidate, PrefixAware, RouteRequest
from router.redis_keys import ShardGroups, group_tag
from router.routing.atomic import AtomicRoute
from router.routing.core import RoutingCore
from router.routing.groups import GroupChoice
from router.routing.replica import ReplicaInfo
from tests.conftest import random_holdings

BS = 32


def route_kwargs(policy: PrefixAware, u: float, rate=20000.0):
    return dict(block_size=BS, prefill_rate=rate, work_weight=policy.work_weight,
                decode_step_s_per_seq=0.005, step_token_budget=policy.step_token_budget,
                tie_abs_s=policy.tie_abs_s, tie_rel=policy.tie_rel, u=u,
                load_factor=policy.load_factor, max_inflight=policy.max_inflight,
                running_weight=policy.running_weight, interference=policy.interference)


@pytest.fixture
async def grouped(redis_cluster):
    """A Redis index and load tracker on the cluster, 3 shard groups, a manual clock."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    conn = RedisConnections(redis_cluster.url, 2.0, cluster=True)
    clock = ManualClock(time.time())
    index = RedisPrefixIndex(redis_cluster.url, ns, clock=clock, connections=conn,
                             shard_groups=3)
    load = RedisLoadTracker(conn, ns, clock=clock, shard_groups=3)
    yield index, load, clock
    await load.close()
    await index.flush()
    await conn.close()


def fleet(groups: ShardGroups, per_group: int, prefix: str = "r") -> list[str]:
    """Replica ids, ``per_group`` in each group (the first ids found of each)."""
    out: dict[int, list[str]] = {g: [] for g in range(groups.count)}
    k = 0
    while any(len(v) < per_group for v in out.values()):
        r = f"{prefix}{k}"
        g = groups.group_of(r)
        if len(out[g]) < per_group:
            out[g].append(r)
        k += 1
    return [r for g in sorted(out) for r in out[g]]


def test_a_groups_keys_lie_in_one_slot_and_the_groups_spread_evenly_over_the_masters(
        redis_cluster):
    client = redis.RedisCluster.from_url(redis_cluster.url)
    try:
        for n in (3, 6, 12):
            groups = ShardGroups("prefix-router", n)
            masters = []
            for g, keys in enumerate(groups.keys):
                names = [keys.load, keys.leases, keys.replicas, keys.heartbeat("abc"),
                         keys.exact("r1"), keys.predicted("r1"),
                         keys.predicted("r1") + ":cursor", keys.predicted("r1") + ":swept",
                         keys.gone("r1"),
                         keys.exact("a:b{c}")]
                slots = {client.keyslot(name) for name in names}
                assert len(slots) == 1, (g, names)
                masters.append(client.get_node_from_key(keys.load).name)
            assert sorted(masters.count(m) for m in set(masters)) == [n // 3] * 3, masters
    finally:
        client.close()
    assert [group_tag(k, 1) for k in range(1)] == ["g0"]
    with pytest.raises(ValueError):
        ShardGroups("ns{x}", 3)
    with pytest.raises(ValueError):
        ShardGroups("ns", 0)


def test_replicas_are_assigned_alike_and_the_assignment_is_stable():
    a, b = ShardGroups("ns", 8), ShardGroups("other", 8)
    ids = [f"replica-{i}" for i in range(400)]
    assert [a.group_of(r) for r in ids] == [b.group_of(r) for r in ids]
    sizes = [sum(a.group_of(r) == g for r in ids) for g in range(8)]
    assert min(sizes) >= 30, sizes  # 50 each on average
    nine = ShardGroups("ns", 9)  # a group added: only the replicas it wins move
    moved = [r for r in ids if nine.group_of(r) != a.group_of(r)]
    assert all(nine.group_of(r) == 8 for r in moved) and len(moved) < 80


async def test_lookup_spans_groups_and_events_land_in_their_replicas_group(grouped):
    index, load, clock = grouped
    reps = fleet(index.groups, 2)
    assert len({index.groups.group_of(r) for r in reps}) == 3
    for k, r in enumerate(reps):
        await index.apply_events(r, [KVEvent("stored", list(range(1, k + 2)), None)])
    assert await index.lookup(list(range(1, 10)), reps) == {r: k + 1 for k, r in
                                                            enumerate(reps)}
    assert (await index.stats()).entries == sum(range(1, 7))
    await index.remove_replica(reps[3])
    assert (await index.lookup([1, 2, 3, 4], [reps[3]]))[reps[3]] == 0


async def test_the_atomic_route_on_the_cluster_chooses_as_the_python_policy(grouped):
    """Each decision runs in one group (one shard): within it, the script's choice and
    matched prefixes are the Python policy's over that group's candidates."""
    index, load, clock = grouped
    rng = random.Random(11)
    replicas = fleet(index.groups, 2)
    atomic = AtomicRoute(index, load)
    parts = index.groups.split(replicas)
    for trial in range(24):
        prefix = [trial * 1000 + i for i in range(rng.randrange(1, 40))]
        await random_holdings(index, load, rng, replicas, prefix, f"bg{trial}", 3, 3000)
        prompt = len(prefix) * BS + rng.randrange(0, 40)
        u = rng.random()
        full = trial % 2 == 1
        policy = PrefixAware(random.Random(), running_weight=1.0 if full else 0.0,
                             interference=1.0 if full else 0.0,
                             load_factor=None if full else 1.35)
        policy.rng.random = lambda: u
        group = atomic.first_level.choose(prefix, parts, f"req{trial}")
        cands = parts[group]
        loads = await load.loads(cands)
        matched = await index.lookup(prefix, cands)
        expected = policy.choose(RouteRequest(prompt, BS, len(prefix)), [
            Candidate(r, matched[r], loads[r], 20000.0, 0.005) for r in cands]).replica
        chosen, lua_matched = await atomic.route(
            f"req{trial}", prompt, prefix, replicas, [15.0] * len(replicas),
            **route_kwargs(policy, u))
        assert chosen == expected, (trial, matched, loads)
        assert {r: lua_matched[r] for r in cands} == matched
        assert all(lua_matched[r] == 0 for r in replicas if r not in cands)
        await load.release(f"req{trial}")
    for trial in range(24):
        for r in replicas:
            for i in range(3):
                await load.release(f"bg{trial}-{r}-{i}")
    loads = await load.loads(replicas)
    assert all(v.inflight == 0 and v.prefill_tokens == 0 for v in loads.values())


async def test_a_request_moved_to_another_group_keeps_one_lease(grouped):
    """Serve may route a request again: its reservation moves, and the lease left in its
    first group is released, so it counts once."""
    index, load, clock = grouped
    a, b = fleet(index.groups, 1)[:2]
    atomic = AtomicRoute(index, load)
    chosen, _ = await atomic.route("q", 640, list(range(20)), [a], [15.0],
                                   **route_kwargs(PrefixAware(), 0.3))
    assert chosen == a
    await load.reserve("q", b, 100)
    loads = await load.loads([a, b])
    assert (loads[a].inflight, loads[b].inflight, loads[b].prefill_tokens) == (0, 1, 100)
    chosen, _ = await atomic.route("q", 640, list(range(20)), [a], [15.0],
                                   **route_kwargs(PrefixAware(), 0.3))
    loads = await load.loads([a, b])
    assert (loads[a].inflight, loads[b].inflight) == (1, 0)
    await load.prefill_done("q")
    await load.release("q")
    await load.release("q")
    loads = await load.loads([a, b])
    assert all(v.inflight == 0 and v.prefill_tokens == 0 for v in loads.values())


async def test_a_held_heads_script_leaves_no_lease_group_behind(grouped, monkeypatch):
    """A long prompt's head found held in one group (``route_head``: no lease written) and
    the whole prompt then decided in another: no release is sent to the first group, where
    no lease is, on the decision's path."""
    from router.index.base import HeadHeld
    index, load, clock = grouped
    a, b = fleet(index.groups, 1)[:2]
    atomic = AtomicRoute(index, load)
    head = list(range(500, 510))
    await index.record_predicted(a, head, 60.0)
    with pytest.raises(HeadHeld):
        await atomic.route("q", 320, head, [a], [15.0], head=True,
                           **route_kwargs(PrefixAware(), 0.3))
    released, release = [], load._release

    async def spied(*args):
        released.append(args)
        return await release(*args)
    monkeypatch.setattr(load, "_release", spied)
    chosen, _ = await atomic.route("q", 384, head + [600, 601], [b], [15.0],
                                   **route_kwargs(PrefixAware(), 0.3))
    assert chosen == b and released == []
    await load.release("q")
    loads = await load.loads([a, b])
    assert all(v.inflight == 0 and v.prefill_tokens == 0 for v in loads.values())


async def test_a_dead_routers_leases_are_swept_in_every_group(grouped):
    index, load, clock = grouped
    reps = fleet(index.groups, 1)
    load.ensure_heartbeat = lambda: None  # no sweep of its own heartbeat task meanwhile
    other = RedisLoadTracker(load.conn, load.ns, clock=clock, shard_groups=3)
    for k, r in enumerate(reps):
        await other.reserve(f"x{k}", r, 50)
    await load.reserve("mine", reps[0], 10)
    assert await load.sweep() == 0
    await other.close()  # it dies: its heartbeats go
    for g in range(3):
        await load.conn.call(lambda c: c.delete(other.heartbeat_key_of(g)))
    assert await load.sweep() == 3
    loads = await load.loads(reps)
    assert [v.inflight for v in loads.values()] == [1, 0, 0]


async def test_a_follow_up_reaches_the_replica_holding_its_prefix_from_any_router(
        redis_cluster):
    """12 replicas in 4 groups over 3 masters. A conversation's first turn, decided by one
    router, lands on some replica, whose engine then reports the prefix (KV events); its
    follow-up, decided by that router or by another that never saw it, goes to that
    replica: the first router remembers the group, the other computes the same group from
    the prompt's first block."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    settings = Settings(redis_url=redis_cluster.url, redis_cluster=True,
                        index_shard_groups=4, index_namespace=ns, block_size=BS)
    cores = []
    for k in range(2):  # two router processes
        conn = RedisConnections(redis_cluster.url, 2.0, cluster=True)
        index = RedisPrefixIndex(redis_cluster.url, ns, connections=conn, shard_groups=4)
        load = RedisLoadTracker(conn, ns, shard_groups=4)
        cores.append(RoutingCore(settings, index, load, PrefixAware(random.Random(k)),
                                 atomic=AtomicRoute(index, load, GroupChoice(index.groups))))
    reps = [ReplicaInfo(r, {}, {}) for r in fleet(cores[0].index.groups, 3, "replica-")]
    try:
        for conv in range(6):
            first = [conv * 10_000 + i for i in range(40)]
            d1 = await cores[0].decide(f"c{conv}-1", 41 * BS, first, reps)
            await cores[0].load.release(f"c{conv}-1")
            held = d1.replica
            await cores[0].index.apply_events(held, [KVEvent("stored", first, None)])
            follow = first + [conv * 10_000 + 500 + i for i in range(8)]
            for k, core in enumerate(cores):
                d = await core.decide(f"c{conv}-2-{k}", 49 * BS, follow, reps)
                await core.load.release(f"c{conv}-2-{k}")
                assert (d.replica, d.reason) == (held, "cache"), (conv, k, d)
    finally:
        for core in cores:
            await core.load.close()
        await cores[0].index.flush()


async def test_a_hot_first_block_spills_to_the_next_group_in_its_order(redis_cluster):
    """Many requests sharing a first block (a system prompt) and nothing else: the first
    level sends them to the block's group until that group's load passes the bound, then
    to the next group of the block's order, and a router that never decided any of them
    computes the same order."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    conn = RedisConnections(redis_cluster.url, 2.0, cluster=True)
    index = RedisPrefixIndex(redis_cluster.url, ns, connections=conn, shard_groups=3)
    load = RedisLoadTracker(conn, ns, shard_groups=3)
    atomic = AtomicRoute(index, load, GroupChoice(index.groups, load_factor=1.25))
    replicas = fleet(index.groups, 2)
    parts = index.groups.split(replicas)
    order = atomic.first_level.order((7).to_bytes(8, "big"), parts)
    assert GroupChoice(index.groups).order((7).to_bytes(8, "big"), parts) == order
    groups_used = []
    try:
        for i in range(24):
            hashes = [7, 100 + i]  # one shared first block, then the request's own
            chosen, _ = await atomic.route(f"h{i}", 2 * BS, hashes, replicas,
                                           [15.0] * len(replicas),
                                           **route_kwargs(PrefixAware(), 0.5))
            groups_used.append(index.groups.group_of(chosen))
        assert groups_used[:4] == [order[0]] * 4, groups_used
        assert order[1] in groups_used
        per_group = [groups_used.count(g) for g in range(3)]
        assert max(per_group) <= 1.25 * 24 / 3 + 2 * 2 + 1, per_group
    finally:
        for i in range(24):
            await load.release(f"h{i}")
        await load.close()
        await index.flush()


async def test_keys_tied_to_no_group_work_on_the_cluster(redis_cluster):
    from router.routing.drain import DrainedReplicas
    from router.routing.sessions import RedisSessionStore
    from router.routing.warmup import RedisWarmupLease
    from router.serve.auth import Tenant
    from router.serve.errors import OpenAIError
    from router.serve.ratelimit import RateLimiter

    ns = f"t-{uuid.uuid4().hex[:8]}"
    conn = RedisConnections(redis_cluster.url, 2.0, cluster=True)
    sessions = RedisSessionStore(conn, ns)
    assert await sessions.pin_first("s1", "a", 60) == "a"
    assert await sessions.pin_first("s1", "b", 60) == "a"
    assert await sessions.get("s1") == "a"
    drains = DrainedReplicas(conn, ns, refresh_s=0)
    assert await drains.set("a", True) == {"a"}
    lease = RedisWarmupLease(conn, ns)
    assert await lease.acquire("scale_out:a", 5) and not await lease.acquire("scale_out:a", 5)
    limiter = RateLimiter(conn, ns)
    tenant = Tenant("acme", requests_per_minute=2, tokens_per_minute=1000)
    await limiter.check(tenant, 10)
    await limiter.check(tenant, 10)
    with pytest.raises(OpenAIError):
        await limiter.check(tenant, 10)
    await RedisPrefixIndex(redis_cluster.url, ns, connections=conn, shard_groups=3).flush()
    await conn.close()


async def test_the_cluster_client_packs_with_hiredis_on_every_node(grouped):
    """The cluster client's nodes pack commands with hiredis (router.index.redis
    .cluster_hiredis_packed), as the single Redis client does; the route runs through them."""
    index, load, _ = grouped
    replicas = fleet(index.groups, 2)
    p = PrefixAware()
    chosen, _ = await AtomicRoute(index, load).route("h", 4 * BS, [1, 2, 3, 4], replicas,
                                                      [15.0] * len(replicas),
                                                      **route_kwargs(p, 0.5))
    await load.release("h")
    nodes = index.conn.client().get_nodes()
    assert len(nodes) == 3 and chosen in replicas
    assert all(n.connection_class.__name__ == "HiredisConnection" for n in nodes)
    used = [c for n in nodes for c in n._connections]
    assert used and all(type(c).__name__.startswith("Hiredis") for c in used)


async def test_a_deadline_shorter_than_the_topology_read_does_not_starve_the_client(
        redis_cluster):
    """The cluster client's first topology read (slots, a connection to each master) runs
    in a task of its own: a call whose deadline ends first fails (routing falls back), the
    read goes on, and later calls succeed. When the deadline cancelled the read itself,
    every call started it again and none succeeded. Here the read is made 60 ms slow (a
    loaded process's event loop) against a 20 ms deadline."""
    conn = RedisConnections(redis_cluster.url, 0.02, cluster=True)
    client = conn.client()
    read = client.initialize

    async def slow_read(*args, **kwargs):
        await asyncio.sleep(0.06)
        return await read(*args, **kwargs)

    client.initialize = slow_read
    with pytest.raises(IndexUnavailable):
        await conn.call(lambda c: c.get("k{g0}"))
    ok = 0
    for _ in range(20):
        await asyncio.sleep(0.01)
        try:
            await conn.call(lambda c: c.get("k{g0}"))
            ok += 1
        except IndexUnavailable:
            pass
    assert ok >= 10 and client._initialize is False
    await conn.close()


async def test_a_master_down_fails_its_own_slots_calls_only(tmp_path):
    """With one master of three killed, calls on its slots fail (routing falls back for
    that group) and calls on the other masters' slots go on, after the topology reads the
    failure asks for (each read's connection checks are best-effort)."""
    from loadtest.redis_cluster import LocalRedisCluster

    with LocalRedisCluster(tmp_path, masters=3) as cluster:
        conn = RedisConnections(cluster.url, 0.5, cluster=True)
        # The first topology read of a cluster just formed may take longer than the
        # routing bound on a loaded machine (CI); it goes on, shielded, past a call's bound,
        # so the set-up call is tried again until it is in (at most 10 s).
        for attempt in range(50):
            try:
                await conn.call(lambda c: c.ping())
                break
            except IndexUnavailable:
                if attempt == 49:
                    raise
                await asyncio.sleep(0.2)
        client, by_port = conn.client(), {}
        for i in range(200):
            by_port.setdefault(client.get_node_from_key(f"k{{t{i}}}").port, f"k{{t{i}}}")
        assert sorted(by_port) == sorted(cluster.ports)
        cluster.procs[0].kill()
        cluster.procs[0].wait()
        for _ in range(3):
            for port, key in by_port.items():
                if port == cluster.ports[0]:
                    with pytest.raises(IndexUnavailable):
                        await conn.call(lambda c: c.set(key, 1))
                else:
                    await conn.call(lambda c: c.set(key, 1))
        await conn.close()


async def test_an_unreachable_cluster_raises_index_unavailable():
    conn = RedisConnections("redis://127.0.0.1:1/0", 0.2, cluster=True)
    index = RedisPrefixIndex("redis://127.0.0.1:1/0", "t", connections=conn, shard_groups=3)
    with pytest.raises(IndexUnavailable):
        await index.lookup([1, 2], ["a", "b"])


def test_cluster_settings_need_groups_and_a_url():
    with pytest.raises(ValueError):
        Settings(redis_cluster=True, index_shard_groups=4)
    with pytest.raises(ValueError):
        Settings(redis_url="redis://127.0.0.1:7000", redis_cluster=True)
    with pytest.raises(ValueError):
        Settings(index_shard_groups=0)
    s = Settings(redis_url="redis://127.0.0.1:7000", redis_cluster=True, index_shard_groups=4)
    assert s.index_group_load_factor == 1.25


async def test_the_services_factories_build_the_cluster_mode(redis_cluster):
    """``router.serve.state`` builds the index, the load tracker and the two-level atomic
    decision from the settings alone, on the cluster client."""
    from router.serve import state

    ns = f"t-{uuid.uuid4().hex[:8]}"
    # a deadline a busy machine's Redis meets: a late first script would settle after the
    # second decision and move the first request's predicted entries meanwhile
    settings = Settings(redis_url=redis_cluster.url, redis_cluster=True, index_shard_groups=4,
                        index_group_load_factor=1.5, index_namespace=ns, block_size=BS,
                        redis_timeout_s=2.0)
    core = state.make_routing_core(settings, PrefixAware(random.Random(0)))
    assert core.index.conn.cluster and core.index.groups.count == 4
    assert core.atomic.first_level.load_factor == 1.5
    reps = [ReplicaInfo(f"replica-{k}", {}, {}) for k in range(12)]
    d1 = await core.decide("f1", 40 * BS, list(range(1, 41)), reps)
    d2 = await core.decide("f2", 44 * BS, list(range(1, 41)) + [77, 78, 79], reps)
    assert (d2.replica, d2.reason) == (d1.replica, "cache")
    for rid in ("f1", "f2"):
        await core.load.release(rid)
    assert sum(v.inflight for v in (await core.load.loads([r.replica_id for r in reps]))
               .values()) == 0
    await core.load.close()
    await core.index.flush()


async def test_the_routers_acl_user_is_enough_on_a_cluster(redis_cluster):
    """Every master gets the ACL user of ``router.redis_keys.acl_rules(ns, cluster=True)``
    (the router's commands on its namespace's keys, plus the slot map and command table
    that the cluster client reads when it connects): a decision, KV events, lookups, the
    lease sweep, sessions and rate limits all pass with it, and a key outside the
    namespace is refused."""
    import subprocess

    from router.redis_keys import acl_rules
    from router.routing.sessions import RedisSessionStore
    from router.serve.auth import Tenant
    from router.serve.ratelimit import RateLimiter

    ns = f"t-{uuid.uuid4().hex[:8]}"
    user, password = f"router-{ns}", uuid.uuid4().hex
    for port in redis_cluster.ports:
        subprocess.run(["redis-cli", "-p", str(port), "ACL", "SETUSER", user, "on",
                        f">{password}", *acl_rules(ns, cluster=True)], check=True,
                       capture_output=True)
    url = f"redis://{user}:{password}@127.0.0.1:{redis_cluster.ports[0]}/0"
    conn = RedisConnections(url, 2.0, cluster=True)
    index = RedisPrefixIndex(url, ns, connections=conn, shard_groups=3)
    load = RedisLoadTracker(conn, ns, shard_groups=3)
    atomic = AtomicRoute(index, load, GroupChoice(index.groups))
    replicas = fleet(index.groups, 2)
    try:
        first = list(range(1000, 1040))
        chosen, _ = await atomic.route("acl-1", 40 * BS, first, replicas,
                                       [15.0] * len(replicas),
                                       **route_kwargs(PrefixAware(), 0.5))
        await load.release("acl-1")
        await index.apply_events(chosen, [KVEvent("stored", first, None)])
        assert (await index.lookup(first, replicas))[chosen] == 40
        again, matched = await atomic.route("acl-2", 41 * BS, first + [5], replicas,
                                            [15.0] * len(replicas),
                                            **route_kwargs(PrefixAware(), 0.5))
        assert again == chosen and matched[chosen] == 40
        await load.release("acl-2")
        await load.sweep()
        sessions = RedisSessionStore(conn, ns)
        assert await sessions.pin_first("s", chosen, 60) == chosen
        await RateLimiter(conn, ns).check(Tenant("acme", requests_per_minute=5), 10)
        with pytest.raises(redis.exceptions.NoPermissionError):
            await conn.client(2.0).set("elsewhere:key", "1")
    finally:
        await load.close()
        await index.flush()
        await conn.close()
        for port in redis_cluster.ports:
            subprocess.run(["redis-cli", "-p", str(port), "ACL", "DELUSER", user],
                           capture_output=True)
