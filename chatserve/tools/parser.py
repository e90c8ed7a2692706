"""Tool calls out of a reply's text, as it streams (`ToolCallStreamParser`) or all at once (`parse_tool_calls`).

One incremental parser, for every format `--tool-call-parser` names, serves every API's stream (OpenAI chat `delta.tool_calls`, Responses
`function_call_arguments.delta`, Anthropic `input_json_delta`), and `parse_tool_calls` is that same
parser fed the whole reply, so a streamed and a whole reply cannot hold different calls.

What it emits, in order:

- `TextEvent`: text outside calls, as soon as it cannot be the start of an opening of the format
  (`<tool_call>`, `[TOOL_CALLS]`, llama's `<|python_tag|>` or `{`, pythonic's `[`; a possible opening is
  held back the way the detokenizer holds back a possible stop string).
- `CallStart(index, id, name)`: a call begins. Sent once the call's `"name"` is complete and names a
  tool of the request, and its `"arguments"` object has begun (`{`), or, with the arguments written
  first or as a JSON string, once both are known. Until then the block is held back.
- `ArgumentsDelta(index, text)`: the next piece of the arguments object's JSON text, sent as it is
  generated. For the JSON formats it is the text exactly as the model generated it (whitespace
  included), sent once the scanner has checked it continues valid JSON; for qwen3_coder's XML and
  pythonic's Python it is the JSON the parameters convert to, a string value's characters as they
  come and any other value once it is whole (`chatserve.tools.xml_reader`, `pythonic_reader`).
  The call's final `arguments` is the concatenation of its deltas (not a re-serialisation), so what a
  client assembled and what a body holds are the same string.
- `CallEnd(index, call)`: the call is over; `call` is the whole `ToolCall` (`call.arguments` is the
  concatenation above, `call.complete` says whether it is a whole JSON object).

Parallel calls (a JSON list in one block, xLAM; one block per call, Hermes; `;`-separated, Llama)
come one after the other, each under its own index.

What a block holds is read by its format's block reader (`chatserve.tools.events.BlockReader`):
the incremental JSON scanner (`json_reader`), the XML reader (`xml_reader`) or the Python-call
reader (`pythonic_reader`); this module finds the blocks and holds back what could open one.

**Text is never lost.** A block that is not a call of a known tool (not JSON, an unknown name, no
name, arguments that are not an object) is released as text, the opening included, as soon as that
is known; nothing of it was sent as a call. Once a call has started it cannot be taken back, so
if the block goes wrong afterwards (JSON that breaks off, a stop string or end-of-turn before the
closing tag): the started call ends there with the arguments sent so far (`complete` False unless
they already formed a whole object), and whatever of the block follows that is more than the calls'
markup (whitespace, commas, brackets, a cut closing tag) is released as text. Under
grammar-constrained decoding (`tool_choice` "required" / named / auto's triggered tag, the Messages
API's `any` / `tool`) a started block can only be well-formed, so this happens only with a stop
string or a model not held to the grammar.

A reply cut off by its token budget (`truncated`, finish_reason "length") inside a block gives the
calls as far as they were generated (`ToolCall.complete` False: the name, and the arguments so far),
including a call whose name was cut but can only be one known tool, as vLLM does for a named tool
choice, rather than the block's markup as text.
"""


from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from chatserve.tools.events import (
    ArgumentsDelta,
    BlockReader,
    CallEnd,
    CallEvent,
    CallStart,
    StreamEvent,
    TextEvent,
)
from chatserve.tools.formats import ToolFormat
from chatserve.tools.json_reader import JsonBlockReader
from chatserve.tools.pythonic_reader import PythonicBlockReader
from chatserve.tools.spec import ToolCall
from chatserve.tools.xml_reader import XmlBlockReader

__all__ = ["ArgumentsDelta", "CallEnd", "CallEvent", "CallStart", "ParsedReply", "StreamEvent", "TextEvent",
           "ToolCallStreamParser", "parse_tool_calls"]


@dataclass
class ParsedReply:
    """A whole reply split into its text and its calls; `content` is None when the reply is only calls."""

    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


def _partial_opening_len(text: str, opening: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `opening`."""
    for k in range(min(len(opening) - 1, len(text)), 0, -1):
        if text.endswith(opening[:k]):
            return k
    return 0


class ToolCallStreamParser:
    """Feed text deltas; get text to show now and calls as they are generated. Call `finish()` at the end.

    `known_names`: the tools a reply may call, or {name: arguments schema} (the schemas type
    qwen3_coder's XML parameters). `make_id` makes call ids (default: the format's, e.g. Mistral's
    9 alphanumerics); a call that carries its own id (Mistral v13's `name[CALL_ID]id[ARGS]`) keeps it."""

    def __init__(self, fmt: ToolFormat, known_names: Collection[str] | Mapping[str, Mapping[str, Any]],
                 make_id: Callable[[], str] | None = None) -> None:
        self.fmt = fmt
        self.known = frozenset(known_names)
        self.schemas: Mapping[str, Mapping[str, Any]] = known_names if isinstance(known_names, Mapping) else {}
        self.make_id = make_id or fmt.new_call_id
        self.calls: list[ToolCall] = []  # the calls that ended, in order
        self._started = 0
        self._ids: set[str] = set()  # the ids given so far (a model's own id is not given twice)
        self._buffer = ""  # outside a block: text held back as a possible opening
        self._reader: BlockReader | None = None  # inside a block: its reader

    @property
    def called(self) -> bool:
        """Whether the reply called tools: at least one call, each of them whole."""
        return bool(self.calls) and all(c.complete for c in self.calls)

    # ---- what block readers ask of the parser (events.CallSink) ------------------------------------
    def next_call(self, own_id: str | None = None) -> tuple[int, str]:
        index = self._started
        self._started += 1
        call_id = own_id if own_id is not None and own_id not in self._ids else self.make_id()
        self._ids.add(call_id)
        return index, call_id

    def ended(self, call: ToolCall) -> None:
        self.calls.append(call)

    # ---- the stream -------------------------------------------------------------------------------
    def feed(self, text: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self._reader is None:
            self._buffer += text
        else:
            self._reader.block += text
        self._run(out)
        return out

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """The end of the reply: whatever is still held back comes out. An unclosed block that no call
        started from is text, unless the reply was `truncated` (cut by max_tokens) and its call can be
        named: then it is a call, partial. A started call ends as far as it got."""
        out: list[StreamEvent] = []
        if self._reader is not None:
            self._reader.finish(truncated, out)
            self._reader = None
        elif self._buffer:
            out.append(TextEvent(self._buffer))
        self._buffer = ""
        return out

    def _run(self, out: list[StreamEvent]) -> None:
        while True:
            reader = self._reader
            if reader is not None:
                if not reader.scan(out):
                    return
                self._buffer, self._reader = reader.rest or "", None
                continue
            start, opening = self._first_opening()
            if opening:
                if start:
                    out.append(TextEvent(self._buffer[:start]))
                block, self._buffer = self._buffer[start:], ""
                self._reader = self._new_reader(block, 0 if opening in self.fmt.kept else len(opening))
                continue
            keep = max(_partial_opening_len(self._buffer, o) for o in self.fmt.openings)
            ready = self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(ready):]
            if ready:
                out.append(TextEvent(ready))
            return

    def _first_opening(self) -> tuple[int, str]:
        """Where the first opening in the held-back text is, and which (the longest at that place)."""
        best, found = -1, ""
        for opening in self.fmt.openings:
            at = self._buffer.find(opening)
            if at >= 0 and (best < 0 or at < best or (at == best and len(opening) > len(found))):
                best, found = at, opening
        return best, found

    def _new_reader(self, block: str, pos: int) -> BlockReader:
        if self.fmt.syntax == "xml":
            return XmlBlockReader(self, self.fmt, block, pos)
        if self.fmt.syntax == "pythonic":
            return PythonicBlockReader(self, block, pos)
        return JsonBlockReader(self, self.fmt, block, pos)


def parse_tool_calls(text: str, fmt: ToolFormat, known_names: Collection[str] | Mapping[str, Mapping[str, Any]],
                     make_id: Callable[[], str] | None = None, truncated: bool = False) -> ParsedReply:
    """A whole reply: its text (None if it was only calls and whitespace) and its calls (`truncated`:
    the reply was cut by max_tokens, so a block it left open holds partial calls). The same parser
    as the stream, fed the whole text: the same calls, the same text."""
    parser = ToolCallStreamParser(fmt, known_names, make_id)
    events = parser.feed(text) + parser.finish(truncated)
    content = "".join(e.text for e in events if isinstance(e, TextEvent))
    if parser.calls and not content.strip():
        return ParsedReply(None, parser.calls)
    return ParsedReply(content, parser.calls)
