"""Benchmarks of the Redis index: lookup time, event ingestion rate, router overhead.

* Lookup: one ``lua/route.lua`` round trip (lookup mode) on the real Redis, p50/p99 over
  repeated requests, for prompts of 1k-128k tokens (block size 32) and 2-64 replicas. The
  index holds, per replica, a prefix of the request of a different length (a realistic
  spread of partial hits), and the request's full prefix is held by one replica (the walk
  goes to the end for it). Also the full atomic decision (``route`` mode: match, score,
  choose, reserve, write predicted entries).
* Ingestion: ``BlockStored`` events written by ``EventFeed``'s batched path
  (``RedisPrefixIndex.apply_events``), blocks per second.
* Router overhead, arrival to dispatch, without the network: validate + render + tokenize +
  hash (``IngressCore.prepare``) + the atomic decision, for chat requests of 1k to 120k
  tokens one at a time, and for 32 concurrent 32k-token requests spread over 1 or more
  ingress processes (docs/fault-cases.md 10.1: routing never waits on a replica's ``/tokenize``; its
  overhead under concurrency is CPU queueing in the ingress, which scales with processes).

* Cluster: decisions/s of the atomic route on a local Redis Cluster of 1, 2 and 3 masters
  started by the benchmark (``loadtest.redis_cluster``), the keys in shard groups
  (``Settings.index_shard_groups``), several client processes at once; Redis time per
  decision summed over the masters (``INFO commandstats``); beside it one plain Redis with
  no groups over the same fleet; and the bytes per block on the cluster.

    python -m loadtest.index_bench            # writes docs/benchmarks.md sections
    python -m loadtest.index_bench --only overhead --processes 1 2 16 --suffix ", 16 cores"
    python -m loadtest.index_bench --only cluster --cluster-processes 4
    python -m loadtest.index_bench --only cluster --masters 0 1 2 3 4 6 --cluster-processes 12 \
        --cluster-no-memory --suffix ", 16-core GPU host"   # a machine with cores to spare
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
import uuid

import redis.asyncio

from loadtest.report import RESULTS, markdown_table, write_benchmark_doc
from loadtest.report import percentile as pct
from router.index.redis import RedisConnections, RedisPrefixIndex
from router.kv_events.wire import EventKind, KVEvent
from router.load.redis import RedisLoadTracker
from router.redis_keys import entries_in
from router.routing.atomic import AtomicRoute
from router.serve import state

BS = 32
BACKGROUND_BLOCKS = 4096  # other prompts' blocks held by every replica
ROUTE_SPAN = 50  # atomic routes measured together, with no INFO between them
NOTES = """Reading: Redis runs on the machine of the benchmark (the line above names it), so
client and server share its cores. *typical*: one replica holds the request's whole prefix
and the others hold other prompts' blocks (a conversation's follow-up turn); *adversarial*:
every replica holds a random-length part of the same prefix, so every candidate's walk is
long. Every replica also holds 4,096 blocks of other prompts, so its Redis hash has the
encoding of a serving engine's (a hash table, not a small listpack whose lookups are
linear). The lookup reads the holders of the prompt's first block, then each listed
candidate's first block and, its blocks being stored after their parents as an engine
stores them (no orphans: router/lua/exact.lua), the end of its exact run by a search of up
to 8 blocks per HMGET, so its cost grows with the listed candidates and the logarithm of
their matched lengths (a replica with orphans is walked, 16 then 64 blocks per HMGET, up to
its first missing block); the atomic route adds the load reservation and the predicted-entry
writes past the chosen replica's fresh run. Ingestion is far above what engines publish (an
H200 prefilling 30k tokens/s at block 16 stores about 2k blocks/s)."""

TURNS_NOTES = """Reading: ``bench_turns`` replays multi-turn chat through the atomic route
with no KV events (every held block is a predicted entry, as with engines that publish
none): each turn reads the candidates' held prefixes, reserves, writes the new blocks'
predicted entries and sweeps expired ones, then releases. Redis time is the scripts' own
(`INFO commandstats`, inner commands included); the HSCAN calls are the sweep's."""


async def bench_lookup(url: str, tokens: int, n_replicas: int, iters: int,
                       scenario: str = "typical") -> dict:
    """``typical``: one replica holds the request's whole prefix, the others other prompts'
    blocks (a conversation's follow-up turn). ``adversarial``: every other replica also holds
    a random-length part of the prefix, so every candidate's walk is long. Every replica also
    holds ``BACKGROUND_BLOCKS`` blocks of other prompts, as a serving engine's cache does
    (an H200 replica holds about 128k blocks of 16 tokens), so the per-replica Redis hashes
    have the encoding they have in production (a hash table, not a small listpack)."""
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    conn = RedisConnections(url, 5.0)
    index = RedisPrefixIndex(url, ns, connections=conn)
    load = RedisLoadTracker(conn, ns)
    rng = random.Random(tokens * 100 + n_replicas)
    n_blocks = tokens // BS
    hashes = [rng.getrandbits(63) for _ in range(n_blocks)]
    replicas = [f"replica-{i:02d}" for i in range(n_replicas)]
    for i, r in enumerate(replicas):
        if i == 0:
            held = hashes
        elif scenario == "adversarial":
            held = hashes[:rng.randrange(0, n_blocks)]
        else:
            held = [rng.getrandbits(63) for _ in range(n_blocks)]
        background = [rng.getrandbits(63) for _ in range(BACKGROUND_BLOCKS)]
        events = [KVEvent(EventKind.STORED, background[k:k + 512], None)
                  for k in range(0, BACKGROUND_BLOCKS, 512)]
        if held:
            events.append(KVEvent(EventKind.STORED, held, None))
        await index.apply_events(r, events)
    lookup_s, route_s = [], []
    stats = redis.asyncio.Redis.from_url(url)
    lookup_us = await script_usec(stats)
    for it in range(iters):
        t0 = time.perf_counter()
        await index.lookup(hashes, replicas)
        lookup_s.append(time.perf_counter() - t0)
    lookup_us = (await script_usec(stats)) - lookup_us
    atomic = AtomicRoute(index, load)

    async def route(request_id: str) -> None:
        await atomic.route(request_id, tokens, hashes, replicas, [15.0] * n_replicas,
                           block_size=BS, prefill_rate=20000.0, work_weight=1.0,
                           decode_step_s_per_seq=3e-5, step_token_budget=8192, tie_abs_s=0.002,
                           tie_rel=0.05, u=rng.random())

    route_us = 0.0
    for it in range(iters):
        before = await script_usec(stats)  # the release below runs a script too
        t0 = time.perf_counter()
        await route(f"q{it}")
        route_s.append(time.perf_counter() - t0)
        route_us += (await script_usec(stats)) - before
        await load.release(f"q{it}")
    # the same routes in spans of ROUTE_SPAN with no INFO between them (the INFO around
    # each call above adds to the call it measures), each span's requests released after it
    # (so up to ROUTE_SPAN of them are in flight during a span)
    span_us = 0.0
    for s0 in range(0, iters, ROUTE_SPAN):
        ids = [f"s{k}" for k in range(s0, min(s0 + ROUTE_SPAN, iters))]
        before = await script_usec(stats)
        for rid in ids:
            await route(rid)
        span_us += (await script_usec(stats)) - before
        for rid in ids:
            await load.release(rid)
    await stats.aclose()
    await load.close()
    await index.flush()
    await conn.close()
    return {"tokens": tokens, "replicas": n_replicas, "iters": iters, "scenario": scenario,
            "lookup_p50_ms": pct(lookup_s, 0.5) * 1e3, "lookup_p99_ms": pct(lookup_s, 0.99) * 1e3,
            "route_p50_ms": pct(route_s, 0.5) * 1e3, "route_p99_ms": pct(route_s, 0.99) * 1e3,
            "lookup_redis_us": lookup_us / iters, "route_redis_us": route_us / iters,
            "route_span_redis_us": span_us / iters}


# The conversations' shapes of ``bench_turns``: the block size (tokens), the blocks a
# conversation starts with, how many of the conversations share them (a system prompt),
# the blocks each turn adds, and the length past which a conversation starts again.
TURN_SHAPES = {
    # 40 blocks of 32 tokens growing by 3 a turn, cut back to 40 past 100
    "default": dict(block_size=BS, start_blocks=40, share=1, turn_blocks=3, max_blocks=100),
    # loadtest.router_throughput's: a system prompt of 1,200 tokens shared by 4
    # conversations, then 8 turns of about 200 tokens (an MT-Bench question and a 100-token
    # answer), at vLLM's block size of 16: 75 blocks growing by 13 a turn, cut back to 75
    # past 179 (127 blocks on average)
    "chat2k": dict(block_size=16, start_blocks=75, share=4, turn_blocks=13, max_blocks=179),
}


async def bench_turns(url: str, turns: int = 3000, conversations: int = 32,
                      n_replicas: int = 8, ttl_s: float = 120.0, seed: int = 1,
                      shape: str = "default") -> dict:
    """Multi-turn chat replayed through the atomic route, as a fleet without KV events sees
    it (every held block a predicted entry): ``conversations`` of the ``TURN_SHAPES``
    ``shape`` (by default 40 blocks, 1,280 tokens, growing by 3 blocks a turn, cut back to
    40 past 100), each turn routed over ``n_replicas`` and released. Per turn: the Redis
    time of the route and the release (``script_usec``, us), the ``HSCAN`` calls of the
    predicted entries' sweep, and the ``HMGET`` calls and their own Redis time (the
    candidates' walks inside the route script, and its one read of the candidates' loads;
    ``INFO commandstats``); at the end the predicted fields held (``HLEN``). ``ttl_s``: the
    predicted entries' TTL (s)."""
    sh = TURN_SHAPES[shape]
    bs, start, grow, cut = (sh["block_size"], sh["start_blocks"], sh["turn_blocks"],
                            sh["max_blocks"])
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    conn = RedisConnections(url, 5.0)
    index = RedisPrefixIndex(url, ns, connections=conn)
    load = RedisLoadTracker(conn, ns)
    atomic = AtomicRoute(index, load)
    rng = random.Random(seed)
    replicas = [f"replica-{i:02d}" for i in range(n_replicas)]
    heads = [[rng.getrandbits(63) for _ in range(start)]
             for _ in range(-(-conversations // sh["share"]))]
    convs = [list(heads[c // sh["share"]]) for c in range(conversations)]
    stats = redis.asyncio.Redis.from_url(url)

    async def inner() -> tuple[int, int, float]:
        """HSCAN calls (the sweep's), HMGET calls and their Redis time (us: the walks' and
        the load reads')."""
        info = await stats.info("commandstats")
        hmget = info.get("cmdstat_hmget", {})
        return (int(info.get("cmdstat_hscan", {}).get("calls", 0)),
                int(hmget.get("calls", 0)), float(hmget.get("usec", 0)))

    us0, (scans0, hmgets0, hmget_us0) = await script_usec(stats), await inner()
    for k in range(turns):
        conv = convs[k % conversations]
        conv.extend(rng.getrandbits(63) for _ in range(grow))
        if len(conv) > cut:
            del conv[start:]
        await atomic.route(f"q{k}", len(conv) * bs, list(conv), replicas,
                           [ttl_s] * n_replicas, block_size=bs, prefill_rate=20000.0,
                           work_weight=1.0, decode_step_s_per_seq=3e-5,
                           step_token_budget=8192, tie_abs_s=0.002, tie_rel=0.05,
                           u=rng.random())
        await load.release(f"q{k}")
    us = (await script_usec(stats)) - us0
    scans, hmgets, hmget_us = await inner()
    scans, hmgets, hmget_us = scans - scans0, hmgets - hmgets0, hmget_us - hmget_us0
    fields = 0
    for r in replicas:
        fields += entries_in(await stats.hlen(index.keys.predicted(r)))
    await stats.aclose()
    await load.close()
    await index.flush()
    await conn.close()
    return {"turns": turns, "conversations": conversations, "replicas": n_replicas,
            "ttl_s": ttl_s, "shape": shape, "redis_us_per_turn": us / turns, "hscan_calls": scans,
            "hmget_calls_per_turn": hmgets / turns, "hmget_us_per_turn": hmget_us / turns,
            "predicted_fields": fields}


async def script_usec(client) -> float:
    """Microseconds Redis has spent running scripts since its start (``INFO commandstats``:
    the ``usec`` of ``evalsha`` and ``eval``; a script's inner commands are inside it). The
    difference over a span in which only the benchmark's scripts ran is their Redis CPU."""
    info = await client.info("commandstats")
    return float(sum(info.get(f"cmdstat_{c}", {}).get("usec", 0) for c in ("evalsha", "eval")))


async def bench_ingestion(url: str, blocks: int = 200_000, per_event: int = 16,
                          per_write: int = 2000, per_prompt: int = 128) -> dict:
    """``BlockStored`` events into one replica's entries as an engine publishes them:
    prompts of ``per_prompt`` blocks, each stored in events of ``per_event`` blocks, the
    first from block 0 and each next one after the last block of the one before (so every
    block is stored after a held parent, as vLLM stores them), ``per_write`` blocks per
    ``apply_events`` call. Returns blocks per second, the span (s) and the Redis time per
    block (us, ``INFO commandstats``: the scripts' time over the span)."""
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    index = RedisPrefixIndex(url, ns, timeout_s=30.0)
    stats = redis.asyncio.Redis.from_url(url)
    rng = random.Random(1)
    events = []
    for _ in range(blocks // per_prompt):
        prompt = [rng.getrandbits(63) for _ in range(per_prompt)]
        events += [KVEvent(EventKind.STORED, prompt[k:k + per_event],
                           prompt[k - 1] if k else None)
                   for k in range(0, per_prompt, per_event)]
    usec = await script_usec(stats)
    t0 = time.perf_counter()
    batch: list[KVEvent] = []
    n = 0
    for ev in events:
        batch.append(ev)
        n += len(ev.block_hashes)
        if n >= per_write:
            await index.apply_events("replica-00", batch)
            batch, n = [], 0
    if batch:
        await index.apply_events("replica-00", batch)
    dt = time.perf_counter() - t0
    usec = await script_usec(stats) - usec
    await stats.aclose()
    await index.flush()
    await index.close()
    return {"blocks": blocks, "blocks_per_event": per_event, "blocks_per_write": per_write,
            "blocks_per_prompt": per_prompt, "seconds": dt, "blocks_per_s": blocks / dt,
            "redis_us_per_block": usec / blocks}


async def bench_memory(url: str, blocks: int = 160_000, cluster: bool = False,
                       shard_groups: int | None = None) -> dict:
    """Redis memory per block of one replica's entries: ``blocks`` exact entries (applied
    as ``BlockStored`` events of 16 blocks) and as many predicted ones, each hash measured
    with ``MEMORY USAGE <key> SAMPLES 0`` (every field counted). 160k blocks is an H200
    replica's KV cache of a 7B model at block 16 (about 2.5 M tokens). ``cluster`` /
    ``shard_groups``: the same on a Redis Cluster node, the keys in shard groups."""
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    index = RedisPrefixIndex(url, ns, connections=RedisConnections(url, 30.0, cluster=cluster),
                             shard_groups=shard_groups)
    rng = random.Random(2)
    hashes = [rng.getrandbits(64) for _ in range(blocks)]
    events = [KVEvent(EventKind.STORED, hashes[k:k + 16], hashes[k - 1] if k else None)
              for k in range(0, blocks, 16)]
    for k in range(0, len(events), 125):
        await index.apply_events("replica-00", events[k:k + 125])
    for k in range(0, blocks, 4096):
        await index.record_predicted("replica-00", hashes[k:k + 4096], 600.0)
    client = index.conn.client()
    keys = index.keys_of("replica-00")
    exact = await client.memory_usage(keys.exact("replica-00"), samples=0)
    predicted = await client.memory_usage(keys.predicted("replica-00"), samples=0)
    await index.flush()
    await index.close()
    return {"blocks": blocks, "exact_bytes_per_block": exact / blocks,
            "predicted_bytes_per_block": predicted / blocks}


async def bench_overhead(url: str, tokens: int, iters: int, unique: bool = False) -> dict:
    """Arrival to dispatch of chat requests of about ``tokens`` tokens, one at a time.
    ``unique``: every request has its own system prompt (nothing to reuse); otherwise they
    share one and differ in the question (a system prompt or a conversation's earlier turns:
    the tokenizer pieces and block digests of the shared part are reused)."""
    from deploy.make_model import ensure_model
    from router.config import DEFAULT_MODEL_DIR as MODEL_DIR
    from router.config import Settings
    from router.policy import PrefixAware
    from router.prompt.render import CHAT_PATH
    from router.routing.core import RoutingCore, route_request
    from router.routing.replica import ReplicaInfo
    from router.serve.ingress import IngressCore
    ensure_model(MODEL_DIR)
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    settings = Settings(model=str(MODEL_DIR), redis_url=url, index_namespace=ns,
                        redis_timeout_s=1.0)
    ingress = IngressCore(settings, engine_handle=None)
    conn = RedisConnections(url, 1.0)
    index, load = RedisPrefixIndex(url, ns, connections=conn), RedisLoadTracker(conn, ns)
    core = RoutingCore(settings, index, load, PrefixAware(random.Random(0)),
                       atomic=AtomicRoute(index, load))
    replicas = [ReplicaInfo(f"replica-{i}", {}, {}) for i in range(8)]
    state.put("replica_infos", tuple(replicas))  # as Serve's router (state.replica_infos)
    shared = text_of(tokens, "overhead", ingress.renderer.tokenizer)
    prepare_s, decide_s, total_s, sizes = [], [], [], []
    for i in range(iters):
        system = text_of(tokens, f"overhead-{i}", ingress.renderer.tokenizer) if unique \
            else shared
        body = json.dumps({"model": "tiny-qwen2", "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": f"question {i}"}]}).encode()
        t0 = time.perf_counter()
        req = await ingress.prepare(CHAT_PATH, body)
        t1 = time.perf_counter()
        await route_request(core, req, replicas, core.policy)
        t2 = time.perf_counter()
        await core.load.release(req.request_id)
        prepare_s.append(t1 - t0)
        decide_s.append(t2 - t1)
        total_s.append(t2 - t0)
        sizes.append(len(ingress.renderer.tokenizer.apply_chat_template(  # exact, uncached
            json.loads(body)["messages"], tokenize=True, add_generation_prompt=True,
            return_dict=False)))
    await core.index.flush()
    return {"tokens": int(statistics.median(sizes)), "replicas": 8, "iters": iters,
            "unique": unique,
            "prepare_p50_ms": pct(prepare_s, 0.5) * 1e3, "prepare_p99_ms": pct(prepare_s, 0.99) * 1e3,
            "decide_p50_ms": pct(decide_s, 0.5) * 1e3, "decide_p99_ms": pct(decide_s, 0.99) * 1e3,
            "total_p50_ms": pct(total_s, 0.5) * 1e3, "total_p99_ms": pct(total_s, 0.99) * 1e3}


async def bench_shadow(url: str, tokens: int = 8192, n_replicas: int = 8,
                       iters: int = 1000) -> dict:
    """The cost of shadow evaluation (``router.routing.shadow``): ``RoutingCore.decide`` on
    the Redis atomic path, ``tokens``-token follow-up turns over ``n_replicas`` replicas,
    without shadow and with every decision sampled (the default shadow policies), in
    alternating blocks of 50 on the same state; p50 of each (ms) and the added time per
    sampled decision and per decision at the default sample rate."""
    from router.config import Settings
    from router.policy import PrefixAware
    from router.routing.core import RoutingCore
    from router.routing.replica import ReplicaInfo
    from router.serve.state import make_shadow
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    settings = Settings(redis_url=url, index_namespace=ns, shadow_sample_rate=1.0)
    conn = RedisConnections(url, 5.0)
    index, load = RedisPrefixIndex(url, ns, connections=conn), RedisLoadTracker(conn, ns)
    reps = [ReplicaInfo(f"replica-{i:02d}", {}, {}) for i in range(n_replicas)]
    plain = RoutingCore(settings, index, load, PrefixAware(random.Random(0)),
                        atomic=AtomicRoute(index, load))
    shadowed = RoutingCore(settings, index, load, PrefixAware(random.Random(0)),
                           atomic=AtomicRoute(index, load), shadow=make_shadow(settings))
    bs = settings.block_size
    rng = random.Random(4)
    convs = [[rng.getrandbits(63) for _ in range(tokens // bs)] for _ in range(16)]
    times: dict[str, list[float]] = {"off": [], "on": []}
    for k in range(iters):
        mode = "on" if (k // 50) % 2 else "off"
        core = shadowed if mode == "on" else plain
        hashes = convs[k % len(convs)]
        t0 = time.perf_counter()
        await core.decide(f"s{k}", len(hashes) * bs + 7, hashes, reps)
        times[mode].append(time.perf_counter() - t0)
        await load.release(f"s{k}")
    await load.close()
    await index.flush()
    await conn.close()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    return {"tokens": tokens, "replicas": n_replicas, "iters": iters,
            "off_p50_ms": off * 1e3, "on_p50_ms": on * 1e3, "added_ms": (on - off) * 1e3,
            "default_rate": Settings().shadow_sample_rate,
            "added_ms_at_default": (on - off) * 1e3 * Settings().shadow_sample_rate}


def text_of(tokens: int, seed: str, tokenizer) -> str:
    """Deterministic text of exactly ``tokens`` tokens of ``tokenizer`` (one encode)."""
    from tests.conftest import make_text
    ids = tokenizer.encode(make_text(tokens, seed), add_special_tokens=False)
    while len(ids) < tokens:  # make_text sizes by characters: grow until long enough
        ids = ids + ids
    return tokenizer.decode(ids[:tokens])


def _concurrent_worker(url: str, ns: str, tokens: int, share: int, worker: int,
                       barrier, results) -> None:
    """One ingress process of ``bench_concurrent``: prepares its tokenizer and Redis
    connection, waits at ``barrier``, then takes ``share`` requests that all arrive at once
    and puts each one's arrival-to-dispatch time (s) on ``results``."""
    from router.config import DEFAULT_MODEL_DIR as MODEL_DIR
    from router.config import Settings
    from router.policy import PrefixAware
    from router.prompt.render import CHAT_PATH
    from router.routing.core import RoutingCore, route_request
    from router.routing.replica import ReplicaInfo
    from router.serve.ingress import IngressCore

    settings = Settings(model=str(MODEL_DIR), redis_url=url, index_namespace=ns,
                        redis_timeout_s=5.0)
    ingress = IngressCore(settings, engine_handle=None)
    conn = RedisConnections(url, 5.0)
    index, load = RedisPrefixIndex(url, ns, connections=conn), RedisLoadTracker(conn, ns)
    core = RoutingCore(settings, index, load, PrefixAware(random.Random(worker)),
                       atomic=AtomicRoute(index, load))
    replicas = [ReplicaInfo(f"replica-{i}", {}, {}) for i in range(8)]
    state.put("replica_infos", tuple(replicas))  # as Serve's router (state.replica_infos)
    bodies = [json.dumps({"model": "tiny-qwen2", "messages": [
        {"role": "system", "content": text_of(tokens, f"concurrent-{worker}-{i}",
                                              ingress.renderer.tokenizer)},
        {"role": "user", "content": "question"}]}).encode() for i in range(share)]

    async def one(body: bytes, t_arrival: float) -> tuple[float, float]:
        req = await ingress.prepare(CHAT_PATH, body)
        t1 = time.perf_counter()
        await route_request(core, req, replicas, core.policy)
        t2 = time.perf_counter()
        return t2 - t_arrival, t2 - t1

    async def run() -> list[tuple[float, float]]:
        # warm the template, the tokenizer, the script cache and as many Redis connections
        # as a warm router under this load keeps in its pool
        req = await ingress.prepare(CHAT_PATH, bodies[0])
        await route_request(core, req, replicas, core.policy)
        await core.load.release(req.request_id)
        await asyncio.gather(*(core.index.lookup(req.block_hashes, ["replica-0"])
                               for _ in bodies))
        barrier.wait()
        t0 = time.perf_counter()
        return await asyncio.gather(*(one(b, t0) for b in bodies))

    results.put(asyncio.run(run()))


def bench_concurrent(url: str, tokens: int, concurrency: int, processes: int) -> dict:
    """``concurrency`` chat requests of about ``tokens`` tokens arriving at once, spread
    evenly over ``processes`` ingress processes (as Ray Serve spreads them over ingress
    replicas); arrival-to-dispatch p50/p99 (ms). Each process tokenizes its requests one
    after another (the renderer holds a lock; a long prompt's chunks are encoded on the
    tokenizer's thread pool), so the p99 is bounded below by the total tokenization work
    over the cores the processes get."""
    import multiprocessing as mp
    import os

    from deploy.make_model import ensure_model
    from router.config import DEFAULT_MODEL_DIR as MODEL_DIR
    ensure_model(MODEL_DIR)
    ctx = mp.get_context("spawn")
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    barrier, results = ctx.Barrier(processes), ctx.Queue()
    shares = [concurrency // processes + (k < concurrency % processes)
              for k in range(processes)]
    procs = [ctx.Process(target=_concurrent_worker,
                         args=(url, ns, tokens, shares[k], k, barrier, results))
             for k in range(processes)]
    for p in procs:
        p.start()
    pairs = [t for _ in procs for t in results.get(timeout=600)]
    times, decide = [t for t, _ in pairs], [d for _, d in pairs]
    for p in procs:
        p.join()
    asyncio.run(RedisPrefixIndex(url, ns).flush())
    return {"tokens": tokens, "concurrency": concurrency, "processes": processes,
            "cores": os.cpu_count(), "p50_ms": pct(times, 0.5) * 1e3,
            "p99_ms": pct(times, 0.99) * 1e3, "decide_p50_ms": pct(decide, 0.5) * 1e3,
            "decide_p99_ms": pct(decide, 0.99) * 1e3}


OVERHEAD_NOTES = """Reading: routing never calls a replica (no ``/tokenize`` round trip): the
ingress renders, tokenizes and hashes in its own process, then makes one Redis round trip
(two for a long prompt: the head's lookup, then the decision). A prompt of its own is
tokenized only up to its head (``route_head_chars``, 2048 characters): no replica holds
the head, so none can match past it, and the rest is left to the engine; that is why the
"each its own" rows barely grow with the prompt. A prompt that shares a system prompt or
earlier turns with a recent request takes the shared pieces' token ids and the shared
blocks' digests from caches (``router.prompt.segments.SegmentEncoder``,
``router.hashing.BlockHasher``) and pays for its new part; its head is held, so it is
tokenized whole, and the p99 of those rows is the second request (the first one to find
the head held, which encodes the whole shared prefix once). Under N requests arriving at
once the work is CPU-bound, so the last one waits for about N renders over the cores the
ingress processes get: the ratio to the single-request time is about N / cores whatever
the per-request cost, and only more cores lower it. Renders take turns in arrival order
with the index answers in between (``IngressCore._cpu_turn``), so the first of a burst is
dispatched after a few renders, not after all of them."""


SHADOW_NOTES = """Reading: ``RoutingCore.decide`` on the Redis atomic path (one script per
decision), Redis on the same machine. A sampled decision adds one load read (a Redis round
trip, before the script, so the shadow policies see the state without this request), a
copy of the live policy and the shadow policies' choices (``round_robin``,
``least_loaded`` and the live ``prefix_aware``'s copy). At the default sample rate the
added time per decision is the last column; ``router_shadow_seconds_total`` counts the same
time on a live router."""


def overhead_text(overhead: list[dict], concurrent: list[dict]) -> str:
    """The Markdown of the overhead results (``bench_overhead`` rows, ``bench_concurrent``
    rows)."""
    single = next(o for o in overhead if o["tokens"] >= 30000 and o["unique"]
                  )["total_p50_ms"]
    ov = ["| prompt tokens | prompts | validate+render+tokenize+hash p50 / p99 (ms) | "
          "decision p50 / p99 (ms) | arrival to dispatch p50 / p99 (ms) |",
          "|---|---|---|---|---|"]
    for o in overhead:
        kind = "each its own" if o["unique"] else "shared system prompt"
        ov.append(f"| {o['tokens']} | {kind} | {o['prepare_p50_ms']:.2f} / "
                  f"{o['prepare_p99_ms']:.2f}"
                  f" | {o['decide_p50_ms']:.2f} / {o['decide_p99_ms']:.2f} | "
                  f"{o['total_p50_ms']:.2f} / {o['total_p99_ms']:.2f} |")
    cc = ["| concurrent 32k requests | ingress processes | cores | p50 (ms) | p99 (ms) | "
          "p99 / single p50 |", "|---|---|---|---|---|---|"]
    for c in concurrent:
        cc.append(f"| {c['concurrency']} | {c['processes']} | {c['cores']} | "
                  f"{c['p50_ms']:.0f} | {c['p99_ms']:.0f} | {c['p99_ms'] / single:.1f} |")
    text = ("One request at a time, 8 replicas, atomic decision on the real Redis:\n\n"
            + "\n".join(ov) + f"\n\n32 requests of about 32k tokens arriving at once "
            f"(each its own; single-request p50 above: {single:.1f} ms):\n\n" + "\n".join(cc))
    return text


CLUSTER_GROUPS = 6  # shard groups: 2, 3 or 6 per master at 3, 2 or 1 masters
CLUSTER_PER_GROUP = 8  # replicas per group: 48 in the fleet
CLUSTER_PREFIX_BLOCKS = 248  # a conversation's history: 7,936 tokens at block 32
CLUSTER_NEW_BLOCKS = 8  # its new turn: the prompt is 8,192 tokens
CLUSTER_CONVERSATIONS = 192


def cluster_fleet(groups, per_group: int) -> list[str]:
    """``per_group`` replica ids in each group of ``groups`` (``ShardGroups``): the first
    ids ``replica-<k>`` that fall in it."""
    out: dict[int, list[str]] = {g: [] for g in range(groups.count)}
    k = 0
    while any(len(v) < per_group for v in out.values()):
        r = f"replica-{k:03d}"
        if len(out[groups.group_of(r)]) < per_group:
            out[groups.group_of(r)].append(r)
        k += 1
    return [r for g in sorted(out) for r in out[g]]


def _cluster_worker(url: str, cluster: bool, ns: str, groups: int | None, seconds: float,
                    concurrency: int, worker: int, ready, go, results) -> None:
    """One router process of ``bench_cluster``: ``concurrency`` clients, each deciding a
    follow-up turn of a random conversation (``route.lua`` over the whole fleet: with
    groups, the first level picks the group) and releasing it, again and again for
    ``seconds`` after ``go`` (``ready`` once warm); puts (decisions, route latencies in s, the process's CPU
    seconds over that window) on ``results``."""
    from router.redis_keys import ShardGroups

    layout = ShardGroups(ns, groups)
    replicas = cluster_fleet(layout, CLUSTER_PER_GROUP) if groups else \
        cluster_fleet(ShardGroups(ns, CLUSTER_GROUPS), CLUSTER_PER_GROUP)
    convs = [[random.Random(f"conv-{c}").getrandbits(63) for _ in range(CLUSTER_PREFIX_BLOCKS)]
             for c in range(CLUSTER_CONVERSATIONS)]
    ttls = [15.0] * len(replicas)
    kw = dict(block_size=BS, prefill_rate=20000.0, work_weight=1.0,
              decode_step_s_per_seq=3e-5, step_token_budget=8192, tie_abs_s=0.002,
              tie_rel=0.05)

    async def run() -> tuple[int, list[float], float]:
        conn = RedisConnections(url, 5.0, cluster=cluster)
        index = RedisPrefixIndex(url, ns, connections=conn, shard_groups=groups)
        load = RedisLoadTracker(conn, ns, shard_groups=groups)
        atomic = AtomicRoute(index, load)
        rng = random.Random(worker)
        # warm: the script cache, and a connection per client to every master; the first
        # decision alone (see _prepare_cluster_index: concurrent first connections on a
        # cluster lost some)
        await atomic.route(f"warm-{worker}", 64, [0], replicas, ttls, u=0.5, **kw)
        await load.release(f"warm-{worker}")
        for c in range(concurrency):
            await asyncio.gather(*(atomic.route(f"warm-{worker}-{c}-{k}", 64, [k], replicas,
                                                ttls, u=0.5, **kw) for k in range(8)))
            for k in range(8):
                await load.release(f"warm-{worker}-{c}-{k}")
        ready.wait()
        go.wait()  # the parent has read the masters' counters in between
        cpu0 = time.process_time()
        t_end = time.perf_counter() + seconds
        lat: list[float] = []

        async def client(c: int) -> int:
            n = 0
            while time.perf_counter() < t_end:
                hashes = rng.choice(convs) + [rng.getrandbits(63)
                                              for _ in range(CLUSTER_NEW_BLOCKS)]
                rid = f"w{worker}-{c}-{n}"
                t0 = time.perf_counter()
                await atomic.route(rid, len(hashes) * BS, hashes, replicas, ttls,
                                   u=rng.random(), **kw)
                lat.append(time.perf_counter() - t0)
                await load.release(rid)
                n += 1
            return n

        counts = await asyncio.gather(*(client(c) for c in range(concurrency)))
        cpu = time.process_time() - cpu0
        await load.close()
        await conn.close()
        return sum(counts), lat, cpu

    results.put(asyncio.run(run()))


async def _prepare_cluster_index(url: str, cluster: bool, ns: str,
                                 groups: int | None) -> None:
    """Every replica holds ``BACKGROUND_BLOCKS`` blocks of other prompts; each conversation
    is held (exact entries, from KV events) by one replica of the group its first block's
    rendezvous order puts first (where any router's first level sends it while that group
    is within its load bound), round-robin within the group."""
    from router.redis_keys import ShardGroups
    from router.routing.groups import GroupChoice

    layout = ShardGroups(ns, groups)
    fleet_layout = layout if groups else ShardGroups(ns, CLUSTER_GROUPS)
    replicas = cluster_fleet(fleet_layout, CLUSTER_PER_GROUP)
    index = RedisPrefixIndex(url, ns, connections=RedisConnections(url, 30.0, cluster=cluster),
                             shard_groups=groups)
    rng = random.Random(3)
    events: dict[str, list[KVEvent]] = {r: [] for r in replicas}
    for r in replicas:
        background = [rng.getrandbits(63) for _ in range(BACKGROUND_BLOCKS)]
        events[r] += [KVEvent(EventKind.STORED, background[k:k + 512], None)
                      for k in range(0, BACKGROUND_BLOCKS, 512)]
    parts = fleet_layout.split(replicas)
    choice = GroupChoice(fleet_layout)
    turn = {g: 0 for g in parts}
    for c in range(CLUSTER_CONVERSATIONS):
        prefix = [random.Random(f"conv-{c}").getrandbits(63)
                  for _ in range(CLUSTER_PREFIX_BLOCKS)]
        g = choice.order(prefix[0].to_bytes(8, "big"), parts)[0]
        holder = parts[g][turn[g] % len(parts[g])]
        turn[g] += 1
        events[holder].append(KVEvent(EventKind.STORED, prefix, None))
    # one replica at a time: on a cluster, redis-py 8.1's client lost connections (MOVED
    # answers, then "Connection lost") when 48 writes opened connections at once, and
    # Python 3.12.3 turns such a lost write into a TypeError that nothing retries
    for r, ev in events.items():
        await index.apply_events(r, ev)
    await index.close()


async def _cluster_script_stats(url: str,
                                cluster: bool) -> dict[str, tuple[float, int, float]]:
    """Per master (``host:port``): (microseconds spent in scripts, script calls, CPU seconds
    of the server process) since its start, from ``INFO commandstats`` (``evalsha`` and
    ``eval``) and ``INFO cpu`` (``used_cpu_user`` + ``used_cpu_sys``)."""
    if cluster:
        from redis.asyncio.cluster import RedisCluster
        client = RedisCluster.from_url(url)
        info = await client.info("commandstats", target_nodes=RedisCluster.PRIMARIES)
        cpu = await client.info("cpu", target_nodes=RedisCluster.PRIMARIES)
        if any(str(k).startswith("cmdstat_") for k in info):  # one master: its own dict
            info = {url: info}
        if "used_cpu_user" in cpu:
            cpu = {url: cpu}
    else:
        client = redis.asyncio.Redis.from_url(url)
        info = {url: await client.info("commandstats")}
        cpu = {url: await client.info("cpu")}
    await client.aclose()
    out = {}
    for node, stats in info.items():
        used = cpu.get(node, {})
        out[str(node)] = (
            float(sum(stats.get(f"cmdstat_{c}", {}).get("usec", 0) for c in ("evalsha", "eval"))),
            int(sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval"))),
            float(used.get("used_cpu_user", 0.0)) + float(used.get("used_cpu_sys", 0.0)))
    return out


def bench_cluster(masters: int, processes: int, concurrency: int, seconds: float,
                  workdir) -> dict:
    """Decisions/s of the atomic route over a fleet of 48 replicas, on a Redis Cluster of
    ``masters`` masters started here with the keys in 6 shard groups (``masters=0``: one
    plain Redis started here, no groups, every replica a candidate of every decision);
    ``processes`` router processes of ``concurrency`` clients each, for ``seconds``.
    Every decision is a follow-up turn of 8,192 tokens of one of 192 conversations, each
    held by one replica, followed by its release. Redis time is summed over the masters."""
    import multiprocessing as mp
    import subprocess
    from pathlib import Path

    from loadtest.redis_cluster import LocalRedisCluster
    from loadtest.service import free_port

    cluster = masters > 0
    groups = CLUSTER_GROUPS if cluster else None
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    workdir = Path(workdir) / f"m{masters}-{ns}"
    workdir.mkdir(parents=True)
    proc = node = None
    if cluster:
        node = LocalRedisCluster(workdir, masters)
        url = node.url
    else:
        port = free_port()
        proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1",
                                 "--save", "", "--appendonly", "no", "--dir", str(workdir)],
                                stdout=subprocess.DEVNULL)
        url = f"redis://127.0.0.1:{port}/0"
        import redis as sync_redis
        for _ in range(100):
            try:
                if sync_redis.Redis.from_url(url).ping():
                    break
            except sync_redis.RedisError:
                time.sleep(0.1)
    try:
        asyncio.run(_prepare_cluster_index(url, cluster, ns, groups))
        ctx = mp.get_context("spawn")
        ready, go = ctx.Barrier(processes + 1), ctx.Barrier(processes + 1)
        results = ctx.Queue()
        procs = [ctx.Process(target=_cluster_worker,
                             args=(url, cluster, ns, groups, seconds, concurrency, k,
                                   ready, go, results)) for k in range(processes)]
        for p in procs:
            p.start()
        ready.wait(timeout=300)  # every worker warm
        # read before the start, so the counters cover the whole window
        before = asyncio.run(_cluster_script_stats(url, cluster))
        go.wait(timeout=60)
        t0 = time.perf_counter()
        got = [results.get(timeout=seconds + 300) for _ in procs]
        wall = time.perf_counter() - t0
        after = asyncio.run(_cluster_script_stats(url, cluster))
        for p in procs:
            p.join()
    finally:
        if node is not None:
            node.stop()
        if proc is not None:
            proc.kill()
            proc.wait()
    decisions = sum(n for n, _, _ in got)
    lat = [x for _, ls, _ in got for x in ls]
    usec = {k: after[k][0] - before[k][0] for k in after}
    calls = {k: after[k][1] - before[k][1] for k in after}
    server_cpu = {k: after[k][2] - before[k][2] for k in after}
    redis_us = sum(usec.values()) / decisions
    busiest = max(usec.values()) / (seconds * 1e6)
    return {"masters": masters, "groups": groups, "replicas": CLUSTER_PER_GROUP * CLUSTER_GROUPS,
            "processes": processes, "concurrency": concurrency, "seconds": seconds,
            "wall_s": wall, "decisions": decisions, "decisions_per_s": decisions / seconds,
            "route_p50_ms": pct(lat, 0.5) * 1e3, "route_p99_ms": pct(lat, 0.99) * 1e3,
            "redis_us_per_decision": redis_us,
            "script_calls_per_master": sorted(calls.values()),
            "busiest_master_busy": busiest,
            "redis_bound_decisions_per_s": max(masters, 1) * 1e6 / redis_us,
            # CPU over the measured window, as a share of one core: the router processes'
            # mean, and the busiest master's (its whole process, scripts and network)
            "client_cpu_per_process": statistics.mean(c for _, _, c in got) / seconds,
            "busiest_master_cpu": max(server_cpu.values()) / wall,
            "master_cpu": sorted(v / wall for v in server_cpu.values()),
            "cores": __import__("os").cpu_count()}


CLUSTER_NOTES = """Reading: each row starts its own Redis (a plain one; or a cluster of
masters from `redis-server --cluster-enabled yes` and `redis-cli --cluster create`, slots
split evenly) on this machine, and the router processes run beside it: where the machine
has fewer cores than router processes plus masters (**the 2-core VM**), clients and
servers share the cores, so the decisions/s measured are bounded by the machine, not by
Redis, and do not grow with the masters. The CPU columns (where present; over the measured
window, as a share of one core) say which side ran out: a router process near 100 % makes
the rate the clients', a master near 100 % (its whole process: scripts, parsing, network)
the shard's. The columns that
show what sharding buys are the Redis time per decision (all masters' script time, `INFO
commandstats`, over the decisions: a route and its release) and the share of the run the
busiest master spent in scripts; *Redis-bound ceiling* is masters x 1 s / Redis time per
decision, the rate at which the masters themselves would saturate with enough client cores
(it assumes the groups' load even over the masters, which the script calls per master
show). With groups, a decision's candidates are one group's 8 replicas, not the fleet's
48: that, more than the masters, is what makes a decision cheaper in Redis. Each decision
is a follow-up turn of 8,192 tokens (block 32) of one of 192 conversations, each held
whole by one replica (from KV events); every replica also holds 4,096 blocks of other
prompts."""


def cluster_text(rows: list[dict], memory: dict | None, memory_one: dict | None = None) -> str:
    """The docs/benchmarks.md section of ``--only cluster``."""
    cpu = any("client_cpu_per_process" in r for r in rows)
    table = ["| Redis | shard groups | replicas (candidates per decision) | router processes x "
             "clients | decisions/s | route p50 (ms) | route p99 (ms) | Redis time per "
             "decision (us, all masters) | busiest master in scripts | script calls per "
             "master | Redis-bound ceiling (decisions/s) |"
             + (" CPU per router process | busiest master's CPU |" if cpu else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|" + ("---|---|" if cpu else "")]
    for r in rows:
        what = "one Redis, no groups" if r["masters"] == 0 else f"cluster, {r['masters']} " \
            f"master{'s' if r['masters'] > 1 else ''}"
        cands = r["replicas"] if r["masters"] == 0 else CLUSTER_PER_GROUP
        table.append(f"| {what} | {r['groups'] or '-'} | {r['replicas']} ({cands}) | "
                     f"{r['processes']} x {r['concurrency']} | {r['decisions_per_s']:,.0f} | "
                     f"{r['route_p50_ms']:.2f} | {r['route_p99_ms']:.2f} | "
                     f"{r['redis_us_per_decision']:.0f} | {r['busiest_master_busy']:.0%} | "
                     f"{' / '.join(f'{c:,}' for c in r['script_calls_per_master'])} | "
                     f"{r['redis_bound_decisions_per_s']:,.0f} |"
                     + (f" {r.get('client_cpu_per_process', 0):.0%} | "
                        f"{r.get('busiest_master_cpu', 0):.0%} |" if cpu else ""))
    text = "\n".join(table)
    if memory:
        text += (f"\n\nRedis memory per block on the cluster ({memory['blocks']:,} blocks of "
                 f"one replica, `MEMORY USAGE`, keys in shard groups): exact entry "
                 f"{memory['exact_bytes_per_block']:.1f} bytes, predicted entry "
                 f"{memory['predicted_bytes_per_block']:.1f} bytes")
        if memory_one:
            text += (f"; on one Redis in the same run (`--redis-url`), "
                     f"{memory_one['exact_bytes_per_block']:.1f} and "
                     f"{memory_one['predicted_bytes_per_block']:.1f} bytes")
        text += "."
    return text


CALLS_NOTES = """Reading: `RedisConnections.call` against `call_or_leave` (the route
script's call: a task per call, so that a call past the routing bound is left running and
settled, docs/fault-cases.md 8.3) on one connection, a PING each, in alternating blocks of 200
on one event loop so that both see the same machine load; the medians and the added time per
call. A routed request makes one such call. *Guarded*: `call` on connections with the
key-layout guard of a namespace (`router.index.layout`, as every router process has: each
call first asks it, and one call every 5 s also renews the layout's presence), in the same
rotation."""


async def bench_calls(url: str, iters: int = 30000, block: int = 200) -> dict:
    """Time per Redis call (us) through ``RedisConnections.call``, ``call_or_leave`` and
    ``call`` with the key-layout guard (``layout_namespace``), ``iters`` PINGs in blocks of
    ``block`` taking turns; p50 and mean of each, and their differences from ``call``."""
    conn = RedisConnections(url, 1.0)
    ns = f"bench-{uuid.uuid4().hex[:6]}"
    guarded = RedisConnections(url, 1.0, layout_namespace=ns)

    async def ping(client):
        return await client.ping()

    fns = {"call": conn.call, "call_or_leave": conn.call_or_leave, "guarded": guarded.call}
    times: dict[str, list[float]] = {mode: [] for mode in fns}
    for _ in range(block):  # connect and warm every path
        for fn in fns.values():
            await fn(ping)
    modes = list(fns)
    for k in range(iters):
        mode = modes[(k // block) % len(modes)]
        fn = fns[mode]
        t0 = time.perf_counter()
        await fn(ping)
        times[mode].append(time.perf_counter() - t0)
    await conn.call(lambda c: c.delete(f"{ns}:layouts"))
    await conn.close()
    await guarded.close()
    out = {"iters": iters, "block": block}
    for mode, xs in times.items():
        out[f"{mode}_p50_us"] = statistics.median(xs) * 1e6
        out[f"{mode}_mean_us"] = statistics.fmean(xs) * 1e6
    out["added_p50_us"] = out["call_or_leave_p50_us"] - out["call_p50_us"]
    out["added_mean_us"] = out["call_or_leave_mean_us"] - out["call_mean_us"]
    out["guard_added_p50_us"] = out["guarded_p50_us"] - out["call_p50_us"]
    return out


def one_row_table(header: list[str], cells: list) -> str:
    """A markdown table of ``header`` and one row of ``cells`` (as ``str`` gives them)."""
    return markdown_table(header, [cells])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--iters", type=int, default=2000,
                    help="requests per case up to 8k tokens (a tenth of it above): p99 of "
                         "2,000 is the 20th worst, steadier than 300's third worst")
    ap.add_argument("--only", choices=["lookup", "turns", "overhead", "shadow", "cluster", "calls"],
                    default=None)
    ap.add_argument("--cluster-processes", type=int, default=4,
                    help="router processes deciding at once in the cluster benchmark")
    ap.add_argument("--cluster-concurrency", type=int, default=8,
                    help="clients per router process in the cluster benchmark")
    ap.add_argument("--cluster-seconds", type=float, default=10.0,
                    help="measured seconds per row of the cluster benchmark")
    ap.add_argument("--masters", nargs="+", type=int, default=[0, 1, 2, 3],
                    help="cluster sizes of the cluster benchmark (0: one plain Redis)")
    ap.add_argument("--cluster-no-memory", action="store_true",
                    help="skip the cluster benchmark's bytes per block (the same software "
                         "gives the same bytes on any machine; it also needs --redis-url)")
    ap.add_argument("--processes", nargs="+", type=int, default=[1, 2],
                    help="ingress process counts for the 32-way concurrent run")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1024, 8192, 32768, 131072],
                    help="prompt lengths of --only lookup")
    ap.add_argument("--replicas", nargs="+", type=int, default=[2, 8, 32, 64],
                    help="candidate counts of --only lookup")
    ap.add_argument("--turn-shape", choices=sorted(TURN_SHAPES), default="default",
                    help="the multi-turn replay's conversations (TURN_SHAPES)")
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--suffix", default="",
                    help="appended to the docs/benchmarks.md section headings (another "
                         "machine's results beside this one's)")
    a = ap.parse_args(argv)
    cmd = "python -m loadtest.index_bench " + " ".join(argv if argv is not None else
                                                       __import__("sys").argv[1:])
    stamp = int(time.time())
    RESULTS.mkdir(exist_ok=True)
    if a.only in (None, "lookup"):
        rows = []
        for scenario in ("typical", "adversarial"):
            for tokens in a.tokens:
                for n in a.replicas:
                    iters = a.iters if tokens <= 8192 else max(a.iters // 10, 30)
                    row = asyncio.run(bench_lookup(a.redis_url, tokens, n, iters, scenario))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
        ingest = asyncio.run(bench_ingestion(a.redis_url))
        print(json.dumps(ingest), flush=True)
        memory = asyncio.run(bench_memory(a.redis_url))
        print(json.dumps(memory), flush=True)
        (RESULTS / f"index-bench-{stamp}.json").write_text(
            json.dumps({"lookup": rows, "ingestion": ingest, "memory": memory}, indent=1))
        table = ["| scenario | prompt tokens | replicas | lookup p50 (ms) | lookup p99 (ms) | "
                 "atomic route p50 (ms) | atomic route p99 (ms) | Redis time per lookup (us) "
                 "| Redis time per atomic route (us) | the same over spans of "
                 f"{ROUTE_SPAN} (us) |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            table.append(f"| {r['scenario']} | {r['tokens']} | {r['replicas']} | "
                         f"{r['lookup_p50_ms']:.3f} | {r['lookup_p99_ms']:.3f} | "
                         f"{r['route_p50_ms']:.3f} | {r['route_p99_ms']:.3f} | "
                         f"{r['lookup_redis_us']:.1f} | {r['route_redis_us']:.1f} | "
                         f"{r.get('route_span_redis_us', 0.0):.1f} |")
        at8k = [r for r in rows if r["tokens"] == 8192 and r["replicas"] == 8]
        verdict = "; ".join(f"{r['scenario']} {r['lookup_p99_ms']:.2f} ms "
                            f"({'met' if r['lookup_p99_ms'] < 1.0 else 'missed'})" for r in at8k)
        redis_verdict = "; ".join(
            f"{r['scenario']} {r['route_redis_us']:.0f} us "
            f"({'met' if r['route_redis_us'] <= 100 else 'missed'}; over spans "
            f"{r['route_span_redis_us']:.0f} us)" for r in at8k)
        text = ("\n".join(table) + f"\n\nTargets at 8k tokens and 8 replicas: lookup p99 under "
                f"1 ms: {verdict}. Redis time of the atomic route at most 100 us: "
                f"{redis_verdict}.\n\nEvent ingestion into Redis (batched `apply_events`, "
                f"{ingest['blocks_per_event']} blocks per BlockStored, each after its "
                f"prompt's last, prompts of {ingest['blocks_per_prompt']} blocks, "
                f"{ingest['blocks_per_write']} per write): **{ingest['blocks_per_s']:,.0f} "
                f"blocks/s** ({ingest['blocks']} blocks in {ingest['seconds']:.2f} s; Redis "
                f"time {ingest['redis_us_per_block']:.2f} us per block).\n\n"
                f"Redis memory per block ({memory['blocks']:,} blocks of one replica, "
                f"`MEMORY USAGE`): exact entry {memory['exact_bytes_per_block']:.1f} bytes, "
                f"predicted entry {memory['predicted_bytes_per_block']:.1f} bytes.")
        print(text)
        if not a.no_doc:
            write_benchmark_doc("Redis index: lookup and ingestion" + a.suffix, cmd.strip(), text,
                                NOTES)
    if a.only in (None, "turns"):
        row = asyncio.run(bench_turns(a.redis_url, shape=a.turn_shape))
        print(json.dumps(row), flush=True)
        text = one_row_table(
            ["turns", "conversations", "replicas", "predicted TTL (s)",
             "Redis time per turn, route + release (us)", "HMGET calls / time per turn (us)",
             "sweep HSCAN calls", "predicted fields at the end"],
            [row['turns'], row['conversations'], row['replicas'], f"{row['ttl_s']:.0f}",
             f"{row['redis_us_per_turn']:.1f}",
             f"{row['hmget_calls_per_turn']:.1f} / {row['hmget_us_per_turn']:.1f}",
             row['hscan_calls'], row['predicted_fields']])
        print(text)
        if not a.no_doc:
            write_benchmark_doc("Redis index: multi-turn replay" + a.suffix, cmd.strip(), text,
                                TURNS_NOTES)
    if a.only in (None, "shadow"):
        rows = [asyncio.run(bench_shadow(a.redis_url, t, n)) for t, n in
                ((1024, 8), (8192, 8), (8192, 32))]
        for r in rows:
            print(json.dumps(r), flush=True)
        table = ["| prompt tokens | replicas | decision p50 without (ms) | every decision "
                 "sampled p50 (ms) | added per sampled decision (ms) | added per decision at "
                 f"the default rate {rows[0]['default_rate']} (ms) |", "|---|---|---|---|---|---|"]
        for r in rows:
            table.append(f"| {r['tokens']} | {r['replicas']} | {r['off_p50_ms']:.3f} | "
                         f"{r['on_p50_ms']:.3f} | {r['added_ms']:.3f} | "
                         f"{r['added_ms_at_default']:.4f} |")
        text = "\n".join(table)
        print(text)
        if not a.no_doc:
            write_benchmark_doc("Shadow evaluation" + a.suffix, cmd.strip(), text,
                                SHADOW_NOTES)
    if a.only in (None, "calls"):
        import sys
        row = asyncio.run(bench_calls(a.redis_url))
        print(json.dumps(row), flush=True)
        text = one_row_table(
            ["Python", "PINGs", "call p50 (us)", "call_or_leave p50 (us)", "added p50 (us)",
             "call mean (us)", "call_or_leave mean (us)", "added mean (us)",
             "guarded call p50 (us)", "guard added p50 (us)"],
            [f"{sys.version_info.major}.{sys.version_info.minor}", row['iters']]
            + [f"{row[k]:.1f}" for k in ("call_p50_us", "call_or_leave_p50_us",
                                         "added_p50_us", "call_mean_us",
                                         "call_or_leave_mean_us", "added_mean_us",
                                         "guarded_p50_us", "guard_added_p50_us")])
        print(text)
        if not a.no_doc:
            write_benchmark_doc("Redis call: left running past its bound" + a.suffix,
                                cmd.strip(), text, CALLS_NOTES)
    if a.only in (None, "cluster"):
        import tempfile
        rows = []
        with tempfile.TemporaryDirectory(prefix="index-bench-cluster-") as tmp:
            for masters in a.masters:
                rows.append(bench_cluster(masters, a.cluster_processes, a.cluster_concurrency,
                                          a.cluster_seconds, tmp))
                print(json.dumps(rows[-1]), flush=True)
            from pathlib import Path

            from loadtest.redis_cluster import LocalRedisCluster
            memory = memory_one = None
            if not a.cluster_no_memory:
                with LocalRedisCluster(Path(tmp) / "memory", 3) as node:
                    memory = asyncio.run(bench_memory(node.url, cluster=True,
                                                      shard_groups=CLUSTER_GROUPS))
                print(json.dumps(memory), flush=True)
        if not a.cluster_no_memory:
            memory_one = asyncio.run(bench_memory(a.redis_url))  # the same on one Redis
            print(json.dumps(memory_one), flush=True)
        (RESULTS / f"cluster-bench-{stamp}.json").write_text(
            json.dumps({"rows": rows, "memory": memory, "memory_one_redis": memory_one},
                       indent=1))
        text = cluster_text(rows, memory, memory_one)
        print(text)
        if not a.no_doc:
            write_benchmark_doc("Redis Cluster: decisions/s against shards" + a.suffix,
                                cmd.strip(), text, CLUSTER_NOTES)
    if a.only in (None, "overhead"):
        overhead = [asyncio.run(bench_overhead(a.redis_url, t, n, unique))
                    for unique in (False, True)
                    for t, n in ((1024, 200), (8192, 200), (32768, 50), (122880, 10))]
        for o in overhead:
            print(json.dumps(o), flush=True)
        concurrent = []
        for procs in a.processes:
            concurrent.append(bench_concurrent(a.redis_url, 32768, 32, procs))
            print(json.dumps(concurrent[-1]), flush=True)
        (RESULTS / f"overhead-bench-{stamp}.json").write_text(
            json.dumps({"overhead": overhead, "concurrent": concurrent}, indent=1))
        text = overhead_text(overhead, concurrent)
        print(text)
        if not a.no_doc:
            write_benchmark_doc("Router overhead (docs/fault-cases.md 10.1)" + a.suffix,
                                cmd.strip(), text, OVERHEAD_NOTES)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
