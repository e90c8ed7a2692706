"""What the radix tree tells the tiers below it (disk, Redis): blocks it took, blocks it is about to free.

The tree stays plain Python and knows nothing of KV bytes; the engine hands it an observer
(``engine/kv_tiering.py``) that copies blocks out of the KV pool when told. Each call names a
root-to-node path by its tokens and its tree block ids, so the observer can name every block by
its whole prefix, and by the path's ``salt`` (the requests' ``cache_salt``, None unsalted), which is
part of every block's name: two salts never share an entry. Calls run on the engine's step thread,
inside the tree's operation: the blocks' KV is still intact (an evicted block is reused only after
the call returns).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["TierObserver"]


class TierObserver(Protocol):
    def on_insert(
        self, path_tokens: Sequence[int], first_new_block: int, block_ids: Sequence[int], *, salt: str | None = None
    ) -> None:
        """The tree took blocks ``first_new_block ..`` of the path (``block_ids``: one per full block of it)."""

    def on_evict(
        self, path_tokens: Sequence[int], first_victim: int, victim_ids: Sequence[int], *, salt: str | None = None
    ) -> None:
        """The tree is freeing blocks ``first_victim ..`` of the path; ``victim_ids`` are their ids."""

    def on_lease(self, path_tokens: Sequence[int], block_ids: Sequence[int], *, salt: str | None = None) -> None:
        """A session or a prompt prefix leased the path: the tiers should hold it too."""
