"""KV-block memory management: block allocator and prefix caches (plain Python, no torch)."""

from __future__ import annotations

import time
from collections.abc import Callable

from .allocator import BlockAllocator, OutOfBlocksError, RefCountError
from .leases import LeaseInfo
from .prefix_cache import (
    CacheStats,
    InsertResult,
    MatchResult,
    MissExplanation,
    MissReason,
    NoPrefixCache,
    PartialMatch,
    PrefixCache,
)
from .radix_tree import RadixPrefixCache

__all__ = [
    "BlockAllocator",
    "OutOfBlocksError",
    "RefCountError",
    "PrefixCache",
    "RadixPrefixCache",
    "NoPrefixCache",
    "MatchResult",
    "PartialMatch",
    "InsertResult",
    "CacheStats",
    "MissExplanation",
    "MissReason",
    "LeaseInfo",
    "make_prefix_cache",
]


def make_prefix_cache(
    enable_prefix_caching: bool, allocator: BlockAllocator, block_size: int, clock: Callable[[], float] = time.monotonic
) -> PrefixCache:
    """The radix tree when prefix caching is on, else a cache that caches nothing
    behind the same interface (so the engine has one code path). ``clock``: lease expiry times."""
    if enable_prefix_caching:
        return RadixPrefixCache(allocator, block_size, clock=clock)
    return NoPrefixCache(allocator, block_size)
