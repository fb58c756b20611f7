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
from zmq.utils.monitor import parse_monitor_message

from router.kv_events.wire import EventBatch, decode_batch
from router.logs import get_logger

logger = get_logger(__name__)

_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


def subscriber_endpoint(endpoint: str, host: str) -> str:
    """Where a subscriber connects for a publisher bound at ``endpoint``: a wildcard TCP
    bind (``tcp://*:5557``, ``tcp://[::]:5557``) is reached at ``tcp://<host>:5557``;
    ``ipc://`` endpoints and explicit TCP addresses are returned unchanged.

    Args:
        endpoint: the engine's bind endpoint, as given to its ``--kv-events-config``.
        host: an address of the engine's node, as seen by the subscriber (an IPv6 address
            is bracketed).
    """
    for wildcard in ("tcp://*:", "tcp://[::]:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            h = f"[{host}]" if ":" in host and not host.startswith("[") else host
            return f"tcp://{h}:{endpoint[len(wildcard):]}"
    return endpoint


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
    counts from 0 again) yields ``"restart"`` (clear, then apply what follows, starting with
    the new engine's earlier batches, fetched by replay).

    PUB/SUB drops what is published while no connection is up, so every time the
    connection to the publisher is made (the first time, and again after the engine
    restarted on the same address, which ZMQ reconnects by itself) the subscriber asks the
    replay endpoint for everything it buffers and reconciles it with what it delivered
    before (``_sync``): the batches it already has are skipped by sequence number and
    payload; a batch it has under the same number with another payload, or a buffer that
    ends below the last delivered number, is a restarted engine. Without this a restarted
    engine's first batch, published before the reconnection, was never applied (and with no
    second batch the feed looked silent).

    Args:
        endpoint: the engine's publisher, e.g. ``ipc:///tmp/prefix-router-r1-kv.sock``.
        replay_endpoint: its replay ROUTER socket, or None.
        topic: topic prefix to subscribe to (``""`` for all).
    """

    SEEN_MAX = 16384  # payload digests kept; vLLM's replay buffer holds 10,000 batches

    def __init__(self, endpoint: str, replay_endpoint: str | None = None, topic: str = ""):
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.last_seq: int | None = None
        self.gaps = 0
        self.unfilled_gaps = 0
        self.restarts = 0
        self.connections = 0
        # delivered batches, seq -> hash of the payload, oldest first: a batch equal to one
        # of them is a duplicate; a restarted engine reuses the numbers with other payloads
        self._seen: dict[int, int] = {}
        self._ctx = zmq.asyncio.Context.instance()

    async def batches(self) -> AsyncIterator[EventBatch | str]:
        """Batches in sequence order, interleaved with ``"restart"`` / ``"clear"`` markers."""
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 0)
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        sub.connect(self.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = parse_monitor_message(await monitor.recv_multipart())
                    if event["event"] == zmq.EVENT_CONNECTED:
                        self.connections += 1
                        await asyncio.sleep(0.05)  # let the subscription reach the publisher
                        async for item in self._sync():
                            yield item
                if sub in ready:
                    while True:  # everything received, then look at the monitor again
                        try:
                            frames = await sub.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        topic_b, seq_b, payload = frames[:3]
                        async for item in self._accept(topic_b.decode(errors="replace"),
                                                       int.from_bytes(seq_b, "big"), payload):
                            yield item
        finally:
            sub.disable_monitor()
            monitor.close()
            sub.close()

    def _remember(self, seq: int, payload: bytes) -> None:
        self._seen[seq] = hash(payload)
        if len(self._seen) > self.SEEN_MAX:
            del self._seen[next(iter(self._seen))]

    def _restart(self, seq: int, last: int) -> str:
        self.restarts += 1
        logger.warning("KV events of %s went back to seq %d (last %d): engine restart",
                       self.endpoint, seq, last)
        self.last_seq = None
        self._seen = {}
        return "restart"

    async def _sync(self):
        """Reconcile the engine's replay buffer with what was delivered (on each new
        connection to the publisher)."""
        raw = None
        for attempt in range(3):  # a restarting engine may bind its replay socket later
            raw = await self._replay_raw(0)
            if raw is not None:
                break
            await asyncio.sleep(0.5)
        if not raw:
            return
        last = self.last_seq
        if last is not None:
            overlap = [(seq, hash(p)) for _, seq, p in raw if seq in self._seen]
            if any(self._seen[seq] != h for seq, h in overlap) or \
                    (not overlap and raw[-1][1] <= last):
                yield self._restart(raw[0][1], last)
                last = None
        new = [r for r in raw if last is None or r[1] > last]
        if last is not None and new and new[0][1] != last + 1:
            self.gaps += 1
            self.unfilled_gaps += 1  # the engine's buffer no longer holds them
            yield "clear"
        for batch in self._decoded(new):
            yield batch

    async def _accept(self, topic: str, seq: int, payload: bytes):
        last = self.last_seq
        if last is not None and seq <= last:
            if self._seen.get(seq) == hash(payload):
                return  # already delivered (by a replay)
            yield self._restart(seq, last)
            last = None
            if seq > 0:  # the new engine's earlier batches were published before we heard
                for batch in await self._replay_range(0, seq - 1):
                    yield batch
                last = self.last_seq
        if last is not None and seq > last + 1:
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
        for batch in self._decoded([(topic, seq, payload)], replayed=False):
            yield batch

    def _decoded(self, raw: list[tuple[str, int, bytes]], replayed: bool = True
                 ) -> list[EventBatch]:
        """Raw batches as delivered: decoded (an undecodable one is skipped, with a warning),
        remembered, ``last_seq`` moved to each."""
        out = []
        for topic, seq, payload in raw:
            self.last_seq = seq
            self._remember(seq, payload)
            try:
                ts, events = decode_batch(payload)
            except ValueError as exc:
                logger.warning("undecodable KV-event batch from %s: %s", self.endpoint, exc)
                continue
            out.append(EventBatch(topic, seq, ts, events, replayed=replayed))
        return out

    async def _replay_raw(self, start: int) -> list[tuple[str, int, bytes]] | None:
        """The replay endpoint's batches from ``start``: [] without one, None when it
        failed."""
        if not self.replay_endpoint:
            return []
        try:
            return await replay(self._ctx, self.replay_endpoint, start)
        except (TimeoutError, zmq.ZMQError) as exc:
            logger.warning("replay from %s failed: %s", self.replay_endpoint, exc)
            return None

    async def _replay_range(self, start: int, end: int) -> list[EventBatch]:
        """Buffered batches with ``start <= seq <= end``, delivered (``_decoded``)."""
        raw = [r for r in await self._replay_raw(start) or [] if r[1] <= end]
        return self._decoded(raw)
