"""A session turn's prompt: the session's exact token history plus only the new part.

Re-rendering the whole conversation can give other tokens than the ones the model saw (and then
the prefix cache misses), so a turn continues the stored tokens by `chat/prompts.py`'s
`continue_history` (the sentinel cut). A turn that offers tools or hands back tool results
renders through the template `InputProcessor.tool_rendering` picks (the shipped xLAM template for
SmolLM2), with the new messages being tool results (`role: "tool"`) and/or a user message. A
reply that called tools is stored as the very tokens the model produced,
`<tool_call>...</tool_call>` included, so the next turn (the tool results) is a prefix-cache hit
over all of it.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from chatserve.engine.input_processor import InputProcessor
from chatserve.server.chat.prompts import continue_history
from chatserve.server.chat.tool_request import ToolPlan
from chatserve.server.sessions.protocol import SessionMessageRequest


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


def first_turn_ids(input_processor: InputProcessor, system_prompt: str | None, content: str,
                   chat_template: str | None = None) -> list[int]:
    """No history yet: the whole conversation through the template (`chat_template`: --chat-template's,
    None the model's; PromptError names `content`)."""
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": content}
    ]
    return input_processor.render_chat(messages, add_generation_prompt=True, chat_template=chat_template,
                                       param="content")


def next_turn_ids(tokenizer: Any, history: list[int], content: str, eos_token_ids: Collection[int],
                  chat_template: str | None = None) -> list[int]:
    """history (prompt + reply of the last turn, exactly as generated: a reasoning model's thinking
    included, markers and all) + the new user turn through `chat_template` (None: the model's)."""
    return continue_history(tokenizer, history, [{"role": "user", "content": content}], eos_token_ids,
                            chat_template=chat_template)


def first_tool_turn_ids(processor: InputProcessor, system_prompt: str | None, messages: list[dict[str, Any]],
                        plan: ToolPlan | None, chat_template: str | None, tool_parser: str | None = None) -> list[int]:
    conversation = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + messages
    return processor.render_chat(conversation, add_generation_prompt=True, chat_template=chat_template,
                                 tools=plan.template_tools() if plan is not None else None, param="content",
                                 tool_parser=tool_parser)
