"""A Responses request's input items as the chat side's messages, and as the records the store lists.

Items map onto Chat Completions messages one to one, except that an assistant's text and the
function calls that follow it are one assistant message with `tool_calls` (how chat templates
render a reply that called tools); a `function_call_output` is a `role: "tool"` message; a
`reasoning` item is the following assistant turn's `reasoning_content` (the variable Qwen3's
template renders earlier reasoning from), its text the `encrypted_content` this server sealed, else
its `content` as sent. From
there the prompt is built by the chat route's own rendering (`routes.openai.chat_prompt_ids`) or,
after a `previous_response_id`, by the session turns' continuation of exact stored tokens
(`chat/prompts.py`: `continue_history` via `next_tool_turn_ids`).
"""

from __future__ import annotations

import re
from typing import Any

from chatserve.reasoning.signature import ReasoningSignatureError, ReasoningSigner
from chatserve.server.chat.protocol import ChatMessage, ToolCallFunction, ToolCallIn
from chatserve.server.errors import bad_request
from chatserve.server.responses.protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
)
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
        elif isinstance(item, ReasoningItem):
            record: dict[str, Any] = {"id": item.id or new_item_id("rs"), "type": "reasoning",
                                      "summary": [p.model_dump() for p in item.summary],
                                      "content": [p.model_dump() for p in item.content or []], "status": "completed"}
            if item.encrypted_content is not None:
                record["encrypted_content"] = item.encrypted_content
            out.append(record)
        else:
            out.append({"id": item.id or new_item_id("fco"), "type": "function_call_output", "call_id": item.call_id,
                        "output": item.text(), "status": "completed"})
    return out


def reasoning_text(item: ReasoningItem, index: int, signer: ReasoningSigner) -> str | None:
    """A reasoning item's text: its sealed `encrypted_content` (authenticated: an edited or foreign value
    is a 400 naming it), else its `content` parts as sent; None when it has neither."""
    if item.encrypted_content is not None:
        try:
            return signer.unseal(item.encrypted_content)
        except ReasoningSignatureError as exc:
            raise bad_request(f"input.{index}.encrypted_content is not reasoning this server sealed: {exc}",
                              param=f"input.{index}.encrypted_content", code="invalid_encrypted_content") from None
    return item.text()


def chat_messages(body: ResponsesRequest, signer: ReasoningSigner, *,
                  with_instructions: bool = True) -> list[ChatMessage]:
    """The input (and the instructions, as the system message) as chat messages."""
    messages: list[ChatMessage] = []
    if with_instructions and body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    if isinstance(body.input, str):
        return [*messages, ChatMessage(role="user", content=body.input)]
    # NOTE: a reasoning item opens the assistant turn that its reply's message or first call then makes;
    # one with no assistant item after it is a turn of reasoning alone (the model stopped after thinking).
    reasoning: str | None = None
    for index, item in enumerate(body.input):
        last = messages[-1] if messages else None
        if isinstance(item, ReasoningItem):
            if reasoning is not None:
                messages.append(_assistant("", reasoning))
            reasoning = reasoning_text(item, index, signer) or ""
        elif isinstance(item, MessageItem) and item.role == "assistant":
            messages.append(_assistant(item.text(), reasoning))
            reasoning = None
        elif isinstance(item, FunctionCallItem):
            call = ToolCallIn(id=item.call_id, function=ToolCallFunction(name=item.name, arguments=item.arguments))
            if reasoning is None and last is not None and last.role == "assistant":  # text, then calls: one message
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(_assistant(None, reasoning, [call]))
            reasoning = None
        else:
            if reasoning is not None:
                messages.append(_assistant("", reasoning))
                reasoning = None
            if isinstance(item, MessageItem):
                messages.append(ChatMessage(role=item.role, content=item.text()))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(ChatMessage(role="tool", content=item.text(), tool_call_id=item.call_id))
    if reasoning is not None:
        messages.append(_assistant("", reasoning))
    return messages


def _assistant(content: str | None, reasoning: str | None, calls: list[ToolCallIn] | None = None) -> ChatMessage:
    """An assistant turn; its reasoning (if any) in `reasoning_content`, which the template renders."""
    if reasoning is None:
        return ChatMessage(role="assistant", content=content, tool_calls=calls)
    return ChatMessage(role="assistant", content=content, tool_calls=calls, reasoning_content=reasoning)


# Parts of a pydantic error path that name a union member rather than a field (see responses_protocol).
_TAGS = [
    (re.compile(r"^input\.(?:items|text)(?=\.|$)"), "input"),
    (re.compile(r"^(input\.\d+)\.(?:message|function_call_output|function_call|reasoning)(?=\.|$)"), r"\1"),
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
