from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from chatserve.cache import (
    BlockAllocator,
    CacheStats,
    MatchResult,
    NoPrefixCache,
    PartialMatch,
    PrefixCache,
    RadixPrefixCache,
    make_prefix_cache,
)

BS = 2


def make(num_blocks: int = 32, block_size: int = BS) -> tuple[BlockAllocator, RadixPrefixCache]:
    a = BlockAllocator(num_blocks)
    return a, RadixPrefixCache(a, block_size)


def cache_tokens(a: BlockAllocator, c: PrefixCache, tokens: list[int]) -> list[int]:
    """Run a request to completion: allocate, insert, release its own refs."""
    table = a.allocate(-(-len(tokens) // c.block_size))
    r = c.insert(tokens, table)
    a.decref(table)
    return r.block_ids


# ---- match / insert / split ---------------------------------------------------


def test_empty_tree_matches_nothing() -> None:
    a, c = make()
    m = c.match_prefix([1, 2, 3, 4])
    assert m.block_ids == [] and m.num_tokens == 0 and m.node is c.root
    c.lock(m.node)  # locking the root is a no-op, so the engine needs no special case
    c.unlock(m.node)
    c.check_integrity({})


def test_insert_then_match_whole_blocks_only() -> None:
    a, c = make()
    ids = cache_tokens(a, c, [1, 2, 3, 4, 5])  # the partial block (5) is not cached
    assert len(ids) == 2
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).block_ids == ids
    assert c.match_prefix([1, 2, 3]).block_ids == ids[:1]
    assert c.match_prefix([1]).num_tokens == 0
    assert c.match_prefix([2, 1]).num_tokens == 0
    assert c.stats() == CacheStats(total=32, free=30, evictable=2, locked=0)
    c.check_integrity({})


def test_insert_takes_its_own_reference() -> None:
    a, c = make()
    table = a.allocate(2)
    r = c.insert([1, 2, 3, 4], table)
    assert r.num_cached_tokens == 0 and r.block_ids == table
    assert [a.ref_count(b) for b in table] == [2, 2]
    c.lock(r.node)  # the engine's contract: tree blocks a request holds are locked
    c.check_integrity(Counter(table))


def test_insert_of_cached_prefix_keeps_tree_blocks() -> None:
    a, c = make()
    tree = cache_tokens(a, c, [1, 2, 3, 4])
    mine = a.allocate(3)
    r = c.insert([1, 2, 3, 4, 5, 6], mine)
    assert r.num_cached_tokens == 4
    assert r.block_ids == tree + [mine[2]]
    # duplicates are not taken: still only the caller's reference
    assert [a.ref_count(b) for b in mine] == [1, 1, 2]
    c.lock(r.node)
    c.check_integrity(Counter(mine))
    c.unlock(r.node)
    assert a.decref(mine) == mine[:2]
    c.check_integrity({})


def test_extra_block_ids_are_ignored_and_too_few_is_an_error() -> None:
    a, c = make()
    table = a.allocate(3)
    r = c.insert([1, 2, 3], table)
    assert r.block_ids == table[:1]
    with pytest.raises(ValueError):
        c.insert([5, 5, 5, 5], table[:1])


def test_inserting_a_block_already_in_tree_is_rejected() -> None:
    a, c = make()
    (b,) = a.allocate(1)
    c.lock(c.insert([1, 2], [b]).node)
    with pytest.raises(ValueError, match="already in the tree"):
        c.insert([3, 4], [b])
    c.check_integrity({b: 1})


def test_match_mid_edge_splits_and_preserves_locks() -> None:
    a, c = make()
    ids = cache_tokens(a, c, [1, 2, 3, 4, 5, 6])
    m_full = c.match_prefix([1, 2, 3, 4, 5, 6])
    c.lock(m_full.node)
    assert c.stats().locked == 3
    m = c.match_prefix([1, 2, 3, 4, 9, 9])  # ends inside the edge: split after 2 blocks
    assert m.block_ids == ids[:2] and m.node is not m_full.node
    assert m_full.node.parent is m.node
    assert m.node.lock_ref == 1 and m_full.node.lock_ref == 1
    assert c.stats().locked == 3
    c.check_integrity()
    assert c.evict(10) == 0  # everything still locked
    c.unlock(m_full.node)  # the old handle still works after the split
    assert c.stats() == CacheStats(32, 29, 3, 0)
    c.check_integrity({})


def test_insert_diverging_mid_edge_branches() -> None:
    a, c = make()
    first = cache_tokens(a, c, [1, 2, 3, 4, 5, 6])
    second = cache_tokens(a, c, [1, 2, 3, 4, 7, 8])
    assert second[:2] == first[:2] and second[2] != first[2]
    assert c.match_prefix([1, 2, 3, 4, 7, 8]).block_ids == second
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).block_ids == first
    assert len(c.root.children) == 1 and len(c.root.children[(1, 2)].children) == 2
    c.check_integrity({})


def test_insert_shorter_than_edge_splits() -> None:
    a, c = make()
    ids = cache_tokens(a, c, [1, 2, 3, 4, 5, 6])
    r = c.insert([1, 2, 3, 4], a.allocate(2))
    assert r.num_cached_tokens == 4 and r.block_ids == ids[:2]
    assert r.node.children and r.node.block_ids == ids[:2]


# ---- lock / evict ---------------------------------------------------------------


def test_locked_path_is_never_evicted_and_locks_nest() -> None:
    a, c = make()
    cache_tokens(a, c, [1, 2, 3, 4])
    node = c.match_prefix([1, 2, 3, 4]).node
    c.lock(node)
    c.lock(node)
    assert c.evict(5) == 0
    c.unlock(node)
    assert c.evict(5) == 0
    c.unlock(node)
    assert c.evict(5) == 2 and a.num_free == 32
    c.check_integrity({})


def test_unlock_without_lock_is_a_bug() -> None:
    a, c = make()
    cache_tokens(a, c, [1, 2])
    with pytest.raises(AssertionError):
        c.unlock(c.match_prefix([1, 2]).node)
    with pytest.raises(TypeError):
        c.lock("not a node")


def test_evicts_least_recently_used_leaf_first() -> None:
    a, c = make()
    x = cache_tokens(a, c, [1, 1])
    y = cache_tokens(a, c, [2, 2])
    z = cache_tokens(a, c, [3, 3])
    c.match_prefix([1, 1])  # x becomes the most recent
    assert c.evict(1) == 1 and a.ref_count(y[0]) == 0
    assert c.evict(1) == 1 and a.ref_count(z[0]) == 0
    assert a.ref_count(x[0]) == 1
    assert c.num_evicted_blocks == 2
    c.check_integrity({})


def test_evict_trims_leaf_from_its_tail() -> None:
    a, c = make()
    ids = cache_tokens(a, c, [1, 2, 3, 4, 5, 6])
    assert c.evict(1) == 1
    assert a.ref_count(ids[2]) == 0
    assert c.match_prefix([1, 2, 3, 4, 5, 6]).block_ids == ids[:2]
    c.check_integrity({})


def test_parent_becomes_candidate_once_its_children_are_gone() -> None:
    a, c = make()
    cache_tokens(a, c, [1, 2, 3, 4])
    cache_tokens(a, c, [1, 2, 5, 6])
    cache_tokens(a, c, [7, 7])
    c.match_prefix([7, 7])
    # the [1,2] subtree is older: both leaves, then their parent, go before [7,7]
    assert c.evict(3) == 3
    assert c.match_prefix([7, 7]).num_tokens == 2
    assert c.match_prefix([1, 2]).num_tokens == 0
    c.check_integrity({})


def test_evict_skips_blocks_a_request_still_holds() -> None:
    # A request that holds tree blocks without locking them breaks the engine's
    # contract; evict must still never free them.
    a, c = make()
    table = a.allocate(2)
    c.insert([1, 2, 3, 4], table)  # refs: request + tree, no lock
    assert c.evict(5) == 0
    a.decref(table[1:])  # the request lets go of its tail block
    assert c.evict(5) == 1  # tail trimmed, head still held
    assert a.ref_count(table[0]) == 2
    c.check_integrity()  # no external_refs: the contract check would (rightly) fail
    a.decref(table[:1])
    assert c.evict(5) == 1
    c.check_integrity({})


def test_evict_of_zero_or_from_empty_tree() -> None:
    a, c = make()
    assert c.evict(3) == 0
    cache_tokens(a, c, [1, 2])
    assert c.evict(0) == 0


def test_stats_and_reset() -> None:
    a, c = make()
    cache_tokens(a, c, [1, 2, 3, 4])
    cache_tokens(a, c, [5, 6])
    node = c.match_prefix([1, 2, 3, 4]).node
    c.lock(node)
    assert c.stats() == CacheStats(total=32, free=29, evictable=1, locked=2)
    c.reset()
    assert c.stats() == CacheStats(total=32, free=30, evictable=0, locked=2)
    c.unlock(node)
    c.reset()
    assert c.stats() == CacheStats(32, 32, 0, 0)
    c.check_integrity({})


def test_check_integrity_catches_a_missing_holder() -> None:
    a, c = make()
    table = a.allocate(1)
    c.insert([1, 2], table)
    with pytest.raises(AssertionError):
        c.check_integrity({})  # the request's reference is unaccounted for
    with pytest.raises(AssertionError, match="not locked"):
        c.check_integrity(Counter(table))  # held by a request but not locked


# ---- match_partial (copy-on-write of a partially matching block) -----------------


def test_partial_at_node_end_picks_the_child_with_the_longest_run() -> None:
    a, c = make(block_size=4)
    head = [1, 2, 3, 4]
    x = cache_tokens(a, c, head + [5, 6, 7, 8])
    y = cache_tokens(a, c, head + [5, 6, 9, 9])
    z = cache_tokens(a, c, head + [5, 9, 9, 9, 1, 1, 1, 1])
    cache_tokens(a, c, head + [7, 7, 7, 7])
    before = c.stats()
    for tail, want in [
        ([5, 6, 7, 0, 0], PartialMatch(x[1], 3)),
        ([5, 6, 9, 0], PartialMatch(y[1], 3)),
        ([5, 9, 0], PartialMatch(z[1], 2)),
        ([5, 6, 7, 8, 0], PartialMatch(x[1], 3)),  # never a whole block: k < block_size
        ([5, 6], PartialMatch(x[1], 2)),  # the query ends inside the block
    ]:
        m = c.match_prefix(head)
        assert m.num_tokens == 4 and not m.node.key[4:]
        assert c.match_partial(head + tail, m) == want
    m = c.match_prefix(head + [5, 0, 0])
    assert c.match_partial(head + [5, 0, 0], m).num_tokens == 1  # a tie: any of the three
    assert c.stats() == before
    c.check_integrity({})


def test_partial_mid_edge_looks_at_the_nodes_next_block_without_splitting() -> None:
    a, c = make(block_size=4)
    r = c.insert(list(range(1, 13)), a.allocate(3))
    a.decref(r.block_ids)
    node = r.node
    # a match that stops at a block boundary inside the node's edge
    m = MatchResult(r.block_ids[:1], 4, node)
    assert c.match_partial([1, 2, 3, 4, 5, 6, 0, 0], m) == PartialMatch(r.block_ids[1], 2)
    m = MatchResult(r.block_ids[:2], 8, node)
    assert c.match_partial([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], m) == PartialMatch(r.block_ids[2], 3)
    assert c.match_partial([1, 2, 3, 4, 5, 6, 7, 8, 0], m) is None
    assert len(node.block_ids) == 3 and node.key == tuple(range(1, 13))  # no split
    # the same through match_prefix (which splits, so it ends at a node's end)
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 0])
    assert m.num_tokens == 4 and len(m.node.block_ids) == 1
    assert c.match_partial([1, 2, 3, 4, 5, 6, 0], m) == PartialMatch(r.block_ids[1], 2)
    c.check_integrity({})


def test_partial_no_match() -> None:
    a, c = make(block_size=4)
    empty = c.match_prefix([1, 2, 3])
    assert c.match_partial([1, 2, 3], empty) is None  # empty tree
    cache_tokens(a, c, [1, 2, 3, 4, 5, 6, 7, 8])
    m = c.match_prefix([1, 2, 3, 4, 9, 9])
    assert m.num_tokens == 4
    assert c.match_partial([1, 2, 3, 4, 9, 9], m) is None  # first token differs
    assert c.match_partial([1, 2, 3, 4], c.match_prefix([1, 2, 3, 4])) is None  # nothing after the match
    m = c.match_prefix([1, 2, 3, 4, 5, 6, 7, 8, 1])
    assert m.num_tokens == 8 and c.match_partial([1, 2, 3, 4, 5, 6, 7, 8, 1], m) is None  # at a leaf
    m = c.match_prefix([2, 2])
    assert m.node is c.root and c.match_partial([2, 2], m) is None
    assert c.match_partial([1, 2], m) == PartialMatch(c.match_prefix([1, 2, 3, 4]).block_ids[0], 2)  # from the root


def test_partial_touches_the_candidate_for_lru() -> None:
    a, c = make(block_size=4)
    x = cache_tokens(a, c, [1, 2, 3, 4])
    y = cache_tokens(a, c, [5, 6, 7, 8])  # y is newer: x would go first
    p = c.match_partial([1, 2, 0], c.match_prefix([1, 2, 0]))
    assert p == PartialMatch(x[0], 2)
    assert c.evict(1) == 1
    assert c.match_prefix([1, 2, 3, 4, 0]).block_ids == x  # y went instead
    assert c.match_prefix([5, 6, 7, 8, 0]).block_ids == []
    del y


def test_pinned_source_of_a_pending_copy_in_integrity_check() -> None:
    a, c = make(block_size=4)
    x = cache_tokens(a, c, [1, 2, 3, 4])
    p = c.match_partial([1, 2, 0], c.match_prefix([1, 2, 0]))
    a.incref([p.block_id])  # the engine pins the source until the copy is done
    dst = a.allocate(1)
    c.check_integrity(Counter(dst), pinned_refs={p.block_id: 1})
    with pytest.raises(AssertionError):
        c.check_integrity(Counter(dst))
    assert c.evict(4) == 0  # pinned: cannot be freed
    a.decref([p.block_id])
    a.decref(dst)
    c.check_integrity({})
    assert c.evict(4) == 1 and x


def test_no_prefix_cache_has_no_partial_match() -> None:
    a = BlockAllocator(8)
    c = NoPrefixCache(a, 4)
    m = c.match_prefix([1, 2, 3])
    assert c.match_partial([1, 2, 3], m) is None


# ---- NoPrefixCache --------------------------------------------------------------


def test_no_prefix_cache_runs_the_same_code_path() -> None:
    a = BlockAllocator(8)
    c = make_prefix_cache(False, a, BS)
    assert isinstance(c, NoPrefixCache)
    assert isinstance(make_prefix_cache(True, a, BS), RadixPrefixCache)
    prompt = [1, 2, 3, 4, 5]
    m = c.match_prefix(prompt[:-1])
    assert m.block_ids == [] and m.num_tokens == 0
    c.lock(m.node)
    a.incref(m.block_ids)
    table = m.block_ids + a.allocate(3)
    r = c.insert(prompt, table)
    assert r.num_cached_tokens == 0 and r.block_ids == table[:2]
    c.lock(r.node)
    c.unlock(m.node)
    c.check_integrity(Counter(table))
    c.unlock(r.node)
    a.decref(table)
    assert c.evict(4) == 0
    assert c.stats() == CacheStats(8, 8, 0, 0)
    assert c.match_prefix(prompt).num_tokens == 0
    c.reset()
    c.check_integrity({})


# ---- random workloads -----------------------------------------------------------


@dataclass
class Req:
    tokens: list[int]
    table: list[int]
    computed: int  # tokens whose KV is in the table's blocks
    node: object  # the one node this request has locked


class CacheMachine(RuleBasedStateMachine):
    """Requests over a 4-token vocabulary share prefixes often; a reference model
    (``content``: block -> the token prefix its KV holds) catches any wrong reuse."""

    def __init__(self) -> None:
        super().__init__()
        self.reqs: dict[int, Req] = {}
        self.history: list[list[int]] = []
        self.content: dict[int, tuple[int, ...]] = {}
        self.next_id = 0

    @initialize(bs=st.sampled_from([2, 4]), num_blocks=st.integers(16, 64))
    def setup(self, bs: int, num_blocks: int) -> None:
        self.bs = bs
        self.alloc = BlockAllocator(num_blocks)
        self.cache = RadixPrefixCache(self.alloc, bs)

    # helpers

    def _pick(self, idx: int) -> int:
        keys = sorted(self.reqs)
        return keys[idx % len(keys)]

    def _reserve(self, n: int) -> list[int] | None:
        """Allocate n blocks, evicting first if short; None if impossible."""
        if n > self.alloc.num_free:
            self.cache.evict(n - self.alloc.num_free)
        if n > self.alloc.num_free:
            return None
        new = self.alloc.allocate(n)
        live = {b for r in self.reqs.values() for b in r.table}
        assert not live & set(new), "a block held by a live request was handed out again"
        for b in new:
            self.content.pop(b, None)  # stale: it was free
        return new

    def _mark_computed(self, req: Req) -> None:
        for i in range(req.computed // self.bs):
            b, want = req.table[i], tuple(req.tokens[: (i + 1) * self.bs])
            assert self.content.setdefault(b, want) == want, f"block {b} holds the wrong prefix"

    def _insert(self, req: Req) -> object:
        n = req.computed // self.bs
        r = self.cache.insert(req.tokens[: n * self.bs], req.table[:n])
        k = r.num_cached_tokens // self.bs
        assert r.num_cached_tokens % self.bs == 0 and len(r.block_ids) == n
        assert r.block_ids[k:] == req.table[k:n]
        for i, b in enumerate(r.block_ids):
            assert self.content[b] == tuple(req.tokens[: (i + 1) * self.bs])
        return r

    # rules

    @rule(
        base=st.integers(0, 1000),
        cut=st.integers(0, 24),
        suffix=st.lists(st.integers(0, 3), min_size=1, max_size=10),
    )
    def admit(self, base: int, cut: int, suffix: list[int]) -> None:
        prefix = self.history[base % len(self.history)][:cut] if self.history else []
        tokens = prefix + suffix
        m = self.cache.match_prefix(tokens[:-1])
        assert m.num_tokens == len(m.block_ids) * self.bs <= len(tokens) - 1
        for i, b in enumerate(m.block_ids):
            assert self.content[b] == tuple(tokens[: (i + 1) * self.bs])
        self.cache.lock(m.node)
        self.alloc.incref(m.block_ids)
        new = self._reserve(-(-len(tokens) // self.bs) - len(m.block_ids))
        if new is None:  # does not fit: back out
            self.cache.unlock(m.node)
            self.alloc.decref(m.block_ids)
            return
        self.reqs[self.next_id] = Req(tokens, m.block_ids + new, m.num_tokens, m.node)
        self.next_id += 1
        self.history.append(tokens)

    @precondition(lambda self: self.reqs)
    @rule(idx=st.integers(0, 1000), k=st.integers(1, 12))
    def compute(self, idx: int, k: int) -> None:
        req = self.reqs[self._pick(idx)]
        req.computed = min(len(req.tokens), req.computed + k)
        self._mark_computed(req)

    @precondition(lambda self: self.reqs)
    @rule(idx=st.integers(0, 1000), token=st.integers(0, 3))
    def decode(self, idx: int, token: int) -> None:
        req = self.reqs[self._pick(idx)]
        if len(req.tokens) == len(req.table) * self.bs:
            new = self._reserve(1)
            if new is None:
                return
            req.table += new
        req.tokens.append(token)

    @precondition(lambda self: self.reqs)
    @rule(idx=st.integers(0, 1000), adopt=st.booleans())
    def publish(self, idx: int, adopt: bool) -> None:
        req = self.reqs[self._pick(idx)]
        r = self._insert(req)
        self.cache.lock(r.node)
        self.cache.unlock(req.node)
        req.node = r.node
        if adopt:  # swap our duplicates for the tree's blocks
            for i in range(r.num_cached_tokens // self.bs):
                mine, tree = req.table[i], r.block_ids[i]
                if mine != tree:
                    self.alloc.incref([tree])
                    assert self.alloc.decref([mine]) == [mine]
                    req.table[i] = tree

    @precondition(lambda self: self.reqs)
    @rule(idx=st.integers(0, 1000), abort=st.booleans())
    def finish(self, idx: int, abort: bool) -> None:
        req = self.reqs.pop(self._pick(idx))
        if not abort:
            req.computed = len(req.tokens)
            self._mark_computed(req)
        self._insert(req)
        self.cache.unlock(req.node)
        self.alloc.decref(req.table)
        self.history.append(req.tokens)

    @rule(n=st.integers(0, 20))
    def evict(self, n: int) -> None:
        locked = self.cache.stats().locked
        freed = self.cache.evict(n)
        assert 0 <= freed <= n
        assert self.cache.stats().locked == locked
        for req in self.reqs.values():
            assert all(self.alloc.ref_count(b) > 0 for b in req.table), "evicted a live request's block"

    @rule(base=st.integers(0, 1000), cut=st.integers(0, 30))
    def lookup(self, base: int, cut: int) -> None:
        if not self.history:
            return
        tokens = self.history[base % len(self.history)][:cut]
        m = self.cache.match_prefix(tokens)
        for i, b in enumerate(m.block_ids):
            assert self.content[b] == tuple(tokens[: (i + 1) * self.bs])
        # the partial match is the tree block at the next position sharing the most tokens
        p = self.cache.match_partial(tokens, m)
        n, rest = m.num_tokens, tuple(tokens[m.num_tokens : m.num_tokens + self.bs - 1])
        best = 0
        for b in self.cache._tree_blocks:
            held = self.content[b]
            if len(held) == n + self.bs and held[:n] == tuple(tokens[:n]):
                k = next((i for i, (u, v) in enumerate(zip(held[n:], rest)) if u != v), min(len(rest), self.bs))
                best = max(best, k)
        if p is None:
            assert best == 0
        else:
            assert 1 <= p.num_tokens == best < self.bs
            assert self.content[p.block_id][: n + p.num_tokens] == tuple(tokens[: n + p.num_tokens])

    @rule()
    def reset(self) -> None:
        self.cache.reset()
        assert self.cache.stats().evictable == 0

    # invariants

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity(Counter(b for r in self.reqs.values() for b in r.table))
        s = self.cache.stats()
        assert s.total == self.alloc.num_total and s.free == self.alloc.num_free
        # every tree block holds the KV of exactly the prefix its path spells
        stack = [(self.cache.root, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                path = prefix + child.key
                for i, b in enumerate(child.block_ids):
                    assert self.content.get(b) == path[: len(prefix) + (i + 1) * self.bs]
                stack.append((child, path))

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        while self.reqs:
            self.finish(0, abort=len(self.reqs) % 2 == 1)
        self.cache.check_integrity({})
        s = self.cache.stats()
        assert s.free + s.evictable == s.total and s.locked == 0
        self.cache.reset()
        assert self.alloc.num_free == self.alloc.num_total


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
