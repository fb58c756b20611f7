"""Watching a running engine from outside its process: its metrics, its hashing, its events.

One ``EngineWatch`` per engine, shared by the two ways an engine joins the fleet: the Ray
Serve replica that supervises its own engine (``replicas.deployment.EngineReplica``) and an
engine that runs elsewhere and is reached by URL (``replicas.external``). It scrapes the
engine's Prometheus ``/metrics`` into the ``RoutingStats`` the router reads (load, measured
prefill rate, liveness of the KV events), and probes once whether the engine hashes blocks
as the router does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

from replicas.engine_metrics import PrefillRateEstimator, parse_engine_metrics
from router.config import Settings
from router.hashing import BlockHasher
from router.kv_events.feed import EventFeed
from router.logs import get_logger
from router.routing.replica import RoutingStats
from router.serve.engine_client import ENGINE_ERRORS, EngineClient

logger = get_logger(__name__)


class EngineStatusError(Exception):
    """An engine answered a control call (scrape, probe) with a status other than 200."""

    def __init__(self, status: int):
        super().__init__(f"engine answered {status}")
        self.status = status


class EngineWatch:
    """The router's view of one engine: its ``RoutingStats``, refreshed by ``scrape``.

    Args:
        replica_id: the id the router routes by.
        settings: the deployment's settings (block size, hash settings, served model name,
            initial prefill rate, KV-event grace).
        client: the HTTP client of the engine calls (the dispatch's own, pooled
            connections: a poll of 8 engines cost its process 5-10 % less CPU than with
            httpx on the VM, docs/benchmarks.md).
        url: the engine's OpenAI server, e.g. ``http://10.0.0.5:8000``.
        feed: the engine's KV-event feed (started by the caller), or None for an engine
            that publishes no events (its stats then say ``kv_events_live=False``).
    """

    def __init__(self, replica_id: str, settings: Settings, client: EngineClient, url: str,
                 feed: EventFeed | None):
        self.replica_id = replica_id
        self.settings = settings
        self.client = client
        self.url = url.rstrip("/")
        self.feed = feed
        self.rate = PrefillRateEstimator(settings.prefill_tokens_per_s)
        self.stats = RoutingStats()
        self._scraped_at: float | None = None  # time.monotonic() of the last good scrape
        self.probe_ran = False  # whether the last probe_hashes got its request answered

    def scrape_age_s(self) -> float:
        """Seconds since the last successful ``scrape`` (infinite before the first)."""
        return float("inf") if self._scraped_at is None \
            else time.monotonic() - self._scraped_at

    async def scrape(self, *, engine_alive: bool, engine_pid: int | None = None,
                     restarts: int | None = None) -> RoutingStats:
        """Scrape the engine's ``/metrics`` (2 s timeout) into ``self.stats``, and return it.

        A failed scrape keeps the last figures and records its error and ``engine_alive``.

        Args:
            engine_alive: whether the engine is known to run (its process, or its last
                health check for an engine the router does not run).
            engine_pid / restarts: the engine process's id and restarts, when known.
        """
        try:
            status, _, data = await self.client.call("GET", self.url + "/metrics",
                                                     timeout_s=2.0)
            if status != 200:
                raise EngineStatusError(status)
            snap = parse_engine_metrics(data.decode("utf-8", "replace"))
            if self.feed is not None:
                self.feed.health.on_engine_counters(
                    snap.computed_prompt_tokens_total, snap.requests_finished_total,
                    snap.running + snap.waiting, self.settings.block_size, time.time())
        except Exception as exc:
            self.stats = dataclasses.replace(self.stats, scrape_error=type(exc).__name__,
                                             engine_alive=engine_alive)
            return self.stats
        feed = self.feed
        events = {} if feed is None else dict(
            kv_events_live=feed.health.live(time.time()), kv_event_batches=feed.batches,
            kv_event_gaps=feed.subscriber.gaps, kv_event_lag_s=feed.health.lag_s(),
            index_dirty=feed.dirty)
        if events.get("kv_events_live"):
            # the engine the feed hears: a data-parallel server's first rank (vLLM
            # publishes each rank's events on the endpoint's port plus the rank), one
            # engine, as kv_capacity_tokens is one engine's
            held = await feed.record.exact_entry_count(self.replica_id)
            events["kv_cached_tokens"] = held * self.settings.block_size
        self.stats = RoutingStats(
            prefill_tokens_per_s=self.rate.update(snap), prefill_rate_measured=self.rate.measured,
            **({"kv_events_live": False} | events), engine_pid=engine_pid,
            running=snap.running, waiting=snap.waiting, kv_usage_frac=snap.kv_usage_frac,
            kv_capacity_tokens=snap.kv_capacity_tokens,
            engine_alive=engine_alive, restarts=restarts,
            output_tokens_total=snap.generation_tokens_total,
            requests_finished_total=snap.requests_finished_total)
        self._scraped_at = time.monotonic()
        from router import metrics
        metrics.record_engine_load(self.replica_id, snap.running, snap.waiting,
                                   snap.kv_usage_frac)
        return self.stats

    async def probe_hashes(self, timeout_s: float = 5.0) -> str:
        """Send a probe prompt (``2 * block_size + 1`` token ids, ``max_tokens`` 1) and
        compare the engine's ``BlockStored`` hashes with the router's.

        Returns:
            ``"ok"``; ``"mismatch"`` (events came, with other hashes: the engine hashes
            differently, logged loudly); or ``"no_events"`` (none came within
            ``timeout_s``, or the probe could not run: predicted entries only;
            ``probe_ran`` then tells the two apart).
        """
        self.probe_ran = False
        if self.feed is None:
            return "no_events"
        bs = self.settings.block_size
        rng = random.Random(self.replica_id)
        ids = [rng.randrange(100, 4000) for _ in range(2 * bs + 1)]
        expected = BlockHasher(self.settings.hash_settings).block_hashes(ids)
        before = self.feed.batches
        body = json.dumps({"model": self.settings.served_model_name, "prompt": ids,
                           "max_tokens": 1}).encode()
        try:
            status, _, _ = await self.client.call(
                "POST", self.url + "/v1/completions", body,
                {"content-type": "application/json"}, timeout_s=60.0)
            if status != 200:
                raise EngineStatusError(status)
        except (EngineStatusError, *ENGINE_ERRORS) as exc:
            logger.error("hash probe of replica %s could not run: %s", self.replica_id,
                         str(exc) or type(exc).__name__)
            return "no_events"
        self.probe_ran = True
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            held = self.feed.record.exact_entries(self.replica_id)
            if all(h in held for h in expected):
                return "ok"
            await asyncio.sleep(0.05)
        if self.feed.batches > before:
            logger.error(
                "replica %s: its engine's block hashes differ from the router's for the same "
                "tokens (settings %s)", self.replica_id, self.settings.hash_settings.as_dict())
            return "mismatch"
        logger.error("replica %s: its engine published no KV events within %.0f s; routing "
                     "for it uses predicted entries only", self.replica_id, timeout_s)
        return "no_events"
