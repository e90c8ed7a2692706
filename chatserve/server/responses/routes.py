"""The Responses API: `POST /v1/responses` (streamed or not, foreground or background), `GET`,
`DELETE`, `POST .../cancel` and `GET .../input_items` of a stored response.

A request's path is the chat route's: the same tool planning (`plan_tools`), rendering
(`chat_prompt_ids`), prompt checks (`input_processor.process`, naming `input`), sampling
(`build_sampling_params`) and constrained decoding (`request_constraint`: tools and `text.format`),
only the input is items and the output is typed events (`events`). With
`previous_response_id` the prompt is the stored exact token ids of the earlier conversation plus
only the new items (the continuation session turns use), so the prefix cache matches all of it.

Background responses run on the run registry (streams/runs.py, with a `detach` disconnect policy): every
event goes to the response's event log, and `GET /v1/responses/{id}?stream=true&starting_after=N`
replays it from the cursor, then follows live, from any replica sharing the Redis.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from chatserve.server.chat.generation import Generation
from chatserve.server.chat.prompts import chat_prompt_ids, continue_history, next_tool_turn_ids
from chatserve.server.chat.tool_request import ToolPlan, conversation, plan_tools
from chatserve.server.context import ServerContext, get_context
from chatserve.server.errors import APIError, JSONResponse, bad_request
from chatserve.server.http_input import parse_model_off_loop, query_limit, read_body
from chatserve.server.pipeline import FieldNames, ReasoningRequest, ServeSpec, ServingAdapter, serve
from chatserve.server.responses.input import chat_messages, clean_param, input_items
from chatserve.server.responses.protocol import ResponsesRequest
from chatserve.server.responses.run import TERMINAL, ResponseRun
from chatserve.server.streams.event_log import event_log_errors
from chatserve.server.streams.runs import DisconnectPolicy
from chatserve.server.streams.sse import dumps, run_or_disconnect, sse_response
from chatserve.sessions.response_store import (
    ResponseStore,
    ResponseStoreUnavailable,
    is_valid_response_id,
    new_response_id,
)

_CANCEL_WAIT_S = 10.0  # how long a cancel waits for the run (here or on another replica) to record its end


@contextlib.contextmanager
def store_errors() -> Iterator[None]:
    try:
        yield
    except ResponseStoreUnavailable as exc:
        raise APIError(503, f"stored responses are unavailable right now: {exc}", code="response_store_unavailable",
                       headers={"Retry-After": "1"}) from None


def _store(ctx: ServerContext) -> ResponseStore:
    store = ctx.responses
    if store is None:
        raise APIError(404, "the Responses API's store is not enabled on this server")
    return store


def _not_found(rid: str) -> APIError:
    return APIError(404, f"no response with id {rid!r} is stored (it was never stored, was deleted, or expired)",
                    param="response_id", code="response_not_found")


async def _read_body(request: Request, ctx: ServerContext) -> ResponsesRequest:
    try:
        return await parse_model_off_loop(ResponsesRequest, await read_body(request, ctx.settings.max_body_bytes),
                                          ctx.settings)
    except APIError as exc:
        exc.param = clean_param(exc.param)
        raise


# ---- building the prompt ----------------------------------------------------------------------------
async def _prompt_ids(ctx: ServerContext, body: ResponsesRequest, plan: ToolPlan | None) -> tuple[list[int], str | None]:
    """The prompt's exact token ids and the instructions the response reports."""
    if body.previous_response_id is None:  # (rendering and tokenizing run off the event loop)
        chat = chat_messages(body, ctx.reasoning_signer)  # (a tampered encrypted_content: 400 before any work)
        return await ctx.off_loop(chat_prompt_ids, ctx, chat, True, None, plan), body.instructions
    prev_id = body.previous_response_id
    with store_errors():
        prev = await _store(ctx).get(prev_id) if is_valid_response_id(prev_id) else None
        history = await _store(ctx).get_token_ids(prev_id) if prev is not None else None
    if prev is None or history is None:
        raise bad_request(f"previous response {prev_id!r} is not stored (never stored, deleted, or expired)",
                          param="previous_response_id", code="previous_response_not_found")
    if prev.get("status") not in TERMINAL:
        raise bad_request(f"previous response {prev_id!r} is still {prev.get('status')}; wait for it to end",
                          param="previous_response_id", code="previous_response_running")
    if not history:
        raise bad_request(f"previous response {prev_id!r} ended without a conversation to continue "
                          f"(status {prev.get('status')})", param="previous_response_id")
    stored_instructions = _first_instructions(prev)
    if body.instructions is not None and body.instructions != stored_instructions:
        # NOTE: the stored tokens hold the earlier instructions as their system message; other ones
        # would need the whole conversation rendered again (and the cache lost), so they are refused.
        raise bad_request("instructions differ from those the previous response's conversation began with; "
                          "send the same instructions (or none) when continuing with previous_response_id",
                          param="instructions")
    messages = conversation(chat_messages(body, ctx.reasoning_signer, with_instructions=False))
    if len(messages) > ctx.settings.max_messages:
        raise bad_request(f"at most {ctx.settings.max_messages} input items are allowed", param="input")
    engine = ctx.engine
    uses_tools = plan is not None or any(m["role"] == "tool" or m.get("tool_calls") for m in messages)
    if uses_tools:
        ids = await ctx.off_loop(next_tool_turn_ids, engine.input_processor, history, messages, engine.eos_token_ids,
                                 plan, ctx.chat_template, ctx.settings.tool_call_parser)
    else:
        ids = await ctx.off_loop(continue_history, engine.tokenizer, history, messages, engine.eos_token_ids,
                                 chat_template=ctx.chat_template)
    return ids, stored_instructions


def _first_instructions(prev: dict[str, Any]) -> str | None:
    instructions = prev.get("instructions")
    return instructions if isinstance(instructions, str) else None


# ---- POST /v1/responses -----------------------------------------------------------------------------
class ResponsesAdapter(ServingAdapter):
    """`POST /v1/responses` over the serving pipeline: items in, typed events out, the record stored."""

    names = FieldNames(prompt="input", max_tokens="max_output_tokens", rename=lambda p: _responses_param(p))

    def __init__(self, body: ResponsesRequest) -> None:
        super().__init__(new_response_id(), body.model)
        self.body = body
        self.store: ResponseStore | None = None
        self.policy: DisconnectPolicy | None = None

    def admit(self, ctx: ServerContext) -> None:
        self.store = _store(ctx) if self.body.store else None
        self.policy = _disconnect_policy(ctx, self.body)

    async def prepare(self, ctx: ServerContext) -> ServeSpec:
        body = self.body
        plan = plan_tools(body.chat_tools(), body.chat_tool_choice(), body.parallel_tool_calls,
                          ctx.engine.input_processor, ctx.chat_template, ctx.settings.tool_call_parser)
        ids, instructions = await _prompt_ids(ctx, body, plan)
        effort = body.reasoning.effort if body.reasoning is not None else None
        reasoning = ReasoningRequest(effort=effort, api="responses", param="reasoning.effort")
        return ServeSpec([ids], body.sampling_fields(), body.max_output_tokens, None, tools=plan,
                         reasoning=reasoning, extra={"instructions": instructions})

    async def respond(self, request: Request, ctx: ServerContext, gen: Generation, spec: ServeSpec) -> Response:
        body, rid, policy = self.body, self.request_id, self.policy
        assert policy is not None
        run = ResponseRun(gen, body, spec.tools, response_id=rid, model=ctx.model_name,
                          prompt_ids=gen.prompts[0].prompt_token_ids, input_items=input_items(body), store=self.store,
                          instructions=spec.extra["instructions"],
                          seal=ctx.reasoning_signer.seal if body.include_sealed_reasoning else None)
        try:
            with store_errors():
                await run.save_start()
        except BaseException:
            await gen.cancel("store_unavailable")
            raise
        headers = {"X-Request-Id": rid}
        if policy.mode == "detach":
            return await _start_detached(ctx, run, policy, headers)
        if body.stream:
            return sse_response(_sse(ctx, run), keepalive_s=ctx.settings.sse_keepalive_s, headers=headers,
                                numbered=False)

        async def collect() -> None:
            async for _ in run.events():
                pass

        events_done, _ = await run_or_disconnect(collect(), request.receive)
        if not events_done:
            ctx.spawn(run.abandoned())
            raise APIError(499, "client closed the request")
        assert run.final is not None
        return JSONResponse(run.final, headers=headers)


async def create_response(request: Request) -> Response:
    ctx = get_context(request)
    return await serve(request, ResponsesAdapter(await _read_body(request, ctx)))


def _responses_param(param: str) -> str:
    """A constraint's chat field name as the Responses request spells it."""
    if param.startswith("response_format"):
        return "text.format.schema" if "schema" in param else "text.format"
    return param.replace(".function.", ".")  # tools.0.function.parameters -> tools.0.parameters


async def _sse(ctx: ServerContext, run: ResponseRun) -> AsyncIterator[dict[str, Any]]:
    """A foreground run's typed events as SSE, framed as OpenAI frames them: `event:` the type and the
    data (its `sequence_number` is in the data; no `id:`, as the stream cannot be resumed). A client
    that leaves aborts the run, which is then stored as cancelled."""
    try:
        async for event in run.events():
            yield {"event": event["type"], "data": dumps(event)}
    finally:
        if run.final is None:
            ctx.spawn(run.abandoned())


async def _follow(ctx: ServerContext, rid: str, after: int) -> AsyncIterator[dict[str, Any]]:
    try:
        with event_log_errors("starting_after"):
            async for seq, event in ctx.runs.attach(rid, after=after):
                yield {"event": event["type"], "id": str(seq), "data": dumps(event)}
    except APIError as exc:  # mid-stream: the stream's last event says why it ends
        body = exc.body()["error"]
        yield {"event": "error", "data": dumps({"type": "error", "code": body["code"], "message": body["message"],
                                                "param": body["param"], "sequence_number": -1})}


def _disconnect_policy(ctx: ServerContext, body: ResponsesRequest) -> DisconnectPolicy:
    """A background response detaches: a streamed one for the server's lease without readers (its
    client may come back with starting_after), a polled one, which never has readers, for the longest
    lease. A foreground stream aborts on disconnect unless it asks to detach (then it is resumable too)."""
    settings = ctx.settings
    default = None
    if body.background:
        default = DisconnectPolicy.detach(settings.detach_lease_s if body.stream else settings.max_detach_lease_s)
    policy = DisconnectPolicy.parse(body.disconnect_policy, param="disconnect_policy", settings=settings,
                                    default=default)
    if body.background and policy.mode == "abort":
        raise bad_request("a background response runs without its client; disconnect_policy must be 'detach'",
                          param="disconnect_policy")
    if not body.background and policy.mode == "detach" and not body.stream:
        raise bad_request("disconnect_policy 'detach' needs stream: true or background: true (a detached run is "
                          "read back by resuming its stream)", param="disconnect_policy")
    return policy


async def _start_detached(ctx: ServerContext, run: ResponseRun, policy: DisconnectPolicy,
                          headers: dict[str, str]) -> Response:
    """Run on the run registry: events go to the response's event log, readers follow it."""
    try:
        ctx.runs.start(run.id, run.events(), policy=policy, on_abort=run.gen.close)
    except ValueError as exc:
        await run.gen.cancel("engine")
        raise APIError(409, str(exc), code="duplicate_request_id") from None
    if run.body.stream:
        return sse_response(_follow(ctx, run.id, -1), keepalive_s=ctx.settings.sse_keepalive_s, headers=headers,
                            numbered=True)
    return JSONResponse(run.snapshot(), headers=headers)


# ---- GET / DELETE / cancel / input_items --------------------------------------------------------------
async def get_response(request: Request) -> Response:
    ctx = get_context(request)
    rid = request.path_params["response_id"]
    stream = _flag(request, "stream")
    with store_errors():
        found = await _store(ctx).get(rid)
    if found is None:
        raise _not_found(rid)
    if not stream:
        if "starting_after" in request.query_params:
            raise bad_request("starting_after needs stream=true", param="starting_after")
        return JSONResponse(found)
    if not found.get("background") and not await _has_log(ctx, rid):
        raise bad_request("only background (or detached) responses can be streamed again; this one was not "
                          "created with background: true", param="stream")
    raw = request.query_params.get("starting_after", "-1")
    try:
        after = int(raw)
    except ValueError:
        raise bad_request(f"starting_after must be an integer sequence number, got {raw[:40]!r}",
                          param="starting_after") from None
    if after < -1:
        raise bad_request("starting_after must be >= -1", param="starting_after")
    return sse_response(_follow(ctx, rid, after), keepalive_s=ctx.settings.sse_keepalive_s,
                        headers={"X-Request-Id": rid}, numbered=True)


async def _has_log(ctx: ServerContext, rid: str) -> bool:
    # The run registry's view: a local run's events may still be in its in-process mirror, not yet
    # in the shared log.
    with event_log_errors("response_id"):
        return await ctx.runs.info(rid) is not None


def _flag(request: Request, name: str) -> bool:
    raw = request.query_params.get(name)
    if raw is None:
        return False
    if raw.lower() in ("true", "1"):
        return True
    if raw.lower() in ("false", "0", ""):
        return False
    raise bad_request(f"{name} must be true or false, got {raw[:40]!r}", param=name)


async def delete_response(request: Request) -> Response:
    ctx = get_context(request)
    rid = request.path_params["response_id"]
    with store_errors():
        deleted = await _store(ctx).delete(rid)
    if not deleted:
        raise _not_found(rid)
    with contextlib.suppress(Exception):  # a background response's event log goes too (else it just expires)
        await ctx.runs.log.delete(rid)
    return JSONResponse({"id": rid, "object": "response.deleted", "deleted": True})


async def cancel_response(request: Request) -> Response:
    """Cancel a queued or running response (here, or on the replica that runs it); a finished one is
    answered as it is, so a cancel is idempotent. The answer is the response's final state."""
    ctx = get_context(request)
    store = _store(ctx)
    rid = request.path_params["response_id"]
    loop = asyncio.get_running_loop()
    deadline: float | None = None  # set once the run was asked to stop
    while deadline is None or loop.time() < deadline:
        with store_errors():
            found = await store.get(rid)
        if found is None:
            raise _not_found(rid)
        if found.get("status") in TERMINAL:  # finished before, or the run recorded its end since
            return JSONResponse(found)
        if deadline is None:
            if await ctx.tracker.cancel(rid) is None and ctx.cancel_bus is not None:
                with contextlib.suppress(Exception):
                    await ctx.cancel_bus.cancel_remote(rid)
            deadline = loop.time() + _CANCEL_WAIT_S
        else:
            await asyncio.sleep(0.02)
    raise APIError(503, f"response {rid!r} was asked to cancel but has not recorded its end yet; retry",
                   code="cancel_pending", headers={"Retry-After": "1"})


async def list_input_items(request: Request) -> Response:
    ctx = get_context(request)
    rid = request.path_params["response_id"]
    q = request.query_params
    limit = query_limit(request)
    order = q.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad_request(f'order must be "asc" or "desc", got {order[:40]!r}', param="order")
    if q.get("include"):
        raise bad_request("include is not supported on input_items", param="include")
    with store_errors():
        items = await _store(ctx).get_input_items(rid)
    if items is None:
        raise _not_found(rid)
    if order == "desc":
        items = items[::-1]
    after, before = q.get("after"), q.get("before")
    ids = [item["id"] for item in items]
    for cursor, name in ((after, "after"), (before, "before")):
        if cursor is not None and cursor not in ids:
            raise bad_request(f"{name} must be the id of an input item of this response", param=name)
    if after is not None:
        items = items[ids.index(after) + 1:]
    if before is not None:
        items = items[:[i["id"] for i in items].index(before)] if before in [i["id"] for i in items] else []
    page = items[:limit]
    return JSONResponse({"object": "list", "data": page, "has_more": len(items) > limit,
                         "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None})


def routes() -> list[Route]:
    return [
        Route("/v1/responses", create_response, methods=["POST"]),
        Route("/v1/responses/{response_id:str}", get_response, methods=["GET"]),
        Route("/v1/responses/{response_id:str}", delete_response, methods=["DELETE"]),
        Route("/v1/responses/{response_id:str}/cancel", cancel_response, methods=["POST"]),
        Route("/v1/responses/{response_id:str}/input_items", list_input_items, methods=["GET"]),
    ]


__all__ = ["routes"]
