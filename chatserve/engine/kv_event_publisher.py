"""Publish the prefix cache's KV events over ZMQ in vLLM's wire format (``--kv-events-endpoint``).

vLLM's router (policy ``kv_aware``) subscribes to each replica's events and indexes which blocks
each one holds; this is the replica's side, shaped like vLLM's ``ZmqEventPublisher``:

* a PUB socket, bound here (the router connects), sending one multipart message per engine step:
  ``[topic, 8-byte big-endian sequence number, msgpack payload]``;
* the payload is a batch ``[ts, [event, ...], data_parallel_rank]`` (a positional array), each event
  a map tagged by ``"type"`` (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``) with vLLM's
  field names; ``medium`` says where the blocks live: ``"GPU"``, vLLM's name for the device tier (on
  the CPU engine the KV pool *is* that tier), or ``"DISK"`` / ``"REDIS"`` for blocks the tiers below
  the tree stored (``--kv-offload-dir`` / ``--kv-offload-redis-url``; a router may count a
  ``REDIS`` block as held by every replica sharing that Redis);
* an optional ROUTER socket for replay: a subscriber that missed sequence numbers sends
  ``[b"", start_seq (8 bytes)]`` and gets every buffered batch from there, then ``seq = -1``.

The engine's step thread only appends to a queue; encoding and sending run in one daemon thread
that owns both sockets (ZMQ sockets are not thread-safe), so a slow or absent router never
stalls a step. Sockets are bound in the constructor, so a taken port fails at startup.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import count
from typing import Any

from chatserve.cache import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

logger = logging.getLogger(__name__)

__all__ = ["KVEventPublisher", "KVEventsConfig", "encode_event", "encode_batch", "MEDIUM", "MAX_EVENTS_PER_BATCH"]

MEDIUM = "GPU"  # the default medium: the engine's own KV pool
MAX_EVENTS_PER_BATCH = 4096  # the router rejects a batch with more events
_END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    """Where events go; what ``GET /kv_event_sources`` tells a router."""

    endpoint: str
    """PUB address to bind, ``tcp://HOST:PORT`` (``*`` or ``0.0.0.0`` for every interface)."""
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000


def encode_event(event: KVCacheEvent) -> dict[str, Any]:
    """One event as vLLM's msgspec encodes it: a map tagged by class name, defaults omitted."""
    if isinstance(event, BlockStored):
        return {"type": "BlockStored", "block_hashes": list(event.block_hashes),
                "parent_block_hash": event.parent_block_hash, "token_ids": list(event.token_ids),
                "block_size": event.block_size, "lora_id": None, "medium": event.medium, "lora_name": None}
    if isinstance(event, BlockRemoved):
        return {"type": "BlockRemoved", "block_hashes": list(event.block_hashes), "medium": event.medium}
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(ts: float, events: Sequence[KVCacheEvent], data_parallel_rank: int = 0) -> bytes:
    import msgpack

    return msgpack.packb([float(ts), [encode_event(e) for e in events], data_parallel_rank], use_bin_type=True)


class KVEventPublisher:
    """ZMQ PUB (+ optional replay ROUTER) fed from a queue by one background thread."""

    def __init__(self, config: KVEventsConfig) -> None:
        try:
            import msgpack  # noqa: F401 - fail here, not in the thread
            import zmq
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise RuntimeError(
                "kv_events_endpoint needs pyzmq and msgpack: pip install 'chatserve[cluster]'") from exc
        self.config = config
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = None
        try:
            self._pub.bind(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events_endpoint: cannot bind {exc}") from None
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = count()
        self.num_published_batches = 0  # ZMQ messages sent
        self.num_queued_steps = 0  # publish() calls that queued something ...
        self.num_sent_steps = 0  # ... and of those, how many the thread has sent (equal: nothing in flight)
        self._running = True
        self._thread = threading.Thread(target=self._run, name="chatserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (never blocks; nothing is sent for an empty list)."""
        if events and self._running:
            self.num_queued_steps += 1
            self._queue.put((time.time(), events))

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``timeout_s``), then close the sockets. Idempotent."""
        if not self._running:
            return
        self._running = False
        self._queue.put(None)
        self._thread.join(timeout_s)
        if not self._thread.is_alive():
            self._close_sockets()

    # ---- the publisher thread ----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            if self._replay is not None:
                try:
                    while self._replay.poll(0):
                        self._serve_replay()
                except Exception:  # noqa: BLE001 - replay is best effort; publishing goes on
                    logger.exception("kv events: replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                break
            ts, events = item
            try:
                for i in range(0, len(events), MAX_EVENTS_PER_BATCH):
                    self._send(encode_batch(ts, events[i : i + MAX_EVENTS_PER_BATCH]))
            except Exception:  # noqa: BLE001 - one bad batch must not end the stream
                logger.exception("kv events: publishing a batch failed")
            self.num_sent_steps += 1

    def _send(self, payload: bytes) -> None:
        seq = next(self._seq)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.num_published_batches += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", _END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
