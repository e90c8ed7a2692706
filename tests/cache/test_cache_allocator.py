from __future__ import annotations

import pytest

from chatserve.cache import BlockAllocator, OutOfBlocksError
from chatserve.cache.allocator import RefCountError


def test_fresh_allocator_is_all_free() -> None:
    a = BlockAllocator(8)
    assert (a.num_total, a.num_free, a.num_used) == (8, 8, 0)
    assert all(a.ref_count(b) == 0 for b in range(8))
    a.check_integrity()


def test_allocate_sets_ref_one_and_ids_are_distinct() -> None:
    a = BlockAllocator(8)
    got = a.allocate(3) + a.allocate(5)
    assert sorted(got) == list(range(8))
    assert all(a.ref_count(b) == 1 for b in got)
    assert a.num_free == 0
    assert a.allocate(0) == []
    a.check_integrity()


def test_allocate_too_many_allocates_nothing() -> None:
    a = BlockAllocator(4)
    a.allocate(3)
    with pytest.raises(OutOfBlocksError, match="only 1 of 4"):
        a.allocate(2)
    assert a.num_free == 1
    a.check_integrity()
    assert isinstance(OutOfBlocksError("x"), RuntimeError)


def test_allocate_negative_is_an_error() -> None:
    with pytest.raises(ValueError):
        BlockAllocator(4).allocate(-1)
    with pytest.raises(ValueError):
        BlockAllocator(0)


def test_incref_decref_frees_at_zero() -> None:
    a = BlockAllocator(4)
    b = a.allocate(2)
    a.incref(b)
    assert [a.ref_count(x) for x in b] == [2, 2]
    assert a.decref(b) == []
    assert a.num_free == 2
    assert a.decref(reversed(b)) == list(reversed(b))
    assert a.num_free == 4
    a.check_integrity()


def test_decref_repeated_id_in_one_call() -> None:
    a = BlockAllocator(4)
    (b,) = a.allocate(1)
    a.incref([b])
    assert a.decref([b, b]) == [b]
    assert a.ref_count(b) == 0
    a.check_integrity()


def test_decref_of_free_block_is_a_bug_and_changes_nothing() -> None:
    a = BlockAllocator(4)
    x, y = a.allocate(2)
    with pytest.raises(AssertionError):
        a.decref([x, 3])  # 3 is free
    assert a.ref_count(x) == 1, "a failed decref must not half-apply"
    with pytest.raises(RefCountError):
        a.decref([y, y])  # y has only one holder
    assert a.ref_count(y) == 1
    a.check_integrity()


def test_incref_of_free_block_is_a_bug() -> None:
    a = BlockAllocator(4)
    with pytest.raises(AssertionError):
        a.incref([0])
    assert a.ref_count(0) == 0


def test_out_of_range_ids() -> None:
    a = BlockAllocator(4)
    with pytest.raises(IndexError):
        a.ref_count(4)
    with pytest.raises(IndexError):
        a.decref([-1])


def test_freed_blocks_are_reused() -> None:
    a = BlockAllocator(3)
    b = a.allocate(3)
    a.decref([b[1]])
    assert a.allocate(1) == [b[1]]
    a.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    a = BlockAllocator(4)
    a.allocate(1)
    a._free.append(a._free[-1])  # duplicate on the free list
    with pytest.raises(AssertionError):
        a.check_integrity()
