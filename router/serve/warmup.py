"""The ingress's warm-up and re-homing (``Settings.warmup_enabled``): the real-time driver of
``router.routing.warmup``.

Each ingress process records its requests' prefixes (``observe``, ``routed``) and runs one
task that, every second or when a warm-up request ends:

* compares the replica set (``state.replica_infos``, kept by the Ray router) and the drained
  set with what it saw last: a replica that joined is warmed with the hottest prefixes, a
  replica that left, or that an operator drained, has its hot prefixes re-homed on the
  others (``Warmer.replica_joined`` / ``replica_left``; with Redis one process per replica
  wins the lease). The first replica set it sees is taken as it is (nothing joined);
* every ``HOLDERS_REFRESH_S`` asks the index who holds the hottest prefixes (the Ray router
  purges a replica that leaves from the index at once, so what it held is read from there);
* starts the queued warm-up requests the pacer allows: ``POST <engine_url>/v1/completions``
  with the prefix's token ids as the prompt, ``max_tokens: 1``, and the prefix's
  ``cache_salt`` and LoRA adapter (as ``model``), so the engine's blocks hash as the
  requests' did. Sent straight to the engine on either data path (the replica's metadata
  has its URL).
"""

from __future__ import annotations

import asyncio
import json

from router import metrics
from router.clock import SystemClock
from router.config import Settings
from router.logs import get_logger
from router.prompt.render import COMPLETIONS_PATH
from router.serve.engine_client import ENGINE_ERRORS
from router.routing.warmup import (ExtraKeys, HotPrefixes, MemoryWarmupLease,
                                   RedisWarmupLease, Warmer, WarmJob, WarmupPacer)
from router.serve import state

logger = get_logger(__name__)

POLL_S = 1.0  # how often the replica set and the drained set are compared (s)
HOLDERS_REFRESH_S = 5.0  # how often the index is asked who holds the hottest prefixes (s)
MAX_PREFIXES = 16384  # bound on the prefixes recorded (HotPrefixes.max_prefixes)


class WarmupService:
    """One ingress process's warm-up (module docstring).

    Args:
        settings: the deployment's settings (``warmup_*``).
        ingress: the ``router.serve.ingress.IngressCore`` whose routing core decides each
            warm-up request and whose pooled HTTP client sends it.
    """

    def __init__(self, settings: Settings, ingress):
        self.settings = settings
        self.ingress = ingress
        self.clock = SystemClock()
        self.record = HotPrefixes(settings.block_size, settings.warmup_half_life_s,
                                  settings.warmup_record_tokens, MAX_PREFIXES, self.clock)
        self.warmer: Warmer | None = None
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None
        self._posts: set[asyncio.Task] = set()

    def observe(self, block_hashes, token_ids, cache_salt: str | None,
                lora_name: str | None) -> None:
        """Record a cacheable request's prefix: its block hashes and the token ids they
        were cut from (the head's only, for a long prompt routed on its head)."""
        if not block_hashes:
            return
        adapter = self.settings.adapter(lora_name)
        try:
            self.record.observe(block_hashes, token_ids, ExtraKeys(
                cache_salt, lora_name, adapter.path if adapter else None))
        except ValueError:  # ids and hashes of different lengths: not recorded
            logger.debug("request prefix not recorded for warm-up", exc_info=True)

    def routed(self, block_hashes, replica: str) -> None:
        """The request was sent to ``replica``: it holds its prefixes now."""
        if block_hashes:
            self.record.routed(block_hashes, replica)

    def start(self) -> None:
        """Start the task on the running loop (once)."""
        if self._task is None:
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _make_warmer(self) -> Warmer:
        s = self.settings
        lease = RedisWarmupLease(state.redis_connections(s), s.index_namespace) \
            if s.redis_url else MemoryWarmupLease(self.clock)
        return Warmer(self.ingress.routing_core(), self.record,
                      WarmupPacer(s.warmup_tokens_per_s, s.warmup_concurrency, self.clock),
                      lease, self._send, s.warmup_top_prefixes, on_metrics=metrics.inc)

    async def _run(self) -> None:
        known: set[str] | None = None
        drained_seen: frozenset[str] = frozenset()
        next_refresh = 0.0
        while True:
            wait = POLL_S
            try:
                if self.warmer is None:
                    self.warmer = self._make_warmer()
                infos = state.replica_infos()
                if infos is not None:
                    ids = {i.replica_id for i in infos}
                    drained = await state.make_drains(self.settings).refresh() & ids
                    if known is not None:
                        await self._changes(known, ids, drained_seen, drained)
                    known, drained_seen = ids, drained
                    if self.clock.now() >= next_refresh and ids:
                        next_refresh = self.clock.now() + HOLDERS_REFRESH_S
                        await self.record.refresh_holders(
                            self.warmer.core.index, sorted(ids), self.warmer.top_prefixes,
                            self.warmer.min_count)
                    due = await self.warmer.pump(infos)
                    if due is not None:
                        wait = min(wait, max(due, 0.01))
            except Exception:  # noqa: BLE001 - warm-up must never take the ingress down
                logger.exception("warm-up step failed; trying again")
            try:
                async with asyncio.timeout(wait):
                    await self._wake.wait()
            except TimeoutError:
                pass
            self._wake.clear()

    async def _changes(self, known: set[str], ids: set[str], drained_before: frozenset[str],
                       drained: frozenset[str]) -> None:
        """Act on what changed since the last look: joins, leaves, new drains."""
        warmer = self.warmer
        live = [r for r in sorted(ids) if r not in drained]
        for r in sorted(ids - known):
            await warmer.replica_joined(r)
        for r in sorted(known - ids):
            warmer.forget_replica(r)
            await warmer.replica_left(r, live)
            self.record.forget_replica(r)
        for r in sorted(drained - drained_before):
            await warmer.replica_left(r, [x for x in live if x != r])

    def _send(self, job: WarmJob, info, cached_tokens: int) -> None:
        task = asyncio.get_running_loop().create_task(self._post(job, info))
        self._posts.add(task)
        task.add_done_callback(self._posts.discard)

    async def _post(self, job: WarmJob, info) -> None:
        """One warm-up request to ``info``'s engine; ``Warmer.finished`` either way."""
        ok = False
        url = info.metadata.engine_url
        extra = job.prefix.extra
        body = {"model": extra.lora_name or self.settings.served_model_name,
                "prompt": list(job.prefix.token_ids), "max_tokens": 1, "temperature": 0}
        if extra.cache_salt is not None:
            body["cache_salt"] = extra.cache_salt
        try:
            if not url:
                raise RuntimeError("the replica reports no engine URL")
            status, _, data = await self.ingress.engine_client().call(
                "POST", url + COMPLETIONS_PATH, json.dumps(body).encode(),
                {"content-type": "application/json"})
            ok = status == 200
            if not ok:
                logger.warning("warm-up %s on replica %s: the engine answered %d: %s",
                               job.request_id, info.replica_id, status,
                               data[:200].decode(errors="replace"))
        except (*ENGINE_ERRORS, RuntimeError) as exc:
            logger.warning("warm-up %s on replica %s failed: %s", job.request_id,
                           info.replica_id, exc)
        finally:
            await self.warmer.finished(job.request_id, ok)
            self._wake.set()
