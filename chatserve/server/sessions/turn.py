"""One session turn's hold on its session: the turn lock, refreshed while the reply runs, and the
single atomic write of the turn at its end (full, or partial with `finish_reason: "abort"`).

Store exceptions become the HTTP statuses the session API promises (`store_errors`), so a store
outage is a 503 that heals by itself rather than a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from chatserve.server.chat.choices import Accumulator, Usage
from chatserve.server.chat.generation import Generation
from chatserve.server.errors import APIError, bad_request
from chatserve.sessions import (
    Message,
    SessionBusy,
    SessionLimitExceeded,
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
    except SessionLimitExceeded as exc:
        if exc.kind == "count":
            raise APIError(429, str(exc), code="session_limit_reached") from None
        raise APIError(507, str(exc), code="session_storage_full") from None
    except SessionValidationError as exc:
        raise bad_request(str(exc)) from None


def reply_stats(gen: Generation) -> dict[str, Any]:
    """What a reply cost, stored with it so a reloaded page shows the same numbers: time to first
    token and decode speed from the engine's own record, token counts from the usage."""
    eid = gen.engine_ids[0]
    m = gen.record.metrics.get(eid) or gen.ctx.engine.request_metrics(eid)
    ttft = m.time_to_first_token if m is not None else None
    decode = m.stats.decode_tokens_per_s if m is not None else None
    cached = gen.usage.cached_tokens or (m.num_cached_tokens if m is not None else 0)
    return {
        "ttft_s": None if ttft is None else round(ttft, 4),
        "decode_tokens_per_s": None if decode is None else round(decode, 2),
        "prompt_tokens": gen.usage.prompt_tokens,
        "cached_tokens": cached,
        "completion_tokens": gen.usage.completion_tokens,
    }


class SessionTurn:
    """One locked turn: holds the lock (refreshed while the reply runs) and writes the turn once."""

    def __init__(self, store: SessionStore, sid: str, token: str, expected_turns: int, user_text: str,
                 prompt_ids: list[int], *, replace_last_turn: bool = False, user_created_at: float | None = None,
                 lock_ttl_s: float = TURN_LOCK_TTL_S) -> None:
        self.store = store
        self.lock_ttl_s = lock_ttl_s  # a replica that dies mid-turn leaves the lock for at most this long
        self.sid, self.token = sid, token
        self.expected_turns = expected_turns
        self.user_text = user_text
        self.prompt_ids = prompt_ids
        self.replace_last_turn = replace_last_turn  # regenerate: this turn takes the last one's place
        self.user_created_at = user_created_at  # regenerate keeps the stored user message as it was
        self._refresher: asyncio.Task | None = None
        self._closed = False

    def start_refreshing(self) -> None:
        async def refresh() -> None:
            while True:
                await asyncio.sleep(min(_LOCK_REFRESH_S, self.lock_ttl_s / 3))
                with contextlib.suppress(Exception):
                    await self.store.refresh_turn_lock(self.sid, self.token, self.lock_ttl_s)

        self._refresher = asyncio.get_running_loop().create_task(refresh())

    async def finish(self, acc: Accumulator, usage: Usage, stats: dict[str, Any] | None = None) -> None:
        """Store the turn (full or partial) with the reply's `stats` and release the lock.
        Raises APIError if the store fails."""
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
                    Message("user", self.user_text) if self.user_created_at is None
                    else Message("user", self.user_text, created_at=self.user_created_at),
                    Message("assistant", choice.content, finish_reason=finish_reason, usage=usage.as_dict(), stats=stats,
                            prompt_end=len(self.prompt_ids), history_end=len(self.prompt_ids) + len(choice.token_ids),
                            reasoning=choice.reasoning_text),
                    history_token_ids=self.prompt_ids + choice.token_ids,
                    expected_num_turns=self.expected_turns,
                    replace_last_turn=self.replace_last_turn,
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
