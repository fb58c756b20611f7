"""The router's Prometheus metrics, recorded through Ray's metrics API.

``ray.util.metrics`` sends every process's records to Ray's per-node exporter, so counters
from several ingress and replica processes add up in one export (docs/architecture.md,
decision 6). Ray's exporter prefixes names with ``ray_`` (``ray_router_decision_total``...);
the router's ``/metrics`` strips it again after summing over processes
(``aggregate_ray_export``), so clients see ``router_...``. Counters are totals, never
last-value gauges of a ratio (docs/fault-cases.md 12.1): a hit rate is ``cached / prompt``
over a window.

Metric objects are created lazily, once per process (a Serve deployment re-pickles the
router's module, so this module keeps them, not the router).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

_lock = threading.Lock()
_metrics: dict[str, Any] = {}

OVERHEAD_BOUNDARIES_S = [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                         0.1, 0.25, 0.5, 1.0]
PREDICTION_ERROR_BOUNDARIES_TOKENS = [1, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192,
                                      16384, 32768, 131072]
TTFT_BOUNDARIES_S = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0]
KV_APPLY_LAG_BOUNDARIES_S = OVERHEAD_BOUNDARIES_S + [2.5, 5.0, 10.0, 30.0]


def _make() -> dict[str, Any]:
    from ray.util.metrics import Counter, Gauge, Histogram

    return {
        "requests": Counter("router_requests_total",
                            "Requests answered by the ingress, by route and status code (499: the "
                            "client left before the answer started).",
                            tag_keys=("route", "status")),
        "decisions": Counter("router_decision_total",
                             "Routing decisions by reason: cache (a prefix match won), load "
                             "(no useful match; load decided), session (the session's pinned "
                             "replica kept it), fallback (index unavailable).",
                             tag_keys=("reason", "policy")),
        "dispatched": Counter("router_dispatched_total",
                              "Requests dispatched to each replica (attempts, retries included).",
                              tag_keys=("replica",)),
        "completed": Counter("router_completed_total",
                             "Dispatched requests finished on each replica (any outcome). "
                             "In flight = dispatched - completed, summed over routers.",
                             tag_keys=("replica",)),
        "inflight": Gauge("router_inflight",
                          "Requests this router process has in flight on each replica.",
                          tag_keys=("replica",)),
        "prompt_tokens": Counter("router_prompt_tokens_total",
                                 "Prompt tokens of answered requests whose usage the engine "
                                 "reported (non-streamed, or streamed with "
                                 "stream_options.include_usage).",
                                 tag_keys=("replica",)),
        "engine_cached_tokens": Counter(
            "router_engine_cached_tokens_total",
            "usage.prompt_tokens_details.cached_tokens reported by the engines (the same "
            "requests as router_prompt_tokens_total).",
            tag_keys=("replica",)),
        "predicted_cached_tokens": Counter(
            "router_predicted_cached_tokens_total",
            "Cached tokens the index predicted on the replica that served the request (the "
            "same requests as router_prompt_tokens_total).",
            tag_keys=("replica",)),
        "predicted_blocks": Counter(
            "router_selected_predicted_blocks_total",
            "Predicted cached blocks on the chosen replica, summed over decisions.",
            tag_keys=("replica",)),
        "long_prompts": Counter(
            "router_long_prompts_total",
            "Prompts with more than route_head_chars characters to tokenize, by how far the "
            "router tokenized them: head (no replica held the head; routed on it) or whole "
            "(a replica held it, or it had no full block to look up).",
            tag_keys=("tokenized",)),
        "keepalive_streams": Counter(
            "router_keepalive_streams_total",
            "Streaming requests that had nothing to send within sse_keepalive_s and got SSE "
            "keep-alives while they waited (queue or engine).", tag_keys=("route",)),
        "shadow_decisions": Counter(
            "router_shadow_decisions_total",
            "Sampled live decisions evaluated by each shadow policy, by whether it would "
            "have chosen the live replica (router.routing.shadow).",
            tag_keys=("policy", "agrees")),
        "shadow_cached_tokens": Counter(
            "router_shadow_cached_tokens_total",
            "Over the sampled decisions, the cached tokens the replica each shadow policy "
            "would have chosen holds for the request (index match at decision time); "
            "policy=live: the live decisions' own predictions.", tag_keys=("policy",)),
        "shadow_seconds": Counter(
            "router_shadow_seconds_total",
            "Router time spent on shadow evaluation (loads read, policy copy, choices)."),
        "retries": Counter("router_retries_total",
                           "Requests retried on another replica before the first byte.",
                           tag_keys=("reason",)),
        "index_errors": Counter("router_index_errors_total",
                                "Index (Redis) calls that failed or timed out.",
                                tag_keys=("op",)),
        "index_shed": Counter(
            "router_index_shed_total",
            "Route scripts (op=route) and session reads (op=session) not sent, as many "
            "of the process's such calls being in flight as its adaptive bound allows "
            "(Redis answering late, router.index.redis.RoutingCallLimit): their requests "
            "were decided as when the index fails, at once.", tag_keys=("op",)),
        "index_available": Gauge("router_index_available",
                                 "1 while the last index call succeeded, else 0."),
        "index_layout_conflict": Gauge(
            "router_index_layout_conflict",
            "1 while routers of another key layout (another version) share the index's "
            "namespace: this router then routes without the shared index "
            "(router.index.layout)."),
        "hash_mismatch": Gauge("router_replica_hash_mismatch",
                               "1 for a replica whose hash settings differ from the router's "
                               "(it gets no cache-aware traffic).", tag_keys=("replica",)),
        "replicas_without_kv_events": Gauge(
            "router_replicas_without_kv_events",
            "Replicas whose engine published no KV events after serving cacheable requests "
            "(routed on predicted entries only)."),
        "kv_event_batches": Counter("router_kv_event_batches_total",
                                    "KV-event batches consumed.", tag_keys=("replica",)),
        "kv_event_gaps": Counter("router_kv_event_gaps_total",
                                 "Sequence gaps in an engine's KV events.",
                                 tag_keys=("replica",)),
        "kv_event_lag": Histogram("router_kv_event_lag_seconds",
                                  "Engine step time to consumption of a KV-event batch.",
                                  boundaries=OVERHEAD_BOUNDARIES_S, tag_keys=("replica",)),
        "kv_event_apply_lag": Histogram(
            "router_kv_event_apply_lag_seconds",
            "Engine step time of a live KV-event batch to the end of its write into the index "
            "(batching and the index round trip included; replayed batches and batches a "
            "resync rewrites are not observed).",
            boundaries=KV_APPLY_LAG_BOUNDARIES_S, tag_keys=("replica",)),
        "kv_blocks_applied": Counter("router_kv_blocks_applied_total",
                                     "Block hashes written to the index from KV events.",
                                     tag_keys=("replica",)),
        "engine_requests": Gauge(
            "router_engine_requests",
            "Requests the replica's engine reports, by state: running or waiting (vLLM's "
            "vllm:num_requests_running and vllm:num_requests_waiting, scraped by the replica).",
            tag_keys=("replica", "state")),
        "engine_kv_cache_usage": Gauge(
            "router_engine_kv_cache_usage",
            "Fraction of the engine's KV cache in use, 0 to 1 (vllm:kv_cache_usage_perc).",
            tag_keys=("replica",)),
        "index_entries": Gauge("router_index_entries",
                               "(block, replica) entries in the index."),
        "overhead": Histogram("router_routing_overhead_seconds",
                              "Arrival to dispatch: parse, tokenize, hash, index, score.",
                              boundaries=OVERHEAD_BOUNDARIES_S, tag_keys=("policy",)),
        "decision_time": Histogram("router_decision_seconds",
                                   "choose_replicas: index round trip and policy.",
                                   boundaries=OVERHEAD_BOUNDARIES_S, tag_keys=("policy",)),
        "ttft": Histogram("router_ttft_seconds",
                          "Arrival at the ingress to the first body byte from the replica.",
                          boundaries=TTFT_BOUNDARIES_S, tag_keys=("route",)),
        "prediction_error": Histogram(
            "router_cached_tokens_prediction_error",
            "Per answered request, |predicted - engine-reported| cached tokens on the replica "
            "that served it; direction: exact, over (predicted more than the engine had) or "
            "under.",
            boundaries=PREDICTION_ERROR_BOUNDARIES_TOKENS, tag_keys=("direction",)),
        "late_routes": Counter(
            "router_late_routes_total",
            "Route scripts that missed the routing deadline (the request went by the "
            "fallback), settled once they answered, by outcome: same (it chose that replica "
            "too), moved (it chose another: its new predicted entries dropped, its lease "
            "ended, the request's replica's entries written), held (it found a long "
            "prompt's head held whole: nothing reserved, the request's replica's entries "
            "written), lost (it failed or never "
            "answered), dropped (cut at the deadline: nothing undone), failed (a "
            "correction failed).", tag_keys=("outcome",)),
        "sessions": Counter("router_session_affinity_total",
                            "Requests of a session by what became of its pin: kept, new, "
                            "joined (another router pinned it first), yielded_dead, "
                            "yielded_overloaded, unavailable (the store failed).",
                            tag_keys=("outcome",)),
        "warmup_requests": Counter(
            "router_warmup_requests_total",
            "Warm-up requests (prefill-only, max_tokens 1) that ended, by reason: scale_out "
            "(a replica joined) or rehome (the prefixes only a leaving replica held), and "
            "outcome: ok or error (router.routing.warmup).", tag_keys=("reason", "outcome")),
        "warmup_tokens": Counter(
            "router_warmup_tokens_total",
            "Prompt tokens warm-up requests asked the engines to compute (each prefix's "
            "tokens beyond what the index predicted on its replica), by reason.",
            tag_keys=("reason",)),
        "admission_waiting": Gauge("router_admission_waiting",
                                   "Requests waiting in the ingress's admission queue (every "
                                   "replica at max_inflight_per_replica)."),
        "admission_refused": Counter("router_admission_refused_total",
                                     "Requests refused with a 429, by reason: overloaded (no "
                                     "slot within queue_timeout_s, or none expected in it), "
                                     "standing_queue, sustained_overload (router.serve."
                                     "admission), rate_limit_requests, rate_limit_tokens.",
                                     tag_keys=("reason",)),
        "admission_wait": Histogram("router_admission_wait_seconds",
                                    "Time admitted requests waited in the admission queue.",
                                    boundaries=TTFT_BOUNDARIES_S),
    }


def get(name: str):
    """The process's metric called ``name`` (see ``_make``)."""
    with _lock:
        if not _metrics:
            _metrics.update(_make())
        return _metrics[name]


FLUSH_S = 0.5  # how often coalesced counter increments and gauge values reach Ray (s)
# How often every gauge set through ``set_gauge`` is handed to Ray again, changed or not
# (s). Ray's metrics agent drops a gauge series not reported for two of its export
# periods (``RAY_metrics_report_interval_ms``, 5 s by default, at least 1 s:
# ``ray._private.telemetry.open_telemetry_metric_recorder``, Ray 2.60), so a gauge set
# only when it changes (``router_index_available`` on an idle router) vanished from
# ``/metrics``, and an alert on its value saw nothing (a break test).
REFRESH_S = 1.0


class Coalesced:
    """Counter increments and gauge values held in the process and handed to the metric
    objects of ``metric_of(name)`` in one record per (name, tags) at each ``flush``: a
    daemon thread flushes every ``interval_s`` (none when None: ``flush`` by hand), and
    every ``refresh_s`` hands every gauge's latest value again (``REFRESH_S``) until
    ``forget`` drops its series. Thread-safe."""

    def __init__(self, metric_of, interval_s: float | None, refresh_s: float = REFRESH_S):
        self.metric_of, self.interval_s, self.refresh_s = metric_of, interval_s, refresh_s
        self._lock = threading.Lock()
        self._incs: dict[tuple[str, tuple], float] = {}  # (counter, tags) -> to add
        self._sets: dict[tuple[str, tuple], float] = {}  # (gauge, tags) -> latest value
        self._latest: dict[tuple[str, tuple], float] = {}  # every gauge series, refreshed
        self._thread: threading.Thread | None = None

    def inc(self, name: str, value: float, tags: dict[str, str] | None) -> None:
        key = (name, tuple(sorted(tags.items())) if tags else ())
        with self._lock:
            self._incs[key] = self._incs.get(key, 0.0) + value
            self._start_locked()

    def set(self, name: str, value: float, tags: dict[str, str] | None) -> None:
        key = (name, tuple(sorted(tags.items())) if tags else ())
        with self._lock:
            self._sets[key] = self._latest[key] = value
            self._start_locked()

    def forget(self, name: str, tags: dict[str, str] | None) -> None:
        """Stop refreshing gauge ``name``'s series of ``tags`` (a value set and not flushed
        yet is still handed on once): Ray drops it after its retention."""
        with self._lock:
            self._latest.pop((name, tuple(sorted(tags.items())) if tags else ()), None)

    def _start_locked(self) -> None:
        if self.interval_s is not None and (self._thread is None
                                            or not self._thread.is_alive()):
            self._thread = threading.Thread(target=self._flush_forever, daemon=True,
                                            name="router-metrics-flush")
            self._thread.start()

    def flush(self, refresh: bool = False) -> None:
        """Hand every held increment and gauge value to its metric now; with ``refresh``,
        every gauge series' latest value too."""
        with self._lock:
            incs, sets = self._incs, self._sets
            self._incs, self._sets = {}, {}
            if refresh:
                sets = {**self._latest, **sets}
        for held, op in ((incs, "inc"), (sets, "set")):
            for (name, tags), value in held.items():
                try:  # one bad record (a tag the metric lacks) must not drop the others
                    getattr(self.metric_of(name), op)(value, tags=dict(tags) or None)
                except Exception:
                    import logging
                    logging.getLogger(__name__).exception("metric %s not recorded", name)
                    if op == "set":  # not refreshed (and logged) again every second
                        with self._lock:
                            self._latest.pop((name, tags), None)

    def _flush_forever(self) -> None:
        import logging
        import time

        last_refresh = time.monotonic()
        while True:
            time.sleep(self.interval_s)
            now = time.monotonic()
            refresh = now - last_refresh >= self.refresh_s
            if refresh:
                last_refresh = now
            try:
                self.flush(refresh)
            except Exception:  # a metric must never stop the flushes (nor the process)
                logging.getLogger(__name__).exception("metrics flush failed")


_coalesced = Coalesced(lambda name: get(name), FLUSH_S)


def inc(name: str, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
    """Add ``value`` to counter ``name`` (Ray's counters refuse 0 and negatives: skipped).

    The increment is coalesced with the others of the same counter and tags and handed to
    Ray's metrics API at most ``FLUSH_S`` later (``Coalesced``): one record of Ray's API cost
    about 37 us of the ingress's CPU on the 2-core VM (``ray.util.metrics.Metric._record``
    validates and merges the tags on every call), and a request made about ten of them
    (docs/benchmarks.md, "Reading the router throughput against issue 12"). Ray's exporter
    sends its totals every few seconds anyway, so a scrape sees an increment at most
    ``FLUSH_S`` later than it would have; those of a process's last ``FLUSH_S`` before it
    exits are lost, as Ray's own unexported records are."""
    if value > 0:
        _coalesced.inc(name, value, tags)


def set_gauge(name: str, value: float, tags: dict[str, str] | None = None) -> None:
    """Set gauge ``name`` to ``value``, coalesced as ``inc`` (the latest value wins), and
    handed to Ray again every ``REFRESH_S`` while this process lives, so that the series
    does not vanish between changes (``forget_gauge`` ends it)."""
    _coalesced.set(name, value, tags)


def forget_gauge(name: str, tags: dict[str, str] | None = None) -> None:
    """Stop refreshing a ``set_gauge`` series (its replica left): Ray drops it later."""
    _coalesced.forget(name, tags)


def record_engine_load(replica: str, running: float, waiting: float,
                       kv_cache_usage: float) -> None:
    """Export one scrape of ``replica``'s engine: its running and waiting requests and its
    KV-cache usage (each replica process sets only its own replica's series)."""
    gauge = get("engine_requests")
    gauge.set(running, tags={"replica": replica, "state": "running"})
    gauge.set(waiting, tags={"replica": replica, "state": "waiting"})
    get("engine_kv_cache_usage").set(kv_cache_usage, tags={"replica": replica})


# Gauges that are each router's view of the whole fleet: summing them over router
# processes would count one replica once per router, so they aggregate otherwise. An
# engine's own figures are set by its Ray replica alone, or, for an engine reached by URL,
# by every router process that watches it: the same value, kept once.
_FLEET_VIEW_GAUGES = {"router_replicas_without_kv_events": max, "router_index_entries": max,
                      "router_replica_hash_mismatch": max, "router_index_available": min,
                      "router_index_layout_conflict": max,
                      "router_engine_requests": max, "router_engine_kv_cache_usage": max}

# Labels Ray's exporter adds per process; dropping them sums a series over processes.
_PROCESS_LABELS = {"WorkerId", "Component", "SessionName", "Version", "NodeAddress", "JobId",
                   "otel_scope_name", "otel_scope_schema_url", "otel_scope_version"}


def aggregate_ray_export(texts: list[str], prefix: str = "ray_router_") -> str:
    """Sum the router's series over processes and nodes, in Prometheus text format.

    Args:
        texts: Prometheus exports of Ray's per-node metrics agents.
        prefix: keep only families whose name starts with it; the ``ray_`` of Ray's export
            is removed from the names (``router_decision_total``...).
    Returns:
        One sample per (name, labels without process labels): counters, histogram buckets
        and per-process gauges (in-flight counts) summed across every router and replica
        process; fleet-view gauges (``_FLEET_VIEW_GAUGES``) take the max or min instead.
    """
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[tuple, float] = {}
    kinds: dict[str, tuple[str, str]] = {}
    # only the router's lines reach the parser (Ray's export holds every Ray series of the
    # node, most of it): a family's HELP and TYPE lines and its samples all name it. On
    # the 2-core VM, 11,000 lines of other families with the router's: 290 ms to parse
    # them all, 2.7 ms to filter and aggregate
    heads = (prefix, f"# HELP {prefix}", f"# TYPE {prefix}")
    for text in texts:
        ours = "\n".join(line for line in text.splitlines() if line.startswith(heads))
        for fam in text_string_to_metric_families(ours):
            if not fam.name.startswith(prefix):
                continue
            name = fam.name[len("ray_"):]
            kinds.setdefault(name, (fam.type, fam.documentation))
            for s in fam.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items()
                                      if k not in _PROCESS_LABELS))
                key = (name, s.name[len("ray_"):], labels)
                agg = _FLEET_VIEW_GAUGES.get(name)
                if key not in sums:
                    sums[key] = s.value
                else:
                    sums[key] = agg(sums[key], s.value) if agg else sums[key] + s.value
    out: list[str] = []
    for fam_name, (kind, doc) in sorted(kinds.items()):
        out.append(f"# HELP {fam_name} {doc}")
        out.append(f"# TYPE {fam_name} {kind}")
        for (fname, sname, labels), value in sorted(sums.items()):
            if fname != fam_name:
                continue
            lab = ",".join(f'{k}="{v}"' for k, v in labels)
            out.append(f"{sname}{{{lab}}} {value!r}" if lab else f"{sname} {value!r}")
    return "\n".join(out) + "\n"


class MetricsUnavailable(Exception):
    """A live node's metrics exporter did not answer: the scrape fails as a whole."""


async def scrape_cluster_metrics(timeout_s: float = 5.0) -> str:
    """The router's metrics from Ray's exporter on every live node, summed over processes
    (``aggregate_ray_export``).

    Ray's node list (a blocking call to its GCS) and the parsing of the exports (Python's
    Prometheus parser over every Ray series of every node) run on a thread, and the nodes
    are read at once: on the ingress's event loop, a scrape took 0.5 to 15.6 s on the
    2-core VM under load, and stopped every request's routing meanwhile (a break test).

    Raises:
        MetricsUnavailable: an alive node's exporter failed or did not answer within
            ``timeout_s``. Its counters would otherwise drop out of the sums, and a
            Prometheus reading a lower counter takes it for a reset (``rate()`` then counts
            the whole total again when the node is back), where a failed scrape only
            leaves a gap (``up == 0``). Before, such a scrape came back as an empty 200.
    """
    import ray

    try:
        nodes = await asyncio.to_thread(ray.nodes)
    except Exception as exc:  # Ray's GCS did not answer: a failed scrape, not a 500
        raise MetricsUnavailable(f"Ray's node list: {type(exc).__name__}: {exc}") from None
    urls = [f"http://{_host(n['NodeManagerAddress'])}:{n['MetricsExportPort']}/metrics"
            for n in nodes if n.get("Alive") and n.get("MetricsExportPort")]
    texts = await fetch_exports(urls, timeout_s)
    return await asyncio.to_thread(aggregate_ray_export, texts)


def _host(address: str) -> str:
    """An address as a URL's host: an IPv6 one in brackets."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


async def fetch_exports(urls: list[str], timeout_s: float = 5.0) -> list[str]:
    """The bodies of ``urls`` (Prometheus exports), read at once, in order.

    Raises:
        MetricsUnavailable: none to read, or one failed (any error), answered other than
            200 or took longer than ``timeout_s`` in all; the message names them.
    """
    import httpx

    if not urls:
        raise MetricsUnavailable("no live Ray node exports metrics")

    async def get(client: httpx.AsyncClient, url: str):
        async with asyncio.timeout(timeout_s):  # the whole request (httpx's: each phase)
            return await client.get(url)

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        results = await asyncio.gather(*(get(client, u) for u in urls),
                                       return_exceptions=True)
    texts, failed = [], []
    for url, r in zip(urls, results):
        if isinstance(r, asyncio.CancelledError):
            raise r
        if isinstance(r, BaseException):
            failed.append(f"{url} ({type(r).__name__})")
        elif r.status_code != 200:
            failed.append(f"{url} (HTTP {r.status_code})")
        else:
            texts.append(r.text)
    if failed:
        raise MetricsUnavailable("Ray's metrics exporter did not answer on " + ", ".join(failed))
    return texts
