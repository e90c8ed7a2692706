"""The session API: multi-turn chats whose exact token history lives in a SessionStore (Redis).

Every turn reuses the cached KV of the whole history: its prompt is the stored token ids plus
the new user turn, so the radix tree matches all of it. One turn at a time per session (an
expiring lock); a finished, cancelled or disconnected turn is written atomically, partial
replies marked `finish_reason: "abort"`. Store outages are 503s that heal by themselves.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from chatserve.sessions import (
    Message,
    SessionBusy,
    SessionNotFound,
    SessionStoreUnavailable,
    SessionValidationError,
)

from chatserve.server.errors import APIError, bad_request
from chatserve.server.http_utils import read_model, request_id_from
from chatserve.server.openai_routes import (
    Accumulator,
    build_sampling_params,
    chat_events,
    chat_response,
    check_limits,
    check_model,
    check_stop_list,
    fit_max_tokens,
    get_ctx,
    run_non_streaming,
    sse_response,
)
from chatserve.server.protocol import TopK, _SamplingFields, _Strict
from chatserve.server.serving import Generation, ServerContext
from chatserve.server.session_templates import first_turn_ids, next_turn_ids

logger = logging.getLogger(__name__)

TURN_LOCK_TTL_S = 120.0
_LOCK_REFRESH_S = 30.0


class SessionDefaults(_Strict):
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16)] | None = None


class CreateSessionRequest(_Strict):
    system_prompt: Annotated[str, Field(max_length=200_000)] | None = None
    metadata: dict[str, Any] | None = None
    ttl_seconds: Annotated[int, Field(ge=1, le=365 * 24 * 3600)] | None = None
    defaults: SessionDefaults | None = None


class SessionMessageRequest(_SamplingFields):
    content: Annotated[str, Field(min_length=1)]
    stream: bool = True
    logprobs: bool = False


@contextlib.contextmanager
def _store_errors() -> Any:
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


def _store(ctx: ServerContext) -> Any:
    if ctx.sessions is None:
        raise APIError(404, "the session API is not enabled on this server")
    return ctx.sessions


async def create_session(request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    store = _store(ctx)
    body = await read_model(request, CreateSessionRequest, ctx.settings)
    defaults = body.defaults.model_dump(exclude_none=True) if body.defaults else {}
    stop = defaults.get("stop", [])
    check_stop_list(ctx, [stop] if isinstance(stop, str) else stop, param="defaults.stop")  # a request's limits
    with _store_errors():
        session = await store.create(system_prompt=body.system_prompt, metadata=body.metadata or {},
                                     ttl_seconds=body.ttl_seconds, defaults=defaults, model=ctx.model_name)
    return JSONResponse(session.to_dict(), status_code=201)


async def list_sessions(request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    store = _store(ctx)
    raw_limit = request.query_params.get("limit", "20")
    try:
        limit = int(raw_limit)
    except ValueError:
        raise bad_request(f"limit must be an integer, got {raw_limit!r}", param="limit") from None
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be in [1, 100], got {limit}", param="limit")
    after = request.query_params.get("after") or None
    with _store_errors():
        page = await store.list(limit=limit, after=after)
    data = [s.to_dict() for s in page.sessions]
    return JSONResponse({
        "object": "list", "data": data, "has_more": page.has_more,
        "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
    })


async def get_session(request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    sid = request.path_params["session_id"]
    with _store_errors():
        found = await _store(ctx).get_with_messages(sid)
    if found is None:
        raise APIError(404, f"session {sid!r} does not exist (or expired)", param="session_id", code="session_not_found")
    session, messages = found
    return JSONResponse({**session.to_dict(), "messages": [m.to_dict() for m in messages]})


async def delete_session(request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    sid = request.path_params["session_id"]
    with _store_errors():
        deleted = await _store(ctx).delete(sid)
    if not deleted:
        raise APIError(404, f"session {sid!r} does not exist (or expired)", param="session_id", code="session_not_found")
    return JSONResponse({"id": sid, "object": "session.deleted", "deleted": True})


class _Turn:
    """One locked turn: holds the lock (refreshed while the reply runs) and writes the turn once."""

    def __init__(self, ctx: ServerContext, sid: str, token: str, expected_turns: int, user_text: str,
                 prompt_ids: list[int]) -> None:
        self.ctx, self.sid, self.token = ctx, sid, token
        self.expected_turns = expected_turns
        self.user_text = user_text
        self.prompt_ids = prompt_ids
        self.stored: asyncio.Future | None = None
        self._refresher: asyncio.Task | None = None
        self._closed = False

    def start_refreshing(self) -> None:
        async def refresh() -> None:
            while True:
                await asyncio.sleep(_LOCK_REFRESH_S)
                with contextlib.suppress(Exception):
                    await self.ctx.sessions.refresh_turn_lock(self.sid, self.token, TURN_LOCK_TTL_S)

        self._refresher = asyncio.get_running_loop().create_task(refresh())

    async def finish(self, gen: Generation, acc: Accumulator) -> None:
        """Store the turn (full or partial) and release the lock. Raises APIError if the store fails."""
        if self._closed:
            return
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
        store = self.ctx.sessions
        choice = acc.choices[0]
        finish_reason = choice.finish_reason or "abort"
        try:
            with _store_errors():
                await store.append_turn(
                    self.sid,
                    Message("user", self.user_text),
                    Message("assistant", choice.content, finish_reason=finish_reason, usage=gen.usage.as_dict()),
                    history_token_ids=self.prompt_ids + choice.token_ids,
                    expected_num_turns=self.expected_turns,
                )
        finally:
            with contextlib.suppress(Exception):
                await store.release_turn_lock(self.sid, self.token)

    async def abandon(self) -> None:
        """Nothing was generated (the turn failed before it started): just release the lock."""
        if self._closed:
            return
        self._closed = True
        if self._refresher is not None:
            self._refresher.cancel()
        with contextlib.suppress(Exception):
            await self.ctx.sessions.release_turn_lock(self.sid, self.token)


async def post_message(request: Request) -> Any:
    ctx = get_ctx(request)
    store = _store(ctx)
    sid = request.path_params["session_id"]
    body = await read_model(request, SessionMessageRequest, ctx.settings)
    request_id = request_id_from(request, ctx.settings)
    check_model(ctx, body.model)
    if body.n != 1:
        raise bad_request("a session turn has exactly one reply; n must be 1", param="n")
    check_limits(ctx, body)
    ctx.check_capacity()
    with _store_errors():
        session = await store.get(sid)
        if session is None:
            raise SessionNotFound(sid)
        token = await store.acquire_turn_lock(sid, TURN_LOCK_TTL_S)
    turn: _Turn | None = None
    try:
        with _store_errors():
            session = await store.get(sid)  # re-read under the lock
            if session is None:
                raise SessionNotFound(sid)
            history = await store.get_history_tokens(sid)
        tokenizer = ctx.engine.get_tokenizer()
        if history:
            prompt_ids = next_turn_ids(tokenizer, history, body.content, ctx.engine.engine.eos_token_ids)
        else:
            prompt_ids = first_turn_ids(tokenizer, session.system_prompt, body.content)
        params = build_sampling_params(body, body.max_tokens, 0 if body.logprobs else None, session.defaults)
        fit_max_tokens(ctx, params, len(prompt_ids), explicit=body.max_tokens is not None, param="content")
        turn = _Turn(ctx, sid, token, session.num_turns, body.content, prompt_ids)
        gen = Generation(ctx, request_id, [prompt_ids], params)
    except BaseException:
        if turn is None:
            with contextlib.suppress(Exception):
                await store.release_turn_lock(sid, token)
        else:
            await turn.abandon()
        raise
    turn.start_refreshing()
    acc = Accumulator(1)
    cid, created = f"chatcmpl-{request_id}", int(time.time())
    headers = {"X-Request-Id": request_id, "X-Session-Id": sid}
    if body.stream:
        include_usage = body.stream_options.include_usage if body.stream_options else True

        async def on_end(completed: bool) -> None:
            try:
                await turn.finish(gen, acc)
            except APIError as exc:
                logger.warning("session %s: the turn could not be stored: %s", sid, exc.message)
                if completed:
                    raise

        events = _store_failure_as_event(
            chat_events(gen, acc, cid=cid, created=created, model=ctx.model_name, include_usage=include_usage,
                        top_logprobs=0, on_end=on_end)
        )
        response = sse_response(events, ctx, request_id)
        response.headers["X-Session-Id"] = sid
        return response
    try:
        await run_non_streaming(request, gen, acc)
    except BaseException:
        # The client left (or the engine died): keep what was produced as an aborted turn.
        ctx.spawn(turn.finish(gen, acc))
        raise
    await turn.finish(gen, acc)  # a store failure here is the client's 503
    obj = chat_response(gen, acc, cid, created, ctx.model_name, 0)
    obj["session_id"] = sid
    return JSONResponse(obj, headers=headers)


async def _store_failure_as_event(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[dict[str, Any]]:
    """A turn that cannot be stored at its end becomes an error event instead of [DONE]."""
    from chatserve.server.formatting import dumps

    last_id = 0
    try:
        async for event in events:
            last_id = int(event["id"])
            yield event
    except APIError as exc:
        yield {"id": str(last_id + 1), "data": dumps(exc.body())}


def session_routes() -> list[Route]:
    return [
        Route("/v1/sessions", create_session, methods=["POST"]),
        Route("/v1/sessions", list_sessions, methods=["GET"]),
        Route("/v1/sessions/{session_id:str}", get_session, methods=["GET"]),
        Route("/v1/sessions/{session_id:str}", delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{session_id:str}/messages", post_message, methods=["POST"]),
    ]


__all__ = ["session_routes"]
