"""Soft leases: a cached branch outlives plain LRU while its user is idle.

A lease names one tree node and protects the root->node path until it expires. Protection is soft:
eviction takes leased leaves only when no unleased one is left (oldest lease first), so a lease
never makes a request wait, fail or be preempted. Two kinds share this machinery:

* a **session lease** (key: the session id) protects the end of the session's last turn and is
  replaced by each turn;
* a **prefix lease** (key: ``PrefixKey``, the prefix's salted block-hash chain) protects a prompt's
  prefix up to a ``cache_control`` breakpoint or a ``prompt_cache_key``'s whole prompt. It is
  renewed by every later request whose prompt matches that prefix, and the blocks all prefix leases
  protect together are capped (the tree drops the least recently renewed one past the cap).

This module keeps the leases, their expiry order, the prefix leases' renewal order and which node
holds which lease; the radix tree counts them on its nodes.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

__all__ = ["Lease", "LeaseBook", "LeaseInfo", "LeaseKey", "PrefixKey"]


class PrefixKey(NamedTuple):
    """Who holds a prefix lease: the prefix itself, named by its salt and the (salted, unsigned 64-bit)
    chain hash of its last block, which names every token before it (``eviction_record.chain_hashes``)."""

    salt: str | None
    block_hash: int


LeaseKey = str | PrefixKey
"""A session id (str) or a prompt prefix (``PrefixKey``): the two never compare equal."""


@dataclass(eq=False)
class Lease:
    key: LeaseKey
    """Who holds it: a session id, or the leased prefix."""
    node: object
    """The tree node whose root path is protected (a RadixNode)."""
    expires_at: float
    """Clock seconds (the cache's clock) after which the branch is plain LRU again."""
    stamp: int
    """The tree's clock when it was last renewed: leased leaves are evicted in this order."""
    generation: int = 0
    seconds: float = 0.0
    """A prefix lease's TTL: each hit on the prefix pushes ``expires_at`` to at least now + this."""

    @property
    def is_prefix(self) -> bool:
        return isinstance(self.key, PrefixKey)


class LeaseInfo(NamedTuple):
    """What the cache holds for a lease holder."""

    num_tokens: int
    """Tokens on the leased root->node path (whole blocks)."""
    expires_at: float
    """The cache clock's time the lease ends."""


class LeaseBook:
    """Leases by key plus a min-heap of expiry times (lazy deletion), so expiry is O(log n) each; the
    leases on each node; and the prefix leases from least to most recently renewed."""

    def __init__(self) -> None:
        self._by_key: dict[LeaseKey, Lease] = {}
        self._expiry: list[tuple[float, int, LeaseKey]] = []
        self._generation = 0
        self._by_node: dict[object, dict[LeaseKey, None]] = {}
        self._prefix_order: OrderedDict[PrefixKey, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._by_key.values()))

    @property
    def num_prefix(self) -> int:
        """Live prefix leases."""
        return len(self._prefix_order)

    def get(self, key: LeaseKey) -> Lease | None:
        return self._by_key.get(key)

    def put(self, lease: Lease) -> None:
        """Add, replace or renew ``lease.key``'s lease (the caller moved the tree's counts already).
        A prefix lease goes to the back of the renewal order."""
        old = self._by_key.get(lease.key)
        if old is not None and old.node is not lease.node:
            self._unindex(old)
        self._generation += 1
        lease.generation = self._generation
        self._by_key[lease.key] = lease
        self._by_node.setdefault(lease.node, {})[lease.key] = None
        if isinstance(lease.key, PrefixKey):
            self._prefix_order[lease.key] = None
            self._prefix_order.move_to_end(lease.key)
        heapq.heappush(self._expiry, (lease.expires_at, lease.generation, lease.key))
        if len(self._expiry) > 2 * len(self._by_key) + 64:
            self._expiry = [(x.expires_at, x.generation, x.key) for x in self._by_key.values()]
            heapq.heapify(self._expiry)

    def pop(self, key: LeaseKey) -> Lease | None:
        lease = self._by_key.pop(key, None)
        if lease is not None:
            self._unindex(lease)
        return lease

    def move(self, lease: Lease, node: object) -> None:
        """``lease`` now protects ``node``'s path (its own node left the tree)."""
        self._unindex(lease)
        lease.node = node
        self._by_node.setdefault(node, {})[lease.key] = None  # (its place in the renewal order stays)

    def on_node(self, node: object) -> list[Lease]:
        """The leases whose own node is ``node``."""
        keys = self._by_node.get(node)
        return [self._by_key[k] for k in keys] if keys else []

    def prefix_leases(self) -> list[Lease]:
        """The prefix leases, least recently renewed first."""
        return [self._by_key[k] for k in self._prefix_order]

    def oldest_prefix(self) -> Lease | None:
        """The prefix lease renewed longest ago (what a full cap drops first)."""
        for key in self._prefix_order:
            return self._by_key[key]
        return None

    def _unindex(self, lease: Lease) -> None:
        keys = self._by_node.get(lease.node)
        if keys is not None:
            keys.pop(lease.key, None)
            if not keys:
                del self._by_node[lease.node]
        if isinstance(lease.key, PrefixKey) and self._by_key.get(lease.key) is not lease:
            self._prefix_order.pop(lease.key, None)

    def due(self, now: float) -> list[Lease]:
        """Remove and return every lease with ``expires_at <= now``."""
        out: list[Lease] = []
        heap = self._expiry
        while heap and heap[0][0] <= now:
            _, generation, key = heapq.heappop(heap)
            lease = self._by_key.get(key)
            if lease is not None and lease.generation == generation:
                self.pop(key)
                out.append(lease)
        return out

    def check_integrity(self) -> None:
        live = {(x.expires_at, x.generation, x.key) for x in self._by_key.values()}
        assert live <= set(self._expiry), "a lease has no expiry entry"
        indexed = {(id(node), k) for node, keys in self._by_node.items() for k in keys}
        assert indexed == {(id(x.node), x.key) for x in self._by_key.values()}, "the node index is out of sync"
        assert set(self._prefix_order) == {k for k in self._by_key if isinstance(k, PrefixKey)}, \
            "the prefix-lease order is out of sync"
