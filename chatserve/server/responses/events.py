"""A reply's text as Responses output items and OpenAI's typed stream events, built together.

One `OutputBuilder` per response: the reply's deltas go in (through the request's tool-call parser
when tools may be called, the same `ToolCallStreamParser` the chat route streams with), and out
come the events (`response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`, `response.function_call_arguments.delta` / `.done`, ...) and, at the
end, the finished `output` list. A function call's item is added as soon as its name is known, and
its `function_call_arguments.delta` events carry its arguments as they are generated. The
non-streaming body is that same list, so a streamed and a whole reply cannot differ. Field names
are exactly the openai SDK's (openai/types/responses/), whose `client.responses.stream` checks every
event against what came before it.

A reasoning model's thinking (the engine's `reasoning` deltas, split from the answer by the
server's reasoning parser) is one `reasoning` item before the message and the calls:
`response.output_item.added`, `response.content_part.added` (a `reasoning_text` part),
`response.reasoning_text.delta` as it is generated, then `response.reasoning_text.done`,
`response.content_part.done` and `response.output_item.done` as soon as the answer begins (or the
reply ends). Its `summary` is empty (no summary is written; `content` holds the text whole) and,
when the request includes `reasoning.encrypted_content`, the finished item carries the text sealed
by the server's key (chatserve/reasoning/signature.py), which a later request may send back.

Events leave without `sequence_number`; `Sequencer` numbers them once, where they are emitted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chatserve.server.chat.tool_request import ToolPlan
from chatserve.sessions.response_store import new_item_id
from chatserve.tools import ToolCall, ToolCallStreamParser
from chatserve.tools.parser import ArgumentsDelta, CallEnd, CallStart, StreamEvent, TextEvent


class Sequencer:
    """Numbers a response's events from 0 (`sequence_number`, also the SSE `id:` a resume starts after)."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def number(self, event: dict[str, Any]) -> dict[str, Any]:
        event["sequence_number"] = self.next
        self.next += 1
        return event


class OutputBuilder:
    def __init__(self, plan: ToolPlan | None, seal: Callable[[str], str] | None = None) -> None:
        """`seal`: makes a finished reasoning item's `encrypted_content` (None: the request did not include it)."""
        self.output: list[dict[str, Any]] = []
        self._seal = seal
        self._reasoning: dict[str, Any] | None = None  # the open reasoning item, if any
        self._reasoning_text: list[str] = []
        self._parser: ToolCallStreamParser | None = plan.parser() if plan is not None and plan.parses_calls else None
        self._message: dict[str, Any] | None = None  # the open message item, if any
        self._text: list[str] = []
        self._calls: dict[int, dict[str, Any]] = {}  # a call's index -> its function_call item

    @property
    def called_tools(self) -> bool:
        return any(item["type"] == "function_call" for item in self.output)

    def feed(self, text: str, reasoning: str | None = None) -> list[dict[str, Any]]:
        """One delta of the reply: its reasoning (first, as the engine produced it), then its answer text."""
        out = self._reasoning_events(reasoning) if reasoning else []
        if not text:
            return out
        out += self._close_reasoning("completed")  # the answer began: the reasoning is whole
        if self._parser is None:
            return out + self._text_events(text)
        return out + self._events(self._parser.feed(text))

    def finish(self, item_status: str = "completed") -> list[dict[str, Any]]:
        """Flush the parser and close what is open; `item_status` "incomplete" for a cut-off reply."""
        truncated = item_status == "incomplete"
        events = self._close_reasoning(item_status)
        events += self._events(self._parser.finish(truncated)) if self._parser is not None else []
        return events + self._close_message(item_status)

    # ---- reasoning --------------------------------------------------------------------------------
    def _reasoning_events(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._reasoning is None:
            out += self._close_message("completed")  # (reasoning after an answer: a new item, in order)
            item = {"id": new_item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}
            self._reasoning = item
            self._reasoning_text = []
            self.output.append(item)
            index = len(self.output) - 1
            out.append({"type": "response.output_item.added", "output_index": index, "item": _copy(item)})
            out.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": _reasoning_part("")})
        self._reasoning_text.append(text)
        out.append({"type": "response.reasoning_text.delta", "item_id": self._reasoning["id"],
                    "output_index": self.output.index(self._reasoning), "content_index": 0, "delta": text})
        return out

    def _close_reasoning(self, status: str) -> list[dict[str, Any]]:
        item = self._reasoning
        if item is None:
            return []
        self._reasoning = None
        index = self.output.index(item)
        text = "".join(self._reasoning_text)
        part = _reasoning_part(text)
        item["content"] = [part]
        item["status"] = status
        if self._seal is not None:
            item["encrypted_content"] = self._seal(text)
        return [
            {"type": "response.reasoning_text.done", "item_id": item["id"], "output_index": index, "content_index": 0,
             "text": text},
            {"type": "response.content_part.done", "item_id": item["id"], "output_index": index, "content_index": 0,
             "part": dict(part)},
            {"type": "response.output_item.done", "output_index": index, "item": _copy(item)},
        ]

    # ---- items ----------------------------------------------------------------------------------
    def _events(self, parsed: list[StreamEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in parsed:
            if isinstance(e, TextEvent):
                out += self._text_events(e.text)
            elif isinstance(e, CallStart):
                out += self._call_start(e)
            elif isinstance(e, ArgumentsDelta):
                item = self._calls[e.index]
                item["arguments"] += e.text
                out.append({"type": "response.function_call_arguments.delta", "item_id": item["id"],
                            "output_index": self.output.index(item), "delta": e.text})
            elif isinstance(e, CallEnd):
                out += self._call_end(e.index, e.call)
        return out

    def _text_events(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._message is None:
            item = {"id": new_item_id("msg"), "type": "message", "role": "assistant", "status": "in_progress",
                    "content": []}
            self._message = item
            self._text = []
            self.output.append(item)
            index = len(self.output) - 1
            out.append({"type": "response.output_item.added", "output_index": index, "item": _copy(item)})
            out.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": index,
                        "content_index": 0, "part": _text_part("")})
        self._text.append(text)
        out.append({"type": "response.output_text.delta", "item_id": self._message["id"],
                    "output_index": len(self.output) - 1, "content_index": 0, "delta": text, "logprobs": []})
        return out

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        item = self._message
        if item is None:
            return []
        self._message = None
        index = self.output.index(item)
        text = "".join(self._text)
        part = _text_part(text)
        item["content"] = [part]
        item["status"] = status
        return [
            {"type": "response.output_text.done", "item_id": item["id"], "output_index": index, "content_index": 0,
             "text": text, "logprobs": []},
            {"type": "response.content_part.done", "item_id": item["id"], "output_index": index, "content_index": 0,
             "part": _copy(part)},
            {"type": "response.output_item.done", "output_index": index, "item": _copy(item)},
        ]

    def _call_start(self, e: CallStart) -> list[dict[str, Any]]:
        out = self._close_message("completed")
        item = {"id": new_item_id("fc"), "type": "function_call", "call_id": e.id, "name": e.name,
                "arguments": "", "status": "in_progress"}
        self._calls[e.index] = item
        self.output.append(item)
        out.append({"type": "response.output_item.added", "output_index": len(self.output) - 1, "item": _copy(item)})
        return out

    def _call_end(self, index: int, call: ToolCall) -> list[dict[str, Any]]:
        item = self._calls[index]
        output_index = self.output.index(item)
        item["arguments"] = call.arguments  # (the deltas' concatenation already)
        item["status"] = "completed" if call.complete else "incomplete"  # (cut by max_output_tokens)
        return [
            {"type": "response.function_call_arguments.done", "item_id": item["id"], "output_index": output_index,
             "name": call.name, "arguments": call.arguments},
            {"type": "response.output_item.done", "output_index": output_index, "item": _copy(item)},
        ]


def _reasoning_part(text: str) -> dict[str, Any]:
    return {"type": "reasoning_text", "text": text}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    """A snapshot of an item as it is now (it changes as the reply goes on)."""
    return {k: ([dict(p) for p in v] if k in ("content", "summary") else v) for k, v in item.items()}


def output_text(output: list[dict[str, Any]]) -> str:
    """All the text of a response's output (its messages' output_text parts), in order."""
    return "".join(p["text"] for item in output if item["type"] == "message" for p in item["content"])
