"""Errors of the session stores, one per HTTP status the server maps them to."""

from __future__ import annotations


class SessionStoreError(Exception):
    """Base class of every error a SessionStore raises on purpose."""


class SessionNotFound(SessionStoreError, LookupError):
    """No such session (never created, deleted, or expired). HTTP 404."""

    def __init__(self, session_id: str) -> None:
        super().__init__(
            f"session {session_id!r} does not exist (it was deleted, or it expired after its TTL); "
            "create a new one with POST /v1/sessions"
        )
        self.session_id = session_id


class SessionBusy(SessionStoreError):
    """Another turn holds the session (or changed it while this turn ran). HTTP 409.

    `retry_after` is the lock's remaining lifetime in seconds when known (for Retry-After).
    """

    def __init__(self, message: str, *, session_id: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.session_id = session_id
        self.retry_after = retry_after


class SessionStoreUnavailable(SessionStoreError):
    """The backing store (Redis) cannot be reached or failed. HTTP 503; retry later."""


class SessionLimitExceeded(SessionStoreError):
    """The store is full: `kind` "count" (--session-max-count live sessions; HTTP 429) or "bytes"
    (--session-max-bytes held by all sessions together; HTTP 507). Nothing was written."""

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class SessionValidationError(SessionStoreError, ValueError):
    """An argument the store cannot accept (bad TTL, limit, cursor, role, token id,
    or a value that is not JSON-serialisable). HTTP 400."""
