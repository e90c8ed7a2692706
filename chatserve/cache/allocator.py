"""Reference-counted allocator of KV-cache block ids.

The KV pool is a fixed array of ``num_blocks`` blocks; this class only hands out
their integer ids and counts who holds each one. A block's ref count is the
number of holders: each running request whose block table contains it, plus one
if the prefix cache (radix tree) keeps it. A block goes back to the free list
exactly when its count drops to zero, so sharing a cached prefix between
requests is just ``incref`` and finishing a request is just ``decref``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

__all__ = ["BlockAllocator", "OutOfBlocksError", "RefCountError"]


class OutOfBlocksError(RuntimeError):
    """Not enough free blocks; the caller should evict from the prefix cache,
    preempt a request, or wait. Nothing was allocated."""


class RefCountError(AssertionError):
    """A ref-count bug in the caller (e.g. decref of a free block).

    Subclasses AssertionError because it signals a broken invariant, not a
    recoverable condition; it is raised explicitly so ``python -O`` keeps it.
    """


class BlockAllocator:
    """Free list plus per-block ref counts, O(1) per block for every operation.

    # NOTE: invariant: a block is on the free list  <=>  its ref count is 0,
    # and the free list holds no duplicates.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self._num_total = num_blocks
        self._ref_counts: list[int] = [0] * num_blocks
        # LIFO stack; reversed so a fresh allocator hands out 0, 1, 2, ...
        # (LIFO also makes use-after-free bugs surface sooner in tests: a freed
        # block is the very next one handed out).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))

    @property
    def num_total(self) -> int:
        return self._num_total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self._num_total - len(self._free)

    def ref_count(self, block_id: int) -> int:
        self._check_id(block_id)
        return self._ref_counts[block_id]

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks, each with ref count 1 (owned by the caller)."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise OutOfBlocksError(
                f"need {n} KV blocks but only {len(self._free)} of {self._num_total} are free; "
                "evict from the prefix cache or preempt a running request first"
            )
        free = self._free
        out = free[len(free) - n :]
        del free[len(free) - n :]
        out.reverse()
        for b in out:
            self._ref_counts[b] = 1
        return out

    def incref(self, block_ids: Iterable[int]) -> None:
        """Add one holder to each block. Blocks must already be allocated."""
        ids = list(block_ids)
        for b in ids:
            self._check_id(b)
            if self._ref_counts[b] <= 0:
                raise RefCountError(f"incref of free block {b}: only allocated blocks can be shared")
        for b in ids:
            self._ref_counts[b] += 1

    def decref(self, block_ids: Iterable[int]) -> list[int]:
        """Drop one holder from each block; return the ids that became free.

        Validates everything before changing anything, so a buggy call leaves
        the allocator as it was.
        """
        ids = list(block_ids)
        for b, k in Counter(ids).items():
            self._check_id(b)
            if self._ref_counts[b] < k:
                raise RefCountError(
                    f"decref of block {b} {k} time(s) but its ref count is {self._ref_counts[b]} "
                    "(double free or decref of a block the caller does not hold)"
                )
        freed: list[int] = []
        for b in ids:
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)
                freed.append(b)
        return freed

    def check_integrity(self) -> None:
        """Raise AssertionError if the free list and ref counts disagree."""
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "free list has duplicates"
        for b in free_set:
            assert 0 <= b < self._num_total, f"free list holds out-of-range id {b}"
        for b, rc in enumerate(self._ref_counts):
            if b in free_set:
                assert rc == 0, f"free block {b} has ref count {rc}"
            else:
                assert rc > 0, f"block {b} is neither free nor referenced (leaked)"

    def _check_id(self, block_id: int) -> None:
        if not 0 <= block_id < self._num_total:
            raise IndexError(f"block id {block_id} out of range [0, {self._num_total})")

    def __repr__(self) -> str:
        return f"BlockAllocator(free={self.num_free}, total={self.num_total})"
