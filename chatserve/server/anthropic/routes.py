"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the serving pipeline.

The route is parse-then-serve, like every API here: `MessagesAdapter` hands the pipeline
(`server/pipeline.py`) the prompt (`prompt.render`: the billing header dropped, inline system
turns in place, cache_control breakpoints located), the sampling fields in the shared vocabulary,
and Anthropic's output: `message_start` (with the prompt's cache counts), content block events,
`message_delta` with the stop reason and the final usage, `message_stop`; a real `ping` event as
the keepalive; an `event: error` frame for a failure after the headers. Errors before the stream
leave in Anthropic's shape (`errors.py`). A closed connection aborts the request within a step,
and the request's id (`msg_...`) is the one the cancel endpoint takes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from chatserve.core.cache_lease import CacheLease
from chatserve.engine.async_engine import EngineDeadError
from chatserve.server.anthropic.errors import anthropic_errors, error_event
from chatserve.server.anthropic.events import AnthropicUsage, MessageBuilder, Ping, new_id, sse, stop_reason
from chatserve.server.anthropic.prompt import Breakpoint, RenderedMessages, render
from chatserve.server.anthropic.protocol import CountTokensRequest, MessagesBase, MessagesRequest
from chatserve.server.anthropic.thinking import reasoning_request, template_kwargs, with_verified_thinking
from chatserve.server.chat.choices import Accumulator
from chatserve.server.chat.generation import Generation
from chatserve.server.chat.params import check_stop_list
from chatserve.server.chat.protocol import SamplingFields
from chatserve.server.chat.replies import collect_reply
from chatserve.server.context import ServerContext, get_context
from chatserve.server.errors import APIError, JSONResponse, bad_request
from chatserve.server.http_input import read_model, request_id_from
from chatserve.server.pipeline import FieldNames, ServeSpec, ServingAdapter, serve
from chatserve.server.streams.sse import sse_response

_FIELDS = {"stop": "stop_sequences", "response_format.json_schema.schema": "output_config.format.schema",
           "response_format": "output_config.format"}


def _ours(param: str) -> str:
    """A shared step's field name as the Messages API spells it."""
    if param in _FIELDS:
        return _FIELDS[param]
    return param.replace(".function.parameters", ".input_schema")  # tools.0.function.parameters -> tools.0.input_schema


def _message_id(request: Request) -> str:
    """`msg_` + the client's X-Request-Id (checked as everywhere) or 24 random characters: the id the
    reply carries, the `request-id` header and the cancel endpoint's key."""
    if request.headers.get("x-request-id"):
        return "msg_" + request_id_from(request, get_context(request).settings)
    return new_id("msg_")


def _too_long(num_tokens: int, limit: int) -> APIError:
    # Anthropic's wording, which clients (Claude Code's auto-compaction) look for: no field prefix
    return bad_request(f"prompt is too long: {num_tokens} tokens > {limit - 1} maximum", code="context_length_exceeded")


class MessagesAdapter(ServingAdapter):
    names = FieldNames(prompt="messages", rename=_ours)

    def __init__(self, body: MessagesRequest, message_id: str) -> None:
        super().__init__(message_id, body.model)
        self.body = body

    def admit(self, ctx: ServerContext) -> None:
        check_stop_list(ctx.settings, self.body.stop_sequences or [], param="stop_sequences")

    async def prepare(self, ctx: ServerContext) -> ServeSpec:
        body = self.body
        rendered = await ctx.off_loop(_render, ctx, body)  # off the loop
        if len(rendered.ids) >= ctx.max_model_len:
            raise _too_long(len(rendered.ids), ctx.max_model_len)
        leases = [CacheLease(bp.position, bp.ttl_s) for bp in rendered.breakpoints]
        return ServeSpec([rendered.ids], _sampling_fields(body), body.max_tokens, None, tools=rendered.plan,
                         refuse_overflow=False, cache_leases=leases, reasoning=reasoning_request(body, ctx.reasoning_parser),
                         extra={"breakpoints": rendered.breakpoints})

    async def respond(self, request: Request, ctx: ServerContext, gen: Generation, spec: ServeSpec) -> Response:
        omit = self.body.thinking is not None and self.body.thinking.omitted
        signer = ctx.reasoning_signer
        builder = MessageBuilder(self.request_id, ctx.model_name, spec.tools,
                                 signature=signer.seal if omit else signer.sign, omit_thinking=omit)
        reply = MessageReply(ctx, gen, builder, spec.extra["breakpoints"])
        headers = {"request-id": self.request_id, "X-Request-Id": self.request_id}
        if self.body.stream:
            return sse_response(reply.events(), keepalive_s=ctx.settings.sse_keepalive_s, headers=headers,
                                numbered=False, keepalive=Ping)
        acc = Accumulator(1)
        await collect_reply(request, gen, acc)
        return JSONResponse(reply.whole(acc), headers=headers)


def _render(ctx: ServerContext, body: MessagesBase, with_breakpoints: bool = True) -> RenderedMessages:
    """The prompt, once every thinking block's signature has been checked (a 400 naming it otherwise)."""
    return render(with_verified_thinking(body, ctx.reasoning_signer), ctx.engine.input_processor, ctx.chat_template,
                  with_breakpoints=with_breakpoints, tool_parser=ctx.settings.tool_call_parser,
                  template_kwargs=template_kwargs(body))


def _sampling_fields(body: MessagesRequest) -> SamplingFields:
    """The request's sampling in the shared vocabulary (checked already; Anthropic's defaults: temperature 1)."""
    raw: dict[str, Any] = {"stream": body.stream, "max_tokens": body.max_tokens}
    if body.temperature is not None:
        raw["temperature"] = body.temperature
    if body.top_p is not None:
        raw["top_p"] = body.top_p
    if body.top_k:  # 0: no top-k
        raw["top_k"] = body.top_k
    if body.stop_sequences:
        raw["stop"] = body.stop_sequences
    if body.cache_salt is not None:
        raw["cache_salt"] = body.cache_salt
    schema = body.json_schema()
    if schema is not None:
        raw["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": schema[0]}}
    try:
        return SamplingFields.model_validate(raw)
    except ValidationError as exc:  # not reachable with a body that passed MessagesRequest; said plainly if it is
        raise bad_request(f"the request's sampling fields are invalid: {exc.errors()[0].get('msg')}") from None


class MessageReply:
    """One message's output: the stream's events, or the whole message, from the same `MessageBuilder`."""

    def __init__(self, ctx: ServerContext, gen: Generation, builder: MessageBuilder, breakpoints: list[Breakpoint]) -> None:
        self.ctx = ctx
        self.gen = gen
        self.builder = builder
        self.breakpoints = sorted(breakpoints, key=lambda b: b.position)
        self.finish_reason: str | None = None
        self.matched: str | int | None = None

    def usage(self) -> AnthropicUsage:
        gen = self.gen
        cached = gen.usage.cached_tokens if gen.finished else gen.cached_tokens_so_far
        usage = AnthropicUsage(gen.usage.prompt_tokens, cached, gen.usage.completion_tokens)
        start = cached
        for bp in self.breakpoints:  # what each breakpoint adds beyond what was cached, under its ttl
            added = max(min(bp.position, usage.prompt_tokens) - start, 0)
            start += added
            if bp.ttl_s > 300:
                usage.creation_1h += added
            else:
                usage.creation_5m += added
        return usage

    def _stop(self) -> tuple[str, str | None]:
        gen = self.gen
        context_full = gen.usage.prompt_tokens + gen.usage.completion_tokens >= self.ctx.max_model_len
        reason = stop_reason(self.finish_reason, self.matched, self.builder.called, context_full)
        return reason, self.matched if reason == "stop_sequence" and isinstance(self.matched, str) else None

    async def events(self) -> AsyncIterator[dict[str, Any]]:
        gen, builder = self.gen, self.builder
        started = False
        try:
            try:
                async for deltas in gen.deltas():
                    for d in deltas:
                        if not started:  # the first output carries the prompt's cache hit
                            started = True
                            yield sse({"type": "message_start", "message": builder.message(self.usage(), None, None,
                                                                                              content=False)})
                        if d.finish_reason == "error":
                            yield sse(error_event(500, f"generation failed: {d.error or 'unknown error'}", gen.request_id))
                            return
                        for event in builder.feed(d.text, d.reasoning):
                            yield sse(event)
                        if d.finish_reason:
                            self.finish_reason, self.matched = d.finish_reason, d.stop_reason
            except EngineDeadError as exc:
                yield sse(error_event(500, str(exc), gen.request_id))
                return
            if not started:
                yield sse({"type": "message_start", "message": builder.message(self.usage(), None, None, content=False)})
            for event in builder.finish(truncated=self.finish_reason == "length"):
                yield sse(event)
            reason, sequence = self._stop()
            yield sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                       "usage": self.usage().as_dict()})
            yield sse({"type": "message_stop"})
        finally:
            if not gen.finished:
                gen.close("client_disconnect")

    def whole(self, acc: Accumulator) -> dict[str, Any]:
        choice = acc.choices[0]
        self.finish_reason = choice.finish_reason
        self.matched = choice.stop_reason
        self.builder.feed(choice.content, choice.reasoning_text)
        self.builder.finish(truncated=choice.finish_reason == "length")
        reason, sequence = self._stop()
        return self.builder.message(self.usage(), reason, sequence)


@anthropic_errors
async def create_message(request: Request) -> Response:
    ctx = get_context(request)
    message_id = _message_id(request)
    request.state.anthropic_request_id = message_id
    body = await read_model(request, MessagesRequest, ctx.settings)
    return await serve(request, MessagesAdapter(body, message_id))


@anthropic_errors
async def count_tokens(request: Request) -> Response:
    """The prompt's token count as `/v1/messages` would run it (billing header dropped, tools rendered)."""
    ctx = get_context(request)
    body = await read_model(request, CountTokensRequest, ctx.settings)
    ctx.check_model(body.model)
    rendered = await ctx.off_loop(_render, ctx, body, False)
    return JSONResponse({"input_tokens": len(rendered.ids)})


def routes() -> list[Route]:
    return [
        Route("/v1/messages", create_message, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
    ]


__all__ = ["routes"]
