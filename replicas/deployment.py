"""The engine replica: a Ray Serve deployment that supervises one engine and proxies to it.

Each replica starts its engine (``replicas.engine``) on free local ports in ``__init__``,
advertises its endpoints and hash settings through ``record_replica_metadata`` (read by
the router; docs/architecture.md, decision 5), its measured load and prefill rate through
``record_routing_stats``, and serves ``generate``: it forwards the client's body to the
engine untouched and streams the engine's bytes back. Closing the stream (client gone)
closes the upstream connection, which makes vLLM abort the request
(``with_cancellation``, docs/reference.md 2.2).

A dead engine is restarted up to ``Settings.engine_restarts`` times; meanwhile requests get
a retryable 503 head (the ingress retries them on another replica), and once restarts are
exhausted ``check_health`` fails so Ray Serve replaces the replica.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any, AsyncIterator

from ray import serve

from replicas.engine import EnginePorts, EngineProcess, EngineStartError
from replicas.watch import EngineWatch
from router.config import Settings
from router.index.base import IndexUnavailable
from router.kv_events.feed import EventFeed
from router.kv_events.subscriber import subscriber_endpoint
from router.logs import get_logger
from router.routing.replica import ReplicaMetadata, RoutingStats
from router.serve.engine_client import ENGINE_ERRORS, EngineClient
from router.serve.protocol import ReplicaHead, RoutedRequest
from router.serve.state import make_index

logger = get_logger(__name__)


def _detect_device(setting: str) -> str:
    if setting != "auto":
        return setting
    try:
        import ray
        return "gpu" if ray.get_gpu_ids() else "cpu"
    except Exception:
        return "cpu"


def _node_ip() -> str:
    try:
        import ray
        return ray.util.get_node_ip_address()
    except Exception:
        return "127.0.0.1"


def _rank_of(ctx) -> tuple[int, int]:
    """(rank, world size) of a Serve replica context (Serve's ``ReplicaRank.rank``)."""
    rank = getattr(ctx, "rank", None)
    rank = getattr(rank, "rank", rank)
    return int(rank or 0), int(getattr(ctx, "world_size", 1) or 1)


class EngineReplica:
    """One engine behind Ray Serve. Constructed by Serve with the settings as a dict."""

    async def __init__(self, settings: dict[str, Any]):
        self.settings = Settings(**settings)
        try:
            ctx = serve.get_replica_context()
            self.replica_id = ctx.replica_id.unique_id
            rank, world = _rank_of(ctx)
        except Exception:  # constructed outside Serve (tests)
            self.replica_id = f"local-{os.getpid()}"
            rank, world = 0, 1
        self.lora_adapters = self.settings.adapters_for(rank, world)
        self.device = _detect_device(self.settings.device)
        self.ports = EnginePorts.allocate(f"{self.replica_id}-{os.getpid()}",
                                          self.settings.kv_events_dir,
                                          tcp=self.settings.engine_serves_other_nodes)
        self.engine = EngineProcess(self.settings, self.ports, topic=self.replica_id,
                                    device=self.device, lora_adapters=self.lora_adapters)
        self.restarts = 0
        self.failed = False
        self.started_at = time.time()
        await self.engine.start()
        # the engine's calls: the request path, and the control calls (scrapes, probes)
        self.engine_http = EngineClient(self.settings.request_timeout_s)
        self.stats = RoutingStats()
        # With Redis this replica writes its engine's events to the shared index; without,
        # the router consumes them itself and this feed only watches liveness.
        self.index = make_index(self.settings) if self.settings.redis_url else None
        self.feed = EventFeed(self.replica_id,
                              subscriber_endpoint(self.ports.kv_events, "127.0.0.1"),
                              subscriber_endpoint(self.ports.kv_replay, "127.0.0.1"),
                              self.index)
        self.feed.health.grace_s = self.settings.kv_events_grace_s
        self.feed.start()
        self.watch = EngineWatch(self.replica_id, self.settings, self.engine_http,
                                 self.engine.url, self.feed)
        self.hash_probe = await self.watch.probe_hashes()
        if self.hash_probe == "mismatch":
            logger.error("replica %s: the router will refuse this replica", self.replica_id)
        self._monitor = asyncio.get_running_loop().create_task(self._watch_engine())

    # --- Serve hooks -------------------------------------------------------------------
    def record_replica_metadata(self) -> dict[str, Any]:
        """Serve's hook: this replica's ``ReplicaMetadata``, as the plain dict Serve carries."""
        ip = _node_ip()
        return ReplicaMetadata(
            replica_id=self.replica_id, engine=self.settings.engine, node_ip=ip,
            engine_url=self.engine.advertised_url(ip),
            kv_events_endpoint=subscriber_endpoint(self.ports.kv_events, ip),
            kv_replay_endpoint=subscriber_endpoint(self.ports.kv_replay, ip),
            kv_events_topic=self.replica_id,
            model=self.settings.served_model_name, device=self.device,
            hash_probe=self.hash_probe, hash_settings=self.settings.hash_settings.as_dict(),
            lora_adapters=[a.name for a in self.lora_adapters],
        ).to_dict()

    async def record_routing_stats(self) -> dict[str, Any]:
        """Serve's hook: this replica's ``RoutingStats`` (the engine scraped now), as a dict."""
        await self._scrape()
        return self.stats.to_dict()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom-metrics hook (with ``Settings.autoscaling_config``): this
        replica's engine's requests running and waiting (``router.serve.autoscaling``),
        from the routing stats' scrape when it is under a second old (Serve asks for both
        every few seconds), else scraped now; the last scrape's when this one fails."""
        from router.serve.autoscaling import ENGINE_REQUESTS

        if self.watch.scrape_age_s() > 1.0:
            await self._scrape()
        return {ENGINE_REQUESTS: float(self.stats.running + self.stats.waiting)}

    async def check_health(self) -> None:
        if self.failed:
            raise RuntimeError(f"engine of replica {self.replica_id} is dead after "
                               f"{self.restarts} restarts:\n{self.engine.log_tail(2000)}")

    # --- request path ------------------------------------------------------------------
    async def generate(self, req: RoutedRequest) -> AsyncIterator[Any]:
        """Serve's handle path: yield a ``ReplicaHead``, then the engine's response body as
        raw byte chunks."""
        predicted = req.predicted_cached_tokens.get(self.replica_id, 0)
        if not self.engine.alive():
            yield ReplicaHead(self.replica_id, 503, {}, retryable=True,
                              error="engine is not running", predicted_cached_tokens=predicted)
            return
        try:  # trace_headers: the router's traceparent
            resp = await self.engine_http.open(
                "POST", self.engine.url + req.path, req.body,
                {"content-type": "application/json", **(req.trace_headers or {})})
        except ENGINE_ERRORS as exc:
            yield ReplicaHead(self.replica_id, 503, {}, retryable=True,
                              error=f"engine unreachable: {type(exc).__name__}",
                              predicted_cached_tokens=predicted)
            return
        try:
            yield ReplicaHead(self.replica_id, resp.status, resp.headers,
                              retryable=resp.status >= 500, predicted_cached_tokens=predicted)
            async for chunk in resp.chunks():
                yield chunk
        finally:
            await resp.close()

    async def ping(self) -> str:
        """This replica's id (readiness probe of the ingress)."""
        return self.replica_id

    async def forward(self, method: str, path: str,
                      body: bytes | None = None) -> tuple[int, dict[str, str], bytes]:
        """One call to the engine's HTTP API (``/v1/models``, ``/tokenize`` on Serve's
        handle path): its status, headers (hop-by-hop ones dropped) and body.

        Raises:
            RuntimeError: the engine is not running, or answered 5xx (the caller asks
                another replica).
        """
        if not self.engine.alive():
            raise RuntimeError(f"engine of replica {self.replica_id} is not running")
        status, headers, data = await self.engine_http.call(
            method, self.engine.url + path, body, {"content-type": "application/json"},
            timeout_s=30.0)
        if status >= 500:
            raise RuntimeError(f"engine of replica {self.replica_id} answered {status}")
        return status, headers, data

    async def engine_info(self) -> dict[str, Any]:
        """Metadata plus the engine's process id and restarts (tests, operators)."""
        return {**self.record_replica_metadata(),
                "engine_pid": self.engine.proc.pid if self.engine.proc else None,
                "restarts": self.restarts, "alive": self.engine.alive()}

    # --- supervision -------------------------------------------------------------------
    async def _scrape(self) -> None:
        self.stats = await self.watch.scrape(
            engine_alive=self.engine.alive(),
            engine_pid=self.engine.proc.pid if self.engine.proc else None,
            restarts=self.restarts)

    async def _watch_engine(self) -> None:
        silent_logged = False
        while True:
            await asyncio.sleep(1.0)
            live = self.feed.health.live(time.time())
            if not live and not silent_logged:
                logger.error("replica %s: its engine publishes no KV events (no batch within "
                             "%.0f s of computing a whole prompt block); the router keeps "
                             "predicted entries for it with the long TTL", self.replica_id,
                             self.settings.kv_events_grace_s)
            silent_logged = not live
            if not self.engine.exited() or self.failed:
                continue
            logger.error("engine of replica %s exited (code %s); log tail:\n%s",
                         self.replica_id, self.engine.proc.returncode if self.engine.proc
                         else None, self.engine.log_tail(2000))
            self.engine.reap()  # its engine core would hold its memory on
            self.feed.engine_exited()
            if self.restarts >= self.settings.engine_restarts:
                self.failed = True
                continue
            self.restarts += 1
            try:
                await self.engine.start()
            except EngineStartError as exc:
                logger.error("restart %d of replica %s failed: %s", self.restarts,
                             self.replica_id, exc)

    async def drain(self, timeout_s: float, quiet_s: float = 2.0, poll_s: float = 0.2) -> bool:
        """Wait until the engine is done with what it serves: no request running or
        waiting, and none finished, for ``quiet_s`` seconds in a row (a request that came
        and went between two scrapes moves the finished count). Serve has already waited
        for the requests of its own handle path; the direct path's go to the engine itself,
        and a router sends none once Serve's replica update has told it this replica is
        stopping.

        Returns:
            True when the engine went quiet (or is not running), False after ``timeout_s``.
        """
        deadline = time.monotonic() + timeout_s
        quiet_since, finished = None, None
        while time.monotonic() < deadline:
            if getattr(self, "engine", None) is None or not self.engine.alive():
                return True
            await self._scrape()
            st = self.stats
            now = time.monotonic()
            busy = st.scrape_error is not None or st.running + st.waiting > 0 \
                or st.requests_finished_total != finished
            finished = st.requests_finished_total
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= quiet_s:
                return True
            await asyncio.sleep(poll_s)
        return False

    async def __del__(self):
        await self.shutdown()

    async def shutdown(self) -> None:
        """Drain the engine (``drain``, at most ``Settings.drain_timeout_s``), stop the
        event feed, remove this replica's entries from the shared index and its load
        fields, then stop the engine. The routers purge a replica that leaves, but its
        feed, still running during Serve's graceful shutdown, would take that purge for a
        lost index and rebuild the entries from its record; this last write wins."""
        if getattr(self, "_monitor", None):  # no engine restart while it drains
            self._monitor.cancel()
        if getattr(self, "engine_http", None) is not None and getattr(self, "engine", None) \
                and self.settings.drain_timeout_s > 0:
            t0 = time.monotonic()
            if await self.drain(self.settings.drain_timeout_s):
                logger.info("replica %s drained in %.1f s", self.replica_id,
                            time.monotonic() - t0)
            else:
                logger.warning("replica %s: its engine still served requests after "
                               "drain_timeout_s (%.0f s); stopping it anyway (running %d, "
                               "waiting %d)", self.replica_id, self.settings.drain_timeout_s,
                               self.stats.running, self.stats.waiting)
        if getattr(self, "feed", None):
            await self.feed.stop()
        if getattr(self, "index", None) is not None:
            try:
                await self.index.remove_replica(self.replica_id)
                # its load fields, and any lease left of its requests (all are over once
                # the drain succeeded; a router's later release of one is then a no-op)
                from router.load.redis import RedisLoadTracker
                await RedisLoadTracker(self.index.conn, self.settings.index_namespace,
                                       shard_groups=self.settings.index_shard_groups
                                       ).remove_replica(self.replica_id)
            except IndexUnavailable:
                logger.warning("replica %s could not remove its index entries (Redis "
                               "unavailable); the routers purge them when it leaves",
                               self.replica_id)
        if getattr(self, "engine_http", None) is not None:
            await self.engine_http.close()
        if getattr(self, "engine", None):
            await self.engine.stop()
            self.engine.remove_files()
