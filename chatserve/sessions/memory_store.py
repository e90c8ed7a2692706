"""InMemorySessionStore: the SessionStore of one process, for when no Redis is configured.

Same semantics as the Redis store (TTL, lock expiry, atomic turns, JSON round trip of
every value, the limits); nothing survives the process. Expiry uses the monotonic clock; expired
sessions and locks are dropped lazily, when touched, when listing, or when a limit is checked.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chatserve.sessions.errors import SessionNotFound
from chatserve.sessions.models import (
    Message,
    Session,
    check_ttl,
    decode_token_ids,
    dumps_json,
    encode_token_ids,
    is_valid_session_id,
)
from chatserve.sessions.store import (
    DEFAULT_SESSION_TTL_S,
    DEFAULT_TURN_LOCK_TTL_S,
    UNSET,
    SessionLimits,
    SessionPage,
    SessionStore,
    Unset,
    apply_update,
    busy_error,
    bytes_error,
    changed_error,
    check_list_args,
    check_turn_args,
    count_error,
    message_bytes,
    plan_fork,
    record_bytes,
    without_last_turn,
)


@dataclass
class _Entry:
    record: dict[str, str]  # Session.to_record(): field -> JSON text
    messages: list[str]  # Message.to_record() each
    tokens: bytes  # encode_token_ids(history)
    deadline: float  # time.monotonic() at which the whole session expires

    @property
    def size(self) -> int:
        """The bytes this session counts against --session-max-bytes."""
        return record_bytes(self.record) + message_bytes(self.messages) + len(self.tokens)


@dataclass
class _Lock:
    token: str
    deadline: float


class InMemorySessionStore(SessionStore):
    persistent = False
    backend = "memory"

    def __init__(self, default_ttl_seconds: float = DEFAULT_SESSION_TTL_S, limits: SessionLimits | None = None) -> None:
        self._sessions: dict[str, _Entry] = {}
        self._locks: dict[str, _Lock] = {}
        self._sizes: dict[str, int] = {}  # each live session's bytes (its entry's size when last written)
        self.total_bytes = 0  # sum of _sizes
        super().__init__(default_ttl_seconds, limits)

    # --- lazy expiry -----------------------------------------------------------------

    def _live(self, session_id: str) -> _Entry | None:
        if not is_valid_session_id(session_id):
            return None
        entry = self._sessions.get(session_id)
        if entry is not None and entry.deadline <= time.monotonic():
            self._drop(session_id)
            return None
        return entry

    def _drop(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
        self.total_bytes -= self._sizes.pop(session_id, 0)

    def _store(self, session_id: str, entry: _Entry) -> None:
        """Writes (or rewrites) an entry and its byte count."""
        self._sessions[session_id] = entry
        size = entry.size
        self.total_bytes += size - self._sizes.get(session_id, 0)
        self._sizes[session_id] = size

    def _admit(self, new_bytes: int) -> None:
        """Room for one more session of `new_bytes`, or SessionLimitExceeded (expired ones pruned first)."""
        limits = self.limits
        if limits.max_count is not None and len(self._sessions) >= limits.max_count:
            self._prune()
            if len(self._sessions) >= limits.max_count:
                raise count_error(limits.max_count)
        if limits.max_bytes is not None and self.total_bytes + new_bytes > limits.max_bytes:
            self._prune()
            if self.total_bytes + new_bytes > limits.max_bytes:
                raise bytes_error(limits.max_bytes, self.total_bytes, new_bytes)

    def _require(self, session_id: str) -> _Entry:
        entry = self._live(session_id)
        if entry is None:
            raise SessionNotFound(session_id)
        return entry

    def _held_lock(self, session_id: str) -> _Lock | None:
        lock = self._locks.get(session_id)
        if lock is not None and lock.deadline <= time.monotonic():
            del self._locks[session_id]
            return None
        return lock

    def _prune(self) -> None:
        now = time.monotonic()
        for sid in [s for s, e in self._sessions.items() if e.deadline <= now]:
            self._drop(sid)
        for sid in [s for s, lk in self._locks.items() if lk.deadline <= now]:
            del self._locks[sid]

    @staticmethod
    def _refresh(entry: _Entry, *, updated: bool) -> None:
        """Restarts the TTL; with `updated`, also stamps updated_at."""
        ttl = float(entry.record["ttl_seconds"])
        now = time.time()
        entry.deadline = time.monotonic() + ttl
        entry.record["expires_at"] = dumps_json(now + ttl, "expires_at")
        if updated:
            entry.record["updated_at"] = dumps_json(now, "updated_at")

    # --- sessions ----------------------------------------------------------------------

    async def create(
        self,
        *,
        system_prompt: str | None = None,
        metadata: dict[str, Any] | None = None,
        ttl_seconds: float | None = None,
        defaults: dict[str, Any] | None = None,
        model: str | None = None,
    ) -> Session:
        session = self._new_session(system_prompt, metadata, ttl_seconds, defaults, model)
        session_id, ttl, record = session.id, session.ttl_seconds, session.to_record()
        entry = _Entry(record, [], b"", time.monotonic() + ttl)
        self._admit(entry.size)
        self._store(session_id, entry)
        return Session.from_record(record)

    async def get(self, session_id: str) -> Session | None:
        entry = self._live(session_id)
        return None if entry is None else Session.from_record(entry.record)

    async def get_with_messages(self, session_id: str) -> tuple[Session, list[Message]] | None:
        entry = self._live(session_id)
        if entry is None:
            return None
        return Session.from_record(entry.record), [Message.from_record(m) for m in entry.messages]

    async def list(self, limit: int = 20, after: str | None = None) -> SessionPage:
        check_list_args(limit, after)
        self._prune()
        ids = sorted((s for s in self._sessions if after is None or s < after), reverse=True)
        page = [Session.from_record(self._sessions[s].record) for s in ids[:limit]]
        return SessionPage(page, len(ids) > limit)

    async def delete(self, session_id: str) -> bool:
        existed = self._live(session_id) is not None
        self._drop(session_id)
        self._locks.pop(session_id, None)
        return existed

    async def touch(self, session_id: str) -> Session:
        entry = self._require(session_id)
        self._refresh(entry, updated=False)
        self._store(session_id, entry)
        return Session.from_record(entry.record)

    async def update(
        self,
        session_id: str,
        *,
        title: str | None | Unset = UNSET,
        metadata: dict[str, Any] | Unset = UNSET,
        defaults: dict[str, Any] | Unset = UNSET,
    ) -> Session:
        entry = self._require(session_id)
        record = apply_update(Session.from_record(entry.record), title, metadata, defaults).to_record()
        entry.record = record
        self._refresh(entry, updated=True)
        self._store(session_id, entry)
        return Session.from_record(entry.record)

    async def fork(
        self,
        session_id: str,
        keep_turns: int,
        *,
        title: str | None | Unset = UNSET,
        metadata: dict[str, Any] | Unset = UNSET,
    ) -> Session:
        entry = self._require(session_id)
        messages = [Message.from_record(m) for m in entry.messages]
        plan = plan_fork(Session.from_record(entry.record), messages, decode_token_ids(entry.tokens), keep_turns,
                         self._new_id(), title, metadata)
        record = plan.session.to_record()
        tokens = encode_token_ids(plan.token_ids) if plan.token_ids else b""
        new = _Entry(record, [m.to_record() for m in plan.messages], tokens, time.monotonic() + plan.session.ttl_seconds)
        self._admit(new.size)
        self._store(plan.session.id, new)
        return Session.from_record(record)

    # --- turns ---------------------------------------------------------------------------

    async def get_messages(self, session_id: str) -> list[Message]:
        return [Message.from_record(m) for m in self._require(session_id).messages]

    async def get_history_tokens(self, session_id: str) -> list[int]:
        return decode_token_ids(self._require(session_id).tokens)

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
        check_turn_args(user_message, assistant_message, expected_num_turns)
        # NOTE: everything that can fail runs before the first mutation: all or nothing.
        new_messages = [user_message.to_record(), assistant_message.to_record()]
        tokens = encode_token_ids(history_token_ids)
        entry = self._require(session_id)
        num_turns = int(entry.record["num_turns"])
        if expected_num_turns is not None and num_turns != expected_num_turns:
            raise changed_error(session_id, expected_num_turns, num_turns)
        keep = len(entry.messages)
        if replace_last_turn:
            keep = without_last_turn(session_id, [Message.from_record(m) for m in entry.messages])
        entry.messages[keep:] = new_messages
        entry.tokens = tokens
        entry.record["num_turns"] = dumps_json(num_turns + (0 if replace_last_turn else 1), "num_turns")
        self._refresh(entry, updated=True)
        self._store(session_id, entry)
        return Session.from_record(entry.record)

    # --- turn lock ---------------------------------------------------------------------

    async def acquire_turn_lock(self, session_id: str, ttl_s: float = DEFAULT_TURN_LOCK_TTL_S) -> str:
        ttl = check_ttl(ttl_s, "ttl_s")
        self._require(session_id)
        held = self._held_lock(session_id)
        if held is not None:
            raise busy_error(session_id, max(0.0, held.deadline - time.monotonic()))
        max_bytes = self.limits.max_bytes
        if max_bytes is not None and self.total_bytes >= max_bytes:
            self._prune()
            if self.total_bytes >= max_bytes:
                raise bytes_error(max_bytes, self.total_bytes)
        token = secrets.token_hex(16)
        self._locks[session_id] = _Lock(token, time.monotonic() + ttl)
        return token

    async def release_turn_lock(self, session_id: str, token: str) -> bool:
        held = self._held_lock(session_id)
        if held is None or held.token != token:
            return False
        del self._locks[session_id]
        return True

    async def refresh_turn_lock(self, session_id: str, token: str, ttl_s: float = DEFAULT_TURN_LOCK_TTL_S) -> bool:
        ttl = check_ttl(ttl_s, "ttl_s")
        held = self._held_lock(session_id)
        if held is None or held.token != token:
            return False
        held.deadline = time.monotonic() + ttl
        return True

    # --- health and lifetime -------------------------------------------------------------

    async def ping(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def check_integrity(self) -> None:
        """Asserts the invariants of the stored records (tests call it after random operations)."""
        assert set(self._sizes) == set(self._sessions), (set(self._sizes) ^ set(self._sessions))
        assert self.total_bytes == sum(self._sizes.values()), (self.total_bytes, sum(self._sizes.values()))
        for sid, entry in self._sessions.items():
            assert self._sizes[sid] == entry.size, (sid, self._sizes[sid], entry.size)
            session = Session.from_record(entry.record)
            assert session.id == sid, (sid, session.id)
            assert len(entry.messages) == 2 * session.num_turns, (sid, len(entry.messages), session.num_turns)
            assert (session.num_turns == 0) == (entry.tokens == b""), sid
            assert len(entry.tokens) % 4 == 0, sid
