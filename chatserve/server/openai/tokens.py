"""`/tokenize`, `/detokenize` and `/v1/chat/completions/render`: the token view of a request, as vLLM serves it.

Routers and tools that place requests by their tokens (vLLM's router's `cache_aware` policy asks
`/v1/chat/completions/render`, then `/tokenize`) must see exactly the ids the engine will run, or
their prefix tree disagrees with our radix tree and sessions land on the wrong replica. So the
render route takes a whole chat completions body and goes through `openai.chat_prompt_and_plan`, the
one function the chat route itself uses: the two cannot drift. Same auth and body limits as `/v1`.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from chatserve.server.chat.params import build_sampling_params, check_limits
from chatserve.server.chat.protocol import StrictModel
from chatserve.server.context import get_context
from chatserve.server.errors import bad_request
from chatserve.server.http_input import parse_model, read_body, read_model, request_id_from
from chatserve.server.openai.protocol import ChatCompletionRequest
from chatserve.server.openai.routes import chat_prompt_and_plan, chat_token_ids


class TokenizePromptRequest(StrictModel):
    """vLLM's tokenize body for a plain prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's tokenize body for a conversation: a chat completions body, rendered as that route renders it."""

    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=1_000_000)]


async def tokenize(request: Request) -> JSONResponse:
    ctx = get_context(request)
    raw = await read_body(request, ctx.settings.max_body_bytes)
    body: TokenizePromptRequest | TokenizeChatRequest
    if _has_messages(raw):
        body = parse_model(TokenizeChatRequest, raw)
        ctx.check_model(body.model)
        ids, _ = await ctx.off_loop(chat_token_ids, ctx, body)  # the template and tokenizer, off the event loop
    else:
        body = parse_model(TokenizePromptRequest, raw)
        ctx.check_model(body.model)
        ids = list(await ctx.off_loop(ctx.engine.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens))
    strs = ctx.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return JSONResponse({"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids, "token_strs": strs})


def _has_messages(raw: bytes) -> bool:
    """Which of vLLM's two tokenize bodies this is (a body that is not JSON fails in parse_model)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return False
    return isinstance(data, dict) and "messages" in data


async def detokenize(request: Request) -> JSONResponse:
    ctx = get_context(request)
    body = await read_model(request, DetokenizeRequest, ctx.settings)
    ctx.check_model(body.model)
    vocab_size = ctx.engine.input_processor.vocab_size
    for i, token in enumerate(body.tokens):
        if token >= vocab_size:
            raise bad_request(f"token id {token} is outside the vocabulary (size {vocab_size})", param=f"tokens[{i}]")
    return JSONResponse({"prompt": await ctx.off_loop(ctx.engine.tokenizer.decode, body.tokens)})


async def render_chat(request: Request) -> JSONResponse:
    """A chat completions body rendered, not run: vLLM's GenerateRequest shape (`token_ids`,
    `sampling_params`), which is what vLLM's router reads. Every rule the chat route applies to
    the prompt applies here (a prompt the chat route would refuse is refused the same way)."""
    ctx = get_context(request)
    body = await read_model(request, ChatCompletionRequest, ctx.settings)
    ctx.check_model(body.model)
    check_limits(ctx.settings, body)
    prompt, _ = await ctx.off_loop(chat_prompt_and_plan, ctx, body)
    params = build_sampling_params(body, body.effective_max_tokens(), body.num_logprobs())
    return JSONResponse({
        "request_id": request_id_from(request, ctx.settings),
        "model": ctx.model_name,
        "token_ids": prompt.prompt_token_ids,
        "sampling_params": _sampling_params_json(params),
        "stream": bool(body.stream),
    })


def _sampling_params_json(params: Any) -> dict[str, Any]:
    """The sampling settings the chat route would run with, as plain JSON."""
    fields = ("n", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
              "repetition_penalty", "max_tokens", "min_tokens", "stop", "stop_token_ids", "seed", "logprobs",
              "ignore_eos", "skip_special_tokens")
    return {name: getattr(params, name) for name in fields if hasattr(params, name)}


def routes() -> list[Route]:
    return [
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/v1/chat/completions/render", render_chat, methods=["POST"]),
    ]


__all__ = ["routes"]
