"""A subscriber to one engine's KV-event publisher, with gap detection and replay (the
batches' format is ``router.kv_events.wire``).

Replay (docs/reference.md 4.6): a DEALER sends ``[b"", start_seq (8 bytes)]`` to the engine's ROUTER
replay socket; the engine answers one ``[b"", topic, seq, payload]`` per buffered batch with
``seq >= start`` and ends with ``[b"", b"", -1 (8 bytes, signed), b""]``.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import zmq
import zmq.asyncio

from router.kv_events.wire import EventBatch, decode_batch
from router.logs import get_logger

logger = get_logger(__name__)

_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start_seq: int,
                 timeout_s: float = 2.0) -> list[tuple[str, int, bytes]]:
    """Fetch buffered batches with ``seq >= start_seq`` from an engine's replay endpoint.

    Returns:
        ``[(topic, seq, payload), ...]`` in order; empty if the engine has none.
    Raises:
        TimeoutError: no end marker within ``timeout_s`` between messages.
    """
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out = []
    try:
        await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
        while True:
            if not await sock.poll(int(timeout_s * 1000)):
                raise TimeoutError(f"replay from {endpoint} timed out")
            frames = await sock.recv_multipart()
            if len(frames) < 4:
                continue
            _, topic, seq_b, payload = frames[:4]
            if seq_b == _END_OF_REPLAY:
                return out
            out.append((topic.decode(errors="replace"), int.from_bytes(seq_b, "big"), payload))
    finally:
        sock.close()


class KVEventSubscriber:
    """Subscribes to one engine's KV-event publisher and yields its batches in order.

    Sequence numbers are tracked: a gap (lost batches: ZMQ high-water mark, a reconnect) is
    filled by a replay of the missing range when the engine has a replay endpoint; if the
    replay cannot fill it, the marker ``"clear"`` is yielded (the replica's entries are
    incomplete and must be dropped). A sequence that goes back (the engine restarted and
    counts from 0 again) yields ``"restart"`` (clear, then apply what follows). A new
    subscription misses what was published before it took effect, so the subscriber
    replays from 0 right after connecting; live batches that the replay already delivered
    (same sequence number and payload) are skipped, and a restarted engine's batches, which
    reuse the numbers, are not.

    Args:
        endpoint: the engine's publisher, e.g. ``ipc:///tmp/prefix-router-r1-kv.sock``.
        replay_endpoint: its replay ROUTER socket, or None.
        topic: topic prefix to subscribe to (``""`` for all).
    """

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = ""):
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.last_seq: int | None = None
        self.gaps = 0
        self.unfilled_gaps = 0
        self.restarts = 0
        # the last replay's batches, seq -> hash of the payload: a live batch equal to one of
        # them is its duplicate; a restarted engine reuses the numbers with other payloads
        self._replayed: dict[int, int] = {}
        self._ctx = zmq.asyncio.Context.instance()

    async def batches(self) -> AsyncIterator[EventBatch | str]:
        """Batches in sequence order, interleaved with ``"restart"`` / ``"clear"`` markers."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.connect(self.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        try:
            await asyncio.sleep(0.05)  # let the subscription reach the publisher
            for b in await self._replay_range(0, None):
                self.last_seq = b.seq
                yield b
            while True:
                topic_b, seq_b, payload = (await sub.recv_multipart())[:3]
                async for item in self._accept(topic_b.decode(errors="replace"),
                                               int.from_bytes(seq_b, "big"), payload):
                    yield item
        finally:
            sub.close()

    async def _accept(self, topic: str, seq: int, payload: bytes):
        last = self.last_seq
        if last is not None and seq <= last:
            if self._replayed.get(seq) == hash(payload):
                return  # already delivered by the replay
            self.restarts += 1
            logger.warning("KV events of %s went back to seq %d (last %d): engine restart",
                           self.endpoint, seq, last)
            self.last_seq = last = None
            self._replayed = {}
            yield "restart"
        elif last is not None and seq > last + 1:
            self.gaps += 1
            logger.warning("KV events of %s: batches %d..%d lost", self.endpoint, last + 1,
                           seq - 1)
            filled = await self._replay_range(last + 1, seq - 1)
            if [b.seq for b in filled] == list(range(last + 1, seq)):
                for b in filled:
                    yield b
            else:
                self.unfilled_gaps += 1
                yield "clear"
        try:
            ts, events = decode_batch(payload)
        except ValueError as exc:
            logger.warning("undecodable KV-event batch from %s: %s", self.endpoint, exc)
            self.last_seq = seq
            return
        self.last_seq = seq
        if self._replayed and seq > max(self._replayed):
            self._replayed = {}  # live past the replay: no duplicate can follow
        yield EventBatch(topic, seq, ts, events)

    async def _replay_range(self, start: int, end: int | None) -> list[EventBatch]:
        """Buffered batches with ``start <= seq <= end`` (no upper bound when None)."""
        if not self.replay_endpoint:
            return []
        try:
            raw = await replay(self._ctx, self.replay_endpoint, start)
        except (TimeoutError, zmq.ZMQError) as exc:
            logger.warning("replay from %s failed: %s", self.replay_endpoint, exc)
            return []
        out = []
        self._replayed = {}
        for topic, seq, payload in raw:
            if end is not None and seq > end:
                break
            try:
                ts, events = decode_batch(payload)
            except ValueError:
                continue
            out.append(EventBatch(topic, seq, ts, events, replayed=True))
            self._replayed[seq] = hash(payload)
        return out
