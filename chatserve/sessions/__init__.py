"""Multi-turn chat sessions: metadata, messages and exact token history, in Redis or memory.

See store.py for the contract every store keeps, and redis_store.py for the key layout.
"""

from __future__ import annotations

from chatserve.sessions.errors import (
    SessionBusy,
    SessionLimitExceeded,
    SessionNotFound,
    SessionStoreError,
    SessionStoreUnavailable,
    SessionValidationError,
)
from chatserve.sessions.factory import make_session_store
from chatserve.sessions.memory_store import InMemorySessionStore
from chatserve.sessions.models import Message, Session, is_valid_session_id
from chatserve.sessions.store import (
    DEFAULT_SESSION_TTL_S,
    DEFAULT_TURN_LOCK_TTL_S,
    SessionLimits,
    SessionPage,
    SessionStore,
)

__all__ = [
    "DEFAULT_SESSION_TTL_S",
    "DEFAULT_TURN_LOCK_TTL_S",
    "InMemorySessionStore",
    "Message",
    "RedisSessionStore",
    "Session",
    "SessionBusy",
    "SessionLimitExceeded",
    "SessionLimits",
    "SessionNotFound",
    "SessionPage",
    "SessionStore",
    "SessionStoreError",
    "SessionStoreUnavailable",
    "SessionValidationError",
    "is_valid_session_id",
    "make_session_store",
]


def __getattr__(name: str) -> object:
    # RedisSessionStore is imported on first use: the redis client library costs a server that runs
    # without --redis-url about a fifth of a second of its start.
    if name == "RedisSessionStore":
        from chatserve.sessions.redis_store import RedisSessionStore

        return RedisSessionStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
