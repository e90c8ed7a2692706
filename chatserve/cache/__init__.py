"""KV-block memory management: block allocator and prefix caches (plain Python, no torch)."""

from __future__ import annotations

from .allocator import BlockAllocator, OutOfBlocksError, RefCountError
from .prefix_cache import CacheStats, InsertResult, MatchResult, NoPrefixCache, PartialMatch, PrefixCache
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
    "make_prefix_cache",
]


def make_prefix_cache(enable_prefix_caching: bool, allocator: BlockAllocator, block_size: int) -> PrefixCache:
    """The radix tree when prefix caching is on, else a cache that caches nothing
    behind the same interface (so the engine has one code path)."""
    if enable_prefix_caching:
        return RadixPrefixCache(allocator, block_size)
    return NoPrefixCache(allocator, block_size)
