"""A chat's prompt token ids: messages through the chat template, or a kept token history
continued by new messages (what a session turn and a Responses follow-up both do).

Re-rendering the whole conversation through the chat template can give other tokens than the
ones the model saw (and then the prefix cache misses). So the history is kept as token ids and
only the *new* part is rendered: what closes the previous assistant message plus the new user
turn and the generation prompt, found by rendering a sentinel conversation and cutting it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from chatserve.engine.input_processor import InputProcessor
from chatserve.server.chat.protocol import ChatMessage
from chatserve.server.chat.tool_request import ToolPlan, conversation
from chatserve.server.context import ServerContext
from chatserve.server.errors import bad_request

_SENTINEL = "\x1fCHATSERVE_SENTINEL\x1f"


def continue_history(tokenizer: Any, history: list[int], messages: list[dict[str, Any]], eos_token_ids: Collection[int],
                     *, chat_template: str | None = None, **template_kwargs: Any) -> list[int]:
    """history (exactly as generated) + `messages` (a user turn, tool results, ...) and the generation
    prompt, rendered through `chat_template` (None: the model's) with `template_kwargs` (e.g. tools)."""
    before = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
    rendered = tokenizer.apply_chat_template(before, add_generation_prompt=False, tokenize=False,
                                             chat_template=chat_template, **template_kwargs)
    extended = tokenizer.apply_chat_template(before + messages, add_generation_prompt=True, tokenize=False,
                                             chat_template=chat_template, **template_kwargs)
    if _SENTINEL not in rendered or not extended.startswith(rendered):
        # A template that rewrites earlier turns: fall back to rendering the new turn on its own.
        close, new_turn = "", extended[extended.rfind(_SENTINEL) + len(_SENTINEL):]
    else:
        close = rendered[rendered.index(_SENTINEL) + len(_SENTINEL):]
        new_turn = extended[len(rendered):]
    if history and history[-1] in eos_token_ids:
        # The reply ended with the end-of-turn token itself: only what follows it is missing.
        eos_text = tokenizer.decode([history[-1]], skip_special_tokens=False)
        if close.startswith(eos_text):
            close = close[len(eos_text):]
    return list(history) + list(tokenizer.encode(close + new_turn, add_special_tokens=False))


def chat_prompt_ids(ctx: ServerContext, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None, plan: ToolPlan | None = None, *,
                    continue_final_message: bool = False) -> list[int]:
    """The messages through the chat template (a PromptError names `messages`); template_kwargs (the
    request's chat_template_kwargs) are variables for the template, as in vLLM; the plan's tools are offered.
    `continue_final_message`: the last (assistant) message is left open for the reply to continue."""
    if len(messages) > ctx.settings.max_messages:
        raise bad_request(f"at most {ctx.settings.max_messages} messages are allowed, got {len(messages)}",
                          param="messages")
    return ctx.engine.input_processor.render_chat(
        conversation(messages), add_generation_prompt=add_generation_prompt, chat_template=ctx.chat_template,
        tools=plan.template_tools() if plan is not None else None, param="messages",
        tool_parser=ctx.settings.tool_call_parser, continue_final_message=continue_final_message,
        **(template_kwargs or {}))


def next_tool_turn_ids(processor: InputProcessor, history: list[int], messages: list[dict[str, Any]],
                       eos_token_ids: Collection[int], plan: ToolPlan | None, chat_template: str | None,
                       tool_parser: str | None = None) -> list[int]:
    """history (exactly as generated, tool calls included) + the new messages and the generation prompt."""
    template = processor.tool_rendering(chat_template, tool_parser).chat_template
    kwargs: dict[str, Any] = {"tools": plan.template_tools()} if plan is not None and plan.template_tools() else {}
    return continue_history(processor.tokenizer, history, messages, eos_token_ids, chat_template=template, **kwargs)
