"""One session turn's hold on its session: the turn lock, refreshed while the reply runs, and the
single atomic write of the turn at its end (full, or partial with `finish_reason: "abort"`).

Store exceptions become the HTTP statuses the session API promises (`store_errors`), so a store
outage is a 503 that heals by itself rather than a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from chatserve.server.choices import Accumulator, Usage
from chatserve.server.errors import APIError, bad_request
from chatserve.sessions import (
    Message,
    SessionBusy,
    SessionNotFound,
    SessionStore,
    SessionStoreUnavailable,
    SessionValidationError,
)

TURN_LOCK_TTL_S = 120.0
_LOCK_REFRESH_S = 30.0


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    """Store exceptions -> the HTTP statuses the API promises."""
    try:
        yield
    except SessionNotFound as exc:
        raise APIError(404, str(exc), param="session_id", code="session_not_found") from None
    except SessionBusy as exc:
        headers = {"Retry-After": str(max(1, int(exc.retry_after or 1)))}
        raise APIError(409, str(exc), code="session_busy", headers=headers) from None
    except SessionStoreUnavailable as exc:
        raise APIError(503, f"sessions are unavailable right now: {exc}", code="session_store_unavailable",
                       headers={"Retry-After": "1"}) from None
    except SessionValidationError as exc:
        raise bad_request(str(exc)) from None


class SessionTurn:
    """One locked turn: holds the lock (refreshed while the reply runs) and writes the turn once."""

    def __init__(self, store: SessionStore, sid: str, token: str, expected_turns: int, user_text: str,
                 prompt_ids: list[int]) -> None:
        self.store = store
        self.sid, self.token = sid, token
        self.expected_turns = expected_turns
        self.user_text = user_text
        self.prompt_ids = prompt_ids
        self._refresher: asyncio.Task | None = None
        self._closed = False

    def start_refreshing(self) -> None:
        async def refresh() -> None:
            while True:
                await asyncio.sleep(_LOCK_REFRESH_S)
                with contextlib.suppress(Exception):
                    await self.store.refresh_turn_lock(self.sid, self.token, TURN_LOCK_TTL_S)

        self._refresher = asyncio.get_running_loop().create_task(refresh())

    async def finish(self, acc: Accumulator, usage: Usage) -> None:
        """Store the turn (full or partial) and release the lock. Raises APIError if the store fails."""
        if self._closed:
            return
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
        choice = acc.choices[0]
        finish_reason = choice.finish_reason or "abort"
        try:
            with store_errors():
                await self.store.append_turn(
                    self.sid,
                    Message("user", self.user_text),
                    Message("assistant", choice.content, finish_reason=finish_reason, usage=usage.as_dict()),
                    history_token_ids=self.prompt_ids + choice.token_ids,
                    expected_num_turns=self.expected_turns,
                )
        finally:
            with contextlib.suppress(Exception):
                await self.store.release_turn_lock(self.sid, self.token)

    async def abandon(self) -> None:
        """Nothing was generated (the turn failed before it started): just release the lock."""
        if self._closed:
            return
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
        with contextlib.suppress(Exception):
            await self.store.release_turn_lock(self.sid, self.token)
