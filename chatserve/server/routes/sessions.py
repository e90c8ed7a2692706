"""The session API: multi-turn chats whose exact token history lives in a SessionStore (Redis).

Every turn reuses the cached KV of the whole history: its prompt is the stored token ids plus
the new user turn (`session_prompts`), so the radix tree matches all of it. One turn at a time
per session (an expiring lock, `session_turn`); a finished, cancelled or disconnected turn is
written atomically, partial replies marked `finish_reason: "abort"`. Store outages are 503s that
heal by themselves.
"""

from __future__ import annotations

import contextlib
import logging
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from chatserve.server.choices import Accumulator
from chatserve.server.chunks import ChatFormat
from chatserve.server.context import ServerContext, get_context
from chatserve.server.errors import APIError, bad_request
from chatserve.server.generation import Generation
from chatserve.server.http_input import read_model, request_id_from
from chatserve.server.params import build_sampling_params, cap_max_tokens, check_limits, check_stop_list
from chatserve.server.protocol import CreateSessionRequest, SessionMessageRequest
from chatserve.server.session_prompts import first_turn_ids, next_turn_ids
from chatserve.server.session_turn import TURN_LOCK_TTL_S, SessionTurn, store_errors
from chatserve.server.streaming import collect_reply, sse_response, stream_events
from chatserve.sessions import SessionNotFound, SessionStore

logger = logging.getLogger(__name__)


def _store(ctx: ServerContext) -> SessionStore:
    if ctx.sessions is None:
        raise APIError(404, "the session API is not enabled on this server")
    return ctx.sessions


async def create_session(request: Request) -> JSONResponse:
    ctx = get_context(request)
    store = _store(ctx)
    body = await read_model(request, CreateSessionRequest, ctx.settings)
    defaults = body.defaults.model_dump(exclude_none=True) if body.defaults else {}
    stop = defaults.get("stop", [])
    check_stop_list(ctx.settings, [stop] if isinstance(stop, str) else stop, param="defaults.stop")  # a request's limits
    with store_errors():
        session = await store.create(system_prompt=body.system_prompt, metadata=body.metadata or {},
                                     ttl_seconds=body.ttl_seconds, defaults=defaults, model=ctx.model_name)
    return JSONResponse(session.to_dict(), status_code=201)


async def list_sessions(request: Request) -> JSONResponse:
    ctx = get_context(request)
    store = _store(ctx)
    raw_limit = request.query_params.get("limit", "20")
    try:
        limit = int(raw_limit)
    except ValueError:
        raise bad_request(f"limit must be an integer, got {raw_limit!r}", param="limit") from None
    if not 1 <= limit <= 100:
        raise bad_request(f"limit must be in [1, 100], got {limit}", param="limit")
    after = request.query_params.get("after") or None
    with store_errors():
        page = await store.list(limit=limit, after=after)
    data = [s.to_dict() for s in page.sessions]
    return JSONResponse({
        "object": "list", "data": data, "has_more": page.has_more,
        "first_id": data[0]["id"] if data else None, "last_id": data[-1]["id"] if data else None,
    })


async def get_session(request: Request) -> JSONResponse:
    ctx = get_context(request)
    sid = request.path_params["session_id"]
    with store_errors():
        found = await _store(ctx).get_with_messages(sid)
    if found is None:
        raise APIError(404, f"session {sid!r} does not exist (or expired)", param="session_id", code="session_not_found")
    session, messages = found
    return JSONResponse({**session.to_dict(), "messages": [m.to_dict() for m in messages]})


async def delete_session(request: Request) -> JSONResponse:
    ctx = get_context(request)
    sid = request.path_params["session_id"]
    with store_errors():
        deleted = await _store(ctx).delete(sid)
    if not deleted:
        raise APIError(404, f"session {sid!r} does not exist (or expired)", param="session_id", code="session_not_found")
    return JSONResponse({"id": sid, "object": "session.deleted", "deleted": True})


async def post_message(request: Request) -> Response:
    ctx = get_context(request)
    store = _store(ctx)
    sid = request.path_params["session_id"]
    body = await read_model(request, SessionMessageRequest, ctx.settings)
    request_id = request_id_from(request, ctx.settings)
    ctx.check_model(body.model)
    if body.n != 1:
        raise bad_request("a session turn has exactly one reply; n must be 1", param="n")
    check_limits(ctx.settings, body)
    ctx.check_capacity()
    with store_errors():
        session = await store.get(sid)
        if session is None:
            raise SessionNotFound(sid)
        token = await store.acquire_turn_lock(sid, TURN_LOCK_TTL_S)
    turn: SessionTurn | None = None
    try:
        with store_errors():
            session = await store.get(sid)  # re-read under the lock
            if session is None:
                raise SessionNotFound(sid)
            history = await store.get_history_tokens(sid)
        engine = ctx.engine
        if history:
            prompt_ids = next_turn_ids(engine.tokenizer, history, body.content, engine.eos_token_ids)
        else:
            prompt_ids = first_turn_ids(engine.input_processor, session.system_prompt, body.content)
        prompt = engine.input_processor.process({"prompt_token_ids": prompt_ids}, max_tokens=body.max_tokens,
                                                param="content")
        params = build_sampling_params(body, body.max_tokens, 0 if body.logprobs else None, session.defaults)
        cap_max_tokens(params, ctx.max_model_len, prompt.num_tokens)
        turn = SessionTurn(store, sid, token, session.num_turns, body.content, prompt_ids)
        gen = Generation(ctx, request_id, [prompt], params)
    except BaseException:
        if turn is None:
            with contextlib.suppress(Exception):
                await store.release_turn_lock(sid, token)
        else:
            await turn.abandon()
        raise
    turn.start_refreshing()
    acc = Accumulator(1)
    fmt = ChatFormat(f"chatcmpl-{request_id}", int(time.time()), ctx.model_name, 0)
    headers = {"X-Request-Id": request_id, "X-Session-Id": sid}
    if body.stream:
        include_usage = body.stream_options.include_usage if body.stream_options else True

        async def on_end(completed: bool) -> None:
            # A turn that cannot be stored at the end of a full reply is the stream's last event.
            try:
                await turn.finish(acc, gen.usage)
            except APIError as exc:
                logger.warning("session %s: the turn could not be stored: %s", sid, exc.message)
                if completed:
                    raise

        events = stream_events(gen, acc, fmt, include_usage=include_usage, on_end=on_end)
        return sse_response(events, keepalive_s=ctx.settings.sse_keepalive_s, headers=headers)
    try:
        await collect_reply(request, gen, acc)
    except BaseException:
        # The client left (or the engine died): keep what was produced as an aborted turn.
        ctx.spawn(turn.finish(acc, gen.usage))
        raise
    await turn.finish(acc, gen.usage)  # a store failure here is the client's 503
    obj = fmt.reply(acc, gen.usage)
    obj["session_id"] = sid
    return JSONResponse(obj, headers=headers)


def routes() -> list[Route]:
    return [
        Route("/v1/sessions", create_session, methods=["POST"]),
        Route("/v1/sessions", list_sessions, methods=["GET"]),
        Route("/v1/sessions/{session_id:str}", get_session, methods=["GET"]),
        Route("/v1/sessions/{session_id:str}", delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{session_id:str}/messages", post_message, methods=["POST"]),
    ]


__all__ = ["routes"]
