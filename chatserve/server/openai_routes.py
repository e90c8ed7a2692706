"""`/v1/chat/completions`, `/v1/completions` and `/v1/models`: OpenAI's contract, streamed or not."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.requests import Request
from starlette.responses import JSONResponse

from chatserve.engine.async_engine import EngineDeadError
from chatserve.llm import apply_chat_template
from chatserve.sampling_params import SamplingParams

from chatserve.server.errors import APIError, bad_request, error_body
from chatserve.server.formatting import chat_chunk, chat_logprobs, completion_chunk, completion_logprobs, dumps
from chatserve.server.http_utils import read_model, request_id_from
from chatserve.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest, _SamplingFields
from chatserve.server.serving import ChoiceDelta, Generation, ServerContext, run_or_disconnect


def get_ctx(request: Request) -> ServerContext:
    return request.app.state.ctx


# ---- shared pieces (also used by the session routes) ------------------------------------------------
def check_model(ctx: ServerContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(404, f"The model `{model}` does not exist. This server serves `{ctx.model_name}`.",
                       param="model", code="model_not_found")


def check_limits(ctx: ServerContext, body: _SamplingFields) -> None:
    s = ctx.settings
    if body.n > s.max_n:
        raise bad_request(f"n must be at most {s.max_n}, got {body.n}", param="n")
    check_stop_list(ctx, body.stop_list())


def check_stop_list(ctx: ServerContext, stops: list[str], param: str = "stop") -> None:
    s = ctx.settings
    if len(stops) > s.max_stop_sequences:
        raise bad_request(f"at most {s.max_stop_sequences} stop sequences are allowed, got {len(stops)}", param=param)
    if any(len(x) > s.max_stop_length for x in stops):
        raise bad_request(f"each stop sequence may have at most {s.max_stop_length} characters", param=param)
    if any(x == "" for x in stops):
        raise bad_request("stop sequences must not be empty", param=param)


def build_sampling_params(body: _SamplingFields, max_tokens: int | None, logprobs: int | None,
                          defaults: dict[str, Any] | None = None) -> SamplingParams:
    """Request fields override session defaults, which override OpenAI's defaults."""
    defaults = defaults or {}

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(body, name, None)
        if value is not None:
            return value
        return defaults.get(name, fallback)

    try:
        return SamplingParams(
            n=body.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            seed=body.seed,
            stop=body.stop_list() or defaults.get("stop"),
            stop_token_ids=body.stop_token_ids,
            ignore_eos=body.ignore_eos,
            max_tokens=max_tokens if max_tokens is not None else defaults.get("max_tokens"),
            min_tokens=body.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens,
            include_stop_str_in_output=body.include_stop_str_in_output,
            output_kind="delta",
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def fit_max_tokens(ctx: ServerContext, params: SamplingParams, num_prompt_tokens: int, explicit: bool,
                   param: str = "messages") -> None:
    """Refuse an explicit max_tokens that cannot fit; cap an implicit one to the room left."""
    ctx.check_context(num_prompt_tokens, params.max_tokens if explicit else None, param=param)
    room = ctx.max_model_len - num_prompt_tokens
    if params.max_tokens is None or params.max_tokens > room:
        params.max_tokens = room
    if params.min_tokens > params.max_tokens:
        raise bad_request(f"min_tokens={params.min_tokens} exceeds the room left in the context ({room} tokens)",
                          param="min_tokens")


def chat_prompt_ids(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool = True) -> list[int]:
    if len(messages) > ctx.settings.max_messages:
        raise bad_request(f"at most {ctx.settings.max_messages} messages are allowed, got {len(messages)}",
                          param="messages")
    conversation = [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in messages]
    try:
        return apply_chat_template(ctx.engine.get_tokenizer(), conversation, add_generation_prompt=add_generation_prompt)
    except ValueError as exc:
        raise bad_request(str(exc), param="messages") from None
    except Exception as exc:  # noqa: BLE001 - a template that raises on this conversation (jinja error)
        raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") from None


@dataclass
class ChoiceState:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    has_logprobs: bool = False

    @property
    def content(self) -> str:
        return "".join(self.text)


class Accumulator:
    """Everything a request produced so far, per choice: the non-streaming body and the session turn."""

    def __init__(self, num_choices: int) -> None:
        self.choices = [ChoiceState() for _ in range(num_choices)]

    def add(self, d: ChoiceDelta) -> None:
        c = self.choices[d.index]
        if d.text:
            c.text.append(d.text)
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            c.has_logprobs = True
            c.logprobs.extend(d.logprobs)
        if d.finish_reason:
            c.finish_reason = d.finish_reason

    def merged_delta(self, index: int) -> ChoiceDelta:
        c = self.choices[index]
        return ChoiceDelta(index, c.content, c.token_ids, c.logprobs if c.has_logprobs else None, c.finish_reason)


def sse_response(events: AsyncIterator[dict[str, Any]], ctx: ServerContext, request_id: str) -> EventSourceResponse:
    return EventSourceResponse(
        events,
        ping=ctx.settings.sse_keepalive_s,
        headers={"X-Request-Id": request_id, "Cache-Control": "no-cache"},
    )


class SSECounter:
    """Numbers the SSE events of one stream (the `id:` field)."""

    def __init__(self) -> None:
        self.n = 0

    def event(self, data: Any) -> dict[str, Any]:
        self.n += 1
        return {"id": str(self.n), "data": data if isinstance(data, str) else dumps(data)}


async def chat_events(
    gen: Generation,
    acc: Accumulator,
    *,
    cid: str,
    created: int,
    model: str,
    include_usage: bool,
    top_logprobs: int,
    on_end: Callable[[bool], Any] | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """OpenAI's chat chunk sequence. `on_end(completed)` runs once, before [DONE] or on disconnect."""
    sse = SSECounter()
    completed = False
    try:
        for i in range(len(acc.choices)):
            choice = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield sse.event(chat_chunk(cid, created, model, [choice], None, include_usage))
        try:
            async for deltas in gen.deltas():
                for d in deltas:
                    acc.add(d)
                    if d.text or (d.logprobs and d.token_ids):
                        choice = {"index": d.index, "delta": {"content": d.text},
                                  "logprobs": chat_logprobs(d, top_logprobs), "finish_reason": None}
                        yield sse.event(chat_chunk(cid, created, model, [choice], None, include_usage))
                    if d.finish_reason:
                        choice = {"index": d.index, "delta": {}, "logprobs": None, "finish_reason": d.finish_reason}
                        yield sse.event(chat_chunk(cid, created, model, [choice], None, include_usage))
        except EngineDeadError as exc:
            yield sse.event(error_body(503, str(exc), code="engine_dead"))
            return
        completed = True
        if on_end is not None:
            await on_end(True)
        if include_usage:
            yield sse.event(chat_chunk(cid, created, model, [], gen.usage.as_dict(), True))
        yield sse.event("[DONE]")
    finally:
        if not gen.finished:
            gen.close("client_disconnect")
        if not completed and on_end is not None:
            gen.ctx.spawn(on_end(False))


def chat_response(gen: Generation, acc: Accumulator, cid: str, created: int, model: str, top_logprobs: int) -> dict[str, Any]:
    choices = []
    for i, c in enumerate(acc.choices):
        choices.append({
            "index": i,
            "message": {"role": "assistant", "content": c.content, "refusal": None},
            "logprobs": chat_logprobs(acc.merged_delta(i), top_logprobs) if c.has_logprobs else None,
            "finish_reason": c.finish_reason,
        })
    return {
        "id": cid, "object": "chat.completion", "created": created, "model": model,
        "system_fingerprint": None, "choices": choices, "usage": gen.usage.as_dict(),
    }


async def collect(gen: Generation, acc: Accumulator) -> None:
    async for deltas in gen.deltas():
        for d in deltas:
            acc.add(d)


async def run_non_streaming(request: Request, gen: Generation, acc: Accumulator) -> None:
    """Collect the whole reply unless the client leaves first (then abort, and answer nobody)."""
    try:
        completed, _ = await run_or_disconnect(collect(gen, acc), request.receive)
    except EngineDeadError as exc:
        raise APIError(503, str(exc), code="engine_dead") from None
    finally:
        if not gen.finished:
            gen.close("client_disconnect")
    if not completed:
        raise APIError(499, "client closed the request")


# ---- routes --------------------------------------------------------------------------------------
async def chat_completions(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await read_model(request, ChatCompletionRequest, ctx.settings)
    request_id = request_id_from(request, ctx.settings)
    check_model(ctx, body.model)
    check_limits(ctx, body)
    ctx.check_capacity()
    prompt_ids = chat_prompt_ids(ctx, body.messages, body.add_generation_prompt)
    max_tokens = body.effective_max_tokens()
    params = build_sampling_params(body, max_tokens, body.num_logprobs())
    fit_max_tokens(ctx, params, len(prompt_ids), explicit=max_tokens is not None)
    gen = Generation(ctx, request_id, [prompt_ids], params)
    acc = Accumulator(body.n)
    cid, created = f"chatcmpl-{request_id}", int(time.time())
    top_n = body.top_logprobs or 0
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = chat_events(gen, acc, cid=cid, created=created, model=ctx.model_name,
                             include_usage=include_usage, top_logprobs=top_n)
        return sse_response(events, ctx, request_id)
    await run_non_streaming(request, gen, acc)
    return JSONResponse(chat_response(gen, acc, cid, created, ctx.model_name, top_n), headers={"X-Request-Id": request_id})


def _completion_prompts(ctx: ServerContext, body: CompletionRequest) -> tuple[list[list[int]], list[str]]:
    engine = ctx.engine.engine
    ids_list, texts = [], []
    for p in body.prompts():
        try:
            text, ids = engine.tokenize_prompt(p if isinstance(p, str) else {"prompt_token_ids": p})
        except ValueError as exc:
            raise bad_request(str(exc), param="prompt") from None
        ids_list.append(ids)
        texts.append(text if text is not None else ctx.engine.get_tokenizer().decode(ids))
    return ids_list, texts


async def completions(request: Request) -> Any:
    ctx = get_ctx(request)
    body = await read_model(request, CompletionRequest, ctx.settings)
    request_id = request_id_from(request, ctx.settings)
    check_model(ctx, body.model)
    check_limits(ctx, body)
    if len(body.prompts()) * body.n > ctx.settings.max_n:
        raise bad_request(f"prompts x n must be at most {ctx.settings.max_n}", param="prompt")
    ctx.check_capacity()
    prompts, texts = _completion_prompts(ctx, body)
    params = build_sampling_params(body, body.max_tokens, body.logprobs)
    explicit = "max_tokens" in body.model_fields_set
    for ids in prompts:
        probe = params.clone()
        fit_max_tokens(ctx, probe, len(ids), explicit=explicit, param="prompt")
    # One max_tokens for all prompts: the tightest room left (only matters when max_tokens was implicit).
    params.max_tokens = min(
        (params.max_tokens or ctx.max_model_len), *(ctx.max_model_len - len(ids) for ids in prompts)
    )
    gen = Generation(ctx, request_id, prompts, params)
    acc = Accumulator(len(prompts) * body.n)
    cid, created = f"cmpl-{request_id}", int(time.time())
    top_n = body.logprobs or 0
    echo = [texts[i // body.n] if body.echo else "" for i in range(len(acc.choices))]
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return sse_response(_completion_events(gen, acc, cid, created, ctx.model_name, include_usage, top_n, echo),
                            ctx, request_id)
    await run_non_streaming(request, gen, acc)
    choices = []
    for i, c in enumerate(acc.choices):
        choices.append({
            "index": i, "text": echo[i] + c.content,
            "logprobs": completion_logprobs(acc.merged_delta(i), top_n, len(echo[i])) if c.has_logprobs else None,
            "finish_reason": c.finish_reason,
        })
    return JSONResponse({
        "id": cid, "object": "text_completion", "created": created, "model": ctx.model_name,
        "system_fingerprint": None, "choices": choices, "usage": gen.usage.as_dict(),
    }, headers={"X-Request-Id": request_id})


async def _completion_events(gen: Generation, acc: Accumulator, cid: str, created: int, model: str,
                             include_usage: bool, top_n: int, echo: list[str]) -> AsyncIterator[dict[str, Any]]:
    sse = SSECounter()
    offsets = [len(e) for e in echo]
    try:
        for i, e in enumerate(echo):
            if e:
                choice = {"index": i, "text": e, "logprobs": None, "finish_reason": None}
                yield sse.event(completion_chunk(cid, created, model, [choice], None, include_usage))
        try:
            async for deltas in gen.deltas():
                for d in deltas:
                    acc.add(d)
                    if d.text or (d.logprobs and d.token_ids) or d.finish_reason:
                        lp = completion_logprobs(d, top_n, offsets[d.index]) if d.logprobs is not None else None
                        offsets[d.index] += len(d.text)
                        choice = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
                        yield sse.event(completion_chunk(cid, created, model, [choice], None, include_usage))
        except EngineDeadError as exc:
            yield sse.event(error_body(503, str(exc), code="engine_dead"))
            return
        if include_usage:
            yield sse.event(completion_chunk(cid, created, model, [], gen.usage.as_dict(), True))
        yield sse.event("[DONE]")
    finally:
        if not gen.finished:
            gen.close("client_disconnect")


async def list_models(request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    return JSONResponse({"object": "list", "data": [{
        "id": ctx.model_name, "object": "model", "created": ctx.started_at,
        "owned_by": "chatserve", "max_model_len": ctx.max_model_len,
    }]})


async def cancel_request(request: Request) -> JSONResponse:
    ctx = get_ctx(request)
    rid = request.path_params["request_id"]
    rec = ctx.tracker.get(rid)
    if rec is None:
        raise APIError(404, f"no request with id {rid!r} is running or finished recently", param="request_id",
                       code="request_not_found")
    if not rec.finished and rec.owner is not None:
        await rec.owner.cancel()
    return JSONResponse(rec.final_state())
