"""The KV tiers below the radix tree: local disk and Redis, one block per entry (plain Python, no torch).

The radix tree (``chatserve/cache/``) is the first tier and lives in one process's memory. This
package keeps full KV blocks beyond it, so a restart, a deploy or a second replica of the same
model starts warm:

* ``fingerprint.py``: what changes a block's bytes (model files, dtype, KV layout, block size, kernel
  tier, resolved rope, the kernel and KV code's sources, library versions), folded into one digest
  that is part of every key and every entry; the format's one version number;
* ``keys.py``: a block's name, a cryptographic chain hash of its whole token prefix (keyed under
  ``--kv-offload-secret``: ``TierSecret``);
* ``codec.py``: one entry = header + payload + checksum (a MAC under a secret); what does not decode
  is a counted miss;
* ``disk_tier.py`` / ``redis_tier.py``: the two backends (LRU-bounded directory; TTL- and size-bounded
  Redis keys shared by replicas);
* ``store.py``: the tiers together, a bounded writer thread (drop and count, never stall the step
  loop) and the reads of a run of consecutive blocks.

Bytes in, bytes out: the engine (``engine/kv_tiering.py``) copies blocks between the KV pool and
here. Imports nothing of ours.
"""

from __future__ import annotations

from .codec import DecodeError, decode_entry, encode_entry
from .disk_tier import DiskTier
from .fingerprint import FORMAT_VERSION, KVFingerprint, hash_model_files, kv_code_hash, library_versions
from .keys import TierSecret, block_keys
from .store import KVOffloadStore, LoadedRun, TierStats, WriteJob

__all__ = [
    "DecodeError", "decode_entry", "encode_entry", "DiskTier", "RedisTier", "FORMAT_VERSION", "KVFingerprint",
    "hash_model_files", "kv_code_hash", "library_versions", "TierSecret", "block_keys", "KVOffloadStore", "LoadedRun",
    "TierStats", "WriteJob",
]


def __getattr__(name: str) -> object:
    # RedisTier is imported on first use: the redis client library costs a start that uses no Redis
    # (most) about a fifth of a second.
    if name == "RedisTier":
        from .redis_tier import RedisTier

        return RedisTier
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
