"""vLLM's KV-cache events on the wire, decoded into typed events.

Wire format (vLLM 0.26 / 0.32 ``vllm/distributed/kv_events.py``; docs/reference.md 4.3):
each batch is a 3-frame PUB message ``[topic, seq (8 bytes, big-endian), payload]``; the
payload is msgpack of ``[ts, [events...], dp_rank]`` (a 2-element array is accepted too);
each event is a map tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``) with default-valued fields omitted. Hashes are ints (the low 64 bits,
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) or raw digest bytes; both map to the same key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import msgspec

from router.hashing import BlockHash, to_block_hash

_decoder = msgspec.msgpack.Decoder()


class EventKind(str, Enum):
    """The KV-cache event kinds the index uses (vLLM's ``BlockStored``, ``BlockRemoved``,
    ``AllBlocksCleared``)."""

    STORED = "stored"
    REMOVED = "removed"
    CLEARED = "cleared"


# ``KVEvent.parent_block_hash`` of blocks stored after parents the writer does not say
# (``router.kv_events.feed`` rebuilding an index writes a block's copies past the first so;
# the index then only adds copies to held blocks); no engine's hash (those are unsigned).
UNKNOWN_PARENT: BlockHash = -1


@dataclass
class KVEvent:
    """One decoded vLLM KV-cache event (``vllm/distributed/kv_events.py``).

    Attributes:
        kind: ``EventKind`` (a plain ``"stored"`` / ``"removed"`` / ``"cleared"`` is
            taken too).
        block_hashes: the 64-bit block keys, in prompt order for ``stored``.
        parent_block_hash: for ``stored``, the key of the block before the first one
            (None at block 0; ``UNKNOWN_PARENT``: each block's parent is not known).
        medium: ``"GPU"`` for the engine's own KV cache (also on CPU engines); events of
            other media (offloaded tiers) do not make a prefill skip and are ignored.
    """

    kind: EventKind
    block_hashes: list[BlockHash] = field(default_factory=list)
    parent_block_hash: BlockHash | None = None
    medium: str | None = "GPU"

    def __post_init__(self):
        self.kind = EventKind(self.kind)


def decode_event(raw: dict) -> KVEvent | None:
    """One event map → ``KVEvent``; None for event types the index does not use."""
    kind = raw.get("type")
    if kind == "BlockStored":
        parent = raw.get("parent_block_hash")
        return KVEvent(EventKind.STORED, [to_block_hash(h) for h in raw.get("block_hashes") or []],
                       to_block_hash(parent) if parent is not None else None,
                       raw.get("medium", "GPU"))
    if kind == "BlockRemoved":
        return KVEvent(EventKind.REMOVED, [to_block_hash(h) for h in raw.get("block_hashes") or []],
                       None, raw.get("medium", "GPU"))
    if kind == "AllBlocksCleared":
        return KVEvent(EventKind.CLEARED)
    return None


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """A batch payload → (engine step time ``ts`` in s since the epoch, events in order).

    Raises:
        ValueError: the payload is not a KV-event batch.
    """
    try:
        batch = _decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"not a msgpack KV-event batch: {exc}") from exc
    if not isinstance(batch, (list, tuple)) or len(batch) < 2:
        raise ValueError("KV-event batch must be an array [ts, events, dp_rank]")
    events = [e for e in (decode_event(r) for r in batch[1] if isinstance(r, dict)) if e]
    return float(batch[0]), events


@dataclass
class EventBatch:
    """One received batch: ``topic`` (the replica), sequence number, engine step time and
    events. ``replayed`` marks batches fetched from the replay endpoint."""

    topic: str
    seq: int
    ts: float
    events: list[KVEvent]
    replayed: bool = False
