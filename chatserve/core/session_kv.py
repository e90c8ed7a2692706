"""What the KV cache is told about a session turn: whose branch to lease, and for how long."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SessionKV"]


@dataclass(frozen=True)
class SessionKV:
    """A request that is one turn of a session.

    When it ends, the branch of the radix tree holding its computed tokens is leased under
    ``session_id`` for ``lease_seconds`` (0: no lease; the previous turn's lease then just ends),
    replacing the previous turn's lease: the idle TTL renews each turn. ``history_tokens`` is how
    many leading prompt tokens are the session's stored history, so the request can report
    whether the cache still held it.
    """

    session_id: str
    lease_seconds: float
    history_tokens: int = 0
