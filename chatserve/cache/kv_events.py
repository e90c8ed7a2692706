"""KV cache events: what the prefix cache tells the outside world about the blocks it holds.

A router that places requests by the KV a replica already holds (vLLM's router, policy
``kv_aware``) cannot ask the tree; it follows a stream of events instead, in vLLM's shape:

* ``BlockStored``: full blocks the tree took (their hashes, the hash of the block before the
  first one, their token ids), in prefix order;
* ``BlockRemoved``: blocks the tree evicted (by hash);
* ``AllBlocksCleared``: the tree is empty (a reset).

This module is only the record: the tree appends events as it changes, and whoever owns the
engine step drains them once per step and ships them (``engine/kv_event_publisher.py``: ZMQ and
msgpack, nothing of which the cache layer imports). With no log attached the tree records
nothing and hashes nothing.

Block hashes name a block by its whole prefix (``eviction_record.chain_hashes``, as vLLM names
blocks), so a block evicted and cached again gets the same hash, and a block's parent is the
hash of the block before it. They are folded to unsigned 64 bits, the one integer form the
router's decoder takes. They are identifiers, not a format the router recomputes: it hashes the
``token_ids`` of each stored block itself to index them.

A request's ``cache_salt`` is part of its first block's hash (``eviction_record.salt_seed``), so
two salts never name a block alike: the stream shows them as unrelated blocks even where their
tokens agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .eviction_record import chain_hashes, salt_seed

__all__ = ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVCacheEvent", "KVEventLog", "event_hashes"]

_U64 = (1 << 64) - 1


def event_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int, salt: str | None = None) -> list[int]:
    """The event-stream names of blocks ``0 .. num_blocks-1`` of ``token_ids`` (under ``salt``): their
    prefix chain hashes as unsigned 64-bit integers (deterministic across processes: ints and tuples
    of ints hash without Python's per-process salt)."""
    return [h & _U64 for h in chain_hashes(token_ids, block_size, num_blocks, start=salt_seed(salt))]


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    """The hash of the block right before ``block_hashes[0]``; None when the first is the prompt's first."""
    token_ids: list[int]
    """``len(block_hashes) * block_size`` tokens: the stored blocks' own tokens, not their prefix."""
    block_size: int
    medium: str = "GPU"
    """Where the blocks now live (vLLM's field): ``GPU`` is vLLM's name for the engine's own KV pool (the
    tree), ``DISK`` and ``REDIS`` the tiers below it (engine/kv_tiering.py)."""


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str = "GPU"


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventLog:
    """Events since the last ``drain()``, in the order the tree changed.

    Not thread-safe by design: the tree and the drain both run on the engine's step thread
    (between steps for aborts and resets); the drained list is what crosses to another thread.
    """

    block_size: int
    events: list[KVCacheEvent] = field(default_factory=list)
    num_stored_blocks: int = 0
    num_removed_blocks: int = 0
    # NOTE: tree block id -> its (signed) chain hash, for every block the tree holds: a new block's
    # hash chains from its parent's, so storing costs the new blocks only, not the whole prefix.
    _hashes: dict[int, int] = field(default_factory=dict)

    def stored(
        self, path_tokens: Sequence[int], first_new_block: int, block_ids: Sequence[int], salt: str | None = None
    ) -> None:
        """The tree took blocks ``first_new_block ..`` of the prefix ``path_tokens`` (under ``salt``);
        ``block_ids[i]`` is the tree's block holding tokens ``[i*bs, (i+1)*bs)`` (one id per full block
        of the path)."""
        num_blocks = len(block_ids)
        if first_new_block >= num_blocks:
            return
        bs = self.block_size
        seed = salt_seed(salt)
        start, parent = seed, None  # the root's chain starts at the salt's seed (0 unsalted)
        if first_new_block > 0:
            known = self._hashes.get(block_ids[first_new_block - 1])
            # (unknown only if the log was attached to a tree that already held blocks)
            start = known if known is not None else chain_hashes(path_tokens, bs, first_new_block, start=seed)[-1]
            parent = start & _U64
        tokens = list(path_tokens[first_new_block * bs : num_blocks * bs])
        signed = chain_hashes(tokens, bs, num_blocks - first_new_block, start=start)
        self._hashes.update(zip(block_ids[first_new_block:], signed))
        self.events.append(BlockStored([h & _U64 for h in signed], parent, tokens, bs))
        self.num_stored_blocks += num_blocks - first_new_block

    def removed(self, block_ids: Sequence[int], block_hashes: Sequence[int]) -> None:
        """The tree evicted these blocks, of these (signed) chain hashes."""
        for b in block_ids:
            self._hashes.pop(b, None)
        if block_hashes:
            self.events.append(BlockRemoved([h & _U64 for h in block_hashes]))
            self.num_removed_blocks += len(block_hashes)

    def cleared(self) -> None:
        self._hashes.clear()
        self.events.append(AllBlocksCleared())

    def drain(self) -> list[KVCacheEvent]:
        out, self.events = self.events, []
        return out
