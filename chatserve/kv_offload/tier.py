"""What the store asks of a backend (disk, Redis): runs of consecutive entries, by name."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

__all__ = ["Tier"]


class Tier(ABC):
    """A place entries live. Names are ``"<fingerprint hex>/<key hex>"``; values are encoded entries.

    Every method absorbs its backend's failures (a full disk, Redis down): a read that fails is a
    miss, a write that fails is counted in ``write_errors``. Nothing a tier does may raise into
    the engine. Methods are called from the store's writer thread and the engine's loader thread
    at once, so implementations lock what they share.
    """

    name: str
    write_errors: int = 0
    read_errors: int = 0

    @abstractmethod
    def get_run(self, names: Sequence[str]) -> list[bytes] | list[bytearray]:
        """The values of the longest run of leading ``names`` present (refreshing their LRU/TTL)."""

    @abstractmethod
    def count_run(self, names: Sequence[str]) -> int:
        """How many leading ``names`` are present, without reading or refreshing them."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[str, bytes]]) -> int:
        """Store entries (skipping ones present); return how many bytes were written."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Drop one entry (a reader found it invalid)."""

    def available(self) -> bool:
        """False while the backend is known to be down (reads miss at once, writes are dropped)."""
        return True

    def describe(self) -> dict[str, object]:
        """Size and bounds, for stats and logs."""
        return {}

    def close(self) -> None:  # noqa: B027 - most tiers hold nothing to close
        """Release connections (the store calls it once, after its last write)."""
