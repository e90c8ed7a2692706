"""make_session_store: the store the server runs with, chosen by --redis-url."""

from __future__ import annotations

import logging

from chatserve.sessions.memory_store import InMemorySessionStore
from chatserve.sessions.redis_store import RedisSessionStore
from chatserve.sessions.store import DEFAULT_SESSION_TTL_S, SessionStore

logger = logging.getLogger(__name__)


def make_session_store(
    redis_url: str | None,
    *,
    prefix: str = "chatserve:",
    default_ttl_seconds: float = DEFAULT_SESSION_TTL_S,
) -> SessionStore:
    """A RedisSessionStore for a URL ("redis://host:6379/0"), else an InMemorySessionStore.

    Connects lazily: an unreachable Redis shows up as SessionStoreUnavailable on first use
    (call `await store.ping()` at startup to log it early).
    """
    if redis_url:
        store = RedisSessionStore(redis_url, prefix=prefix, default_ttl_seconds=default_ttl_seconds)
        logger.info("sessions are stored in Redis at %s under %r", store.url, prefix)
        return store
    logger.warning(
        "sessions are not persisted: no --redis-url given, so they live in this process's memory "
        "and are lost on restart (pass --redis-url redis://host:6379/0 to keep them)"
    )
    return InMemorySessionStore(default_ttl_seconds=default_ttl_seconds)
