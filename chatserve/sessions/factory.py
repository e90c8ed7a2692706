"""make_session_store / make_response_store: the stores the server runs with, chosen by --redis-url."""

from __future__ import annotations

import logging
import sys

from chatserve.sessions.memory_response_store import InMemoryResponseStore
from chatserve.sessions.memory_store import InMemorySessionStore
from chatserve.sessions.response_store import ResponseStore
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
        from chatserve.sessions.redis_store import RedisSessionStore  # (redis imported only here)

        store = RedisSessionStore(redis_url, prefix=prefix, default_ttl_seconds=default_ttl_seconds)
        logger.info("sessions are stored in Redis at %s under %r", store.url, prefix)
        return store
    logger.warning(
        "sessions are not persisted: no --redis-url given, so they live in this process's memory "
        "and are lost on restart (pass --redis-url redis://host:6379/0 to keep them)"
    )
    return InMemorySessionStore(default_ttl_seconds=default_ttl_seconds)


def make_response_store(sessions: SessionStore | None, *, ttl_seconds: float, max_in_memory: int) -> ResponseStore:
    """Stored responses (the Responses API) live where the sessions do: in the same Redis, on the same
    client and prefix, when sessions are in Redis; else in this process's memory (lost on restart)."""
    if is_redis_session_store(sessions):
        from chatserve.sessions.redis_response_store import RedisResponseStore

        return RedisResponseStore.beside(sessions, ttl_seconds=ttl_seconds)
    return InMemoryResponseStore(ttl_seconds=ttl_seconds, max_responses=max_in_memory)


def is_redis_session_store(sessions: object) -> bool:
    """Whether `sessions` is a RedisSessionStore, without importing redis where none was made (a store
    of that class exists only where its module, and redis with it, was imported)."""
    module = sys.modules.get("chatserve.sessions.redis_store")
    return module is not None and isinstance(sessions, module.RedisSessionStore)
