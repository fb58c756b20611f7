"""Load and speed of an engine, read from its Prometheus ``/metrics``.

Metric names are vLLM's (``vllm/v1/metrics/loggers.py``; table in
docs/reference.md 4.7). The prefill rate is measured,
not configured: Δ(prompt tokens − cached prompt tokens) / Δ(sum of request prefill time)
between two scrapes, i.e. uncached tokens prefilled per second of prefill (docs/architecture.md,
decision 4).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families


@dataclass
class EngineSnapshot:
    """Totals and gauges of one scrape (``parse_engine_metrics``): counts and totals
    summed over the server's engines; ``kv_usage_frac`` their mean KV usage (0..1);
    ``kv_capacity_tokens`` one engine's KV size in tokens (the server's with one engine),
    None when unknown."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage_frac: float = 0.0
    prompt_tokens_total: float = 0.0
    prompt_tokens_cached_total: float = 0.0
    prefill_time_sum_s: float = 0.0
    prefill_time_count: float = 0.0
    prefix_cache_queries_total: float = 0.0
    prefix_cache_hits_total: float = 0.0
    requests_finished_total: float = 0.0
    generation_tokens_total: float = 0.0
    kv_capacity_tokens: int | None = None

    @property
    def computed_prompt_tokens_total(self) -> float:
        """Prompt tokens the engine computed rather than took from its prefix cache."""
        return self.prefix_cache_queries_total - self.prefix_cache_hits_total


_GAUGES = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting"}
_SAMPLES = {"vllm:prompt_tokens_total": "prompt_tokens_total",
            "vllm:prompt_tokens_cached_total": "prompt_tokens_cached_total",
            "vllm:request_prefill_time_seconds_sum": "prefill_time_sum_s",
            "vllm:request_prefill_time_seconds_count": "prefill_time_count",
            "vllm:prefix_cache_queries_total": "prefix_cache_queries_total",
            "vllm:prefix_cache_hits_total": "prefix_cache_hits_total",
            # every finish reason counted there (stop, length, error, repetition) summed
            "vllm:request_success_total": "requests_finished_total",
            "vllm:generation_tokens_total": "generation_tokens_total"}


def parse_engine_metrics(text: str) -> EngineSnapshot:
    """Parse vLLM's ``/metrics`` text; unknown or missing metrics stay 0.

    Counts and totals are summed over the engines a server runs (its ``engine`` label:
    data-parallel ranks). The KV cache's size is read from the labels of
    ``vllm:cache_config_info``: ``num_gpu_blocks x block_size`` tokens. The front end
    publishes one label set per engine, each with the server's whole block count (it sums
    the engines' counts at start-up, ``vllm/v1/engine/core_client.py``: "Sum
    num_gpu_blocks from all engines in DP case"; ``log_metrics_info`` in
    ``vllm/v1/metrics/loggers.py``), so the size is that count, not the labels' sum. It is
    None when the usage gauge or the info gauge is missing or its labels are not numbers
    (``num_gpu_blocks`` is ``"None"`` before the engine has profiled its memory).
    ``kv_usage_frac`` is the mean of the engines' ``vllm:kv_cache_usage_perc`` (engines of
    one server are alike: equal shares of the count), 0 when none is published.

    ``kv_capacity_tokens`` is one engine's share of that size (the size over the engines
    publishing a usage gauge): a request runs on one engine, picked by the front end's
    load balancer by its queue (``waiting + running``, ``get_core_engine_for_request``),
    not by its free KV, so the cost model judges whether it fits against an average engine,
    ``share x (1 - mean usage)``, not against the server's whole free KV."""
    snap = EngineSnapshot()
    usage: dict[str, float] = {}
    size: int | None = None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            attr = _GAUGES.get(sample.name) or _SAMPLES.get(sample.name)
            if attr:
                setattr(snap, attr, getattr(snap, attr) + sample.value)
            elif sample.name == "vllm:kv_cache_usage_perc":
                engine = sample.labels.get("engine", "")
                usage[engine] = usage.get(engine, 0.0) + sample.value
            elif sample.name == "vllm:cache_config_info":
                try:
                    size = max(size or 0, int(sample.labels["num_gpu_blocks"])
                               * int(sample.labels["block_size"]))
                except (KeyError, ValueError):
                    continue
    if usage:
        snap.kv_usage_frac = sum(usage.values()) / len(usage)
        snap.kv_capacity_tokens = None if size is None else size // len(usage)
    return snap


@dataclass
class PrefillRateEstimator:
    """Uncached prompt tokens per second of prefill, from successive snapshots.

    Keeps the last measured rate when no prefill happened between two scrapes; starts at
    ``initial_tokens_per_s`` (``Settings.prefill_tokens_per_s``). Smoothed with an
    exponential moving average of weight ``alpha`` per measurement.
    """

    initial_tokens_per_s: float
    alpha: float = 0.5
    rate_tokens_per_s: float = field(init=False)
    measured: bool = field(default=False, init=False)
    _last: EngineSnapshot | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.rate_tokens_per_s = self.initial_tokens_per_s

    def update(self, snap: EngineSnapshot) -> float:
        last, self._last = self._last, snap
        if last is not None:
            d_tokens = ((snap.prompt_tokens_total - snap.prompt_tokens_cached_total)
                        - (last.prompt_tokens_total - last.prompt_tokens_cached_total))
            d_time = snap.prefill_time_sum_s - last.prefill_time_sum_s
            if d_tokens > 0 and d_time > 0:
                measured = d_tokens / d_time
                if not self.measured:
                    self.rate_tokens_per_s, self.measured = measured, True
                else:
                    self.rate_tokens_per_s = (self.alpha * measured
                                              + (1 - self.alpha) * self.rate_tokens_per_s)
        return self.rate_tokens_per_s
