"""Tool calls out of a reply's text: all at once (`parse_tool_calls`) or as it streams (`ToolCallStreamParser`).

The streaming parser holds back text that could be the start of an opening `<tool_call>` the way
the detokenizer holds back a possible stop string: plain text is released as soon as it cannot
be part of an opening, a block is released as one call event once its closing has arrived. A
block that does not parse as calls of known functions is released as plain text, so nothing the
model wrote is ever lost, and both ways give the same calls for the same text.

A reply cut off by its token budget (`truncated`, finish_reason "length") inside a block gives the
calls as far as they were generated (`ToolCall.complete` False: the name, and the arguments so
far), as vLLM does for a named tool choice, rather than the block's markup as text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from chatserve.tools.formats import ToolFormat
from chatserve.tools.spec import ToolCall, new_call_id


@dataclass
class ParsedReply:
    """A whole reply split into its text and its calls; `content` is None when the reply is only calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class TextEvent:
    text: str


@dataclass(frozen=True)
class CallEvent:
    index: int  # position of the call in the reply's tool_calls
    call: ToolCall


StreamEvent = TextEvent | CallEvent


def _partial_opening_len(text: str, opening: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `opening`."""
    for k in range(min(len(opening) - 1, len(text)), 0, -1):
        if text.endswith(opening[:k]):
            return k
    return 0


class ToolCallStreamParser:
    """Feed text deltas; get text to show now and calls once complete. Call `finish()` at the end."""

    def __init__(self, fmt: ToolFormat, known_names: Collection[str], make_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self.known = frozenset(known_names)
        self.make_id = make_id
        self._buffer = ""
        self._in_block = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str) -> list[StreamEvent]:
        self._buffer += text
        events: list[StreamEvent] = []
        while True:
            if self._in_block:
                end = self._buffer.find(self.fmt.closing)
                if end < 0:
                    return events
                inner, self._buffer = self._buffer[:end], self._buffer[end + len(self.fmt.closing):]
                self._in_block = False
                events.extend(self._block(inner))
                continue
            start = self._buffer.find(self.fmt.opening)
            if start >= 0:
                if start:
                    events.append(TextEvent(self._buffer[:start]))
                self._buffer = self._buffer[start + len(self.fmt.opening):]
                self._in_block = True
                continue
            keep = _partial_opening_len(self._buffer, self.fmt.opening)
            ready = self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(ready):]
            if ready:
                events.append(TextEvent(ready))
            return events

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """The end of the reply: whatever is still held back comes out. An unclosed block is text,
        unless the reply was `truncated` (cut by max_tokens) and its calls can be named: then they
        come out as calls, the last one partial."""
        if truncated and self._in_block:
            partial = self.fmt.partial_calls_in_block(self._buffer, sorted(self.known))
            if partial is not None:
                self._buffer, self._in_block = "", False
                events: list[StreamEvent] = []
                for p in partial:
                    call = ToolCall(self.make_id(), p.name, p.arguments, complete=p.complete)
                    events.append(CallEvent(len(self.calls), call))
                    self.calls.append(call)
                return events
        rest = (self.fmt.opening if self._in_block else "") + self._buffer
        self._buffer, self._in_block = "", False
        return [TextEvent(rest)] if rest else []

    def _block(self, inner: str) -> list[StreamEvent]:
        calls = self.fmt.calls_in_block(inner)
        if calls is None or any(name not in self.known for name, _ in calls):
            return [TextEvent(self.fmt.opening + inner + self.fmt.closing)]
        events: list[StreamEvent] = []
        for name, args in calls:
            call = ToolCall(self.make_id(), name, json.dumps(args, ensure_ascii=False))
            events.append(CallEvent(len(self.calls), call))
            self.calls.append(call)
        return events


def parse_tool_calls(text: str, fmt: ToolFormat, known_names: Collection[str],
                     make_id: Callable[[], str] = new_call_id, truncated: bool = False) -> ParsedReply:
    """A whole reply: its text (None if it was only calls and whitespace) and its calls (`truncated`:
    the reply was cut by max_tokens, so a block it left open holds partial calls)."""
    parser = ToolCallStreamParser(fmt, known_names, make_id)
    events = parser.feed(text) + parser.finish(truncated)
    content = "".join(e.text for e in events if isinstance(e, TextEvent))
    if parser.calls and not content.strip():
        return ParsedReply(None, parser.calls)
    return ParsedReply(content, parser.calls)
