"""The tiers together: reads of a run of consecutive blocks, and a writer thread that never blocks.

Writes: the engine hands ``WriteJob``s (a block's bytes, already copied out of the KV pool) to
``submit``; a bounded queue (by bytes) feeds one writer thread that encodes each entry once and
puts it in every tier. When the queue is full the job is dropped and counted
(``dropped_blocks``): a slow disk or Redis costs cache hits, never a decode step. Names written
recently (or queued) are remembered, so a block is not written twice while it is known to be there.

Reads: ``load_run`` walks the blocks in order, asking the tiers in order (disk, then Redis) for the
longest run each has from where the previous one stopped, and stops where none has the next
block. Each entry is decoded and checked (``codec.py``); one that fails is deleted from its tier,
counted by reason, and treated as absent. Called from the engine's loader thread.

Under a secret (``TierSecret``, from ``--kv-offload-secret``) every block is stored under a keyed
name (``TierSecret.stored_key``) with a MAC instead of a checksum; an entry without it, or with
another secret's, is refused as any invalid entry is (a counted miss).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from .codec import DECODE_FAILURES, DecodeError, decode_entry, encode_entry
from .keys import TierSecret
from .tier import Tier

__all__ = ["KVOffloadStore", "LoadedRun", "TierStats", "WriteJob", "StoredBlock"]

logger = logging.getLogger(__name__)


@dataclass
class TierStats:
    """Counters of one tier (blocks and bytes), read by the metrics."""

    hit_blocks: int = 0
    miss_blocks: int = 0  # lookups that ended at this tier (the next block was not there, or invalid)
    read_bytes: int = 0
    read_seconds: float = 0.0
    num_reads: int = 0
    written_blocks: int = 0
    written_bytes: int = 0
    write_seconds: float = 0.0
    invalid: Counter[str] = field(default_factory=lambda: Counter({r: 0 for r in DECODE_FAILURES}))

    def as_dict(self, tier: Tier) -> dict[str, object]:
        return {
            "hit_blocks": self.hit_blocks, "miss_blocks": self.miss_blocks, "read_bytes": self.read_bytes,
            "read_seconds": self.read_seconds, "num_reads": self.num_reads, "written_blocks": self.written_blocks,
            "written_bytes": self.written_bytes, "write_seconds": self.write_seconds,
            "write_errors": tier.write_errors, "read_errors": tier.read_errors, "invalid_entries": dict(self.invalid),
            "available": tier.available(), **tier.describe(),
        }


@dataclass(frozen=True)
class WriteJob:
    """One block to store: its name, key, own tokens and KV bytes (a copy the engine no longer touches)."""

    name: str
    key: bytes
    token_ids: tuple[int, ...]
    payload: bytes
    event: object = None
    """What the engine wants back once it is stored (its KV-event identity), or None."""


@dataclass(frozen=True)
class StoredBlock:
    """A block the writer stored, in tier ``medium``: for the KV events."""

    medium: str
    event: object


@dataclass
class LoadedRun:
    """The result of ``load_run``: payloads of blocks ``0 .. len(payloads)-1`` of the names asked."""

    payloads: list[memoryview]
    tiers: list[str]
    """Which tier served each block."""
    stop: str
    """Why the run ended: ``complete``, ``absent`` (no tier has the next block), ``invalid:<reason>``
    (the next block's entry failed its checks everywhere it was), ``unavailable`` (a tier is down)."""
    seconds: float = 0.0


class KVOffloadStore:
    def __init__(
        self, tiers: Sequence[Tier], fingerprint: bytes, payload_bytes: int, *, max_queue_bytes: int = 256 << 20,
        batch_blocks: int = 32, known_ttl_s: float = 600.0, secret: TierSecret | None = None,
    ) -> None:
        if not tiers:
            raise ValueError("a KV offload store needs at least one tier (a disk directory or a Redis URL)")
        self.tiers = list(tiers)
        self.fingerprint = fingerprint
        self.fp_hex = fingerprint.hex()
        self.secret = secret
        self._mac_key = secret.mac_key if secret is not None else None
        self.payload_bytes = payload_bytes
        self.max_queue_bytes = max_queue_bytes
        self.batch_blocks = batch_blocks
        self.known_ttl_s = known_ttl_s
        self.stats = {t.name: TierStats() for t in self.tiers}
        self.dropped_blocks = 0
        self.dropped_bytes = 0
        self.submitted_blocks = 0
        self._queue: deque[WriteJob] = deque()
        self._queued_bytes = 0
        self._busy = False
        self._known: OrderedDict[str, float] = OrderedDict()  # name -> when it was written / queued / read
        self._max_known = 1 << 18
        self._stored: deque[StoredBlock] = deque()
        self._cv = threading.Condition()
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name="kv-offload-writer", daemon=True)
        self._writer.start()

    def stored_key(self, key: bytes) -> bytes:
        """The key a block is named and headed under: its chain key, or under a secret a keyed hash of it."""
        return key if self.secret is None else self.secret.stored_key(key)

    def name_of(self, key: bytes) -> str:
        return f"{self.fp_hex}/{self.stored_key(key).hex()}"

    # ---- writes (any thread -> the writer thread) ----------------------------------------------

    def is_known(self, name: str) -> bool:
        """Written, queued or read recently: no need to write it again."""
        with self._cv:
            t = self._known.get(name)
            return t is not None and time.monotonic() - t < self.known_ttl_s

    def _remember(self, names: Sequence[str]) -> None:
        now = time.monotonic()
        with self._cv:
            for n in names:
                self._known[n] = now
                self._known.move_to_end(n)
            while len(self._known) > self._max_known:
                self._known.popitem(last=False)

    def room_for(self, num_blocks: int) -> int:
        """How many blocks the queue takes now (checked before copying them out of the pool)."""
        free = self.max_queue_bytes - self._queued_bytes
        return max(0, min(num_blocks, free // max(1, self.payload_bytes)))

    def drop(self, num_blocks: int) -> None:
        """Count blocks the engine did not even copy because the queue was full."""
        with self._cv:
            self.dropped_blocks += num_blocks
            self.dropped_bytes += num_blocks * self.payload_bytes

    def submit(self, jobs: Sequence[WriteJob]) -> int:
        """Queue jobs for the writer; those past the byte bound are dropped (counted). Never blocks."""
        accepted: list[str] = []
        with self._cv:
            for job in jobs:
                size = len(job.payload)
                if self._closed or self._queued_bytes + size > self.max_queue_bytes:
                    self.dropped_blocks += 1
                    self.dropped_bytes += size
                    continue
                self._queue.append(job)
                self._queued_bytes += size
                accepted.append(job.name)
            self.submitted_blocks += len(accepted)
            if accepted:
                self._cv.notify()
        self._remember(accepted)
        return len(accepted)

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue and self._closed:
                    return
                batch = [self._queue.popleft() for _ in range(min(self.batch_blocks, len(self._queue)))]
                self._busy = True
            try:
                self._write(batch)
            except Exception:  # noqa: BLE001 - the writer must outlive any one bad batch
                logger.exception("KV offload writer: a batch of %d blocks failed", len(batch))
            finally:
                with self._cv:
                    self._queued_bytes -= sum(len(j.payload) for j in batch)
                    self._busy = False
                    self._cv.notify_all()

    def _write(self, batch: list[WriteJob]) -> None:
        items = [(j.name, encode_entry(self.stored_key(j.key), self.fingerprint, j.token_ids, j.payload, self._mac_key))
                 for j in batch]
        for tier in self.tiers:
            t0 = time.perf_counter()
            written = tier.put_many(items)
            st = self.stats[tier.name]
            st.write_seconds += time.perf_counter() - t0
            if written:
                st.written_bytes += written
                st.written_blocks += round(written / len(items[0][1]))
                self._stored.extend(StoredBlock(tier.name, j.event) for j in batch if j.event is not None)
        self._remember([j.name for j in batch])

    def take_stored(self) -> list[StoredBlock]:
        """Blocks stored since the last call (for KV events), oldest first."""
        out = []
        while self._stored:
            out.append(self._stored.popleft())
        return out

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write is done (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Finish the queued writes (up to ``timeout_s``), stop the writer, close the tiers."""
        self.flush(timeout_s)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._writer.join(timeout=max(0.1, timeout_s))
        for t in self.tiers:
            t.close()

    # ---- reads (the engine's loader thread) ----------------------------------------------------

    def load_run(self, keys: Sequence[bytes], block_tokens: Sequence[Sequence[int]]) -> LoadedRun:
        """The longest run of leading blocks some tier holds (valid ones only)."""
        t0 = time.perf_counter()
        names = [self.name_of(k) for k in keys]
        payloads: list[memoryview] = []
        served: list[str] = []
        stop = "complete"
        invalid_at: tuple[int, str] | None = None  # (block, reason) of the last entry refused
        pos = 0
        while pos < len(names):
            progressed = False
            stop = "absent"
            for tier in self.tiers:
                st = self.stats[tier.name]
                if not tier.available():
                    stop = "unavailable"
                    continue
                t1 = time.perf_counter()
                raw = tier.get_run(names[pos:])
                st.read_seconds += time.perf_counter() - t1
                st.num_reads += 1
                if not tier.available():
                    stop = "unavailable"
                got = 0
                for data in raw:
                    i = pos + got
                    try:
                        view = decode_entry(data, key=self.stored_key(keys[i]), fingerprint=self.fingerprint,
                                            token_ids=block_tokens[i], payload_len=self.payload_bytes,
                                            mac_key=self._mac_key)
                    except DecodeError as exc:
                        st.invalid[exc.reason] += 1
                        tier.delete(names[i])
                        invalid_at = (i, f"invalid:{exc.reason}")
                        logger.info("KV %s tier: entry %s is %s; deleted, counted as a miss", tier.name, names[i], exc)
                        break
                    payloads.append(view)
                    served.append(tier.name)
                    st.read_bytes += len(data)
                    got += 1
                st.hit_blocks += got
                if got == 0:
                    st.miss_blocks += 1
                if got:
                    pos += got
                    progressed = True
                    break
            if not progressed:
                break
        if pos == len(names):
            stop = "complete"
        elif invalid_at is not None and invalid_at[0] == pos and stop == "absent":
            stop = invalid_at[1]  # the next block was there, but no copy of it passed its checks
        self._remember(names[:pos])
        return LoadedRun(payloads, served, stop, time.perf_counter() - t0)

    def locate(self, keys: Sequence[bytes]) -> dict[str, int]:
        """How many leading blocks each tier holds (no reads, no LRU refresh): for reports."""
        names = [self.name_of(k) for k in keys]
        return {t.name: t.count_run(names) for t in self.tiers}

    def as_dict(self) -> dict[str, object]:
        return {
            "tiers": {t.name: self.stats[t.name].as_dict(t) for t in self.tiers},
            "submitted_blocks": self.submitted_blocks,
            "dropped_blocks": self.dropped_blocks,
            "dropped_bytes": self.dropped_bytes,
            "queued_bytes": self._queued_bytes,
            "max_queue_bytes": self.max_queue_bytes,
        }
