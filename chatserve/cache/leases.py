"""Soft leases: a session's cached branch outlives plain LRU while its user is idle.

A lease names one tree node (the end of the session's last turn) and protects the root->node
path until it expires. Protection is soft: eviction takes leased leaves only when no unleased
one is left (oldest lease first), so a lease never makes a request wait, fail or be preempted.
This module keeps the leases and their expiry order; the radix tree counts them on its nodes.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Lease", "LeaseBook", "LeaseInfo"]


@dataclass(eq=False)
class Lease:
    key: str
    """Who holds it: a session id."""
    node: object
    """The tree node whose root path is protected (a RadixNode)."""
    expires_at: float
    """Clock seconds (the cache's clock) after which the branch is plain LRU again."""
    stamp: int
    """The tree's clock when it was last renewed: leased leaves are evicted in this order."""
    generation: int = 0


class LeaseInfo(NamedTuple):
    """What the cache holds for a lease holder."""

    num_tokens: int
    """Tokens on the leased root->node path (whole blocks)."""
    expires_at: float
    """The cache clock's time the lease ends."""


class LeaseBook:
    """Leases by key plus a min-heap of expiry times (lazy deletion), so expiry is O(log n) each."""

    def __init__(self) -> None:
        self._by_key: dict[str, Lease] = {}
        self._expiry: list[tuple[float, int, str]] = []
        self._generation = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self):
        return iter(list(self._by_key.values()))

    def get(self, key: str) -> Lease | None:
        return self._by_key.get(key)

    def put(self, lease: Lease) -> None:
        """Add or replace ``lease.key``'s lease (the caller moved the tree's counts already)."""
        self._generation += 1
        lease.generation = self._generation
        self._by_key[lease.key] = lease
        heapq.heappush(self._expiry, (lease.expires_at, lease.generation, lease.key))
        if len(self._expiry) > 2 * len(self._by_key) + 64:
            self._expiry = [(x.expires_at, x.generation, x.key) for x in self._by_key.values()]
            heapq.heapify(self._expiry)

    def pop(self, key: str) -> Lease | None:
        return self._by_key.pop(key, None)

    def due(self, now: float) -> list[Lease]:
        """Remove and return every lease with ``expires_at <= now``."""
        out: list[Lease] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, generation, key = heapq.heappop(heap)
            lease = self._by_key.get(key)
            if lease is not None and lease.generation == generation:
                del self._by_key[key]
                out.append(lease)
        return out

    def check_integrity(self) -> None:
        live = {(x.expires_at, x.generation, x.key) for x in self._by_key.values()}
        assert live <= set(self._expiry), "a lease has no expiry entry"
