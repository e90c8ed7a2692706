"""The prefix-cache interface, its result types, and the "cache off" implementation.

The engine talks only to ``PrefixCache``, so turning prefix caching off swaps
the implementation, not the engine's code path. The contract, in the order the
engine uses it:

* admission: ``m = cache.match_prefix(prompt[:-1]); cache.lock(m.node);
  allocator.incref(m.block_ids)`` -- the request's block table starts with
  ``m.block_ids`` and only ``prompt[m.num_tokens:]`` is prefilled. If
  ``allocator.num_free`` is too low for the rest, call ``cache.evict(k)``
  (after locking, so the matched blocks cannot be evicted) and check its result.
* partial block (optional, copy-on-write): ``p = cache.match_partial(prompt[:-1], m)``;
  if not None, ``allocator.incref(p.block_id)``, copy its first ``p.num_tokens``
  tokens' KV into a fresh private block, then ``allocator.decref(p.block_id)``.
  Between the two the source is pinned, not locked (see ``check_integrity``).
* publish (optional, mid-prefill): ``r = cache.insert(tokens[:n*bs], table[:n]);
  cache.lock(r.node); cache.unlock(old_node)``.
* finish/abort: ``r = cache.insert(...)`` of the computed full blocks,
  ``cache.unlock(node)``, ``allocator.decref(table)``; the tree's own
  references keep cached blocks alive.

Salts: every lookup and insertion takes the request's ``salt`` (its ``cache_salt``; None for
none). The tree is partitioned by it: a request only ever matches blocks inserted under the same
salt, so an unsalted request never matches a salted one and two salts never share a block.

# NOTE: every tree block a running request holds must lie on the root->node
# path of a node that request has locked. ``stats().evictable`` and the
# integrity check rely on it; ``evict`` stays safe even if it is violated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from .allocator import BlockAllocator
from .leases import LeaseInfo, LeaseKey, PrefixKey

__all__ = [
    "MatchResult", "PartialMatch", "InsertResult", "CacheStats", "MissExplanation", "MissReason", "PrefixCache",
    "NoPrefixCache",
]

MissReason = Literal["none", "new", "evicted", "diverged", "skipped"]
"""Why the first uncached prompt token was not cached: ``none`` (nothing missed but the last
token, which is always computed), ``new`` (the tree never held this continuation, as far as it
remembers), ``evicted`` (it held this block's prefix recently and evicted it), ``diverged`` (the
tree holds a sequence that agrees with the prompt up to some token k > 0 and then continues
differently: a re-templated history, an edited turn), ``skipped`` (the request does not read the
cache: it asked for prompt logprobs, which need every prompt position computed)."""


class MatchResult(NamedTuple):
    block_ids: list[int]
    """Cached blocks covering the first ``num_tokens`` tokens (not incref'd)."""
    num_tokens: int
    """Always a multiple of ``block_size``."""
    node: object
    """Handle to lock/unlock: the deepest matched node (the root if nothing matched)."""


class PartialMatch(NamedTuple):
    """A cached block whose first ``num_tokens`` tokens continue a whole-block match.

    Its KV for those tokens depends only on the matched prefix plus these
    tokens (attention is causal), so a request may copy them into a private
    block of its own (copy-on-write) instead of recomputing them."""

    block_id: int
    """The tree block to copy from (not incref'd)."""
    num_tokens: int
    """How many leading tokens of that block match: ``1 <= num_tokens < block_size``."""


class InsertResult(NamedTuple):
    num_cached_tokens: int
    """How many inserted tokens were already in the tree (multiple of block_size).
    For that part the tree kept its own blocks; where the caller's block differs
    (``table[i] != block_ids[i]``) the caller's block is a duplicate it still owns."""
    node: object
    """Handle of the deepest node now covering the inserted tokens."""
    block_ids: list[int]
    """The tree's block ids for ALL inserted full blocks (one per full block)."""


class CacheStats(NamedTuple):
    """Block counts. ``locked``: tree blocks on a path locked by some request.
    ``evictable``: tree blocks not locked (held only by the tree when the
    engine follows the lock contract). Tree blocks = locked + evictable.
    ``leased``: tree blocks on a path a live lease protects (locked or not;
    leased blocks are still evictable, last). ``prefix_leased``: of those, the
    blocks a prefix lease protects (what ``max_prefix_leased_blocks`` caps);
    ``prefix_leases``: live prefix leases."""

    total: int
    free: int
    evictable: int
    locked: int
    leased: int = 0
    prefix_leased: int = 0
    prefix_leases: int = 0


class MissExplanation(NamedTuple):
    """Why a lookup stopped where it did (see ``PrefixCache.explain_miss``)."""

    reason: MissReason
    diverged_at: int | None
    """For ``diverged``: the index of the first prompt token the cached sequence disagrees with."""
    leased: bool
    """The matched prefix ends on a leased branch (a hit the lease protected)."""


class PrefixCache(ABC):
    """Maps token prefixes (whole blocks only) to KV blocks that hold them."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.allocator = allocator
        self.block_size = block_size
        self.num_evicted_blocks = 0  # for metrics; stays 0 when nothing is cached
        self.num_leased_evicted_blocks = 0  # of those, taken from leased branches (nothing else was left)
        self.num_prefix_lease_renewals = 0  # prefix leases a hit renewed
        self.num_prefix_leases_dropped = 0  # prefix leases dropped because the cap was exceeded
        self.num_prefix_leased_dropped_blocks = 0  # the blocks those dropped leases protected when dropped

    @abstractmethod
    def match_prefix(self, token_ids: Sequence[int], *, salt: str | None = None) -> MatchResult:
        """Longest cached run of whole blocks that prefixes ``token_ids``, among the blocks inserted
        under ``salt``. Does not incref; only refreshes LRU timestamps (and may split a node,
        which changes nothing observable) and renews the prefix leases the match covers."""

    @abstractmethod
    def match_partial(self, token_ids: Sequence[int], match: MatchResult) -> PartialMatch | None:
        """The cached block right after ``match`` (which ``match_prefix(token_ids...)``
        returned) that shares the most leading tokens with
        ``token_ids[match.num_tokens:]``, or None if none shares even one.
        Looks only at that one block position (children of one node, never the
        whole tree); no side effect but an LRU refresh. Caller's contract: to
        use it, incref ``block_id`` until the copy is done (the tree may
        otherwise evict it)."""

    @abstractmethod
    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], *, salt: str | None = None) -> InsertResult:
        """Cache ``token_ids`` truncated to whole blocks, under ``salt``; ``block_ids[i]`` holds
        tokens ``[i*bs, (i+1)*bs)`` (extra trailing ids are ignored). The tree
        increfs the blocks it newly takes; it never takes the caller's
        duplicates of blocks it already has."""

    @abstractmethod
    def lock(self, node: object) -> None:
        """Protect the root->node path from eviction. Locks nest (counted)."""

    @abstractmethod
    def unlock(self, node: object) -> None:
        """Undo one ``lock(node)``."""

    @abstractmethod
    def evict(self, num_blocks: int) -> int:
        """Free up to ``num_blocks`` blocks held only by the tree, least recently
        used unlocked leaves first; return how many went back to the free list."""

    @abstractmethod
    def stats(self) -> CacheStats:
        """Block counts, O(1)."""

    # ---- why a request missed ------------------------------------------------------------------

    @abstractmethod
    def explain_miss(self, token_ids: Sequence[int], num_matched: int, *, salt: str | None = None) -> MissExplanation:
        """Why ``token_ids[num_matched]`` is not cached, right after ``match_prefix`` (and
        ``match_partial``) matched ``num_matched`` tokens of ``token_ids`` under ``salt``. No side effect."""

    @abstractmethod
    def peek_prefix(self, token_ids: Sequence[int], *, salt: str | None = None) -> int:
        """How many leading tokens (whole blocks) of ``token_ids`` are cached under ``salt``, without
        touching LRU order or leases: for reports, not for admission."""

    # ---- leases ---------------------------------------------------------------------------------

    @abstractmethod
    def set_lease(self, key: str, node: object, seconds: float) -> None:
        """Protect the root->node path for ``seconds`` under ``key`` (a session id), replacing
        ``key``'s earlier lease. ``seconds <= 0`` only releases the earlier one."""

    @abstractmethod
    def lease_prefix(self, token_ids: Sequence[int], seconds: float, *, salt: str | None = None) -> PrefixKey | None:
        """Lease the whole blocks of ``token_ids`` the tree holds under ``salt`` (from the first
        block on) for ``seconds``, keyed by the prefix (``PrefixKey``: salt and chain hash). The same
        prefix leased again keeps the later end and the longer TTL; a later ``match_prefix`` that covers
        it renews it to now + its TTL. Past ``max_prefix_leased_blocks`` the least recently renewed
        prefix leases are dropped (counted in ``num_prefix_leases_dropped``), this one too if it alone
        exceeds the cap. Returns the key, or None when nothing was leased (no whole block cached,
        ``seconds <= 0``, or the lease was dropped at once)."""

    @abstractmethod
    def release_lease(self, key: LeaseKey) -> bool:
        """End ``key``'s lease now (its branch becomes plain LRU); False if it had none."""

    @abstractmethod
    def expire_leases(self, now: float | None = None) -> int:
        """End every lease due by ``now`` (default: the cache's clock); return how many ended."""

    @abstractmethod
    def lease_info(self, key: LeaseKey) -> LeaseInfo | None:
        """``key``'s live lease: tokens it protects and when it ends; None if none."""

    @abstractmethod
    def check_integrity(
        self, external_refs: Mapping[int, int] | None = None, pinned_refs: Mapping[int, int] | None = None
    ) -> None:
        """Raise AssertionError if any invariant is broken. ``external_refs``:
        block id -> number of running requests whose block tables hold it;
        when given, every block's ref count is checked exactly. ``pinned_refs``:
        block id -> extra references taken only for a short while (the source
        of a pending copy-on-write of a partially matching block); they count
        in the ref counts but need no lock."""

    @abstractmethod
    def reset(self) -> None:
        """Drop every unlocked node (for tests and benchmarks)."""


class _NoCacheRoot:
    """The only node of a cache that caches nothing; lock/unlock ignore it."""

    def __repr__(self) -> str:
        return "<NoPrefixCache root>"


class NoPrefixCache(PrefixCache):
    """Prefix caching off: same interface, nothing is ever cached.

    ``insert`` returns the caller's own block ids as ``block_ids`` with
    ``num_cached_tokens == 0``: there are no duplicates to handle, and since
    the tree took no reference, the caller's final ``decref`` frees them.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        super().__init__(allocator, block_size)
        self._root = _NoCacheRoot()

    def match_prefix(self, token_ids: Sequence[int], *, salt: str | None = None) -> MatchResult:
        return MatchResult([], 0, self._root)

    def match_partial(self, token_ids: Sequence[int], match: MatchResult) -> PartialMatch | None:
        return None

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], *, salt: str | None = None) -> InsertResult:
        n = len(token_ids) // self.block_size
        if len(block_ids) < n:
            raise ValueError(f"{n} full blocks of tokens but only {len(block_ids)} block ids")
        return InsertResult(0, self._root, list(block_ids[:n]))

    def lock(self, node: object) -> None:
        if node is not self._root:
            raise ValueError(f"{node!r} is not a handle of this NoPrefixCache")

    def unlock(self, node: object) -> None:
        if node is not self._root:
            raise ValueError(f"{node!r} is not a handle of this NoPrefixCache")

    def evict(self, num_blocks: int) -> int:
        return 0

    def stats(self) -> CacheStats:
        a = self.allocator
        return CacheStats(total=a.num_total, free=a.num_free, evictable=0, locked=0)

    def explain_miss(self, token_ids: Sequence[int], num_matched: int, *, salt: str | None = None) -> MissExplanation:
        return MissExplanation("none" if num_matched >= len(token_ids) else "new", None, False)

    def peek_prefix(self, token_ids: Sequence[int], *, salt: str | None = None) -> int:
        return 0

    def set_lease(self, key: str, node: object, seconds: float) -> None:
        pass  # nothing is cached, so nothing to protect

    def lease_prefix(self, token_ids: Sequence[int], seconds: float, *, salt: str | None = None) -> PrefixKey | None:
        return None

    def release_lease(self, key: LeaseKey) -> bool:
        return False

    def expire_leases(self, now: float | None = None) -> int:
        return 0

    def lease_info(self, key: LeaseKey) -> LeaseInfo | None:
        return None

    def check_integrity(
        self, external_refs: Mapping[int, int] | None = None, pinned_refs: Mapping[int, int] | None = None
    ) -> None:
        a = self.allocator
        a.check_integrity()
        assert not pinned_refs, f"blocks {sorted(pinned_refs or ())} are pinned but nothing is cached to copy from"
        if external_refs is None:
            return
        for b in range(a.num_total):
            n = external_refs.get(b, 0)
            assert n <= 1, f"block {b} is shared by {n} requests but no tree holds it"
            assert a.ref_count(b) == n, f"block {b}: ref count {a.ref_count(b)} != {n} holders"

    def reset(self) -> None:
        pass
