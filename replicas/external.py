"""Engines outside Ray, reached by URL: a fleet of vLLM servers already running on
Kubernetes or on other hosts, or any OpenAI-compatible server (``Settings.external_engines``
and ``Settings.external_engines_file``).

Each ingress process keeps an ``ExternalFleet``: it health-checks and scrapes every engine
(``replicas.watch.EngineWatch``, as a Ray replica watches its own engine), subscribes to the
engine's KV events over TCP when it publishes them, and publishes the engines as
``ReplicaInfo`` records beside the replicas Ray runs (``router.serve.state``), so the same
routing decides among both. The direct data path streams from the chosen engine's URL.

- An engine with an events endpoint is probed once it answers: a prompt whose block hashes
  the router knows is sent, and the engine's ``BlockStored`` events must carry the same
  hashes. Then routing for it is exact. An engine whose hashes differ (another
  ``--prefix-caching-hash-algo`` or ``PYTHONHASHSEED``) has its events ignored: its entries
  are cleared and routing for it uses the router's predicted entries only.
- An engine without events is routed on predicted entries only, with the long
  ``predicted_ttl_s``.
- With Redis, one router process at a time writes an engine's events to the shared index:
  the holder of a lease in Redis (``<namespace>:feeder:<replica>``, renewed every poll,
  ``FEEDER_LEASE_S``). The others keep their own feed for its record and liveness, and
  take over, rewriting the index from their record, when the holder stops renewing.
- An engine removed from the list leaves the fleet: its feed stops and its entries and load
  fields are dropped (cleared, not tombstoned, so the same URL can come back).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path
from typing import Awaitable, Callable, Sequence
from urllib.parse import urlsplit

from replicas.watch import EngineWatch
from router.config import ExternalEngine, Settings
from router.index.base import IndexUnavailable, PrefixIndex
from router.kv_events.feed import EventFeed
from router.logs import get_logger
from router.routing.replica import ReplicaInfo, ReplicaMetadata
from router.serve.engine_client import ENGINE_ERRORS, EngineClient

logger = get_logger(__name__)

FEEDER_LEASE_S = 10.0  # a feeder that stops renewing is replaced after this long


def read_engines_file(path: str) -> list[ExternalEngine]:
    """The engines listed in a YAML or JSON file: a list of URLs or of
    ``ExternalEngine`` objects (or a mapping with such a list under ``engines``).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not such a list (``pydantic.ValidationError`` is a ValueError).
    """
    import yaml
    from pydantic import TypeAdapter

    data = yaml.safe_load(Path(path).read_text()) or []
    if isinstance(data, dict):
        data = data.get("engines", [])
    engines = TypeAdapter(list[ExternalEngine]).validate_python(data)
    ids = [e.replica_id for e in engines]
    if len(set(ids)) != len(ids):
        raise ValueError(f"engines need URLs and names of their own: {ids}")
    return engines


class ExternalReplica:
    """One engine reached by URL, as a routing candidate.

    Args:
        spec: where it is.
        settings: the router's settings.
        index: where its KV events are written (the process's in-process index, or the
            Redis index while this process holds its feeder lease), or None.
    """

    def __init__(self, spec: ExternalEngine, settings: Settings, index: PrefixIndex | None,
                 client: EngineClient | None = None):
        self.spec = spec
        self.replica_id = spec.replica_id
        self.settings = settings
        self.url = spec.url.rstrip("/")
        # health checks, scrapes and the hash probe; a client of its own unless given one
        self._own_client = client is None
        self.client = EngineClient(30.0) if client is None else client
        self.feed = EventFeed(self.replica_id, spec.kv_events_endpoint,
                              spec.kv_replay_endpoint, index) \
            if spec.kv_events_endpoint else None
        self.watch = EngineWatch(self.replica_id, settings, self.client, self.url, self.feed)
        self.alive: bool | None = None
        self.hash_probe = ""
        self._probed_at = 0.0  # time.monotonic() of the last hash probe

    def start(self) -> None:
        """Start the KV-event feed (on the running loop)."""
        if self.feed is not None:
            self.feed.start()

    async def refresh(self) -> ReplicaInfo:
        """Health-check and scrape the engine (and probe its hashing once it first
        answers); its candidate record now."""
        alive = await self._answers()
        if self.alive and not alive:
            logger.warning("external engine %s (%s) stopped answering", self.replica_id,
                           self.spec.url)
            if self.feed is not None:
                self.feed.engine_exited()  # whatever comes back holds nothing yet
        elif alive and not self.alive:
            logger.info("external engine %s (%s) answers", self.replica_id, self.spec.url)
        self.alive = alive
        if alive and self._probe_due():
            self._probed_at = time.monotonic()
            self.hash_probe = await self.watch.probe_hashes()
            if self.hash_probe == "mismatch":
                await self._ignore_events()
        stats = await self.watch.scrape(engine_alive=alive)
        return ReplicaInfo(self.replica_id, self.metadata(), stats)

    REPROBE_S = 30.0  # how often a probe that could not run is tried again (s)

    def _probe_due(self) -> bool:
        """Probe once the engine first answers; again every ``REPROBE_S`` while the last
        probe's request was refused (say, the engine was still loading its model or named
        it otherwise), since its events, once probed, make its routing exact."""
        if not self.hash_probe:
            return True
        return (self.feed is not None and not self.watch.probe_ran
                and time.monotonic() - self._probed_at >= self.REPROBE_S)

    async def _answers(self) -> bool:
        """Whether the engine answers: its ``GET /health`` (vLLM's, llama.cpp's server's)
        is 200, or, for a server without one (404), its ``GET /v1/models`` is."""
        try:
            status, _, _ = await self.client.call("GET", self.url + "/health", timeout_s=2.0)
            if status == 404:
                status, _, _ = await self.client.call("GET", self.url + "/v1/models",
                                                      timeout_s=2.0)
            return status == 200
        except ENGINE_ERRORS:
            return False

    def metadata(self) -> ReplicaMetadata:
        """What this engine advertises, as a Ray replica's metadata reads. Its hash
        settings are not reported (an engine outside Ray tells none): ``hash_probe`` says
        whether its events are used."""
        probe = "no_events" if self.hash_probe == "mismatch" else self.hash_probe
        return ReplicaMetadata(
            replica_id=self.replica_id, engine="external",
            node_ip=urlsplit(self.spec.url).hostname or "", engine_url=self.spec.url.rstrip("/"),
            kv_events_endpoint=self.spec.kv_events_endpoint or "",
            kv_replay_endpoint=self.spec.kv_replay_endpoint or "",
            model=self.settings.served_model_name or "", hash_probe=probe)

    async def _ignore_events(self) -> None:
        logger.error("external engine %s (%s) hashes blocks differently from the router; "
                     "its KV events are ignored and routing for it uses predicted entries "
                     "only (start it with --prefix-caching-hash-algo %s and "
                     "PYTHONHASHSEED=%s for exact routing)", self.replica_id, self.spec.url,
                     self.settings.hash_algo, self.settings.hash_seed)
        feed, self.feed = self.feed, None
        self.watch.feed = None
        await feed.stop()
        if feed.index is not None:
            try:
                await feed.index.clear_replica(self.replica_id)
            except IndexUnavailable as exc:
                logger.warning("could not clear %s's entries: %s", self.replica_id, exc)

    async def close(self) -> None:
        """Stop the feed, and close the HTTP client if it is this replica's own."""
        if self.feed is not None:
            await self.feed.stop()
        if self._own_client:
            await self.client.close()


class ExternalFleet:
    """The external engines of one router process, kept in step with the settings and the
    engines file, published as ``state.put("external_replicas", (ReplicaInfo, ...))``.

    Args:
        settings: the router's settings (``external_engines``, ``external_engines_file``,
            ``external_engines_poll_s``).
        index: the process's prefix index (``router.serve.state.make_index``).
        on_removed: called with the id of an engine that left the list, after its feed
            stopped (the routing core drops its load fields and its pins).
        publish: called with the engines' records after every poll.
        lease_s: the feeder lease's TTL (s): how long a router that stopped renewing it
            keeps the others from writing the engine's events.
        client: the HTTP client of the polls, or None for one per engine. The ingress
            passes its data path's own (``IngressCore.engine_client``): a poll every
            ``external_engines_poll_s`` (2 s), shorter than the client's keep-alive (4 s),
            then keeps a connection to each engine open in the pool the requests take
            theirs from, and a request after a quiet spell does not open one on its
            critical path. The caller closes it.
    """

    def __init__(self, settings: Settings, index: PrefixIndex,
                 on_removed: Callable[[str], Awaitable[None]],
                 publish: Callable[[tuple[ReplicaInfo, ...]], None],
                 lease_s: float = FEEDER_LEASE_S, client: EngineClient | None = None):
        self.settings = settings
        self.client = client
        self.lease_s = lease_s
        self.index = index
        self.on_removed = on_removed
        self.publish = publish
        self.replicas: dict[str, ExternalReplica] = {}
        self._uncleared: set[str] = set()  # left the fleet, entries not cleared yet
        self._file_stamp: tuple[float, int] | None = None
        self._from_file: list[ExternalEngine] = []
        self._me = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self._task: asyncio.Task | None = None
        self.polls = 0

    @property
    def shared_index(self) -> bool:
        """The index is Redis, shared by every router: one feeder per engine."""
        return bool(self.settings.redis_url)

    def start(self) -> None:
        """Poll in a task of the running loop until ``stop``."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop polling and close every engine's feed and client."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        for r in list(self.replicas.values()):
            await r.close()
        self.replicas.clear()

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # one bad poll must not end the fleet
                logger.exception("external engines: poll failed")
            await asyncio.sleep(self.settings.external_engines_poll_s)

    def wanted(self) -> list[ExternalEngine]:
        """The engines of the settings and of the file (read again when it changed; a file
        that cannot be read or parsed keeps the last good list, logged)."""
        path = self.settings.external_engines_file
        if path:
            try:
                st = os.stat(path)
                stamp = (st.st_mtime, st.st_size)
                if stamp != self._file_stamp:
                    self._from_file = read_engines_file(path)
                    self._file_stamp = stamp
                    logger.info("external engines file %s: %d engines", path,
                                len(self._from_file))
            except (OSError, ValueError) as exc:
                if self._file_stamp != ("bad", str(exc)):
                    logger.error("external engines file %s not used (%s); keeping the last "
                                 "good list of %d", path, exc, len(self._from_file))
                self._file_stamp = ("bad", str(exc))
        seen, out = set(), []
        for e in [*self.settings.external_engines, *self._from_file]:
            if e.replica_id not in seen:
                seen.add(e.replica_id)
                out.append(e)
        return out

    async def poll(self) -> tuple[ReplicaInfo, ...]:
        """One round: join new engines, drop removed ones, refresh every engine's record,
        renew the feeder leases, publish."""
        wanted = {e.replica_id: e for e in self.wanted()}
        if self._uncleared:  # the clears an earlier poll could not make
            await self._clear_removed()
        for rid in [r for r in self.replicas if r not in wanted
                    or wanted[r] != self.replicas[r].spec]:
            await self._remove(rid)
        for rid, spec in wanted.items():
            if rid not in self.replicas:
                r = ExternalReplica(spec, self.settings,
                                    None if self.shared_index else self.index, self.client)
                r.start()
                self.replicas[rid] = r
                logger.info("external engine %s joins: %s (KV events: %s)", rid, spec.url,
                            spec.kv_events_endpoint or "none, predicted entries only")
        infos = await asyncio.gather(*(r.refresh() for r in self.replicas.values()))
        if self.shared_index:
            await self._renew_leases()
        self.polls += 1
        out = tuple(infos)
        self.publish(out)
        return out

    async def _remove(self, rid: str) -> None:
        r = self.replicas.pop(rid)
        logger.info("external engine %s (%s) leaves the fleet", rid, r.spec.url)
        await r.close()  # its feed stopped: nothing of this process writes its events now
        self._uncleared.add(rid)
        await self._clear_removed()
        await self.on_removed(rid)

    async def _clear_removed(self) -> None:
        """Clear the entries of the engines that left, once each; a clear the index did not
        take is tried again on the next poll, unless the engine was listed again."""
        for rid in list(self._uncleared):
            if rid in self.replicas:
                self._uncleared.discard(rid)  # back in the fleet: its feed rewrites it
                continue
            try:
                await self.index.clear_replica(rid)
                self._uncleared.discard(rid)
            except IndexUnavailable as exc:
                logger.warning("could not clear %s's entries (%s); trying again on the "
                               "next poll", rid, exc)

    async def _renew_leases(self) -> None:
        """Hold (or take) the feeder lease of each engine with a feed; write its events to
        the shared index while this process holds it."""
        from router.redis_keys import RedisKeys

        keys = RedisKeys(self.settings.index_namespace)
        ttl_ms = int(self.lease_s * 1000)

        async def hold(client, key: str) -> bool:
            if await client.set(key, self._me, nx=True, px=ttl_ms):
                return True
            if await client.get(key) == self._me.encode():
                await client.pexpire(key, ttl_ms)
                return True
            return False

        for r in self.replicas.values():
            if r.feed is None:
                continue
            try:
                mine = await self.index.conn.call(hold, keys.feeder(r.replica_id),
                                                  maintenance=True)
            except IndexUnavailable:
                continue  # keep the current role until Redis answers
            if mine and r.feed.index is None:
                logger.info("this router now writes %s's KV events to the index",
                            r.replica_id)
                r.feed.set_index(self.index)  # rewritten from this process's record
            elif not mine and r.feed.index is not None:
                logger.info("another router writes %s's KV events now", r.replica_id)
                r.feed.set_index(None)

    def ids(self) -> Sequence[str]:
        """The ids of the engines in the fleet now."""
        return list(self.replicas)

