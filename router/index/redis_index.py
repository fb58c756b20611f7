"""Redis prefix index, shared by every router process (DESIGN.md decisions 2, 3 and 7).

Key layout (``<ns>`` is ``Settings.index_namespace``; only hashes and counters, never text):

* ``<ns>:b:<hash>``: one Redis hash per block key. Field ``<replica>`` = physical copies the
  engine holds (exact entry, from KV events); field ``~<replica>`` = expiry in ms of a
  predicted entry. A key with no exact field expires with its latest predicted entry.
* ``<ns>:r:<replica>:x`` / ``<ns>:r:<replica>:p``: sets of the block hashes a replica has
  exact / predicted entries for, so a replica can be purged without a scan.
* ``<ns>:replicas``: replicas seen, for ``stats``.

Every request costs one round trip (``lua/route.lua``: a lookup alone, or with the
``RedisLoadTracker`` the whole atomic decision). Each call is bounded by
``timeout_s``; past it, or when Redis is down, ``IndexUnavailable`` is raised and routing
decides by load. The asyncio client belongs to the event loop that created it, so one is
made lazily per loop (the Ray router runs on its own loop, DESIGN.md decision 6).
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


def load_lua(name: str) -> str:
    """Source of ``router/index/lua/<name>.lua``."""
    return (_LUA_DIR / f"{name}.lua").read_text()


class RedisConnections:
    """One ``redis.asyncio`` client per event loop, all for the same URL.

    Args:
        url: Redis URL, e.g. ``redis://127.0.0.1:6379/0``.
        timeout_s: socket connect and read timeout; also the bound of each call.
    """

    def __init__(self, url: str, timeout_s: float):
        self.url = url
        self.timeout_s = timeout_s
        self._clients: dict[int, aioredis.Redis] = {}

    def client(self) -> aioredis.Redis:
        loop = asyncio.get_running_loop()
        c = self._clients.get(id(loop))
        if c is None:
            c = aioredis.Redis.from_url(
                self.url, socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                retry_on_timeout=False, health_check_interval=0, decode_responses=False)
            self._clients[id(loop)] = c
        return c

    async def call(self, coro_fn, *args: Any) -> Any:
        """Run ``coro_fn(client, *args)`` bounded by the timeout; errors become IndexUnavailable."""
        try:
            return await asyncio.wait_for(coro_fn(self.client(), *args), self.timeout_s)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            raise IndexUnavailable(f"redis at {self.url}: {type(exc).__name__}: {exc}") from exc

    async def close(self) -> None:
        loop = asyncio.get_running_loop()
        c = self._clients.pop(id(loop), None)
        if c is not None:
            await c.aclose()


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

    def _block_key(self, h: int) -> str:
        return f"{self.ns}:b:{h}"

    def _replica_sets(self, replica: str) -> list[str]:
        return [f"{self.ns}:r:{replica}:x", f"{self.ns}:r:{replica}:p"]

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
        keys = [f"{self.ns}:load", f"{self.ns}:leases"] + [self._block_key(h)
                                                             for h in block_hashes]
        args = [self._now_ms(), "lookup", *([0] * 12), f"{self.ns}:", len(replicas),
                *replicas, *([0] * len(replicas))]

        async def run(client):
            return await self._s(client)[0](keys=keys, args=args)

        res = await self.conn.call(run)
        return {r: int(n) for r, n in zip(replicas, res[1:])}

    async def record_predicted(self, replica: str, block_hashes: Sequence[BlockHash],
                               ttl_s: float) -> None:
        if not block_hashes:
            return
        expiry = self._now_ms() + int(ttl_s * 1000)
        keys = [self._replica_sets(replica)[1]] + [self._block_key(h) for h in block_hashes]

        async def run(client):
            pipe = client.pipeline(transaction=False)
            await self._s(client)[1](keys=keys, args=[replica, expiry, *block_hashes], client=pipe)
            pipe.sadd(f"{self.ns}:replicas", replica)
            return await pipe.execute()

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
        async def run(client):
            pipe = client.pipeline(transaction=False)
            await self._s(client)[2](keys=self._replica_sets(replica),
                               args=[replica, f"{self.ns}:b:", *ops], client=pipe)
            pipe.sadd(f"{self.ns}:replicas", replica)
            return await pipe.execute()

        await self.conn.call(run)

    async def remove_replica(self, replica: str) -> None:
        await self._run_events(replica, ["x"])

        async def run(client):
            return await client.srem(f"{self.ns}:replicas", replica)

        await self.conn.call(run)

    async def exact_entry_count(self, replica: str) -> int:
        async def run(client):
            return await client.scard(self._replica_sets(replica)[0])

        return int(await self.conn.call(run))

    async def stats(self) -> IndexStats:
        async def run(client):
            replicas = await client.smembers(f"{self.ns}:replicas")
            pipe = client.pipeline(transaction=False)
            for r in replicas:
                for key in self._replica_sets(r.decode()):
                    pipe.scard(key)
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
