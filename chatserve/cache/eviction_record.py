"""A bounded memory of the prefixes the cache recently evicted, so a miss can say "evicted".

A block is remembered by the hash of the whole token prefix it ends (a chain of per-block hashes,
as vLLM names blocks), not by its id: ids are reused at once, prefixes are what a later prompt
asks for. The record is a fixed-size FIFO; what falls out of it is reported as "new" again.

A request's ``cache_salt`` (see docs/prefix-cache.md) is part of the first block's hash: the chain
starts from ``salt_seed(salt)`` instead of 0, so every block of a salted prefix has a name no other
salt (and no unsalted request) shares.
"""

from __future__ import annotations

import functools
import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence

__all__ = ["EvictionRecord", "chain_hashes", "salt_seed"]


@functools.lru_cache(maxsize=4096)
def salt_seed(salt: str | None) -> int:
    """Where a prefix's hash chain starts: 0 without a salt (the chain every unsalted request uses),
    else 64 bits of blake2b over the salt, the same in every process (unlike ``hash(str)``)."""
    if salt is None:
        return 0
    digest = hashlib.blake2b(b"chatserve-cache-salt\0" + salt.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") | 1  # never 0: a salted chain never starts where the unsalted one does


def chain_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int, start: int = 0) -> list[int]:
    """Hashes naming blocks ``0 .. num_blocks-1`` of ``token_ids`` by their whole prefix.

    ``h[i] = hash((h[i-1], block i's tokens))`` with ``h[-1] = start``: equal hashes mean equal
    prefixes (up to a 64-bit collision), and each costs one block's worth of hashing. A salted
    prefix starts from ``salt_seed(salt)``.
    """
    out: list[int] = []
    h = start
    for i in range(num_blocks):
        h = hash((h, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        out.append(h)
    return out


class EvictionRecord:
    """The last ``capacity`` evicted block prefixes (by chain hash), oldest forgotten first."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._hashes: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._hashes)

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._hashes

    def add(self, block_hashes: Iterable[int]) -> None:
        for h in block_hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def clear(self) -> None:
        self._hashes.clear()
