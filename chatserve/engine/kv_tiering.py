"""The engine's side of the KV tiers below the radix tree: copies between the pool and the store.

Three flows, all started on the engine's step thread, none of which waits on a disk or Redis:

* **write**: the tree's ``TierObserver`` calls (``cache/tier_observer.py``) name blocks it took
  (write-through policy), is about to evict (write-back) or that a session leased (always). The
  blocks not yet in the tiers are copied out of the pool (a memcpy; only as many as the store's
  queue has room for, the rest dropped and counted) and handed to the store's writer thread.
* **lookup**: a request whose prompt has full blocks beyond what the tree holds gets a lookup on
  the loader thread (keys hashed there, entries read and checked there); the request waits in
  ``LLMEngine.waiting_for_kv`` meanwhile, outside the scheduler, so the step loop runs on.
* **adopt**: once the lookup lands, its run of blocks goes into free blocks and the tree
  (``BlockManager.adopt_blocks``), locked for the request until its first admission, and the
  request joins the scheduler; its prefill then starts after the loaded blocks. An abort while
  the lookup runs drops the result: no block was allocated for it yet.

A request's ``cache_salt`` is part of its first block's key: the key chain starts from
``blake2b(fingerprint || salt)`` instead of the fingerprint (``chain_seed``), so every block of a
salted prefix has a name no other salt shares, while the fingerprint itself (in every entry's name
and header) stays the model's. Entries of two salts are unrelated keys, on disk and in Redis alike.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chatserve.cache import BlockStored
from chatserve.cache.kv_events import event_hashes
from chatserve.config import EngineArgs
from chatserve.core.block_manager import BlockManager
from chatserve.core.sequence import Sequence as Seq
from chatserve.kv_offload import (
    DiskTier,
    KVFingerprint,
    KVOffloadStore,
    LoadedRun,
    TierSecret,
    WriteJob,
    block_keys,
)
from chatserve.kv_offload.tier import Tier
from chatserve.worker.interface import KVBlockIO

__all__ = ["KVTiering", "KVLookup"]

logger = logging.getLogger(__name__)

_GB = 1 << 30


@dataclass
class KVLookup:
    """A finished lookup: blocks ``first_block ..`` of the prompt, as ``run`` found them."""

    first_block: int
    run: LoadedRun | None
    error: str | None = None


class KVTiering:
    """Owns the store (tiers + writer) and the loader thread; is the tree's ``TierObserver``."""

    def __init__(self, args: EngineArgs, fingerprint: KVFingerprint, payload_bytes: int, runner: KVBlockIO) -> None:
        """``fingerprint``: everything that changes a block's bytes, the model's rotary tables included
        (engine/builder.py); ``runner``: the worker's block copies in and out of the pool."""
        self.block_size = args.block_size
        self.policy = args.kv_offload_policy
        self.fingerprint = fingerprint
        self.fp = fingerprint.digest
        self.runner = runner  # read_kv_blocks / write_kv_blocks (worker/kv_transfer.py)
        tiers: list[Tier] = []
        if args.kv_offload_dir:
            tiers.append(DiskTier(args.kv_offload_dir, int(args.kv_offload_max_gb * _GB)))
        if args.kv_offload_redis_url:
            from chatserve.kv_offload.redis_tier import RedisTier  # (redis imported only where a URL is given)

            tiers.append(RedisTier(args.kv_offload_redis_url, prefix=args.kv_offload_redis_prefix,
                                   ttl_s=args.kv_offload_redis_ttl_s, max_bytes=int(args.kv_offload_redis_max_gb * _GB)))
        # --kv-offload-secret: entries carry a MAC and are stored under keyed names (kv_offload/keys.py)
        secret = TierSecret.from_secret(args.kv_offload_secret)
        self.store = KVOffloadStore(tiers, self.fp, payload_bytes, max_queue_bytes=int(args.kv_offload_queue_mb * (1 << 20)),
                                    secret=secret)
        self._loader = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-offload-load")
        self.block_manager: BlockManager | None = None  # set by the engine once built
        # NOTE: True only when someone drains stored_events() (the engine's KV event log is on): otherwise
        # the writer would keep a record of every block it ever stored.
        self.record_events = False
        self.num_lookups = 0
        self.num_loaded_blocks = 0
        self.num_lost_loads = 0  # lookups whose blocks the tree could not take (prefix evicted meanwhile, no room)
        self.load_seconds = 0.0
        self._closed = False
        logger.info("KV tiers below the radix tree: %s (%s, fingerprint %s, %s)", ", ".join(t.name for t in tiers),
                    self.policy, fingerprint.hex[:16],
                    "entries authenticated with the KV offload secret" if secret else "no KV offload secret: entries unauthenticated")

    def chain_seed(self, salt: str | None) -> bytes:
        """Where a prefix's key chain starts: the fingerprint, or for a salted request a digest of
        the fingerprint and the salt (so the salt is part of the first block's key)."""
        if salt is None:
            return self.fp
        return hashlib.blake2b(self.fp + b"\0cache_salt\0" + salt.encode("utf-8"), digest_size=16).digest()

    def keys_of(self, token_ids: Sequence[int], num_blocks: int, salt: str | None = None) -> list[bytes]:
        """The tiers' keys of blocks ``0 .. num_blocks-1`` of ``token_ids`` under ``salt``."""
        return block_keys(token_ids, self.block_size, num_blocks, self.chain_seed(salt))

    # ---- writes (TierObserver, step thread) -----------------------------------------------------

    def on_insert(
        self, path_tokens: Sequence[int], first_new_block: int, block_ids: Sequence[int], *, salt: str | None = None
    ) -> None:
        if self.policy == "write_through":
            self._write(path_tokens, first_new_block, block_ids[first_new_block:], salt)

    def on_evict(
        self, path_tokens: Sequence[int], first_victim: int, victim_ids: Sequence[int], *, salt: str | None = None
    ) -> None:
        self._write(path_tokens, first_victim, victim_ids, salt)

    def on_lease(self, path_tokens: Sequence[int], block_ids: Sequence[int], *, salt: str | None = None) -> None:
        self._write(path_tokens, 0, block_ids, salt)

    def _write(self, path_tokens: Sequence[int], first: int, block_ids: Sequence[int], salt: str | None = None) -> None:
        """Copy blocks ``first ..`` of the path (ids ``block_ids``, under ``salt``) to the writer, skipping known ones."""
        if not block_ids:
            return
        bs = self.block_size
        end = first + len(block_ids)
        keys = self.keys_of(path_tokens, end, salt)
        todo = [(first + i, b) for i, b in enumerate(block_ids) if not self.store.is_known(self.store.name_of(keys[first + i]))]
        if not todo:
            return
        room = self.store.room_for(len(todo))
        if room < len(todo):
            self.store.drop(len(todo) - room)
            todo = todo[:room]
        if not todo:
            return
        payloads = self.runner.read_kv_blocks([b for _, b in todo])
        hashes = event_hashes(path_tokens, bs, end, salt) if self.record_events else []
        jobs = []
        for (i, _), payload in zip(todo, payloads):
            tokens = tuple(path_tokens[i * bs : (i + 1) * bs])
            event = (hashes[i], hashes[i - 1] if i > 0 else None, tokens) if hashes else None
            jobs.append(WriteJob(self.store.name_of(keys[i]), keys[i], tokens, payload, event))
        self.store.submit(jobs)

    def flush_tree(self) -> None:
        """Write back every block the tree holds that the tiers lack (a shutdown under write-back)."""
        bm = self.block_manager
        if bm is None or not hasattr(bm.cache, "leaf_paths"):
            return
        for tokens, ids, salt in bm.cache.leaf_paths():
            if self.store.room_for(len(ids)) < len(ids):
                self.store.flush()  # NOTE: at shutdown waiting is right: this is the tree's last chance
            self._write(tokens, 0, ids, salt)

    def stored_events(self) -> list[BlockStored]:
        """BlockStored events (``medium`` DISK / REDIS) for blocks the writer stored since the last call."""
        out = []
        for s in self.store.take_stored():
            h, parent, tokens = s.event  # type: ignore[misc]
            out.append(BlockStored([h], parent, list(tokens), self.block_size, medium=s.medium.upper()))
        return out

    # ---- lookups (step thread -> loader thread) -------------------------------------------------

    def wants_lookup(self, prompt: Sequence[int], tree_tokens: int) -> bool:
        """Does the prompt have a full block (before its last token) past what the tree holds?"""
        return (len(prompt) - 1) // self.block_size > tree_tokens // self.block_size

    def submit_lookup(
        self, prompt: Sequence[int], tree_tokens: int, salt: str | None = None
    ) -> concurrent.futures.Future[KVLookup]:
        self.num_lookups += 1
        first = tree_tokens // self.block_size
        return self._loader.submit(self._lookup, list(prompt[:-1]), first, salt)

    def _lookup(self, tokens: list[int], first: int, salt: str | None = None) -> KVLookup:
        bs = self.block_size
        n = len(tokens) // bs
        try:
            keys = self.keys_of(tokens, n, salt)[first:]
            block_tokens = [tokens[i * bs : (i + 1) * bs] for i in range(first, n)]
            return KVLookup(first, self.store.load_run(keys, block_tokens))
        except Exception as exc:  # noqa: BLE001 - a lookup that fails is a miss, never a failed request
            logger.exception("KV tier lookup failed; the request prefills instead")
            return KVLookup(first, None, f"{type(exc).__name__}: {exc}")

    def adopt(self, seqs: list[Seq], prompt: list[int], lookup: KVLookup) -> None:
        """Put a landed lookup's blocks into the tree for ``seqs`` (step thread); record it in their stats."""
        stats = seqs[0].stats
        run = lookup.run
        if run is None:
            stats.kv_tier_stop = "error"
            return
        stats.kv_tier_stop = run.stop
        stats.kv_load_seconds = run.seconds
        self.load_seconds += run.seconds
        if not run.payloads or self.block_manager is None:
            return
        first = lookup.first_block
        payloads = run.payloads

        def fill(block_ids: list[int], start: int) -> None:
            self.runner.write_kv_blocks(block_ids, payloads[start - first : start - first + len(block_ids)])

        res = self.block_manager.adopt_blocks(prompt[:-1], first, len(payloads), fill, seqs,
                                              salt=seqs[0].cache_salt if seqs else None)
        if res.num_blocks == 0:
            if res.first_block < first:  # the tree evicted part of the prefix the run hangs from
                self.num_lost_loads += 1
                stats.kv_tier_stop = "raced"
            elif res.first_block < first + len(payloads):
                self.num_lost_loads += 1
                stats.kv_tier_stop = "no_room"
            return
        self.num_loaded_blocks += res.num_blocks
        bs = self.block_size
        for tier in run.tiers[res.first_block - first : res.first_block - first + res.num_blocks]:
            if tier == "disk":
                stats.num_disk_cached_tokens += bs
            else:
                stats.num_redis_cached_tokens += bs

    # ---- reports ---------------------------------------------------------------------------------

    def locate(self, token_ids: Sequence[int], salt: str | None = None) -> dict[str, int]:
        """Tokens of ``token_ids`` (whole blocks, from the start, under ``salt``) each tier holds."""
        bs = self.block_size
        n = len(token_ids) // bs
        keys = self.keys_of(token_ids, n, salt)
        return {tier: count * bs for tier, count in self.store.locate(keys).items()}

    def stats(self) -> dict[str, Any]:
        return {
            **self.store.as_dict(),
            "policy": self.policy,
            "fingerprint": self.fingerprint.hex,
            "num_lookups": self.num_lookups,
            "num_loaded_blocks": self.num_loaded_blocks,
            "num_lost_loads": self.num_lost_loads,
            "load_seconds": self.load_seconds,
        }

    def close(self, timeout_s: float = 30.0) -> None:
        """Write back what the tree holds (write-back policy), finish the queued writes, stop the threads.
        Idempotent; later writes are dropped (counted)."""
        if self._closed:
            return
        self._closed = True
        t0 = time.perf_counter()
        if self.policy == "write_back":
            self.flush_tree()
        self._loader.shutdown(wait=True, cancel_futures=True)
        self.store.close(timeout_s)
        logger.info("KV tiers closed in %.2fs", time.perf_counter() - t0)
