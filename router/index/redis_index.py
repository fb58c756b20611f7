"""Redis prefix index, shared by every router process (DESIGN.md decisions 2, 3 and 7).

Key layout (``<ns>`` is ``Settings.index_namespace``; only hashes and counters, never text):

* ``<ns>:x:<replica>``: hash ``block hash -> physical copies`` the engine holds (exact
  entries, from KV events). Bounded by the engine's KV capacity.
* ``<ns>:p:<replica>``: hash ``block hash -> expiry (ms)`` of predicted entries; the hash
  expires with its latest entry and expired fields are swept a few at a time on each write
  (Redis 7.0 has no per-field TTL), so it is bounded by TTL x rate of new blocks.
* ``<ns>:replicas``: replicas with entries, for ``stats``.

Per-replica hashes make a lookup a few ``HMGET``s per candidate whatever the prompt length
(``lua/route.lua`` reads a candidate's blocks in chunks of growing size and stops at its
first missing block), and purging a replica one ``DEL``. Every request costs one round trip
(``route.lua``: a lookup alone, or with the ``RedisLoadTracker`` the whole atomic decision).
Each call is bounded by ``timeout_s``; past it, or when Redis is down, ``IndexUnavailable``
is raised and routing decides by load. The asyncio client belongs to the event loop that
created it, so one is made lazily per loop (the Ray router runs on its own loop, DESIGN.md
decision 6).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Sequence

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from router.clock import Clock, SystemClock
from router.hashing import BlockHash
from router.index.base import IndexStats, IndexUnavailable, KVEvent, PrefixIndex

_LUA_DIR = Path(__file__).with_name("lua")


def pack_hashes(block_hashes: Sequence[BlockHash]) -> str:
    """Block hashes (unsigned ints) as the one space-separated decimal argument that
    ``lua/route.lua`` takes: one string to encode instead of one argument per block."""
    return " ".join(map(str, block_hashes))


def load_lua(name: str) -> str:
    """Source of ``router/index/lua/<name>.lua``."""
    return (_LUA_DIR / f"{name}.lua").read_text()


class RedisConnections:
    """One ``redis.asyncio`` client per event loop, all for the same URL.

    Args:
        url: Redis URL, e.g. ``redis://127.0.0.1:6379/0``.
        timeout_s: socket connect and read timeout; also the bound of each call.
    """

    # bound of the calls that must not be lost (lease releases): longer than a routing call's
    MAINTENANCE_TIMEOUT_S = 2.0

    def __init__(self, url: str, timeout_s: float):
        self.url = url
        self.timeout_s = timeout_s
        self._clients: dict[tuple[int, float], aioredis.Redis] = {}

    def client(self, timeout_s: float | None = None) -> aioredis.Redis:
        """This event loop's client whose socket timeout is ``timeout_s`` (default: the
        routing bound)."""
        t = timeout_s or self.timeout_s
        key = (id(asyncio.get_running_loop()), t)
        c = self._clients.get(key)
        if c is None:
            c = aioredis.Redis.from_url(
                self.url, socket_timeout=t, socket_connect_timeout=t,
                retry_on_timeout=False, health_check_interval=0, decode_responses=False)
            self._clients[key] = c
        return c

    async def call(self, coro_fn, *args: Any, maintenance: bool = False) -> Any:
        """Run ``coro_fn(client, *args)`` bounded by the routing timeout, or by
        ``MAINTENANCE_TIMEOUT_S`` for ``maintenance`` calls (those that must not be lost
        because a loaded machine answered late); errors become IndexUnavailable."""
        t = max(self.timeout_s, self.MAINTENANCE_TIMEOUT_S) if maintenance else self.timeout_s
        try:
            async with asyncio.timeout(t):  # no extra task, unlike wait_for
                return await coro_fn(self.client(t), *args)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise IndexUnavailable(f"redis at {self.url}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        loop = id(asyncio.get_running_loop())
        for key in [k for k in self._clients if k[0] == loop]:
            await self._clients.pop(key).aclose()


class RedisPrefixIndex(PrefixIndex):
    """Prefix index in Redis.

    Args:
        url: Redis URL.
        namespace: prefix of every key.
        timeout_s: bound of one call (``Settings.redis_timeout_s``).
        clock: time source for predicted-entry expiry (ms precision in Redis).
    """

    def __init__(self, url: str, namespace: str = "prefix-router", timeout_s: float = 0.05,
                 clock: Clock | None = None, connections: RedisConnections | None = None):
        self.ns = namespace
        self.clock = clock or SystemClock()
        self.conn = connections or RedisConnections(url, timeout_s)
        self._lookup_src = load_lua("route")  # its "lookup" mode
        self._record_src = load_lua("record_predicted")
        self._events_src = load_lua("apply_events")
        self._scripts: dict[int, tuple] = {}

    def replica_keys(self, replica: str) -> list[str]:
        """The replica's exact and predicted hashes."""
        return [f"{self.ns}:x:{replica}", f"{self.ns}:p:{replica}"]

    def _s(self, client: aioredis.Redis):
        scripts = self._scripts.get(id(client))
        if scripts is None:
            scripts = (client.register_script(self._lookup_src),
                       client.register_script(self._record_src),
                       client.register_script(self._events_src))
            self._scripts[id(client)] = scripts
        return scripts

    def _now_ms(self) -> int:
        return int(self.clock.now() * 1000)

    async def lookup(self, block_hashes: Sequence[BlockHash],
                     replicas: Sequence[str]) -> dict[str, int]:
        if not replicas:
            return {}
        if not block_hashes:
            return {r: 0 for r in replicas}
        keys = [f"{self.ns}:load", f"{self.ns}:leases"] + [
            k for r in replicas for k in self.replica_keys(r)]
        args = [self._now_ms(), "lookup", *([0] * 12), f"{self.ns}:", len(replicas),
                *replicas, *([0] * len(replicas)), pack_hashes(block_hashes)]

        async def run(client):
            return await self._s(client)[0](keys=keys, args=args)

        res = await self.conn.call(run)
        return {r: int(n) for r, n in zip(replicas, res[1:])}

    async def record_predicted(self, replica: str, block_hashes: Sequence[BlockHash],
                               ttl_s: float) -> None:
        if not block_hashes:
            return
        now = self._now_ms()
        keys = [self.replica_keys(replica)[1], f"{self.ns}:replicas"]
        args = [replica, now + int(ttl_s * 1000), now, *block_hashes]

        async def run(client):
            return await self._s(client)[1](keys=keys, args=args)

        await self.conn.call(run)

    async def forget_predicted(self, replica: str, block_hashes: Sequence[BlockHash]) -> None:
        if not block_hashes:
            return
        key = self.replica_keys(replica)[1]

        async def run(client):
            pipe = client.pipeline(transaction=False)
            for i in range(0, len(block_hashes), 1024):
                pipe.hdel(key, *block_hashes[i:i + 1024])
            await pipe.execute()

        await self.conn.call(run)

    async def apply_events(self, replica: str, events: Sequence[KVEvent]) -> None:
        ops: list[Any] = []
        for ev in events:
            if ev.kind == "cleared":
                ops.append("c")
            elif ev.medium in (None, "GPU") and ev.block_hashes:
                op = "r" if ev.kind == "removed" else (
                    "S" if ev.parent_block_hash is None else "s")
                ops += [op, len(ev.block_hashes), *ev.block_hashes]
        if ops:
            await self._run_events(replica, ops)

    async def _run_events(self, replica: str, ops: list[Any]) -> None:
        keys = self.replica_keys(replica) + [f"{self.ns}:replicas"]

        async def run(client):
            return await self._s(client)[2](keys=keys, args=[replica, *ops])

        await self.conn.call(run)

    async def remove_replica(self, replica: str) -> None:
        await self._run_events(replica, ["x"])

    async def exact_entry_count(self, replica: str) -> int:
        async def run(client):
            return await client.hlen(self.replica_keys(replica)[0])

        return int(await self.conn.call(run))

    async def stats(self) -> IndexStats:
        async def run(client):
            replicas = await client.smembers(f"{self.ns}:replicas")
            pipe = client.pipeline(transaction=False)
            for r in replicas:
                for key in self.replica_keys(r.decode()):
                    pipe.hlen(key)
            counts = await pipe.execute()
            return sum(counts)

        entries = await self.conn.call(run)
        return IndexStats(blocks=-1, entries=int(entries))

    async def flush(self) -> None:
        """Delete every key of this namespace (tests and ``FLUSHDB``-style resets)."""
        async def run(client):
            n = 0
            async for key in client.scan_iter(match=f"{self.ns}:*", count=1000):
                n += await client.delete(key)
            return n

        await asyncio.wait_for(run(self.conn.client()), 30)

    async def close(self) -> None:
        await self.conn.close()
