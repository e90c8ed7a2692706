"""A KV block's name in the tiers: a cryptographic hash chained over its whole token prefix.

The radix tree and the KV events name blocks with Python's 64-bit tuple hash
(``cache/eviction_record.chain_hashes``): fine for a process's own bookkeeping, where a collision
costs one wrong "evicted" label. A store that outlives the process and is shared by replicas
must never hand out another prefix's KV, so its keys chain blake2b-128 over the token bytes
(``k[i] = blake2b(k[i-1] || tokens of block i)``), and each entry also carries its block's own
token ids, checked on read.

Under ``--kv-offload-secret`` (``TierSecret``) an entry is stored under ``stored_key(key)``, a keyed
BLAKE2b of its chain key: whoever can read or list the tier but lacks the secret can neither compute
the name a guessed prefix would have (no probing for someone's prompt) nor link one stored block to
the next (the chain keys are never stored). The secret also keys each entry's MAC (codec.py).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["TierSecret", "block_keys", "token_bytes"]


@dataclass(frozen=True)
class TierSecret:
    """Two keys derived from the KV offload secret: one for entries' MACs, one for their names.
    Never printed (``repr`` shows neither), never stored, never part of the fingerprint."""

    mac_key: bytes = field(repr=False)
    name_key: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, secret: str | bytes | None) -> TierSecret | None:
        """None for no secret (or an empty one); else the keys, derived with keyed BLAKE2b from a
        BLAKE2b-512 of the secret (a secret of any length, each key for one use only)."""
        if not secret:
            return None
        raw = secret.encode("utf-8") if isinstance(secret, str) else bytes(secret)
        root = hashlib.blake2b(raw, digest_size=64, person=b"chatserve-kv-sec").digest()
        return cls(hashlib.blake2b(b"entry mac", key=root, digest_size=32).digest(),
                   hashlib.blake2b(b"block names", key=root, digest_size=32).digest())

    def stored_key(self, key: bytes) -> bytes:
        """The 16-byte key a block is stored (named, and headed) under."""
        return hashlib.blake2b(key, key=self.name_key, digest_size=16).digest()


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 (the form hashed and stored)."""
    a = array("I", token_ids)
    if a.itemsize != 4:  # pragma: no cover - every platform we run on has 4-byte unsigned int
        raise RuntimeError("array('I') is not 32-bit here")
    return a.tobytes()


def block_keys(token_ids: Sequence[int], block_size: int, num_blocks: int, fingerprint: bytes) -> list[bytes]:
    """Keys (16 bytes each) of blocks ``0 .. num_blocks-1`` of ``token_ids``. The chain starts from
    the fingerprint, so one prefix under two models has two unrelated names."""
    if num_blocks * block_size > len(token_ids):
        raise ValueError(f"{num_blocks} blocks of {block_size} need {num_blocks * block_size} tokens, got {len(token_ids)}")
    out: list[bytes] = []
    prev = fingerprint
    data = token_bytes(token_ids[: num_blocks * block_size])
    step = 4 * block_size
    for i in range(num_blocks):
        prev = hashlib.blake2b(prev + data[i * step : (i + 1) * step], digest_size=16).digest()
        out.append(prev)
    return out
