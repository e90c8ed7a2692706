"""`/v1/chat/completions` and `/v1/completions`: OpenAI's contract, streamed or not (`/v1/models`: server/models.py).

Each POST route is parse-then-serve: the body is validated, and an adapter hands the serving
pipeline (`server/pipeline.py`) what only this API knows: its limits and stream policy, its prompt
builder (the chat template for chat, the prompts as sent for completions) and its output format
(OpenAI's chunks and bodies, `chat/chunks.py`).
"""

from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from chatserve.engine.input_processor import ProcessedPrompt
from chatserve.server.chat.choices import Accumulator
from chatserve.server.chat.chunks import ChatFormat, CompletionFormat, ReplyFormat
from chatserve.server.chat.generation import Generation
from chatserve.server.chat.params import check_limits
from chatserve.server.chat.prompts import chat_prompt_ids
from chatserve.server.chat.replies import collect_reply, logged_stream, stream_events, stream_policy
from chatserve.server.chat.tool_replies import ToolChatFormat
from chatserve.server.chat.tool_request import ToolPlan, plan_tools
from chatserve.server.context import ServerContext, get_context
from chatserve.server.errors import APIError, JSONResponse, bad_request
from chatserve.server.http_input import read_model, request_id_from
from chatserve.server.openai.fim import fim_prompt
from chatserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from chatserve.server.pipeline import FieldNames, ReasoningRequest, ServeSpec, ServingAdapter, serve
from chatserve.server.streams.event_log import event_log_errors
from chatserve.server.streams.resume import MAX_ID_LEN, cursor, follow_sse
from chatserve.server.streams.runs import DisconnectPolicy
from chatserve.server.streams.sse import sse_response


def chat_token_ids(ctx: ServerContext, body: ChatCompletionRequest) -> tuple[list[int], ToolPlan | None]:
    """A chat body's prompt ids through the template, and its tool plan: the one rendering that the chat
    route and the render/tokenize routes (openai/tokens.py) share, so a router's view of our tokens cannot drift."""
    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls, ctx.engine.input_processor,
                      ctx.chat_template, ctx.settings.tool_call_parser)
    ids = chat_prompt_ids(ctx, body.messages, body.add_generation_prompt, body.chat_template_kwargs, plan,
                          continue_final_message=body.continue_final_message)
    return ctx.engine.input_processor.truncate(ids, body.truncate_prompt_tokens), plan


def chat_prompt_and_plan(ctx: ServerContext, body: ChatCompletionRequest) -> tuple[ProcessedPrompt, ToolPlan | None]:
    """The exact prompt a chat body runs as (every rule checked, with the reply's budget) and its tool plan."""
    ids, plan = chat_token_ids(ctx, body)
    prompt = ctx.engine.input_processor.process({"prompt_token_ids": ids}, max_tokens=body.effective_max_tokens(),
                                                param="messages")
    return prompt, plan


class ChatAdapter(ServingAdapter):
    """`/v1/chat/completions` over the serving pipeline."""

    def __init__(self, body: ChatCompletionRequest, request_id: str) -> None:
        super().__init__(request_id, body.model)
        self.body = body
        self.policy: DisconnectPolicy | None = None

    def admit(self, ctx: ServerContext) -> None:
        check_limits(ctx.settings, self.body)
        self.policy = stream_policy(ctx, self.body)

    async def prepare(self, ctx: ServerContext) -> ServeSpec:
        body = self.body
        ids, plan = await ctx.off_loop(chat_token_ids, ctx, body)  # the template and tokenizer, off the event loop
        return ServeSpec([ids], body, body.effective_max_tokens(), body.num_logprobs(), tools=plan,
                         reasoning=ReasoningRequest(effort=body.reasoning_effort, enable_thinking=body.enable_thinking()))

    async def respond(self, request: Request, ctx: ServerContext, gen: Generation, spec: ServeSpec) -> Response:
        body, plan = self.body, spec.tools
        cid, created, top = f"chatcmpl-{self.request_id}", int(time.time()), body.top_logprobs or 0
        reasons = gen.params.reasoning is not None  # reasoning split off: sent under both of its names
        fmt = ToolChatFormat(cid, created, ctx.model_name, top, plan, reasoning=reasons) \
            if plan is not None and plan.parses_calls else ChatFormat(cid, created, ctx.model_name, top, reasoning=reasons)
        fmt.echo = chat_echo(body)
        fmt.token_ids_as_text = body.return_tokens_as_token_ids
        if body.prompt_logprobs is not None:
            fmt.prompt_logprobs, fmt.choices_per_prompt = gen.prompt_logprobs, body.n
        return await respond(request, ctx, body, self.request_id, gen, Accumulator(body.n), fmt, self.policy)


class CompletionAdapter(ServingAdapter):
    """`/v1/completions` over the serving pipeline: several prompts, each with `n` choices."""

    names = FieldNames(prompt="prompt")

    def __init__(self, body: CompletionRequest, request_id: str) -> None:
        super().__init__(request_id, body.model)
        self.body = body
        self.policy: DisconnectPolicy | None = None

    def admit(self, ctx: ServerContext) -> None:
        body = self.body
        check_limits(ctx.settings, body)
        if len(body.prompts()) * body.n > ctx.settings.max_n:
            raise bad_request(f"prompts x n must be at most {ctx.settings.max_n}", param="prompt")
        self.policy = stream_policy(ctx, body)

    async def prepare(self, ctx: ServerContext) -> ServeSpec:
        body = self.body
        prompts = await ctx.off_loop(completion_prompts, ctx, body)  # tokenizing, off the event loop
        # an explicit max_tokens must fit beside each prompt; the default (16) is only lowered
        return ServeSpec(prompts, body, body.max_tokens, body.logprobs,
                         refuse_overflow="max_tokens" in body.model_fields_set)

    async def respond(self, request: Request, ctx: ServerContext, gen: Generation, spec: ServeSpec) -> Response:
        body = self.body
        acc = Accumulator(len(gen.prompts) * body.n)
        texts = [_prompt_text(ctx, p) if body.echo else "" for p in gen.prompts]
        echo = [texts[i // body.n] for i in range(len(acc.choices))]
        fmt = CompletionFormat(f"cmpl-{self.request_id}", int(time.time()), ctx.model_name, body.logprobs or 0, echo)
        fmt.token_ids_as_text = body.return_tokens_as_token_ids
        if body.prompt_logprobs is not None:
            fmt.prompt_logprobs, fmt.choices_per_prompt = gen.prompt_logprobs, body.n
        return await respond(request, ctx, body, self.request_id, gen, acc, fmt, self.policy)


def chat_echo(body: ChatCompletionRequest) -> str:
    """What chat `echo` puts before the reply, as vLLM: the last message's content when that message has the
    reply's role (the assistant's; with add_generation_prompt false, the last message's own), else nothing."""
    if not body.echo:
        return ""
    last = body.messages[-1]
    role = "assistant" if body.add_generation_prompt else last.role
    return last.text() if last.role == role else ""


def completion_prompts(ctx: ServerContext, body: CompletionRequest) -> list[str | list[int]]:
    """The prompts as the engine runs them: as sent; with `suffix`, each as a fill-in-the-middle prompt
    (openai/fim.py); with `truncate_prompt_tokens`, each cut to its last tokens (the suffix kept whole)."""
    prompts = body.prompts()
    keep = body.truncate_prompt_tokens
    if body.suffix is None and keep is None:
        return prompts
    processor, tokenizer = ctx.engine.input_processor, ctx.engine.tokenizer
    out: list[str | list[int]] = []
    for prompt in prompts:
        ids = prompt if isinstance(prompt, list) else list(tokenizer.encode(prompt))
        ids = processor.truncate(ids, keep)
        out.append(fim_prompt(tokenizer, ctx.model_name, ids, body.suffix) if body.suffix is not None else ids)
    return out


async def chat_completions(request: Request) -> Response:
    ctx = get_context(request)
    body = await read_model(request, ChatCompletionRequest, ctx.settings)
    return await serve(request, ChatAdapter(body, request_id_from(request, ctx.settings)))


async def completions(request: Request) -> Response:
    ctx = get_context(request)
    body = await read_model(request, CompletionRequest, ctx.settings)
    return await serve(request, CompletionAdapter(body, request_id_from(request, ctx.settings)))


async def respond(request: Request, ctx: ServerContext, body: ChatCompletionRequest | CompletionRequest, request_id: str,
                  gen: Generation, acc: Accumulator, fmt: ReplyFormat, policy: DisconnectPolicy | None) -> Response:
    """The reply to a chat or completions request: an SSE stream (logged as a run under the reply's id
    when `policy` is set: resumable), or one JSON body once done."""
    headers = {"X-Request-Id": request_id}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = stream_events(gen, acc, fmt, include_usage=include_usage)
        if policy is not None:
            return logged_stream(ctx, fmt.cid, events, policy=policy, gen=gen, headers=headers)
        return sse_response(events, keepalive_s=ctx.settings.sse_keepalive_s, headers=headers, numbered=False)
    await collect_reply(request, gen, acc)
    return JSONResponse(fmt.reply(acc, gen.usage), headers=headers)


def _prompt_text(ctx: ServerContext, prompt: ProcessedPrompt) -> str:
    """What `echo` repeats: the prompt as sent, or its token ids decoded."""
    return prompt.prompt if prompt.prompt is not None else ctx.engine.tokenizer.decode(prompt.prompt_token_ids)


async def resume_stream(request: Request) -> Response:
    ctx = get_context(request)
    run_id = request.path_params["stream_id"]
    prefix = "cmpl-" if request.url.path.startswith("/v1/completions/") else "chatcmpl-"
    if not run_id.startswith(prefix) or len(run_id) > MAX_ID_LEN or not run_id.isprintable():
        raise APIError(404, f"no resumable stream {run_id[:MAX_ID_LEN]!r} (ids start with {prefix!r})",
                       param="id", code="not_found")
    after, param = cursor(request)
    with event_log_errors(param):
        info = await ctx.runs.info(run_id)
    if info is None:
        raise APIError(404, f"no resumable stream {run_id!r}: it was not resumable (stream_options.resumable or "
                       f"disconnect_policy 'detach'), or its events expired", param="id", code="not_found")
    if after + 1 < info.first_seq:
        raise bad_request(f"events after {after} are no longer kept (the oldest kept is {info.first_seq})",
                          param=param, code="cursor_expired")
    # NOTE: only an ended log can say a cursor is too far: while the run goes on, the shared log may lag
    # the replica's own mirror (whose ids the client saw) by the batch in flight, so the reader waits.
    if info.ended is not None and after >= info.next_seq:
        raise bad_request(f"{param} {after} is beyond the stream's last event ({info.next_seq - 1})", param=param)
    return sse_response(follow_sse(ctx.runs, run_id, after), keepalive_s=ctx.settings.sse_keepalive_s,
                        headers={"X-Request-Id": run_id.split("-", 1)[1]}, numbered=True)


def routes() -> list[Route]:
    return [
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        # a logged stream read back (streams/resume.py); session turns resume by their chatcmpl- id too
        Route("/v1/chat/completions/{stream_id}/stream", resume_stream, methods=["GET"]),
        Route("/v1/completions/{stream_id}/stream", resume_stream, methods=["GET"]),
    ]


__all__ = ["routes"]
