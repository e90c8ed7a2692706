"""Radix-tree prefix cache over whole KV blocks.

Each edge is a run of whole blocks: a node stores the tokens of its edge
(``key``, a multiple of ``block_size`` long) and the KV blocks holding them.
Because only whole blocks are cached, a block's KV depends only on the tokens
from the root down to the end of that block, so two requests with the same
block-aligned prefix can share the same physical blocks.

Eviction takes least-recently-used unlocked leaves from an ``LRUIndex``, so it
never walks the tree; a leaf may be trimmed from its tail when fewer blocks are
needed than it holds. ``last_access`` is a counter, not wall time, so tests are
deterministic.

Leases (``leases.py``) are counted on nodes like locks (``lease_ref``): a leaf
on a leased path waits in a second index, ordered by lease renewal, that
eviction reaches only once the plain LRU index is empty. Evicted blocks leave
their prefix hash in a bounded ``EvictionRecord``, so ``explain_miss`` can tell
"evicted" from "new".

Salts (a request's ``cache_salt``): the tree is a forest with one root per salt
(the unsalted root is ``root``; a salt's root exists while it holds a block).
Every walk starts at the request's salt's root, so two salts never share a
node, let alone a block, and every hash of a salted block (eviction record, KV
events, the tiers' keys) starts its chain from the salt (``salt_seed``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from .allocator import BlockAllocator, RefCountError
from .eviction_record import EvictionRecord, chain_hashes, salt_seed
from .kv_events import KVEventLog
from .leases import Lease, LeaseBook, LeaseInfo, LeaseKey, PrefixKey
from .lru_index import LRUIndex
from .prefix_cache import CacheStats, InsertResult, MatchResult, MissExplanation, PartialMatch, PrefixCache
from .tier_observer import TierObserver

__all__ = ["RadixNode", "RadixPrefixCache"]

_U64 = (1 << 64) - 1


class RadixNode:
    """One edge of the tree (the root has an empty key and no blocks).

    # NOTE: lock_ref == num_own_locks + sum(child.lock_ref for children), i.e.
    # the number of locks on this node or any descendant; a node with
    # lock_ref > 0 is never evicted.
    # NOTE: parent.last_access >= child.last_access (touching refreshes the
    # whole root->node path), so a parent that becomes a leaf keeps LRU order.
    """

    __slots__ = (
        "key", "block_ids", "children", "parent", "lock_ref", "num_own_locks", "last_access",
        "lease_ref", "num_own_leases", "lease_stamp", "prefix_lease_ref", "salt", "is_root",
    )

    def __init__(
        self, key: tuple[int, ...], block_ids: list[int], parent: RadixNode | None, last_access: int,
        salt: str | None = None, *, is_root: bool = False,
    ) -> None:
        self.salt = salt  # the cache_salt of every request whose blocks are on this node's path (its root's)
        self.is_root = is_root  # a salt's root (empty key, no blocks); never locked, leased or evicted
        self.key = key
        self.block_ids = block_ids
        # keyed by the child's first block of tokens (a tuple of block_size ints)
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.parent = parent
        self.lock_ref = 0
        self.num_own_locks = 0
        self.last_access = last_access
        # NOTE: lease_ref == num_own_leases + sum(child.lease_ref): live leases on this node or below.
        self.lease_ref = 0
        self.num_own_leases = 0
        self.lease_stamp = 0  # newest renewal of a lease through this node: leased leaves go oldest first
        # NOTE: prefix_lease_ref: of lease_ref, the prefix leases (their distinct blocks are what the cap counts).
        self.prefix_lease_ref = 0

    def __repr__(self) -> str:
        return f"RadixNode(blocks={self.block_ids}, lock_ref={self.lock_ref}, last_access={self.last_access})"


class RadixPrefixCache(PrefixCache):
    """The prefix cache used when prefix caching is on."""

    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        eviction_memory_blocks: int | None = None,
        kv_events: KVEventLog | None = None,
        tier_observer: TierObserver | None = None,
        max_prefix_leased_blocks: int | None = None,
    ) -> None:
        super().__init__(allocator, block_size)
        if max_prefix_leased_blocks is not None and max_prefix_leased_blocks < 0:
            raise ValueError(f"max_prefix_leased_blocks must be >= 0, got {max_prefix_leased_blocks}")
        # NOTE: the most distinct blocks prefix leases protect together (None: no cap); sessions' leases do not count.
        self.max_prefix_leased_blocks = max_prefix_leased_blocks
        # NOTE: when set, the tiers below the tree hear of blocks taken, about to be freed, and leased
        # (tier_observer.py); paused during reset(), which forgets rather than evicts.
        self.tier_observer = tier_observer
        self._observer_paused = False
        # NOTE: when set, every block the tree takes or frees is recorded there (kv_events.py).
        self.kv_events = kv_events
        self._root = RadixNode((), [], None, 0, is_root=True)
        # NOTE: the root of each salt that holds a block (made on its first insert, dropped when its last leaf goes).
        self._salt_roots: dict[str, RadixNode] = {}
        self._clock = 0
        # NOTE: exactly the non-root leaves with lock_ref == 0 and lease_ref == 0 (priority last_access) ...
        self._evictable: LRUIndex[RadixNode] = LRUIndex()
        # ... and those with lock_ref == 0 and lease_ref > 0 (priority lease_stamp): evicted only when the first is empty.
        self._leased_leaves: LRUIndex[RadixNode] = LRUIndex()
        self._tree_blocks: set[int] = set()
        self._num_locked_blocks = 0
        self._num_leased_blocks = 0
        self._num_prefix_leased_blocks = 0
        self.now = clock  # lease expiry times are on this clock (seconds)
        self._leases = LeaseBook()
        self._evicted = EvictionRecord(eviction_memory_blocks or max(256, 4 * allocator.num_total))

    @property
    def root(self) -> RadixNode:
        """The unsalted requests' root."""
        return self._root

    def root_for(self, salt: str | None) -> RadixNode:
        """The root of ``salt``'s partition (a fresh, childless one if the salt holds nothing)."""
        if salt is None:
            return self._root
        if not isinstance(salt, str):
            raise TypeError(f"cache salt must be a str or None, got {type(salt).__name__}")
        root = self._salt_roots.get(salt)
        # NOTE: a childless root is not registered: it becomes the salt's root only when a block hangs from it
        return root if root is not None else RadixNode((), [], None, 0, salt, is_root=True)

    def _roots(self) -> list[RadixNode]:
        return [self._root, *self._salt_roots.values()]

    # ---- lookup and insertion -------------------------------------------------

    def match_prefix(self, token_ids: Sequence[int], *, salt: str | None = None) -> MatchResult:
        n = len(token_ids) // self.block_size
        node, block_ids = self._walk(tuple(token_ids[: n * self.block_size]), self.root_for(salt))
        if self._leases.num_prefix and block_ids:
            self._renew_prefix_leases(node)
        self._touch(node)
        return MatchResult(block_ids, len(block_ids) * self.block_size, node)

    def match_partial(self, token_ids: Sequence[int], match: MatchResult) -> PartialMatch | None:
        bs = self.block_size
        start = match.num_tokens
        rest = tuple(token_ids[start : start + bs - 1])  # NOTE: k < bs: a full block is match_prefix's job
        if not rest:
            return None
        node = self._as_node(match.node)
        end = self._depth(node)
        if end is None:
            return None  # the node left the tree (evicted since the match)
        candidates: list[tuple[tuple[int, ...], int, RadixNode]] = []
        if end == start:
            # the match ends at the node's end: the next block is some child's first one
            candidates = [(first, child.block_ids[0], child) for first, child in node.children.items()]
        elif end - len(node.key) <= start < end and (start - (end - len(node.key))) % bs == 0:
            # the match ends inside the node's edge (at a block boundary): its next block
            off = start - (end - len(node.key))
            candidates = [(node.key[off : off + bs], node.block_ids[off // bs], node)]
        best: tuple[int, int, RadixNode] | None = None
        for first, block_id, owner in candidates:
            k = _common_prefix_len(first, rest)
            if k and (best is None or k > best[0] or (k == best[0] and owner.last_access > best[2].last_access)):
                best = (k, block_id, owner)
        if best is None:
            return None
        self._touch(best[2])
        return PartialMatch(best[1], best[0])

    def _depth(self, node: RadixNode) -> int | None:
        """Tokens from the root to the end of ``node``'s edge (None if detached)."""
        depth = 0
        n: RadixNode | None = node
        while n is not None and not n.is_root:
            depth += len(n.key)
            n = n.parent
        return depth if n is not None else None

    def insert(self, token_ids: Sequence[int], block_ids: Sequence[int], *, salt: str | None = None) -> InsertResult:
        bs = self.block_size
        n = len(token_ids) // bs
        if len(block_ids) < n:
            raise ValueError(f"{n} full blocks of tokens but only {len(block_ids)} block ids")
        tokens = tuple(token_ids[: n * bs])
        root = self.root_for(salt)
        node, tree_ids = self._walk(tokens, root)
        num_cached = len(tree_ids)
        if num_cached < n:
            new_ids = list(block_ids[num_cached:n])
            clash = [b for b in new_ids if b in self._tree_blocks]
            if clash or len(set(new_ids)) != len(new_ids):
                raise ValueError(
                    f"blocks {clash or new_ids} are already in the tree or repeated; a block can cache "
                    "only one prefix (is the block table out of sync with its tokens?)"
                )
            self.allocator.incref(new_ids)  # NOTE: the tree's own reference
            self._unfile(node)  # no longer a leaf
            if root.salt is not None and node is root:
                self._salt_roots[root.salt] = root  # (already there unless this is the salt's first block)
            leaf = RadixNode(tokens[num_cached * bs :], new_ids, node, self._clock, root.salt)
            node.children[leaf.key[:bs]] = leaf
            self._tree_blocks.update(new_ids)
            tree_ids.extend(new_ids)
            node = leaf
            if self.kv_events is not None:
                self.kv_events.stored(tokens, num_cached, tree_ids, salt=root.salt)
            if self.tier_observer is not None:
                self.tier_observer.on_insert(tokens, num_cached, tree_ids, salt=root.salt)
        self._touch(node)
        return InsertResult(num_cached * bs, node, tree_ids)

    def _walk(self, tokens: tuple[int, ...], root: RadixNode) -> tuple[RadixNode, list[int]]:
        """Follow the longest whole-block match of ``tokens`` (block aligned) from ``root`` (a salt's),
        splitting the last edge if the match ends inside it."""
        bs = self.block_size
        node, block_ids, pos = root, [], 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos : pos + bs])
            if child is None:
                break
            limit = min(len(child.key), len(tokens) - pos)
            length = limit
            if child.key[:limit] != tokens[pos : pos + limit]:
                length = bs  # the first block matched (it is the dict key)
                while length < limit and child.key[length : length + bs] == tokens[pos + length : pos + length + bs]:
                    length += bs
            if length < len(child.key):
                child = self._split(child, length // bs)
            block_ids.extend(child.block_ids)
            node, pos = child, pos + length
        return node, block_ids

    def _split(self, child: RadixNode, num_blocks: int) -> RadixNode:
        """Cut ``child``'s edge after ``num_blocks`` blocks; return the new upper node.

        # NOTE: the lower part stays the same object, so lock handles held by
        # requests stay valid; the upper part inherits lock_ref (same
        # descendants' locks) and is internal, so the evictable index and the
        # locked-block count are unchanged.
        """
        bs = self.block_size
        parent = child.parent
        assert parent is not None and 0 < num_blocks < len(child.block_ids)
        upper = RadixNode(child.key[: num_blocks * bs], child.block_ids[:num_blocks], parent, child.last_access,
                          child.salt)
        upper.lock_ref = child.lock_ref
        upper.lease_ref = child.lease_ref  # NOTE: the same leases run through both halves
        upper.prefix_lease_ref = child.prefix_lease_ref
        upper.lease_stamp = child.lease_stamp
        child.key = child.key[num_blocks * bs :]
        child.block_ids = child.block_ids[num_blocks:]
        child.parent = upper
        upper.children[child.key[:bs]] = child
        parent.children[upper.key[:bs]] = upper
        return upper

    def _touch(self, node: RadixNode) -> None:
        """Mark the root->node path as used now."""
        if node.is_root:
            return
        self._clock += 1
        n: RadixNode | None = node
        while n is not None and not n.is_root:
            n.last_access = self._clock
            n = n.parent
        self._file(node)

    def _file(self, node: RadixNode) -> None:
        """Put an unlocked leaf in the index eviction takes it from (unleased LRU, or leased by renewal)."""
        if node.is_root or node.children or node.lock_ref > 0 or node.parent is None:
            return
        if node.lease_ref > 0:
            self._evictable.discard(node)
            self._leased_leaves.add(node, node.lease_stamp)
        else:
            self._leased_leaves.discard(node)
            self._evictable.add(node, node.last_access)

    def _unfile(self, node: RadixNode) -> None:
        self._evictable.discard(node)
        self._leased_leaves.discard(node)

    # ---- locking --------------------------------------------------------------

    def lock(self, node: object) -> None:
        n = self._as_node(node)
        if n.is_root:
            return
        n.num_own_locks += 1
        while not n.is_root:
            if n.lock_ref == 0:
                self._num_locked_blocks += len(n.block_ids)
                self._unfile(n)
            n.lock_ref += 1
            n = n.parent  # type: ignore[assignment]

    def unlock(self, node: object) -> None:
        n = self._as_node(node)
        if n.is_root:
            return
        if n.num_own_locks <= 0:
            raise RefCountError(f"unlock of {n!r} which holds no lock of its own (double unlock?)")
        n.num_own_locks -= 1
        while not n.is_root:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_locked_blocks -= len(n.block_ids)
                self._file(n)
            n = n.parent  # type: ignore[assignment]

    def _as_node(self, node: object) -> RadixNode:
        if not isinstance(node, RadixNode):
            raise TypeError(f"expected a node handle from match_prefix/insert, got {node!r}")
        return node

    # ---- eviction -------------------------------------------------------------

    def evict(self, num_blocks: int) -> int:
        bs = self.block_size
        ref_count = self.allocator.ref_count
        freed = 0
        put_back: list[RadixNode] = []
        if len(self._leases):
            self.expire_leases()
        while freed < num_blocks:
            # NOTE: unleased LRU leaves first; a leased leaf (oldest renewal first) only once none is left,
            # so a lease never costs a request its memory.
            leaf = self._evictable.pop() or self._leased_leaves.pop()
            if leaf is None:
                break
            ids = leaf.block_ids
            # NOTE: only blocks held by the tree alone (ref 1) may be freed; a
            # request that holds a tree block without locking it keeps it alive.
            k = 0
            while k < len(ids) and freed + k < num_blocks and ref_count(ids[-1 - k]) == 1:
                k += 1
            if k == 0:
                put_back.append(leaf)
                continue
            victims = ids[len(ids) - k :]
            victim_hashes = self._path_hashes(leaf)[len(ids) - k :]
            if self.tier_observer is not None and not self._observer_paused:
                path = self._path_tokens(leaf)
                self.tier_observer.on_evict(path, len(path) // bs - k, victims, salt=leaf.salt)
            self._evicted.add(victim_hashes)
            if self.kv_events is not None:
                self.kv_events.removed(victims, victim_hashes)
            if leaf.lease_ref > 0:
                self._num_leased_blocks -= k
                self.num_leased_evicted_blocks += k
            if leaf.prefix_lease_ref > 0:
                self._num_prefix_leased_blocks -= k
            if k == len(ids):
                self._remove_leaf(leaf)
            else:
                del ids[len(ids) - k :]
                leaf.key = leaf.key[: len(ids) * bs]
                put_back.append(leaf)
            self._tree_blocks.difference_update(victims)
            released = self.allocator.decref(victims)
            assert len(released) == k
            freed += k
        for leaf in put_back:
            self._file(leaf)
        self.num_evicted_blocks += freed
        return freed

    def _path_nodes(self, node: RadixNode) -> list[RadixNode]:
        path: list[RadixNode] = []
        n: RadixNode | None = node
        while n is not None and not n.is_root:
            path.append(n)
            n = n.parent
        path.reverse()
        return path

    def _path_tokens(self, node: RadixNode) -> list[int]:
        return [t for x in self._path_nodes(node) for t in x.key]

    def path_of(self, node: object) -> tuple[list[int], list[int]]:
        """Tokens and tree block ids from the root (its salt's) to the end of ``node``'s edge."""
        nodes = self._path_nodes(self._as_node(node))
        return [t for x in nodes for t in x.key], [b for x in nodes for b in x.block_ids]

    def salt_of(self, node: object) -> str | None:
        """The salt of the partition ``node`` is in."""
        return self._as_node(node).salt

    def leaf_paths(self) -> list[tuple[list[int], list[int], str | None]]:
        """Every leaf's root path (tokens, block ids, salt): what a shutdown writes back to the tiers."""
        out = []
        stack = self._roots()
        while stack:
            node = stack.pop()
            if not node.is_root and not node.children:
                out.append((*self.path_of(node), node.salt))
            stack.extend(node.children.values())
        return out

    def _path_hashes(self, node: RadixNode) -> list[int]:
        """Chain hashes of the blocks on node's edge (see ``eviction_record.chain_hashes``), under its salt."""
        tokens = self._path_tokens(node)
        hashes = chain_hashes(tokens, self.block_size, len(tokens) // self.block_size, start=salt_seed(node.salt))
        return hashes[len(hashes) - len(node.block_ids) :]

    def _remove_leaf(self, leaf: RadixNode) -> None:
        parent = leaf.parent
        assert parent is not None and not leaf.children and leaf.lock_ref == 0
        del parent.children[leaf.key[: self.block_size]]
        leaf.parent = None
        self._unfile(leaf)
        if leaf.num_own_leases:
            # NOTE: a lease whose node is evicted keeps protecting what is left of its branch (the
            # parent already counts it in lease_ref); one left with nothing above the root ends.
            for lease in self._leases.on_node(leaf):
                if parent.is_root:
                    self._leases.pop(lease.key)
                else:
                    self._leases.move(lease, parent)
                    parent.num_own_leases += 1
            leaf.num_own_leases = leaf.lease_ref = leaf.prefix_lease_ref = 0
        if parent.is_root and not parent.children and parent.salt is not None:
            if self._salt_roots.get(parent.salt) is parent:
                del self._salt_roots[parent.salt]  # the salt holds nothing any more
        self._file(parent)  # NOTE: parents that become leaves are candidates

    def reset(self) -> None:
        """Evict every unlocked node whose blocks no request holds (leased ones too), and forget
        what was evicted: a reset starts the next run cold, not "evicted". An event log gets the
        removals and, once the tree is empty, ``AllBlocksCleared`` (vLLM's reset event)."""
        self._observer_paused = True
        try:
            self.evict(len(self._tree_blocks))
        finally:
            self._observer_paused = False
        self._evicted.clear()
        if self.kv_events is not None and not self._tree_blocks:
            self.kv_events.cleared()

    # ---- introspection --------------------------------------------------------

    def stats(self) -> CacheStats:
        a = self.allocator
        locked = self._num_locked_blocks
        return CacheStats(a.num_total, a.num_free, len(self._tree_blocks) - locked, locked, self._num_leased_blocks,
                          self._num_prefix_leased_blocks, self._leases.num_prefix)

    # ---- why a request missed ---------------------------------------------------------------

    def explain_miss(self, token_ids: Sequence[int], num_matched: int, *, salt: str | None = None) -> MissExplanation:
        bs = self.block_size
        whole = num_matched // bs * bs
        node, ids = self._walk(tuple(token_ids[:whole]), self.root_for(salt))
        leased = whole > 0 and len(ids) * bs == whole and node.lease_ref > 0
        if num_matched >= len(token_ids):
            return MissExplanation("none", None, leased)
        if whole + bs <= len(token_ids):
            next_block = chain_hashes(token_ids, bs, whole // bs + 1, start=salt_seed(salt))[-1]
            if next_block in self._evicted:
                return MissExplanation("evicted", None, leased)
        # NOTE: a cached continuation past the matched point that is not the prompt's: the prompt
        # departs from a cached sequence there (matching nothing at all is not departing).
        if num_matched > 0 and len(ids) * bs == whole and node.children:
            return MissExplanation("diverged", num_matched, leased)
        return MissExplanation("new", None, leased)

    def peek_prefix(self, token_ids: Sequence[int], *, salt: str | None = None) -> int:
        n = len(token_ids) // self.block_size
        _, ids = self._walk(tuple(token_ids[: n * self.block_size]), self.root_for(salt))
        return len(ids) * self.block_size

    # ---- leases ---------------------------------------------------------------------------------

    def set_lease(self, key: str, node: object, seconds: float) -> None:
        n = self._as_node(node)
        old = self._leases.pop(key)
        if seconds > 0 and not n.is_root and self._depth(n) is not None:
            self._clock += 1
            self._count_lease(n, +1, self._clock)
            self._leases.put(Lease(key, n, self.now() + seconds, self._clock))
            if self.tier_observer is not None:
                self.tier_observer.on_lease(*self.path_of(n), salt=n.salt)
        if old is not None:
            self._count_lease(old.node, -1, prefix=old.is_prefix)  # type: ignore[arg-type]

    def lease_prefix(self, token_ids: Sequence[int], seconds: float, *, salt: str | None = None) -> PrefixKey | None:
        bs = self.block_size
        n = len(token_ids) // bs
        if seconds <= 0 or n == 0:
            return None
        if len(self._leases):
            self.expire_leases()
        node, ids = self._walk(tuple(token_ids[: n * bs]), self.root_for(salt))
        if not ids:
            return None
        key = PrefixKey(salt, chain_hashes(token_ids, bs, len(ids), start=salt_seed(salt))[-1] & _U64)
        now = self.now()
        expires_at, ttl = now + seconds, seconds
        old = self._leases.pop(key)
        if old is not None:  # the same prefix again: keep the later end and the longer TTL
            expires_at, ttl = max(expires_at, old.expires_at), max(ttl, old.seconds)
        self._clock += 1
        self._count_lease(node, +1, self._clock, prefix=True)
        self._leases.put(Lease(key, node, expires_at, self._clock, seconds=ttl))
        if old is not None:
            self._count_lease(old.node, -1, prefix=True)  # type: ignore[arg-type]
        elif self.tier_observer is not None:
            self.tier_observer.on_lease(*self.path_of(node), salt=salt)
        self._enforce_prefix_cap()
        return key if self._leases.get(key) is not None else None

    def _enforce_prefix_cap(self) -> None:
        """Drop prefix leases, least recently renewed first, until their blocks fit the cap."""
        cap = self.max_prefix_leased_blocks
        if cap is None:
            return
        while self._num_prefix_leased_blocks > cap:
            oldest = self._leases.oldest_prefix()
            assert oldest is not None, "prefix-leased blocks counted but no prefix lease is live"
            before = self._num_prefix_leased_blocks
            self._leases.pop(oldest.key)
            self._count_lease(oldest.node, -1, prefix=True)  # type: ignore[arg-type]
            self.num_prefix_leases_dropped += 1
            self.num_prefix_leased_dropped_blocks += before - self._num_prefix_leased_blocks

    def _renew_prefix_leases(self, node: RadixNode) -> None:
        """A match reached ``node``: every prefix lease on its root path is renewed to now + its TTL
        (never shortened) and goes to the back of the eviction and cap orders."""
        self.expire_leases()  # NOTE: an expired lease is not brought back by a hit; it is plain LRU now
        renewed: list[Lease] = []
        deepest: RadixNode | None = None
        n: RadixNode | None = node
        while n is not None and not n.is_root:
            if n.num_own_leases:
                found = [x for x in self._leases.on_node(n) if x.is_prefix]
                if found and deepest is None:
                    deepest = n
                renewed.extend(found)
            n = n.parent
        if deepest is None:
            return
        self._clock += 1
        now = self.now()
        for lease in reversed(renewed):  # (shallowest first: the deeper ones end up renewed more recently)
            lease.expires_at = max(lease.expires_at, now + lease.seconds)
            lease.stamp = self._clock
            self._leases.put(lease)
        self.num_prefix_lease_renewals += len(renewed)
        n = deepest
        while n is not None and not n.is_root:
            n.lease_stamp = self._clock
            n = n.parent
        self._file(deepest)

    def release_lease(self, key: LeaseKey) -> bool:
        lease = self._leases.pop(key)
        if lease is None:
            return False
        self._count_lease(lease.node, -1, prefix=lease.is_prefix)  # type: ignore[arg-type]
        return True

    def expire_leases(self, now: float | None = None) -> int:
        due = self._leases.due(self.now() if now is None else now)
        for lease in due:
            self._count_lease(lease.node, -1, prefix=lease.is_prefix)  # type: ignore[arg-type]
        return len(due)

    def lease_info(self, key: LeaseKey) -> LeaseInfo | None:
        self.expire_leases()
        lease = self._leases.get(key)
        if lease is None:
            return None
        depth = self._depth(lease.node)  # type: ignore[arg-type]
        return LeaseInfo(depth or 0, lease.expires_at)

    def prefix_leases(self) -> list[tuple[PrefixKey, LeaseInfo]]:
        """Every live prefix lease, least recently renewed first (for reports and tests)."""
        self.expire_leases()
        return [(x.key, LeaseInfo(self._depth(x.node) or 0, x.expires_at))  # type: ignore[arg-type,misc]
                for x in self._leases.prefix_leases()]

    def _count_lease(self, node: RadixNode, delta: int, stamp: int | None = None, *, prefix: bool = False) -> None:
        """Add (+1) or drop (-1) one lease on the root->node path, keeping the leased-block counts
        (``prefix``: a prefix lease, which counts in the capped prefix-leased blocks too)."""
        node.num_own_leases += delta
        n: RadixNode | None = node
        while n is not None and not n.is_root:
            before = n.lease_ref
            n.lease_ref += delta
            if before == 0 and n.lease_ref > 0:
                self._num_leased_blocks += len(n.block_ids)
            elif before > 0 and n.lease_ref == 0:
                self._num_leased_blocks -= len(n.block_ids)
            if prefix:
                before = n.prefix_lease_ref
                n.prefix_lease_ref += delta
                if before == 0 and n.prefix_lease_ref > 0:
                    self._num_prefix_leased_blocks += len(n.block_ids)
                elif before > 0 and n.prefix_lease_ref == 0:
                    self._num_prefix_leased_blocks -= len(n.block_ids)
            if stamp is not None:
                n.lease_stamp = stamp
            n = n.parent
        self._file(node)  # NOTE: only the node itself can be a leaf of the path

    def check_integrity(
        self, external_refs: Mapping[int, int] | None = None, pinned_refs: Mapping[int, int] | None = None
    ) -> None:
        """Walk the whole tree (tests only) and assert every invariant.

        With ``external_refs`` it also asserts the engine's side of the
        contract: tree blocks held by a request lie on a locked path, and a
        block outside the tree is private to at most one request.
        """
        a = self.allocator
        a.check_integrity()
        self._evictable.check_integrity()
        bs = self.block_size
        roots = self._roots()
        for root in roots:
            assert root.is_root and root.parent is None and root.key == () and not root.block_ids, f"bad root {root!r}"
            assert root.lock_ref == 0 and root.lease_ref == 0 and root.num_own_leases == 0, "a root is locked or leased"
            assert root is self._root or (root.children and self._salt_roots[root.salt] is root), (  # type: ignore[index]
                f"salt root {root.salt!r} holds no block or is filed under another salt")
        assert self._root.salt is None
        tree_blocks: set[int] = set()
        locked_blocks: set[int] = set()
        leased_blocks: set[int] = set()
        prefix_leased_blocks: set[int] = set()
        leaves: set[RadixNode] = set()
        leased_leaves: set[RadixNode] = set()
        own_leases: dict[RadixNode, int] = {}
        own_prefix_leases: dict[RadixNode, int] = {}
        self._leases.check_integrity()
        for lease in self._leases:
            assert isinstance(lease.node, RadixNode) and not lease.node.is_root, f"lease {lease.key!r} is on no node"
            assert self._depth(lease.node) is not None, f"lease {lease.key!r} is on a node that left the tree"
            own_leases[lease.node] = own_leases.get(lease.node, 0) + 1
            if lease.is_prefix:
                own_prefix_leases[lease.node] = own_prefix_leases.get(lease.node, 0) + 1
                assert lease.key.salt == lease.node.salt, f"prefix lease {lease.key!r} is under another salt"  # type: ignore[union-attr]
        stack = list(roots)
        while stack:
            node = stack.pop()
            child_locks = 0
            child_leases = 0
            child_prefix_leases = 0
            for first, child in node.children.items():
                assert child.parent is node, f"{child!r} has a wrong parent"
                assert not child.is_root and child.salt == node.salt, f"{child!r} is in another salt's partition"
                assert child.block_ids and len(child.key) == len(child.block_ids) * bs, f"{child!r}: bad key length"
                assert child.key[:bs] == first, f"{child!r} is filed under the wrong first block"
                assert node.is_root or child.last_access <= node.last_access, f"{child!r} is newer than its parent"
                child_locks += child.lock_ref
                child_leases += child.lease_ref
                child_prefix_leases += child.prefix_lease_ref
                stack.append(child)
            if node.is_root:
                continue
            assert node.last_access <= self._clock
            assert node.num_own_locks >= 0 and node.lock_ref == node.num_own_locks + child_locks, f"{node!r}: lock_ref"
            assert node.num_own_leases == own_leases.get(node, 0), f"{node!r}: own lease count != leases on it"
            assert node.lease_ref == node.num_own_leases + child_leases, f"{node!r}: lease_ref"
            assert node.prefix_lease_ref == own_prefix_leases.get(node, 0) + child_prefix_leases, f"{node!r}: prefix_lease_ref"
            for b in node.block_ids:
                assert b not in tree_blocks, f"block {b} appears twice in the tree"
                tree_blocks.add(b)
            if node.prefix_lease_ref > 0:
                prefix_leased_blocks.update(node.block_ids)
            if node.lease_ref > 0:
                leased_blocks.update(node.block_ids)
            if node.lock_ref > 0:
                locked_blocks.update(node.block_ids)
            elif not node.children:
                (leased_leaves if node.lease_ref > 0 else leaves).add(node)
        assert tree_blocks == self._tree_blocks, "tree block set out of sync"
        assert len(locked_blocks) == self._num_locked_blocks, "locked block count out of sync"
        assert len(leased_blocks) == self._num_leased_blocks, "leased block count out of sync"
        assert len(prefix_leased_blocks) == self._num_prefix_leased_blocks, "prefix-leased block count out of sync"
        self._leased_leaves.check_integrity()
        assert set(self._evictable) == leaves, "evictable-leaf index does not match the tree"
        assert set(self._leased_leaves) == leased_leaves, "leased-leaf index does not match the tree"
        for leaf in leaves:
            assert self._evictable.priority(leaf) == leaf.last_access, f"{leaf!r}: stale LRU priority"
        for leaf in leased_leaves:
            assert self._leased_leaves.priority(leaf) == leaf.lease_stamp, f"{leaf!r}: stale lease priority"
        pinned = pinned_refs or {}
        for b, n in pinned.items():
            # NOTE: a pinned block is the source of a pending copy: it must still be cached
            assert n >= 0 and (n == 0 or b in tree_blocks), f"pinned block {b} is not in the tree"
        for b in range(a.num_total):
            in_tree = b in tree_blocks
            rc = a.ref_count(b)
            if external_refs is None:
                assert not in_tree or rc >= 1 + pinned.get(b, 0), f"tree block {b} has ref count {rc}"
                continue
            ext = external_refs.get(b, 0)
            pin = pinned.get(b, 0)
            assert rc == ext + pin + in_tree, (
                f"block {b}: ref count {rc} != {ext} request(s) + {pin} pending copies + {int(in_tree)} tree"
            )
            if in_tree:
                assert ext == 0 or b in locked_blocks, f"tree block {b} is held by a request but not locked"
            else:
                assert ext <= 1, f"block {b} is shared by {ext} requests but is not in the tree"

    def format_tree(self) -> str:
        """Indented dump for debugging failed tests."""
        lines: list[str] = []
        stack = [(root, 0) for root in self._roots()]
        while stack:
            node, depth = stack.pop()
            if node.is_root:
                lines.append(f"root of salt {node.salt!r}")
            else:
                lines.append(f"{'  ' * depth}{list(node.key)} {node!r}")
            stack.extend((c, depth + 1) for c in node.children.values())
        return "\n".join(lines)


def _common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    k = 0
    for x, y in zip(a, b):
        if x != y:
            break
        k += 1
    return k
