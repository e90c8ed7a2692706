"""KV-block memory management: block allocator and prefix caches (plain Python, no torch)."""

from __future__ import annotations

import time
from collections.abc import Callable

from .allocator import BlockAllocator, OutOfBlocksError, RefCountError
from .kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, KVEventLog
from .leases import LeaseInfo, LeaseKey, PrefixKey
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
from .tier_observer import TierObserver

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
    "LeaseKey",
    "PrefixKey",
    "KVEventLog",
    "KVCacheEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "TierObserver",
    "make_prefix_cache",
]


def make_prefix_cache(
    enable_prefix_caching: bool,
    allocator: BlockAllocator,
    block_size: int,
    clock: Callable[[], float] = time.monotonic,
    kv_events: KVEventLog | None = None,
    tier_observer: TierObserver | None = None,
    max_prefix_leased_blocks: int | None = None,
) -> PrefixCache:
    """The radix tree when prefix caching is on, else a cache that caches nothing
    behind the same interface (so the engine has one code path). ``clock``: lease expiry times.
    ``kv_events``: where the tree records blocks stored and removed (a cache that caches nothing
    records nothing). ``tier_observer``: the disk / Redis tiers below the tree (none: the tree is the only tier).
    ``max_prefix_leased_blocks``: the most blocks prefix leases may protect together (None: no cap)."""
    if enable_prefix_caching:
        return RadixPrefixCache(allocator, block_size, clock=clock, kv_events=kv_events, tier_observer=tier_observer,
                                max_prefix_leased_blocks=max_prefix_leased_blocks)
    return NoPrefixCache(allocator, block_size)
