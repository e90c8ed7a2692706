"""A min-priority set with O(log n) add/update/pop and O(1) discard.

The radix tree keeps its evictable leaves here (priority = last access), so
eviction pops the least-recently-used leaf without walking the tree. It is a
heap with lazy deletion: ``discard`` and ``update`` only change the dict, and
stale heap entries are skipped on ``pop`` and dropped by compaction.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["LRUIndex"]

T = TypeVar("T", bound=Hashable)


class LRUIndex(Generic[T]):
    """Items are compared by identity/hash only; ties break by insertion order.

    # NOTE: invariant: an item is a member  <=>  it is in ``_live``, and
    # ``_live[item]`` equals exactly one heap entry's (priority, seq).
    """

    def __init__(self) -> None:
        self._live: dict[T, tuple[int, int]] = {}
        self._heap: list[tuple[int, int, T]] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, item: object) -> bool:
        return item in self._live

    def __iter__(self):
        return iter(self._live)

    def add(self, item: T, priority: int) -> None:
        """Insert ``item`` or change its priority."""
        self._seq += 1
        entry = (priority, self._seq)
        self._live[item] = entry
        heapq.heappush(self._heap, (priority, self._seq, item))
        if len(self._heap) > 2 * len(self._live) + 64:
            self._compact()

    def priority(self, item: T) -> int:
        return self._live[item][0]

    def discard(self, item: T) -> None:
        self._live.pop(item, None)

    def pop(self) -> T | None:
        """Remove and return the lowest-priority item, or None if empty."""
        heap = self._heap
        while heap:
            priority, seq, item = heapq.heappop(heap)
            if self._live.get(item) == (priority, seq):
                del self._live[item]
                return item
        return None

    def _compact(self) -> None:
        self._heap = [(p, s, it) for it, (p, s) in self._live.items()]
        heapq.heapify(self._heap)

    def check_integrity(self) -> None:
        valid = {(p, s) for p, s, it in self._heap if self._live.get(it) == (p, s)}
        assert len(valid) == len(self._live), "an index member has no live heap entry"
