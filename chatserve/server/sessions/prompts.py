"""Session turns with tools: the prompt of a turn that offers tools or hands back tool results.

The session keeps its exact token history, so a turn's prompt is that history plus only the new
part, rendered by `session_prompts.continue_history` (the sentinel cut every session turn uses), here
through the template `InputProcessor.tool_rendering` picks (the shipped xLAM template for SmolLM2),
with the new messages being tool results (`role: "tool"`) and/or a user message. A reply that
called tools is stored as the very tokens the model produced, `<tool_call>...</tool_call>`
included, so the next turn (the tool results) is a prefix-cache hit over all of it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from chatserve.engine.input_processor import InputProcessor
from chatserve.server.protocol import SessionMessageRequest
from chatserve.server.session_prompts import continue_history
from chatserve.server.tool_request import ToolPlan


def new_messages(body: SessionMessageRequest) -> list[dict[str, Any]]:
    """The turn's new messages: its tool results first (they answer the last reply's calls), then its text."""
    out: list[dict[str, Any]] = [{"role": "tool", "content": r.content, "tool_call_id": r.tool_call_id}
                                 for r in body.tool_results or []]
    if body.content:
        out.append({"role": "user", "content": body.content})
    return out


def stored_user_text(body: SessionMessageRequest) -> str:
    """What the turn's user message is stored as: its text, or its tool results when it has none."""
    if body.content:
        return body.content
    return "\n".join(f"[tool result {r.tool_call_id}] {r.content}" for r in body.tool_results or [])


def first_tool_turn_ids(processor: InputProcessor, system_prompt: str | None, messages: list[dict[str, Any]],
                        plan: ToolPlan | None, chat_template: str | None) -> list[int]:
    conversation = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages
    return processor.render_chat(conversation, add_generation_prompt=True, chat_template=chat_template,
                                 tools=plan.template_tools() if plan is not None else None, param="content")


def next_tool_turn_ids(processor: InputProcessor, history: list[int], messages: list[dict[str, Any]],
                       eos_token_ids: Collection[int], plan: ToolPlan | None, chat_template: str | None) -> list[int]:
    """history (exactly as generated, tool calls included) + the new messages and the generation prompt."""
    template = processor.tool_rendering(chat_template).chat_template
    kwargs: dict[str, Any] = {"tools": plan.template_tools()} if plan is not None and plan.template_tools() else {}
    return continue_history(processor.tokenizer, history, messages, eos_token_ids, chat_template=template, **kwargs)
