"""A reply as Anthropic's content blocks: the stream's events and, from the same events, the whole message.

`MessageBuilder` is fed the reply's text deltas. Text goes through the request's tool-call parser
(the one the OpenAI replies use, `tools/parser.py`) when the request offers tools: text that cannot
be part of a call opens (or continues) a `text` block at once, a call becomes a `tool_use` block:
`content_block_start` (its id and name, `input: {}`) as soon as its name is known, an
`input_json_delta` for each piece of its arguments' JSON as it is generated, `content_block_stop`
when the call ends (then the block's `input` is the arguments parsed). A reasoning model's thinking
(the engine's `reasoning` deltas) is a `thinking` block before them: `content_block_start` with
`{"type": "thinking", "thinking": "", "signature": ""}`, a `thinking_delta` per piece, then a
`signature_delta` with the server's signature of the whole text and `content_block_stop` as soon as
the answer begins (with `display: "omitted"`: no deltas, and a signature that seals the text, so
that the block sent back still renders). The non-streaming body is the
blocks those same events built, so both ways give the same content. `stop_reason` follows Anthropic:
`end_turn`, `stop_sequence` (with the matched `stop_sequence`), `max_tokens`,
`model_context_window_exceeded` (the context, not the budget, ended the reply) and `tool_use` (each
call whole: a call a stop sequence cut short ends the turn as that stop).
"""

from __future__ import annotations

import json
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sse_starlette.event import ServerSentEvent

from chatserve.server.chat.tool_request import ToolPlan
from chatserve.server.streams.sse import dumps
from chatserve.tools import ToolCallStreamParser
from chatserve.tools.parser import ArgumentsDelta, CallEnd, CallStart, StreamEvent, TextEvent

_ALPHABET = string.ascii_letters + string.digits


def new_id(prefix: str) -> str:
    """`msg_...` / `toolu_...`: Anthropic's id shapes (24 random alphanumerics)."""
    return prefix + "".join(secrets.choice(_ALPHABET) for _ in range(24))


class Ping(ServerSentEvent):
    """Anthropic's keepalive: a real `ping` event (its SDK skips it), not an SSE comment."""

    LINE = b'event: ping\r\ndata: {"type":"ping"}\r\n\r\n'

    def __init__(self) -> None:
        super().__init__(event="ping")

    def encode(self) -> bytes:
        return self.LINE


def sse(event: dict[str, Any]) -> dict[str, Any]:
    """One SSE frame with its `event:` line, as Anthropic frames every event (the SDK dispatches on it)."""
    return {"event": event["type"], "data": dumps(event)}


@dataclass
class AnthropicUsage:
    """Anthropic's usage: `input_tokens` excludes cached tokens, so input + cache read + cache creation is the prompt."""

    prompt_tokens: int
    cached_tokens: int = 0
    output_tokens: int = 0
    creation_5m: int = 0
    creation_1h: int = 0

    def as_dict(self) -> dict[str, Any]:
        creation = self.creation_5m + self.creation_1h
        return {
            "input_tokens": max(self.prompt_tokens - self.cached_tokens - creation, 0),
            "cache_creation_input_tokens": creation,
            "cache_read_input_tokens": self.cached_tokens,
            "cache_creation": {"ephemeral_5m_input_tokens": self.creation_5m,
                               "ephemeral_1h_input_tokens": self.creation_1h},
            "output_tokens": self.output_tokens,
            "service_tier": "standard",
        }


def stop_reason(finish_reason: str | None, matched: str | int | None, called: bool, context_full: bool) -> str:
    if finish_reason == "length":
        return "model_context_window_exceeded" if context_full else "max_tokens"
    if called:
        return "tool_use"
    if isinstance(matched, str):
        return "stop_sequence"
    return "end_turn"  # an end-of-turn token, a stop token id, or a cancelled reply (docs/anthropic.md)


@dataclass
class MessageBuilder:
    """The reply's content blocks, built from text deltas; each step returns the events it makes."""

    message_id: str
    model: str
    plan: ToolPlan | None
    signature: Callable[[str], str] | None = None
    """Signs a finished thinking block's text (the context's `ReasoningSigner.sign`, or `.seal` when omitted)."""
    omit_thinking: bool = False
    """`thinking.display: "omitted"`: the block's text is left out (its signature carries it)."""
    blocks: list[dict[str, Any]] = field(default_factory=list)
    _open_text: bool = False
    _thinking: list[str] | None = None  # the open thinking block's text so far
    _parser: ToolCallStreamParser | None = None
    _call_blocks: dict[int, int] = field(default_factory=dict)  # a call's index -> its block's

    def __post_init__(self) -> None:
        if self.plan is not None and self.plan.parses_calls:
            self._parser = self.plan.parser(make_id=lambda: new_id("toolu_"))

    @property
    def called(self) -> bool:
        return self._parser is not None and self._parser.called

    def message(self, usage: AnthropicUsage, stop: str | None, stop_sequence: str | None,
                content: bool = True) -> dict[str, Any]:
        return {"id": self.message_id, "type": "message", "role": "assistant", "model": self.model,
                "content": [dict(b) for b in self.blocks] if content else [], "stop_reason": stop,
                "stop_sequence": stop_sequence, "usage": usage.as_dict()}

    def feed(self, text: str, reasoning: str | None = None) -> list[dict[str, Any]]:
        """One delta of the reply: its reasoning (first, as the engine produced it), then its answer text."""
        out = self._thinking_events(reasoning) if reasoning else []
        if not text:
            return out
        out += self._close_thinking()  # the answer began: the thinking is whole
        events: list[StreamEvent] = self._parser.feed(text) if self._parser is not None else [TextEvent(text)]
        return out + self._blocks(events)

    def finish(self, truncated: bool) -> list[dict[str, Any]]:
        out = self._close_thinking()
        events = self._parser.finish(truncated=truncated) if self._parser is not None else []
        out += self._blocks(events)
        out += self._close_text()
        return out

    def _thinking_events(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self._thinking is None:
            out += self._close_text()  # (thinking after an answer's text: a new block, in order)
            self._thinking = []
            self.blocks.append({"type": "thinking", "thinking": "", "signature": ""})
            out.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                        "content_block": {"type": "thinking", "thinking": "", "signature": ""}})
        self._thinking.append(text)
        if not self.omit_thinking:
            self.blocks[-1]["thinking"] += text
            out.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                        "delta": {"type": "thinking_delta", "thinking": text}})
        return out

    def _close_thinking(self) -> list[dict[str, Any]]:
        if self._thinking is None:
            return []
        text = "".join(self._thinking)
        self._thinking = None
        index = len(self.blocks) - 1
        signature = self.signature(text) if self.signature is not None else ""
        self.blocks[index]["signature"] = signature
        return [{"type": "content_block_delta", "index": index,
                 "delta": {"type": "signature_delta", "signature": signature}},
                {"type": "content_block_stop", "index": index}]

    def _close_text(self) -> list[dict[str, Any]]:
        if not self._open_text:
            return []
        self._open_text = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def _blocks(self, events: list[StreamEvent]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for e in events:
            if isinstance(e, TextEvent):
                if not e.text:
                    continue
                if not self._open_text:
                    self.blocks.append({"type": "text", "text": ""})
                    self._open_text = True
                    out.append({"type": "content_block_start", "index": len(self.blocks) - 1,
                                "content_block": {"type": "text", "text": ""}})
                self.blocks[-1]["text"] += e.text
                out.append({"type": "content_block_delta", "index": len(self.blocks) - 1,
                            "delta": {"type": "text_delta", "text": e.text}})
            elif isinstance(e, CallStart):
                out += self._close_text()
                index = self._call_blocks[e.index] = len(self.blocks)
                self.blocks.append({"type": "tool_use", "id": e.id, "name": e.name, "input": {}})
                out.append({"type": "content_block_start", "index": index,
                            "content_block": {"type": "tool_use", "id": e.id, "name": e.name, "input": {}}})
            elif isinstance(e, ArgumentsDelta):
                out.append({"type": "content_block_delta", "index": self._call_blocks[e.index],
                            "delta": {"type": "input_json_delta", "partial_json": e.text}})
            elif isinstance(e, CallEnd):
                index = self._call_blocks[e.index]
                self.blocks[index]["input"] = _input_object(e.call.arguments)
                out.append({"type": "content_block_stop", "index": index})
        return out


def _input_object(arguments: str) -> dict[str, Any]:
    """A call's `input` (a call cut by max_tokens keeps what parses: the SDK's accumulator does the same)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}
