"""A candidate replica as the router sees it: typed records of what each engine replica
reports through Ray Serve.

Serve carries two plain dicts per replica: the metadata a replica records once it is ready
(``record_replica_metadata``) and the routing stats it returns every
``request_routing_stats_period_s`` (``record_routing_stats``; docs/reference.md 1). The
replica writes them with ``to_dict`` and the router reads them with ``from_dict``, so each
key is defined here once, with its unit; unknown keys are ignored and missing ones take the
defaults (a replica that has reported nothing yet).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, Mapping

from router.hashing import HashSettings


@functools.cache
def _field_names(cls) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _known(cls, d: Mapping[str, Any] | None) -> dict[str, Any]:
    names = _field_names(cls)
    return {k: v for k, v in (d or {}).items() if k in names}


@dataclass(frozen=True)
class ReplicaMetadata:
    """What a replica advertises once its engine is up.

    Attributes:
        replica_id: Serve's replica id.
        engine: ``vllm`` or ``sim`` (the simulated engine).
        node_ip: the node the replica runs on.
        engine_url: base URL of the engine's OpenAI server (``http://host:port``), which
            the direct data path calls.
        kv_events_endpoint / kv_replay_endpoint / kv_events_topic: the engine's KV-event
            publisher (ZMQ), replay socket and topic.
        model: the served model name.
        device: ``cpu`` or ``cuda``.
        hash_probe: ``ok``, ``mismatch`` (the engine's ``BlockStored`` hashes differ from
            the router's: the replica is refused) or ``no_events``.
        hash_settings: the engine's block hashing (``HashSettings.as_dict``: ``hash_algo``,
            ``block_size``, ``seed``, ``extra_key_encoding``); empty before it reports.
        lora_adapters: the names of the LoRA adapters its engine loads.
    """

    replica_id: str = ""
    engine: str = ""
    node_ip: str = ""
    engine_url: str = ""
    kv_events_endpoint: str = ""
    kv_replay_endpoint: str = ""
    kv_events_topic: str = ""
    model: str = ""
    device: str = ""
    hash_probe: str = ""
    hash_settings: dict[str, Any] = field(default_factory=dict)
    lora_adapters: list[str] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "ReplicaMetadata":
        """From Serve's ``replica_metadata`` (hash settings flat, as ``to_dict`` writes)."""
        d = dict(d or {})
        hash_keys = _field_names(HashSettings)
        hs = {k: d.pop(k) for k in list(d) if k in hash_keys}
        return cls(**{k: v for k, v in _known(cls, d).items() if v is not None},
                   hash_settings=hs)

    def to_dict(self) -> dict[str, Any]:
        """The plain dict Serve carries (hash settings flat, beside the other keys)."""
        d = dataclasses.asdict(self)
        return {**{k: v for k, v in d.items() if k != "hash_settings"}, **self.hash_settings}

    @property
    def reported(self) -> bool:
        """Whether the replica has advertised its hash settings yet."""
        return "hash_algo" in self.hash_settings


@dataclass(frozen=True)
class RoutingStats:
    """What a replica reports about its engine every stats period.

    Attributes:
        prefill_tokens_per_s: the engine's measured prefill rate (tokens/s), None before
            any measurement.
        prefill_rate_measured: the rate comes from the engine's counters, not the default.
        kv_events_live: the engine publishes KV events (False: approximate mode, predicted
            entries with the long TTL); None before it is known.
        kv_event_batches / kv_event_gaps: batches received, sequence gaps seen.
        kv_event_lag_s: engine step time to receipt of the last batch (s).
        index_dirty: the replica's feed has entries the shared index has not taken yet.
        engine_pid: the engine server's process id.
        running / waiting: the engine's running and waiting requests.
        kv_usage_frac: the engine's KV cache usage (0..1).
        kv_capacity_tokens: the engine's KV cache size in tokens (``num_gpu_blocks x
            block_size``, from ``vllm:cache_config_info``); None before it is known.
        engine_alive: the engine process runs and answered its health check; None before
            the first report.
        restarts: times the replica restarted its engine.
        active_blocks: KV blocks of the requests in flight there (simulator only).
        kv_cached_tokens: the tokens of KV the engine holds with a block hash (in use or
            cached for reuse): the distinct blocks its KV events hold (the replica's event
            feed's record; of a data-parallel server, the first rank's, whose events the
            feed receives) x block size; None without live KV events.
        output_tokens_total / requests_finished_total: the engine's
            ``vllm:generation_tokens_total`` and ``vllm:request_success_total`` (the
            expected output length is their ratio over the fleet).
        scrape_error: why the last scrape of the engine's metrics failed.
    """

    prefill_tokens_per_s: float | None = None
    prefill_rate_measured: bool = False
    kv_events_live: bool | None = None
    kv_event_batches: int = 0
    kv_event_gaps: int = 0
    kv_event_lag_s: float | None = None
    index_dirty: bool = False
    engine_pid: int | None = None
    running: int = 0
    waiting: int = 0
    kv_usage_frac: float | None = None
    kv_capacity_tokens: int | None = None
    engine_alive: bool | None = None
    restarts: int | None = None
    active_blocks: int = 0
    kv_cached_tokens: int | None = None
    output_tokens_total: float = 0.0
    requests_finished_total: float = 0.0
    scrape_error: str | None = None

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "RoutingStats":
        """From Serve's ``routing_stats`` (None values take the defaults)."""
        return cls(**{k: v for k, v in _known(cls, d).items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        """The plain dict Serve carries."""
        return dataclasses.asdict(self)


@dataclass
class ReplicaInfo:
    """A candidate replica: its id, advertised metadata and last routing stats (plain dicts
    are accepted and converted)."""

    replica_id: str
    metadata: ReplicaMetadata = field(default_factory=ReplicaMetadata)
    stats: RoutingStats = field(default_factory=RoutingStats)

    def __post_init__(self):
        if not isinstance(self.metadata, ReplicaMetadata):
            self.metadata = ReplicaMetadata.from_dict(self.metadata)
        if not isinstance(self.stats, RoutingStats):
            self.stats = RoutingStats.from_dict(self.stats)


def hash_mismatches(mine: HashSettings, metadata: ReplicaMetadata) -> list[str]:
    """What a replica's advertised metadata contradicts in the router's hash settings: the
    differing settings, and ``hash_probe`` when the engine's own ``BlockStored`` hashes for a
    probe prompt differed from the router's. Empty for a replica with no metadata yet."""
    if not metadata.reported:
        return []
    bad = mine.mismatches(metadata.hash_settings)
    if metadata.hash_probe == "mismatch":
        bad.append("hash_probe (the engine's BlockStored hashes differ from the router's)")
    return bad
