"""The session API: multi-turn chats whose exact token history lives in a SessionStore (Redis).

Every turn reuses the cached KV of the whole history: its prompt is the stored token ids plus
the new user turn (`prompts`), so the radix tree matches all of it. One turn at a time
per session (an expiring lock, `turn`); a finished, cancelled or disconnected turn is
written atomically, partial replies marked `finish_reason: "abort"`. Store outages are 503s that
heal by themselves.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from chatserve.server.chat.choices import Accumulator
from chatserve.server.chat.chunks import ChatFormat
from chatserve.server.chat.generation import Generation
from chatserve.server.chat.params import check_limits, check_stop_list
from chatserve.server.chat.prompts import next_tool_turn_ids
from chatserve.server.chat.replies import collect_reply, logged_stream, stream_events, stream_policy
from chatserve.server.chat.tool_replies import ToolChatFormat
from chatserve.server.chat.tool_request import ToolPlan, plan_tools
from chatserve.server.context import ServerContext, get_context
from chatserve.server.errors import APIError, JSONResponse, bad_request
from chatserve.server.http_input import query_limit, read_model, request_id_from
from chatserve.server.pipeline import FieldNames, ReasoningRequest, ServeSpec, ServingAdapter, serve
from chatserve.server.sessions.cache import report_for_api, turn_kv
from chatserve.server.sessions.prompts import first_tool_turn_ids, first_turn_ids, new_messages, next_turn_ids, stored_user_text
from chatserve.server.sessions.protocol import (
    CreateSessionRequest,
    ForkSessionRequest,
    SessionMessageRequest,
    SessionRegenerateRequest,
    UpdateSessionRequest,
)
from chatserve.server.sessions.turn import SessionTurn, reply_stats, store_errors
from chatserve.server.streams.runs import DisconnectPolicy
from chatserve.server.streams.sse import sse_response
from chatserve.sessions import Message, Session, SessionNotFound, SessionStore
from chatserve.sessions.models import turn_bounds

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
    return JSONResponse(session.to_dict(), status_code=201, headers={"X-Session-Id": session.id})


async def list_sessions(request: Request) -> JSONResponse:
    ctx = get_context(request)
    store = _store(ctx)
    limit = query_limit(request)
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
    with store_errors():
        history = await _store(ctx).get_history_tokens(sid)
    kv_cache = report_for_api(await ctx.engine.session_cache_report(sid, history))
    return JSONResponse({**session.to_dict(), "messages": [m.to_dict() for m in messages], "kv_cache": kv_cache})


async def delete_session(request: Request) -> JSONResponse:
    ctx = get_context(request)
    sid = request.path_params["session_id"]
    with store_errors():
        deleted = await _store(ctx).delete(sid)
    if not deleted:
        raise APIError(404, f"session {sid!r} does not exist (or expired)", param="session_id", code="session_not_found")
    try:
        await ctx.engine.release_kv_lease(sid)  # its cached branch is plain LRU again
    except Exception as exc:  # noqa: BLE001 - the session is gone either way; the lease just expires later
        logger.warning("session %s: deleted, but its KV lease could not be released: %s", sid, exc)
    return JSONResponse({"id": sid, "object": "session.deleted", "deleted": True})


@dataclass
class TurnPrompt:
    """What a turn sends the engine: the exact prompt ids, the user text stored with the turn, and
    whether the turn replaces the last stored one (regenerate) or follows it."""

    prompt_ids: list[int]
    user_text: str
    replace_last_turn: bool = False
    user_created_at: float | None = None  # set when the stored user message is kept (regenerate)


# Given the session re-read under the lock, its messages and its token history: the turn's prompt.
PlanTurn = Callable[[Session, list[Message], list[int]], TurnPrompt]


async def post_message(request: Request) -> Response:
    ctx = get_context(request)
    body = await read_model(request, SessionMessageRequest, ctx.settings)
    engine = ctx.engine

    def plan(session: Session, messages: list[Message], history: list[int]) -> TurnPrompt:
        if body.has_tools:  # tools offered or tool results handed back: sessions/prompts.py renders the new part
            tools = session_tool_plan(ctx, body)
            new = new_messages(body)
            if history:
                ids = next_tool_turn_ids(engine.input_processor, history, new, engine.eos_token_ids, tools,
                                         ctx.chat_template, ctx.settings.tool_call_parser)
            else:
                ids = first_tool_turn_ids(engine.input_processor, session.system_prompt, new, tools, ctx.chat_template,
                                          ctx.settings.tool_call_parser)
            return TurnPrompt(ids, stored_user_text(body))
        assert body.content is not None
        if history:
            return TurnPrompt(next_turn_ids(engine.tokenizer, history, body.content, engine.eos_token_ids,
                                            ctx.chat_template), body.content)
        return TurnPrompt(first_turn_ids(engine.input_processor, session.system_prompt, body.content, ctx.chat_template),
                          body.content)

    return await _run_turn(request, body, plan, param="content")


async def regenerate(request: Request) -> Response:
    """A new reply in place of the last one: the prompt is the stored history up to where that reply
    started (`prompt_end`), token for token, so all of it is in the prefix cache."""
    ctx = get_context(request)
    body = await read_model(request, SessionRegenerateRequest, ctx.settings)
    sid = request.path_params["session_id"]

    def plan(session: Session, messages: list[Message], history: list[int]) -> TurnPrompt:
        bounds = turn_bounds(messages)
        if not bounds:
            raise bad_request(f"session {sid!r} has no reply to regenerate yet; send a message first", param="session_id")
        start, end = bounds[-1]
        reply = messages[end - 1]
        user = next((m for m in messages[start:end] if m.role == "user"), None)
        if reply.prompt_end is None or user is None:
            raise bad_request("the last reply was stored before replies recorded where their prompt ends; "
                              "send a new message instead", param="session_id")
        return TurnPrompt(history[:reply.prompt_end], user.content, replace_last_turn=True, user_created_at=user.created_at)

    return await _run_turn(request, body, plan, param="session_id")


async def _run_turn(request: Request, body: SessionMessageRequest | SessionRegenerateRequest, plan: PlanTurn,
                    *, param: str) -> Response:
    """One locked turn of a session through the serving pipeline (`TurnAdapter`)."""
    ctx = get_context(request)
    adapter = TurnAdapter(body, request_id_from(request, ctx.settings), request.path_params["session_id"], plan,
                          param=param)
    return await serve(request, adapter)


class TurnAdapter(ServingAdapter):
    """A session turn over the serving pipeline: the prompt from `plan` under the session's turn lock,
    then the reply streamed or whole, and the turn stored once at its end (with its stats) whatever
    happens to the client."""

    def __init__(self, body: SessionMessageRequest | SessionRegenerateRequest, request_id: str, sid: str,
                 plan: PlanTurn, *, param: str) -> None:
        super().__init__(request_id, body.model)
        self.body = body
        self.sid = sid
        self.plan = plan
        self.names = FieldNames(prompt=param)
        self.policy: DisconnectPolicy | None = None
        self.store: SessionStore | None = None
        self.token: str | None = None  # the turn lock, once taken
        self.turn: SessionTurn | None = None

    def admit(self, ctx: ServerContext) -> None:
        self.store = _store(ctx)
        if self.body.n != 1:
            raise bad_request("a session turn has exactly one reply; n must be 1", param="n")
        check_limits(ctx.settings, self.body)
        self.policy = stream_policy(ctx, self.body)

    async def prepare(self, ctx: ServerContext) -> ServeSpec:
        store, sid, body = self.store, self.sid, self.body
        assert store is not None
        with store_errors():
            if await store.get(sid) is None:
                raise SessionNotFound(sid)
            self.token = await store.acquire_turn_lock(sid, ctx.settings.session_turn_lock_ttl_s)
            found = await store.get_with_messages(sid)  # re-read under the lock
            if found is None:
                raise SessionNotFound(sid)
            session, messages = found
            history = await store.get_history_tokens(sid)
        planned = await ctx.off_loop(self.plan, session, messages, history)  # renders and tokenizes: off the loop
        tool_plan = session_tool_plan(ctx, body) if isinstance(body, SessionMessageRequest) else None
        self.turn = SessionTurn(store, sid, self.token, session.num_turns, planned.user_text, planned.prompt_ids,
                                replace_last_turn=planned.replace_last_turn, user_created_at=planned.user_created_at,
                                lock_ttl_s=ctx.settings.session_turn_lock_ttl_s)
        return ServeSpec([planned.prompt_ids], body, body.max_tokens, 0 if body.logprobs else None, tools=tool_plan,
                         defaults=session.defaults, session=turn_kv(ctx.settings, session, planned.prompt_ids, history),
                         reasoning=ReasoningRequest(effort=body.reasoning_effort))

    async def abandon(self) -> None:
        if self.turn is not None:
            await self.turn.abandon()
        elif self.token is not None and self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.release_turn_lock(self.sid, self.token)

    async def respond(self, request: Request, ctx: ServerContext, gen: Generation, spec: ServeSpec) -> Response:
        turn, sid, body, tool_plan = self.turn, self.sid, self.body, spec.tools
        assert turn is not None
        turn.start_refreshing()
        acc = Accumulator(1)
        cid, created = f"chatcmpl-{self.request_id}", int(time.time())
        reasons = gen.params.reasoning is not None  # streamed as chat's delta.reasoning; stored apart from the answer
        fmt = ToolChatFormat(cid, created, ctx.model_name, 0, tool_plan, reasoning=reasons) \
            if tool_plan is not None and tool_plan.parses_calls else ChatFormat(cid, created, ctx.model_name, 0,
                                                                                reasoning=reasons)
        headers = {"X-Request-Id": self.request_id, "X-Session-Id": sid}
        if body.stream:
            include_usage = body.stream_options.include_usage if body.stream_options else True

            async def on_end(completed: bool) -> None:
                # A turn that cannot be stored at the end of a full reply is the stream's last event.
                try:
                    await turn.finish(acc, gen.usage, reply_stats(gen))
                except APIError as exc:
                    logger.warning("session %s: the turn could not be stored: %s", sid, exc.message)
                    if completed:
                        raise

            events = stream_events(gen, acc, fmt, include_usage=include_usage, on_end=on_end)
            if self.policy is not None:  # resumable: the turn is stored when the run ends, whoever reads it
                try:
                    return logged_stream(ctx, cid, events, policy=self.policy, gen=gen, headers=headers)
                except APIError:  # refused (a run of that id is live): nothing ran, so the lock and its refresher go
                    await turn.abandon()
                    raise
            return sse_response(events, keepalive_s=ctx.settings.sse_keepalive_s, headers=headers, numbered=False)
        try:
            await collect_reply(request, gen, acc)
        except BaseException:
            # The client left (or the engine died): keep what was produced as an aborted turn.
            ctx.spawn(turn.finish(acc, gen.usage, reply_stats(gen)))
            raise
        stats = reply_stats(gen)
        await turn.finish(acc, gen.usage, stats)  # a store failure here is the client's 503
        obj = fmt.reply(acc, gen.usage)
        obj["session_id"] = sid
        obj["stats"] = stats
        return JSONResponse(obj, headers=headers)


def _title_and_metadata(body: UpdateSessionRequest | ForkSessionRequest) -> dict[str, Any]:
    """The store arguments for the fields sent: a title ("" clears it) and metadata (replaced whole)."""
    fields: dict[str, Any] = {}
    if body.title is not None:
        fields["title"] = body.title or None
    if body.metadata is not None:
        fields["metadata"] = body.metadata
    return fields


async def update_session(request: Request) -> JSONResponse:
    """PATCH: rename (`title`, "" clears it), replace `metadata` or the sampling `defaults`."""
    ctx = get_context(request)
    store = _store(ctx)
    sid = request.path_params["session_id"]
    body = await read_model(request, UpdateSessionRequest, ctx.settings)
    changes = _title_and_metadata(body)
    if body.defaults is not None:
        defaults = body.defaults.model_dump(exclude_none=True)
        stop = defaults.get("stop", [])
        check_stop_list(ctx.settings, [stop] if isinstance(stop, str) else stop, param="defaults.stop")
        changes["defaults"] = defaults
    if not changes:
        raise bad_request("nothing to change: send title, metadata or defaults", param="title")
    with store_errors():
        session = await store.update(sid, **changes)
    return JSONResponse(session.to_dict())


async def fork_session(request: Request) -> JSONResponse:
    """A branch: a new session with the first `keep_turns` turns and their exact token history, so its
    next turn's prompt is a prefix-cache hit up to the branch point (an edit is a fork at the edited
    turn followed by the new message on the fork; see docs/sessions.md)."""
    ctx = get_context(request)
    store = _store(ctx)
    sid = request.path_params["session_id"]
    body = await read_model(request, ForkSessionRequest, ctx.settings)
    options = _title_and_metadata(body)
    try:
        with store_errors():
            fork = await store.fork(sid, body.keep_turns, **options)
            found = await store.get_with_messages(fork.id)
    except APIError as exc:
        if exc.status == 400 and "keep_turns" in exc.message:
            raise bad_request(exc.message, param="keep_turns") from None
        raise
    if found is None:  # deleted (or expired) in between: say so rather than answer half a fork
        raise APIError(404, f"session {fork.id!r} vanished right after it was created", param="session_id",
                       code="session_not_found")
    session, messages = found
    return JSONResponse({**session.to_dict(), "messages": [m.to_dict() for m in messages]}, status_code=201,
                        headers={"X-Session-Id": session.id})  # the new session's id, not the path's


def session_tool_plan(ctx: ServerContext, body: SessionMessageRequest) -> ToolPlan | None:
    return plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, ctx.engine.input_processor,
                      ctx.chat_template, ctx.settings.tool_call_parser)


def routes() -> list[Route]:
    return [
        Route("/v1/sessions", create_session, methods=["POST"]),
        Route("/v1/sessions", list_sessions, methods=["GET"]),
        Route("/v1/sessions/{session_id:str}", get_session, methods=["GET"]),
        Route("/v1/sessions/{session_id:str}", delete_session, methods=["DELETE"]),
        Route("/v1/sessions/{session_id:str}", update_session, methods=["PATCH"]),
        Route("/v1/sessions/{session_id:str}/messages", post_message, methods=["POST"]),
        Route("/v1/sessions/{session_id:str}/regenerate", regenerate, methods=["POST"]),
        Route("/v1/sessions/{session_id:str}/fork", fork_session, methods=["POST"]),
    ]


__all__ = ["routes"]
