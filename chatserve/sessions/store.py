"""The SessionStore interface: what the server may rely on, whichever backend runs.

Semantics shared by every store (the contract tests in tests/sessions/test_session_store.py hold
both implementations to them):

- Ids are issued by the store (`create`). An id that is unknown, expired, deleted or not
  even shaped like one of ours is simply "not found": `get` returns None, `delete`
  returns False, every other per-session method raises SessionNotFound.
- A session and all its data share one TTL (`ttl_seconds`), refreshed by `append_turn`
  and `touch`. Expired sessions vanish from `get` and `list` at once.
- One turn at a time: `acquire_turn_lock` hands out a token, or raises SessionBusy; the
  lock expires on its own after `ttl_s` (so a process that dies mid-turn blocks the
  session only that long); only the token's owner can release or extend it.
- `append_turn` writes the user message, the assistant message, the new token history,
  `num_turns`, `updated_at` and the TTL refresh all at once or not at all.
- Backend failures raise SessionStoreUnavailable (HTTP 503); the same store object works
  again once the backend is back.
- Limits (`SessionLimits`, set at construction or by `set_limits`): at most `max_count` live
  sessions (`create` and `fork` beyond it raise SessionLimitExceeded "count"); at most `max_bytes`
  held by all live sessions together, counted as the bytes of their records, messages and token
  histories (`create` and `fork` that would pass it, and `acquire_turn_lock` once it is reached, raise
  SessionLimitExceeded "bytes"; a turn already running is stored, so turns in flight may pass it);
  `ttl_seconds` at most `max_ttl_seconds` (more is a SessionValidationError; the default TTL is
  capped to it). Expired and deleted sessions stop counting at once.

A turn, as the server is expected to run it::

    session = await store.get(sid)                      # None -> 404
    token = await store.acquire_turn_lock(sid)          # SessionBusy -> 409
    try:
        session = await store.get(sid)                  # re-read under the lock
        history = await store.get_history_tokens(sid)   # [] before the first turn
        prompt_ids = history + template_user_turn(...) if history else template_first_turn(...)
        ... generate; call refresh_turn_lock(sid, token) now and then on long replies ...
        await store.append_turn(
            sid, Message("user", text), Message("assistant", reply, finish_reason, usage),
            history_token_ids=prompt_ids + output_ids,   # also for a partial ("abort") reply
            expected_num_turns=session.num_turns,
        )
    finally:
        await store.release_turn_lock(sid, token)

`turn_lock(sid)` wraps acquire/release in an async context manager.
"""

from __future__ import annotations

import abc
import contextlib
import enum
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from chatserve.sessions.errors import SessionBusy, SessionLimitExceeded, SessionStoreUnavailable, SessionValidationError
from chatserve.sessions.models import (
    Message,
    Session,
    SessionIdGenerator,
    check_ttl,
    is_valid_session_id,
    json_round_trip,
    turn_bounds,
)

DEFAULT_SESSION_TTL_S = 24 * 3600  # seconds
DEFAULT_TURN_LOCK_TTL_S = 120.0
MAX_LIST_LIMIT = 1000
MAX_TITLE_CHARS = 200


class Unset(enum.Enum):
    """The type of UNSET: "leave this field as it is" (None is a value: no title)."""

    UNSET = "unset"


UNSET = Unset.UNSET


class SessionPage(NamedTuple):
    """One page of `list`: newest first; pass `sessions[-1].id` as `after` for the next."""

    sessions: list[Session]
    has_more: bool


@dataclass(frozen=True)
class SessionLimits:
    """What one store may hold; None: no limit."""

    max_count: int | None = None
    max_bytes: int | None = None
    max_ttl_seconds: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_count", "max_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer or None, got {value!r}")
        if self.max_ttl_seconds is not None:
            check_ttl(self.max_ttl_seconds, "max_ttl_seconds")


def count_error(max_count: int) -> SessionLimitExceeded:
    return SessionLimitExceeded(
        f"this server already holds its limit of {max_count} live sessions (--session-max-count); delete sessions "
        "you no longer need (DELETE /v1/sessions/{id}) or wait for some to expire, then retry", kind="count")


def bytes_error(max_bytes: int, held: int, adding: int = 0) -> SessionLimitExceeded:
    what = f"adding {adding} bytes would pass" if adding else "has reached"
    return SessionLimitExceeded(
        f"the session store holds {held} bytes and {what} its limit of {max_bytes} (--session-max-bytes); delete "
        "sessions you no longer need (DELETE /v1/sessions/{id}) or wait for some to expire, then retry", kind="bytes")


def record_bytes(record: dict[str, Any]) -> int:
    """The bytes of a session record's values (str or bytes), as the stores count them."""
    return sum(len(v) if isinstance(v, bytes) else len(v.encode()) for v in record.values())


def message_bytes(messages: Sequence[str | bytes]) -> int:
    return sum(len(m) if isinstance(m, bytes) else len(m.encode()) for m in messages)


class SessionStore(abc.ABC):
    """Async storage of chat sessions. Not thread-safe: use it from one event loop."""

    #: True when sessions survive a restart of the process (Redis), False in memory.
    persistent: bool = False
    #: A short name for logs and health output ("redis", "memory").
    backend: str = ""

    def __init__(self, default_ttl_seconds: float = DEFAULT_SESSION_TTL_S, limits: SessionLimits | None = None) -> None:
        self._default_ttl_seconds = check_ttl(default_ttl_seconds, "default_ttl_seconds")
        self.limits = SessionLimits()
        self.set_limits(limits or SessionLimits())
        self._new_id = SessionIdGenerator()

    def set_limits(self, limits: SessionLimits) -> None:
        """The store's limits from now on (the server sets them from its settings)."""
        self.limits = limits

    @property
    def default_ttl_seconds(self) -> float:
        """The TTL of a session created without one: the store's default, capped by max_ttl_seconds."""
        cap = self.limits.max_ttl_seconds
        return self._default_ttl_seconds if cap is None else min(self._default_ttl_seconds, cap)

    def _check_ttl(self, ttl_seconds: object) -> float:
        ttl = check_ttl(ttl_seconds)
        cap = self.limits.max_ttl_seconds
        if cap is not None and ttl > cap:
            raise SessionValidationError(f"ttl_seconds must be at most {cap:g} (this server's --session-max-ttl-s), "
                                         f"got {ttl_seconds!r}")
        return ttl

    # --- sessions -----------------------------------------------------------------

    @abc.abstractmethod
    async def create(
        self,
        *,
        system_prompt: str | None = None,
        metadata: dict[str, Any] | None = None,
        ttl_seconds: float | None = None,
        defaults: dict[str, Any] | None = None,
        model: str | None = None,
    ) -> Session:
        """Creates a session with no turns (`ttl_seconds` None -> the store's default).
        Raises SessionValidationError for a bad TTL or non-JSON metadata/defaults."""

    def _new_session(
        self, system_prompt: str | None, metadata: dict[str, Any] | None, ttl_seconds: float | None,
        defaults: dict[str, Any] | None, model: str | None,
    ) -> Session:
        """A new session with no turns, validated (TTL, JSON-able metadata and defaults): what
        `create` stores, the same for every store."""
        ttl = self._check_ttl(self.default_ttl_seconds if ttl_seconds is None else ttl_seconds)
        session_id, created_at = self._new_id()
        return Session(
            id=session_id,
            created_at=created_at,
            updated_at=created_at,
            expires_at=created_at + ttl,
            ttl_seconds=ttl,
            system_prompt=system_prompt,
            metadata=json_round_trip({} if metadata is None else metadata, "metadata"),
            defaults=json_round_trip({} if defaults is None else defaults, "defaults"),
            model=model,
        )

    @abc.abstractmethod
    async def get(self, session_id: str) -> Session | None:
        """The session, or None if it does not exist."""

    @abc.abstractmethod
    async def get_with_messages(self, session_id: str) -> tuple[Session, list[Message]] | None:
        """The session and its messages read consistently in one step (GET /v1/sessions/{id})."""

    @abc.abstractmethod
    async def list(self, limit: int = 20, after: str | None = None) -> SessionPage:
        """Live sessions, newest first. `after` is the id of the last session of the previous
        page (it need not exist any more). Raises SessionValidationError for a limit outside
        [1, 1000] or an `after` that is not a session id."""

    @abc.abstractmethod
    async def delete(self, session_id: str) -> bool:
        """Removes every key of the session (messages, tokens, lock, index entries).
        True if it existed. A turn in flight then fails to store with SessionNotFound."""

    @abc.abstractmethod
    async def touch(self, session_id: str) -> Session:
        """Restarts the session's TTL (all its data) without changing anything else."""

    @abc.abstractmethod
    async def update(
        self,
        session_id: str,
        *,
        title: str | None | Unset = UNSET,
        metadata: dict[str, Any] | Unset = UNSET,
        defaults: dict[str, Any] | Unset = UNSET,
    ) -> Session:
        """Changes the given fields (rename, metadata, sampling defaults), stamps updated_at and
        restarts the TTL, atomically. Raises SessionNotFound, or SessionValidationError for a
        title that is not a short string or values that are not JSON."""

    @abc.abstractmethod
    async def fork(
        self,
        session_id: str,
        keep_turns: int,
        *,
        title: str | None | Unset = UNSET,
        metadata: dict[str, Any] | Unset = UNSET,
    ) -> Session:
        """A new session holding the first `keep_turns` turns of this one: the same messages, and
        the exact token history up to the end of its last kept turn, so its next prompt matches
        the cached KV of the source (a branch costs no prefill). System prompt, defaults, model
        and TTL are copied, title and metadata too unless given; `forked_from` names the source.
        Raises SessionNotFound, or SessionValidationError for `keep_turns` outside [0, num_turns]."""

    # --- turns ----------------------------------------------------------------------

    @abc.abstractmethod
    async def get_messages(self, session_id: str) -> list[Message]:
        """All messages, oldest first (user, assistant, user, assistant, ...)."""

    @abc.abstractmethod
    async def get_history_tokens(self, session_id: str) -> list[int]:
        """The exact token ids of the conversation so far (the last turn's prompt ids plus its
        generated ids); [] before the first turn. The next prompt is these plus the new turn."""

    @abc.abstractmethod
    async def append_turn(
        self,
        session_id: str,
        user_message: Message,
        assistant_message: Message,
        history_token_ids: Sequence[int],
        *,
        expected_num_turns: int | None = None,
        replace_last_turn: bool = False,
    ) -> Session:
        """Stores one finished (or aborted) turn atomically and returns the updated session.

        `history_token_ids` replaces the stored history (it must be the whole conversation).
        With `replace_last_turn` (regenerate), the new turn takes the place of the last stored
        one instead of following it, and `num_turns` stays (SessionValidationError if none).
        With `expected_num_turns`, raises SessionBusy instead of writing if the session has
        a different number of turns by now (another turn was stored meanwhile).
        Raises SessionNotFound if the session is gone (nothing is written then),
        SessionValidationError for bad roles/tokens/non-JSON usage (before writing anything).
        """

    # --- the per-session turn lock ---------------------------------------------------

    @abc.abstractmethod
    async def acquire_turn_lock(self, session_id: str, ttl_s: float = DEFAULT_TURN_LOCK_TTL_S) -> str:
        """Takes the session's turn lock for `ttl_s` seconds and returns its token.
        Raises SessionBusy if another owner holds it, SessionNotFound if no such session."""

    @abc.abstractmethod
    async def release_turn_lock(self, session_id: str, token: str) -> bool:
        """Releases the lock if `token` still owns it; True if it did (False when it expired,
        was taken over, or the session was deleted)."""

    @abc.abstractmethod
    async def refresh_turn_lock(self, session_id: str, token: str, ttl_s: float = DEFAULT_TURN_LOCK_TTL_S) -> bool:
        """Extends the lock to `ttl_s` from now if `token` still owns it; True if it did."""

    @contextlib.asynccontextmanager
    async def turn_lock(self, session_id: str, ttl_s: float = DEFAULT_TURN_LOCK_TTL_S) -> AsyncIterator[str]:
        """`async with store.turn_lock(sid) as token:` - acquire, then always release.
        A failure to release (store unreachable) is ignored: the lock expires by itself."""
        token = await self.acquire_turn_lock(session_id, ttl_s)
        try:
            yield token
        finally:
            with contextlib.suppress(SessionStoreUnavailable):
                await self.release_turn_lock(session_id, token)

    # --- health and lifetime -------------------------------------------------------

    @abc.abstractmethod
    async def ping(self) -> None:
        """Returns if the backend answers; raises SessionStoreUnavailable otherwise."""

    async def health(self) -> dict[str, Any]:
        """{"backend", "persistent", "ok", "error"} for a health endpoint; never raises."""
        try:
            await self.ping()
        except SessionStoreUnavailable as e:
            return {"backend": self.backend, "persistent": self.persistent, "ok": False, "error": str(e)}
        return {"backend": self.backend, "persistent": self.persistent, "ok": True, "error": None}

    @abc.abstractmethod
    async def close(self) -> None:
        """Releases connections. The store must not be used afterwards."""


def check_list_args(limit: int, after: str | None) -> None:
    if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST_LIMIT:
        raise SessionValidationError(f"limit must be an integer in [1, {MAX_LIST_LIMIT}], got {limit!r}")
    if after is not None and not is_valid_session_id(after):
        raise SessionValidationError(f"after must be a session id from a previous page, got {after!r}")


def check_turn_args(user_message: Message, assistant_message: Message, expected_num_turns: int | None) -> None:
    if user_message.role != "user":
        raise SessionValidationError(f"user_message must have role 'user', got {user_message.role!r}")
    if assistant_message.role != "assistant":
        raise SessionValidationError(f"assistant_message must have role 'assistant', got {assistant_message.role!r}")
    if expected_num_turns is not None and (isinstance(expected_num_turns, bool) or not isinstance(expected_num_turns, int)):
        raise SessionValidationError(f"expected_num_turns must be an int or None, got {expected_num_turns!r}")


def busy_error(session_id: str, retry_after: float | None) -> SessionBusy:
    wait = f" (its lock expires in {retry_after:.1f} s at the latest)" if retry_after is not None else ""
    return SessionBusy(
        f"session {session_id!r} already has a turn in progress{wait}; "
        "wait for that reply to finish, or cancel it, then send the message again",
        session_id=session_id,
        retry_after=retry_after,
    )


def changed_error(session_id: str, expected: int, actual: int) -> SessionBusy:
    return SessionBusy(
        f"session {session_id!r} changed while this turn ran (expected {expected} stored turns, found {actual}); "
        "the reply was not stored - read the session again and resend the message",
        session_id=session_id,
    )



def check_title(title: object) -> str | None:
    if title is None:
        return None
    if not isinstance(title, str) or len(title) > MAX_TITLE_CHARS:
        raise SessionValidationError(f"title must be a string of at most {MAX_TITLE_CHARS} characters or null, got {title!r:.80}")
    return title


def apply_update(
    session: Session, title: str | None | Unset, metadata: dict[str, Any] | Unset, defaults: dict[str, Any] | Unset,
) -> Session:
    """`update`'s change to a session record, validated before anything is written (both stores)."""
    if not isinstance(title, Unset):
        session.title = check_title(title)
    if not isinstance(metadata, Unset):
        session.metadata = json_round_trip(metadata, "metadata")
    if not isinstance(defaults, Unset):
        session.defaults = json_round_trip(defaults, "defaults")
    return session


class ForkPlan(NamedTuple):
    """What `fork` writes: the new session record, its messages and its token history."""

    session: Session
    messages: list[Message]
    token_ids: list[int]


def plan_fork(
    source: Session, messages: list[Message], token_ids: list[int], keep_turns: int, new_id: tuple[str, float],
    title: str | None | Unset, metadata: dict[str, Any] | Unset,
) -> ForkPlan:
    """The first `keep_turns` turns of `source` as a new session (both stores share this)."""
    if isinstance(keep_turns, bool) or not isinstance(keep_turns, int) or not 0 <= keep_turns <= source.num_turns:
        raise SessionValidationError(
            f"keep_turns must be an integer in [0, {source.num_turns}] (the session has {source.num_turns} turns), "
            f"got {keep_turns!r}"
        )
    bounds = turn_bounds(messages)
    if keep_turns == 0:
        kept, history = [], []
    else:
        end = bounds[keep_turns - 1][1]
        kept = messages[:end]
        history_end = kept[-1].history_end
        if keep_turns == len(bounds):
            history = token_ids
        elif history_end is None:
            raise SessionValidationError(
                f"turn {keep_turns - 1} was stored before turns recorded their token offsets; "
                f"fork at keep_turns={source.num_turns} (all turns) or 0 instead"
            )
        else:
            history = token_ids[:history_end]
    session_id, created_at = new_id
    session = Session(
        id=session_id,
        created_at=created_at,
        updated_at=created_at,
        expires_at=created_at + source.ttl_seconds,
        ttl_seconds=source.ttl_seconds,
        system_prompt=source.system_prompt,
        metadata=source.metadata if isinstance(metadata, Unset) else json_round_trip(metadata, "metadata"),
        defaults=source.defaults,
        model=source.model,
        num_turns=keep_turns,
        title=source.title if isinstance(title, Unset) else check_title(title),
        forked_from={"session_id": source.id, "turn": keep_turns},
    )
    return ForkPlan(session, kept, history)


def without_last_turn(session_id: str, messages: list[Message]) -> int:
    """How many messages stay when the last turn is replaced (regenerate); raises if there is none."""
    bounds = turn_bounds(messages)
    if not bounds:
        raise SessionValidationError(f"session {session_id!r} has no stored turn to replace; send a message first")
    return bounds[-1][0]
