"""Where the Redis time of one atomic route goes, section by section: the route script
(``router/lua/route.lua``) run with ``TIME`` probes between its sections (the candidates'
walks; the reads of the load hash; the cost and choice; the reservation; the predicted
entries' write), on a fresh namespace of ``--replicas`` replicas each holding
``BACKGROUND_BLOCKS`` blocks of other prompts, for new prompts of ``--blocks`` blocks (a
burst of new long prompts routes so: no replica holds their head). Prints the median of
each section over ``--iters`` routes (the first 50 left out), in microseconds of Redis's
clock. The probes cost about a microsecond each; the sections' sum is the script's time
less the ``EVALSHA`` call's own (its arguments made into Lua strings).

Usage: ``python -m loadtest.route_profile [--redis-url URL] [--replicas 8] [--blocks 32]``
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import uuid

# (the line of route.lua a probe goes before, the probe's name), in the script's order; the
# last probe goes before the script's final return
SECTIONS = [
    ("local mode = ARGV[1]\n", "start"),
    ("-- 2. load and cost per candidate\n", "walked"),
    ("local sum_k = 0\n", "load_read"),
    ("-- 4. reserve\n", "chosen"),
    ("-- 5. predicted entries", "reserved"),
    ("local out = {pick}\n", "end"),
]


def probe_sections_of(src: str, list_key: str) -> str:
    """The route script's source ``src`` (``load_lua("route")``) with a ``TIME`` probe
    before each line of ``SECTIONS``; the probes' readings (``name=microseconds``,
    comma-separated) are pushed onto the list ``list_key`` before the script returns (the
    route mode's last return).

    Raises:
        ValueError: a line of ``SECTIONS`` is not in the script (the script changed).
    """
    for line, name in SECTIONS:
        i = src.rindex(line) if name == "end" else src.index(line)
        probe = ("do local t = redis.call('TIME'); PROF[#PROF + 1] = '" + name
                 + "=' .. string.format('%d', t[1] * 1000000 + t[2]) end\n")
        if name == "start":
            probe = "local PROF = {}\n" + probe
        if name == "end":
            probe += f"redis.call('RPUSH', '{list_key}', table.concat(PROF, ','))\n"
        src = src[:i] + probe + src[i:]
    return src


async def profile(url: str, n: int = 8, blocks: int = 32, iters: int = 400) -> dict[str, float]:
    """Median microseconds of each section of the route script (``"walked->load_read"``,
    ...) and of their sum (``"total"``), over ``iters`` new prompts of ``blocks`` blocks on
    ``n`` replicas, the first 50 routes left out. Uses a throwaway namespace, deleted after.
    """
    import redis as redis_sync

    from loadtest.index_bench import BACKGROUND_BLOCKS, BS
    from router.index.redis import RedisConnections, RedisPrefixIndex
    from router.kv_events.wire import EventKind, KVEvent
    from router.load.redis import RedisLoadTracker
    from router.redis_keys import Scripts, load_lua
    from router.routing.atomic import AtomicRoute

    ns = f"bench-{uuid.uuid4().hex[:6]}"
    list_key = f"{ns}:route-profile"
    saved = Scripts._sources.get("route")
    Scripts._sources["route"] = probe_sections_of(load_lua("route"), list_key)
    r = redis_sync.Redis.from_url(url)
    conn = RedisConnections(url, 5.0)
    index = RedisPrefixIndex(url, ns, connections=conn)
    load = RedisLoadTracker(conn, ns)
    try:
        rng = random.Random(1)
        replicas = [f"replica-{i:02d}" for i in range(n)]
        for rep in replicas:
            bg = [rng.getrandbits(63) for _ in range(BACKGROUND_BLOCKS)]
            await index.apply_events(rep, [KVEvent(EventKind.STORED, bg[k:k + 512], None)
                                           for k in range(0, len(bg), 512)])
        atomic = AtomicRoute(index, load)
        for k in range(iters):
            await atomic.route(f"x{k}", blocks * BS, [rng.getrandbits(63) for _ in range(blocks)],
                               replicas, [15.0] * n, block_size=BS, prefill_rate=20000.0,
                               work_weight=1.0, decode_step_s_per_seq=3e-5,
                               step_token_budget=8192, tie_abs_s=0.002, tie_rel=0.05,
                               u=rng.random())
            if k % 32 == 31:  # released 32 at a time, as a burst's answers end
                for q in range(k - 31, k + 1):
                    await load.release(f"x{q}")
        rows = [dict(kv.split("=") for kv in x.decode().split(","))
                for x in r.lrange(list_key, 50, -1)]
    finally:
        if saved is None:
            Scripts._sources.pop("route", None)
        else:
            Scripts._sources["route"] = saved
        r.delete(list_key)
        r.close()
        await index.flush()
        await load.close()
        await conn.close()
    names = [name for _, name in SECTIONS]
    out = {f"{a}->{b}": statistics.median(int(x[b]) - int(x[a]) for x in rows)
           for a, b in zip(names, names[1:])}
    out["total"] = statistics.median(int(x["end"]) - int(x["start"]) for x in rows)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--iters", type=int, default=400)
    a = ap.parse_args(argv)
    for name, us in asyncio.run(profile(a.redis_url, a.replicas, a.blocks, a.iters)).items():
        print(f"{name}: {us:.0f} us (median)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
