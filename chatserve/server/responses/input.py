"""A Responses request's input items as the chat side's messages, and as the records the store lists.

Items map onto Chat Completions messages one to one, except that an assistant's text and the
function calls that follow it are one assistant message with `tool_calls` (how chat templates
render a reply that called tools); a `function_call_output` is a `role: "tool"` message. From
there the prompt is built by the chat route's own rendering (`routes.openai.chat_prompt_ids`) or,
after a `previous_response_id`, by the session turns' continuation of exact stored tokens
(`chat/prompts.py`: `continue_history` via `next_tool_turn_ids`).
"""

from __future__ import annotations

import re
from typing import Any

from chatserve.server.chat.protocol import ChatMessage, ToolCallFunction, ToolCallIn
from chatserve.server.responses.protocol import FunctionCallItem, FunctionCallOutputItem, MessageItem, ResponsesRequest
from chatserve.sessions.response_store import new_item_id


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as stored items, each with an id (what input_items lists, in order)."""
    if isinstance(body.input, str):
        return [{"id": new_item_id("msg"), "type": "message", "role": "user", "status": "completed",
                 "content": [{"type": "input_text", "text": body.input}]}]
    out: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            if item.role == "assistant":
                content = [{"type": "output_text", "text": item.text(), "annotations": []}]
            else:
                content = [{"type": "input_text", "text": item.text()}]
            out.append({"id": item.id or new_item_id("msg"), "type": "message", "role": item.role,
                        "status": "completed", "content": content})
        elif isinstance(item, FunctionCallItem):
            out.append({"id": item.id or new_item_id("fc"), "type": "function_call", "call_id": item.call_id,
                        "name": item.name, "arguments": item.arguments, "status": "completed"})
        else:
            out.append({"id": item.id or new_item_id("fco"), "type": "function_call_output", "call_id": item.call_id,
                        "output": item.text(), "status": "completed"})
    return out


def chat_messages(body: ResponsesRequest, *, with_instructions: bool = True) -> list[ChatMessage]:
    """The input (and the instructions, as the system message) as chat messages."""
    messages: list[ChatMessage] = []
    if with_instructions and body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        return [*messages, ChatMessage(role="user", content=body.input)]
    for item in body.input:
        last = messages[-1] if messages else None
        if isinstance(item, MessageItem):
            messages.append(ChatMessage(role=item.role, content=item.text()))
        elif isinstance(item, FunctionCallItem):
            call = ToolCallIn(id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments))
            if last is not None and last.role == "assistant":  # the reply's text, then its calls: one message
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
    return messages


# Parts of a pydantic error path that name a union member rather than a field (see responses_protocol).
_TAGS = [
    (re.compile(r"^input\.(?:items|text)(?=\.|$)"), "input"),
    (re.compile(r"^(input\.\d+)\.(?:message|function_call_output|function_call)(?=\.|$)"), r"\1"),
    (re.compile(r"(content|output)\.(\d+)\.(?:input_text|output_text|text|refusal)(?=\.|$)"), r"\1.\2"),
    (re.compile(r"^tools\.(\d+)\.function\."), r"tools.\1."),  # chat's check_tools names chat's shape
]


def clean_param(param: str | None) -> str | None:
    """"input.items.0.message.content" -> "input.0.content": the path a client wrote."""
    if param is None:
        return None
    for pattern, repl in _TAGS:
        param = pattern.sub(repl, param)
    return param
