"""The one serving pipeline under every API that generates: admission to response, once.

Chat and text completions, a session turn, a Responses call and an Anthropic Messages call all
walk the same sequence, and it lives here only:

    check the model  ->  the API's own limits and stream policy (`admit`)  ->  capacity
    ->  the API's prompt builder (`prepare`: render, tokenize, tools, session lock, ...)
    ->  the prompt checks and the reply's budget  ->  sampling parameters  ->  fit max_tokens
    ->  the reasoning config (`ReasoningRequest`: the server's parser, the API's effort fields, the prompt)
    ->  the output constraint (compiled before anything is queued)  ->  `Generation`
    ->  the API's output format (`respond`: SSE events or one body)

Nothing a client sends holds the event loop: the synchronous work on a request's own input (its
chat template, tokenizing, the JSON-schema checks) runs on the context's worker threads
(`ctx.off_loop`), the grammar compiles on the compiler's pool with a time limit
(`--grammar-compile-timeout-s`), a request being prepared counts against the queue limit, and a
client that leaves while its request is prepared ends that work (a queued grammar compile included).

An API is a `ServingAdapter`: it parses its body, supplies the prompt builder, says how its
fields are named (`FieldNames`, so an error about `max_tokens` says `max_output_tokens` on the
Responses API), and formats the output. Nothing else of the sequence is an adapter's to repeat.
Each route is then parse-then-`serve` (as SGLang's `serving_base.py` and vLLM's
`entrypoints/openai/engine/serving.py` are).
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from chatserve.core.cache_lease import CacheLease
from chatserve.core.session_kv import SessionKV
from chatserve.engine.input_processor import ProcessedPrompt, PromptError
from chatserve.reasoning import ReasoningConfig, reasoning_config_for
from chatserve.sampling_params import SamplingParams
from chatserve.server.chat.generation import Generation
from chatserve.server.chat.params import build_sampling_params, cap_max_tokens
from chatserve.server.chat.protocol import SamplingFields
from chatserve.server.chat.structured import Constraint, check_constraint, request_constraint
from chatserve.server.chat.tool_request import ToolPlan
from chatserve.server.context import ServerContext, get_context
from chatserve.server.errors import APIError
from chatserve.server.streams.sse import run_or_disconnect

Prompt = str | list[int]
"""One prompt as an API hands it over: text to tokenize, or exact token ids (a rendered chat)."""


def _same(param: str) -> str:
    return param


@dataclass(frozen=True)
class FieldNames:
    """How one API names the request fields that the shared steps' errors point at."""

    prompt: str = "messages"
    """The field a prompt error names (`messages`, `prompt`, `input`, `content`, ...)."""
    max_tokens: str = "max_tokens"
    """The reply's budget (`max_output_tokens` on the Responses API)."""
    rename: Callable[[str], str] = _same
    """Any other field the shared steps name (a constraint's `tools.0.function.parameters`, ...) in this API's words."""

    def apply(self, exc: APIError) -> APIError:
        """`exc` (raised by a shared step in chat's vocabulary) in this API's words."""
        if exc.param is None:
            return exc
        ours = self.max_tokens if exc.param == "max_tokens" else self.rename(exc.param)
        if ours != exc.param:
            exc.message = re.sub(rf"\b{re.escape(exc.param)}\b", ours, exc.message)
            exc.param = ours
        return exc


@dataclass(frozen=True)
class ReasoningRequest:
    """What one request asks of the model's reasoning, in the budget table's terms (chatserve/reasoning/budget.py).

    Every adapter of an API that can carry reasoning sets one (all None: the template's and the model's
    default); the pipeline turns it into the engine's `ReasoningConfig` against the server's parser
    (`ctx.reasoning_parser`) and the rendered prompt (`starts_in_reasoning`: does it end in the opening
    marker), in `reasoning_config`.
    """

    effort: str | None = None
    """OpenAI `reasoning_effort` / Responses `reasoning.effort` / Messages `output_config.effort`."""
    budget_tokens: int | None = None
    """Messages `thinking.budget_tokens`."""
    enable_thinking: bool | None = None
    """`chat_template_kwargs.enable_thinking` (the template already rendered with it)."""
    api: str = "openai"
    """Whose effort names `effort` uses ("openai", "responses" or "messages": budget.budget_for_effort)."""
    param: str = "reasoning_effort"
    """The field an error about it names."""

    def asks_to_reason(self) -> bool:
        """Whether the request asks for reasoning a model without a parser cannot give ("none": it does not)."""
        return self.effort not in (None, "none") or bool(self.budget_tokens)


PROMPT_TAIL_TOKENS = 16
"""How many of the prompt's last tokens are decoded to see whether it ends inside an open reasoning block."""


def reasoning_config(ctx: ServerContext, asked: ReasoningRequest | None, prompt_ids: list[int]) -> ReasoningConfig | None:
    """The engine's reasoning config for one request: None when the server has no parser (then asking to
    reason is a 400 naming the field: the model does not reason unless --reasoning-parser forces a parser)."""
    if asked is None:
        return None
    if ctx.reasoning_parser is None:
        if asked.asks_to_reason():
            raise APIError(400, f"this server does not support {asked.param} (this model does not reason: its chat "
                                f"template shows no reasoning markers; start the server with --reasoning-parser "
                                f"to force one); leave {asked.param} out or send null",
                           param=asked.param, code="unsupported_field")
        return None
    tail = ctx.engine.tokenizer.decode(prompt_ids[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    try:
        return reasoning_config_for(ctx.reasoning_parser, tail, effort=asked.effort, budget_tokens=asked.budget_tokens,
                                    enable_thinking=asked.enable_thinking, api=asked.api)
    except ValueError as exc:
        raise APIError(400, str(exc), param=asked.param) from None


@dataclass
class ServeSpec:
    """What one request asks the engine for, whichever API it came through: the pipeline's one request form."""

    prompts: list[Prompt]
    fields: SamplingFields
    """The sampling fields (temperature, stop, response_format, ...), in the shared vocabulary."""
    max_tokens: int | None
    """The reply's budget; None fills the room the prompt leaves."""
    logprobs: int | None = None
    tools: ToolPlan | None = None
    defaults: dict[str, Any] | None = None
    """Sampling defaults under the request's own fields (a session's)."""
    refuse_overflow: bool = True
    """An explicit `max_tokens` that does not fit beside the prompt is a 400 (OpenAI's rule); False
    clamps it to the room left instead (Anthropic's clients ask for far more than any window)."""
    session: SessionKV | None = None
    cache_leases: list[CacheLease] = field(default_factory=list)
    """Prefixes of the prompt to keep cached after the request (`cache_control`, `prompt_cache_key`)."""
    reasoning: ReasoningRequest | None = None
    """What the request asks of the model's reasoning; None: an API that does not reason (text completions)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """What the adapter's `respond` needs from `prepare` (its own values; the pipeline never reads them)."""


async def start_generation(ctx: ServerContext, request_id: str, spec: ServeSpec, names: FieldNames) -> Generation:
    """The shared middle of every request: prompt checks, parameters, budget, constraint, then the engine."""
    try:
        prompts, params, constraint = await ctx.off_loop(_checked, ctx, spec, names)
        if constraint is not None:
            params.structured_outputs = constraint.params
            # a grammar that cannot compile (or not in time): 400, nothing queued
            await check_constraint(ctx.engine, constraint, params, timeout_s=ctx.settings.grammar_compile_timeout_s)
    except PromptError as exc:
        raise names.apply(APIError(400, str(exc), param=exc.param, code=exc.code)) from None
    except APIError as exc:
        raise names.apply(exc) from None
    salt, leases = _cache_options(spec)
    return Generation(ctx, request_id, prompts, params, session=spec.session, cache_salt=salt, cache_leases=leases)


def _checked(ctx: ServerContext, spec: ServeSpec,
             names: FieldNames) -> tuple[list[ProcessedPrompt], SamplingParams, Constraint | None]:
    """The synchronous part (a worker thread runs it): tokenize and check the prompts, build the
    parameters and fit max_tokens, and the output constraint with its schemas checked."""
    budget = spec.max_tokens if spec.refuse_overflow else None
    prompts = [_process(ctx, p, budget, names.prompt) for p in spec.prompts]
    params = build_sampling_params(spec.fields, spec.max_tokens, spec.logprobs, spec.defaults)
    ctx.engine.input_processor.check_params(params)  # token ids in the vocabulary, priority: a 400 naming the field
    # One max_tokens for all prompts: the room the longest leaves (only lowers one that may be lowered).
    cap_max_tokens(params, ctx.max_model_len, max(p.num_tokens for p in prompts))
    # (an API that reasons has one prompt; its config, like the parameters, is the request's)
    params.reasoning = reasoning_config(ctx, spec.reasoning, prompts[0].prompt_token_ids)
    return prompts, params, request_constraint(spec.fields, spec.tools)


RETENTION_S = {"in_memory": 300.0, "24h": 86400.0}
"""How long `prompt_cache_key` leases a prompt's prefix, by `prompt_cache_retention` (in memory: Anthropic's 5 minutes)."""


def _cache_options(spec: ServeSpec) -> tuple[str | None, list[CacheLease]]:
    """The request's salt (`cache_salt`: share cached KV only with the same salt, on every tier) and its
    leases: the adapter's (Anthropic's breakpoints), else `prompt_cache_key`'s, the whole prompt as one
    breakpoint at its end would lease it."""
    fields = spec.fields
    leases = list(spec.cache_leases)
    if not leases and fields.prompt_cache_key:
        leases = [CacheLease(MAX_LEASE_POSITION, RETENTION_S[fields.prompt_cache_retention or "in_memory"])]
    return fields.cache_salt, leases


MAX_LEASE_POSITION = 2**31 - 1
"""A lease position past any prompt: the whole prompt."""


def _process(ctx: ServerContext, prompt: Prompt, max_tokens: int | None, param: str) -> ProcessedPrompt:
    raw = prompt if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    return ctx.engine.input_processor.process(raw, max_tokens=max_tokens, param=param)


class ServingAdapter(ABC):
    """One API over the pipeline: its body (already parsed), its prompt builder, its names, its output."""

    names: FieldNames = FieldNames()

    def __init__(self, request_id: str, model: str | None) -> None:
        self.request_id = request_id
        self.model = model

    def admit(self, ctx: ServerContext) -> None:  # noqa: B027 - an optional step
        """The API's own refusals before any work (its limits, its stream policy); capacity comes next."""

    @abstractmethod
    async def prepare(self, ctx: ServerContext) -> ServeSpec:
        """The prompt builder: the request in the pipeline's form (render and tokenize, plan tools, ...)."""

    async def abandon(self) -> None:  # noqa: B027 - an optional step
        """Undo what `prepare` took (a session's turn lock) when the request fails before it starts."""

    @abstractmethod
    async def respond(self, request: Request, ctx: ServerContext, gen: Generation, spec: ServeSpec) -> Response:
        """The output format: stream `gen` as this API's events, or collect it into this API's body."""


async def serve(request: Request, adapter: ServingAdapter) -> Response:
    """Run one request through the pipeline (see the module docstring for the sequence)."""
    ctx = get_context(request)
    ctx.check_model(adapter.model)
    adapter.admit(ctx)
    ctx.check_capacity()

    async def prepare_and_start() -> tuple[ServeSpec, Generation]:
        spec = await adapter.prepare(ctx)
        return spec, await start_generation(ctx, adapter.request_id, spec, adapter.names)

    ctx.preparing += 1  # counted by check_capacity until the engine has it
    try:
        completed, result = await run_or_disconnect(prepare_and_start(), request.receive)
    except BaseException:
        await adapter.abandon()
        raise
    finally:
        ctx.preparing -= 1
    if not completed:  # the client left before its request reached the engine: nothing runs
        await adapter.abandon()
        raise APIError(499, "client closed the request")
    spec, gen = result
    return await adapter.respond(request, ctx, gen, spec)


__all__ = ["FieldNames", "Prompt", "ReasoningRequest", "ServeSpec", "ServingAdapter", "reasoning_config", "serve",
           "start_generation"]
