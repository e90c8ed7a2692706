"""Gives sequences KV blocks, sharing cached prefixes through the prefix cache.

Reference counting (see DESIGN.md "Cache invariants"): a sequence holds one
reference on every block of its block table; the prefix cache holds one on
every block in its tree. Releasing a sequence therefore always decrefs its whole
table; blocks the tree also holds stay alive for the next request.

Every cache call passes the sequence's ``cache_salt``: it matches and publishes only within its
salt's partition of the tree.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple, get_args

from chatserve.cache import (
    BlockAllocator,
    KVEventLog,
    MatchResult,
    MissExplanation,
    MissReason,
    PrefixCache,
    TierObserver,
    make_prefix_cache,
)
from chatserve.core.sequence import Sequence

MISS_REASONS: tuple[str, ...] = get_args(MissReason)

# A block-table entry whose block went back to the pool: every key in it is outside every layer's
# sliding window for the sequence's next rows (`free_out_of_window`). The attention kernels read
# only the blocks a row's window covers, so such an entry is never read; it keeps the table's
# indexing (position p in entry p // block_size) for the blocks after it.
FREED_BLOCK = -1


class AdoptResult(NamedTuple):
    """Blocks loaded from a lower tier that the tree now holds (see ``BlockManager.adopt_blocks``)."""

    first_block: int
    """Index (in the prompt) of the first block the tree took from the load."""
    num_blocks: int
    """How many it took (0: the tree already had them, lost the prefix before them, or no room)."""


class BlockCopy(NamedTuple):
    """Copy the KV of the first ``num_tokens`` slots of block ``src`` into block ``dst``."""

    src: int
    dst: int
    num_tokens: int


class BlockManager:
    """Owns the KV block accounting of every sequence: the allocator's free list, the prefix cache
    (radix tree) over it, each sequence's block table and prefix-cache locks, pending copy-on-write
    copies of partially matching blocks, prefix and session leases, and the hit / miss counters.
    Plain Python: the KV bytes themselves live in the worker's pool."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool, clock: Callable[[], float] = time.monotonic,
        kv_events: KVEventLog | None = None, tier_observer: TierObserver | None = None,
        max_prefix_leased_blocks: int | None = None,
    ) -> None:
        self.block_size = block_size
        self.allocator = BlockAllocator(num_blocks)
        self.cache: PrefixCache = make_prefix_cache(enable_prefix_caching, self.allocator, block_size, clock, kv_events,
                                                    tier_observer, max_prefix_leased_blocks)
        self.cache_enabled = enable_prefix_caching
        # seq_id -> copy-on-write of a partially matching cached block, not yet done.
        # NOTE: each holds one reference on its src (so eviction cannot free it
        # before the model runner copies it); dst is the last block of the seq's table.
        self._pending_copies: dict[int, BlockCopy] = {}
        # counters for metrics
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.num_block_copies = 0  # partially matching blocks copied instead of recomputed
        self.miss_reasons: Counter[str] = Counter({r: 0 for r in MISS_REASONS})  # per request, at first admission
        self.lease_hits = 0  # requests whose hit ended on a leased branch
        self.lease_hit_tokens = 0
        self.num_prefix_leases_set = 0  # prefix leases (cache_control / prompt_cache_key) set or renewed at a finish
        self._window_freed_upto: dict[int, int] = {}  # seq_id -> table entries already freed or kept
        self.num_window_freed_blocks = 0  # blocks freed by `free_out_of_window`, for metrics and tests

    @property
    def num_total_blocks(self) -> int:
        return self.allocator.num_total

    @property
    def num_free_blocks(self) -> int:
        return self.allocator.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- admission -------------------------------------------------------
    def match_and_lock(self, seq: Sequence, *, read_cache: bool = True) -> int:
        """Reuse the longest cached prefix of seq's tokens, always leaving the last token to compute.

        Returns the number of tokens served from the cache in whole shared blocks;
        `reuse_partial_block` may then add the leading tokens of the next block. ``read_cache``
        False: nothing is reused (seq computes every token; it still publishes its blocks).
        """
        assert not seq.block_table and seq.cache_node is None
        match = self.cache.match_prefix(seq.token_ids[:-1] if read_cache else [], salt=seq.cache_salt)
        self.cache.lock(match.node)
        self._drop_prefetch_lock(seq)  # (after locking the match, which covers what was loaded)
        self.allocator.incref(match.block_ids)
        seq.cache_node = match.node
        seq.block_table = list(match.block_ids)
        seq.num_computed_tokens = match.num_tokens
        seq.num_published_blocks = len(match.block_ids)
        return match.num_tokens

    # ---- blocks loaded from the tiers below the tree ------------------------
    def adopt_blocks(
        self, token_ids: list[int], first_block: int, num_blocks: int, fill: Callable[[list[int], int], None],
        seqs: list[Sequence], *, salt: str | None = None,
    ) -> AdoptResult:
        """Put blocks ``first_block .. first_block+num_blocks-1`` of ``token_ids`` (under ``salt``, the
        seqs' ``cache_salt``), loaded from a lower tier, into free blocks and the tree, and lock them
        for ``seqs`` until they are admitted.

        ``fill(block_ids, first)`` writes the KV of prompt blocks ``first ..`` into ``block_ids``.
        Blocks the tree holds by now are skipped; if it lost part of the prefix before
        ``first_block`` meanwhile (evicted), nothing is taken (the run would not hang from the root).

        # NOTE: who owns the new blocks, step by step: allocate -> private to this call (ref 1);
        # insert -> the tree takes its reference (ref 2); decref -> the tree's alone (ref 1), locked
        # by each seq's ``prefetch_node`` until ``match_and_lock`` (or ``release``) swaps that lock
        # for the seq's own. The prefix matched before them is locked while blocks are evicted to
        # make room, so making room never frees the blocks they hang from. At most three quarters of
        # the pool may be locked after a load: waiting requests must never lock out running ones.
        """
        bs = self.block_size
        end = first_block + num_blocks
        match = self.cache.match_prefix(token_ids[: end * bs], salt=salt)
        have = len(match.block_ids)
        if have < first_block or have >= end:
            return AdoptResult(have, 0)
        self.cache.lock(match.node)
        try:
            take = end - have
            s = self.cache.stats()
            take = min(take, max(0, s.free + s.evictable - s.total // 4))
            if take > 0:
                self.ensure_free(take)
                take = min(take, self.allocator.num_free)
            if take <= 0:
                return AdoptResult(have, 0)
            ids = self.allocator.allocate(take)
            try:
                fill(ids, have)
            except BaseException:
                self.allocator.decref(ids)
                raise
            result = self.cache.insert(token_ids[: (have + take) * bs], match.block_ids + ids, salt=salt)
            self.allocator.decref(ids)
            for seq in seqs:
                self._drop_prefetch_lock(seq)
                self.cache.lock(result.node)
                seq.prefetch_node = result.node
        finally:
            self.cache.unlock(match.node)
        return AdoptResult(have, take)

    def _drop_prefetch_lock(self, seq: Sequence) -> None:
        if seq.prefetch_node is not None:
            self.cache.unlock(seq.prefetch_node)
            seq.prefetch_node = None

    def reuse_partial_block(self, seq: Sequence) -> int:
        """Copy-on-write: start seq's next block as a copy of the cached block that
        shares its first k tokens with seq's, so those k tokens need no prefill.

        Called right after `match_and_lock`, only for a sequence that is being
        admitted (a deferred one should not take or evict a block). Returns k
        (0 when nothing matches or no block is free).
        """
        match = MatchResult(list(seq.block_table), seq.num_computed_tokens, seq.cache_node)
        # NOTE: matched against tokens[:-1], so the last prompt token is always computed.
        partial = self.cache.match_partial(seq.token_ids[:-1], match)
        if partial is None:
            return 0
        src, k = partial
        self.allocator.incref([src])  # before evicting: the source must survive until copied
        if not self.ensure_free(1):
            self.allocator.decref([src])
            return 0
        dst = self.allocator.allocate(1)[0]
        self._pending_copies[seq.seq_id] = BlockCopy(src, dst, k)
        seq.block_table.append(dst)
        seq.num_computed_tokens += k
        return k

    def take_pending_copies(self) -> list[BlockCopy]:
        """The block copies the model runner must do before the next forward pass.

        The caller owns the sources' references from now on: call
        ``finish_copies`` once the copies are done.
        """
        copies = list(self._pending_copies.values())
        self._pending_copies.clear()
        return copies

    def finish_copies(self, copies: list[BlockCopy]) -> None:
        """Drop the references that kept the copies' sources alive."""
        if copies:
            self.allocator.decref([c.src for c in copies])
            self.num_block_copies += len(copies)

    def explain_miss(self, seq: Sequence, num_cached: int) -> MissExplanation:
        """Why seq's lookup stopped at ``num_cached`` tokens; call right after matching (and the
        partial-block reuse), before anything can be evicted."""
        return self.cache.explain_miss(seq.token_ids[:-1], num_cached, salt=seq.cache_salt)

    def record_first_admission(self, seq: Sequence, num_cached: int, why: MissExplanation) -> None:
        """Write the request's one record of its lookup (shared by its n sequences) and count it."""
        stats = seq.stats
        stats.num_cached_tokens = num_cached
        stats.cache_miss_reason = why.reason
        stats.cache_diverged_at = why.diverged_at
        stats.cache_lease_hit = why.leased and num_cached > 0
        history = stats.session_history_tokens
        if history:
            stats.session_history_matched = num_cached >= (history - 1) // self.block_size * self.block_size
        self.miss_reasons[why.reason] += 1
        if stats.cache_lease_hit:
            self.lease_hits += 1
            self.lease_hit_tokens += num_cached

    def record_admission(self, seq: Sequence, num_cached: int) -> None:
        """Count a prefix-cache query once per admitted (not deferred) sequence."""
        self.prefix_query_tokens += len(seq.token_ids) - 1
        self.prefix_hit_tokens += num_cached

    def ensure_free(self, num_blocks: int) -> bool:
        """Make `num_blocks` free, evicting unlocked cached blocks if needed."""
        short = num_blocks - self.allocator.num_free
        if short > 0:
            self.cache.evict(short)
        return self.allocator.num_free >= num_blocks

    def num_new_blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(0, self.blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table))

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Grow seq's block table to hold `num_new_tokens` more tokens; False if memory is short."""
        need = self.num_new_blocks_needed(seq, num_new_tokens)
        if need == 0:
            return True
        if not self.ensure_free(need):
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        return True

    def allocate_free_only(self, seq: Sequence, num_new_tokens: int) -> bool:
        """As allocate, from free blocks only (no eviction): room for speculative drafts."""
        need = self.num_new_blocks_needed(seq, num_new_tokens)
        if need > self.allocator.num_free:
            return False
        if need:
            seq.block_table.extend(self.allocator.allocate(need))
        return True

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past what seq's tokens need (after a verification rejected drafts whose
        slots were in them). Such a block held only rejected tokens and was never published."""
        keep = self.blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            assert seq.num_published_blocks <= keep
            extra = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.allocator.decref(extra)

    def free_out_of_window(self, seq: Sequence, first_needed: int) -> int:
        """Free seq's blocks wholly before position `first_needed`, the first key any of its next
        rows attends to in any layer (a model whose every layer has a sliding window: the next
        position minus the largest window, plus one). Their table entries become FREED_BLOCK.

        Only for an engine without the prefix cache: with it, every full block is published as it is
        computed (it is the cached prefix a later request reuses) and stays the cache's, evictable
        once no sequence locks it. Returns how many blocks went free.
        """
        assert not self.cache_enabled, "windowed blocks are freed only without the prefix cache"
        stop = min(max(0, first_needed) // self.block_size, len(seq.block_table))
        start = self._window_freed_upto.get(seq.seq_id, 0)
        if stop <= start:
            return 0
        pinned = {c.src for c in self._pending_copies.values()}
        freed = [b for b in seq.block_table[start:stop] if b != FREED_BLOCK and b not in pinned]
        for i in range(start, stop):
            if seq.block_table[i] not in pinned:
                seq.block_table[i] = FREED_BLOCK
        self._window_freed_upto[seq.seq_id] = stop
        self.allocator.decref(freed)
        self.num_window_freed_blocks += len(freed)
        return len(freed)

    # ---- sharing computed blocks -------------------------------------------
    def publish(self, seq: Sequence) -> None:
        """Offer seq's newly computed full blocks to the prefix cache (also mid-prefill).

        Requests arriving together then match what the first one computed
        instead of computing the same prefix again.
        """
        num_full = seq.num_computed_tokens // self.block_size
        if num_full <= seq.num_published_blocks:
            return
        result = self.cache.insert(seq.token_ids[: num_full * self.block_size], seq.block_table[:num_full],
                                   salt=seq.cache_salt)
        self.cache.lock(result.node)
        self.cache.unlock(seq.cache_node)
        seq.cache_node = result.node
        seq.num_published_blocks = num_full

    def release(self, seq: Sequence, *, keep_in_cache: bool = True, lease: bool = False) -> None:
        """Return seq's blocks: computed full blocks stay in the tree, the rest go free.

        lease: seq has ended; if it is a session turn, lease its branch for the session's idle time
        (renewing the previous turn's lease), so unleased traffic is evicted before it; lease each of
        its ``cache_leases`` prefixes (what of it was computed) for its TTL.
        """
        self._drop_prefetch_lock(seq)
        if seq.cache_node is None and not seq.block_table:
            return
        copy = self._pending_copies.pop(seq.seq_id, None)
        if copy is not None:
            # never copied: drop the source's pin; dst goes free with the table below
            self.allocator.decref([copy.src])
        if keep_in_cache:
            self.publish(seq)
        if lease and keep_in_cache and seq.session is not None and seq.cache_node is not None:
            self.cache.set_lease(seq.session.session_id, seq.cache_node, seq.session.lease_seconds)
        if lease and keep_in_cache and seq.cache_leases and seq.cache_node is not None:
            self._lease_prefixes(seq)
        if seq.cache_node is not None:
            self.cache.unlock(seq.cache_node)
        self.allocator.decref([b for b in seq.block_table if b != FREED_BLOCK])
        self._window_freed_upto.pop(seq.seq_id, None)
        seq.block_table = []
        seq.cache_node = None
        seq.num_computed_tokens = 0
        seq.num_published_blocks = 0

    def _lease_prefixes(self, seq: Sequence) -> None:
        """Lease seq's ``cache_leases`` prefixes: each position's whole prompt blocks, as far as seq
        published them (all of them, unless it ended before its prompt was computed)."""
        bs = self.block_size
        for want in seq.cache_leases:
            n = min(min(want.position, seq.num_prompt_tokens) // bs, seq.num_published_blocks)
            if n > 0 and self.cache.lease_prefix(seq.token_ids[: n * bs], want.ttl_s, salt=seq.cache_salt) is not None:
                self.num_prefix_leases_set += 1

    def reset_prefix_cache(self) -> bool:
        """Drop every cached block back to the free list, so the next request starts cold.

        Refused (False, nothing changed) while any sequence holds blocks: its tree
        blocks are locked and its next step reads them. Idle means the DESIGN
        invariant "free + evictable == total, no lock, no pending copy" holds, and
        then evicting every unlocked node frees every block.
        """
        s = self.cache.stats()
        if s.locked or self._pending_copies or s.free + s.evictable != s.total:
            return False
        self.cache.reset()
        return self.allocator.num_free == self.allocator.num_total

    # ---- checks ------------------------------------------------------------
    def check_integrity(self, live: list[Sequence]) -> None:
        refs = Counter(b for s in live for b in s.block_table if b != FREED_BLOCK)
        pinned = Counter(c.src for c in self._pending_copies.values())
        live_ids = {s.seq_id for s in live}
        for seq_id, c in self._pending_copies.items():
            assert seq_id in live_ids, f"pending copy {c} belongs to sequence {seq_id}, which holds no blocks"
            assert refs[c.dst] == 1, f"pending copy {c}: dst is not private to one sequence"
        self.allocator.check_integrity()
        self.cache.check_integrity(dict(refs), pinned_refs=dict(pinned))
