"""What the tool-call stream parser emits, and the base every format's block reader shares.

The events, in order (`chatserve.tools.parser` says when each is sent):

- `TextEvent`: text outside calls.
- `CallStart(index, id, name)`: a call begins (its name is known and names a tool of the request).
- `ArgumentsDelta(index, text)`: the next piece of the call's arguments as JSON text.
- `CallEnd(index, call)`: the call is over; `call.arguments` is the concatenation of its deltas.

A `BlockReader` reads one block of calls (from its opening on) for one format: the parser hands it
the block's text as it arrives and takes back, once the block is over, the text that follows it.
Its calls' indexes and ids come from the parser (`CallSink`), so they run on across blocks.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from chatserve.tools.spec import ToolCall


@dataclass(frozen=True)
class TextEvent:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # position of the call in the reply's tool_calls
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    index: int
    text: str  # the next piece of the arguments' JSON text


@dataclass(frozen=True)
class CallEnd:
    index: int
    call: ToolCall  # the whole call: its arguments are the concatenation of its deltas


CallEvent = CallEnd  # (the name of the one event a whole call was, before arguments streamed)

StreamEvent = TextEvent | CallStart | ArgumentsDelta | CallEnd

WS = " \t\n\r"
MARKUP = WS + ",[]{}();"  # what a block holds around its calls: dropped, not text, once a call was sent


class CallSink(Protocol):
    """The parser, as its block readers see it: the request's tools, and the numbering of calls."""

    known: frozenset[str]
    schemas: Mapping[str, Mapping[str, Any]]  # each known tool's arguments schema (typing XML parameters)

    def next_call(self, own_id: str | None = None) -> tuple[int, str]:
        """The next call's index and its id: `own_id` (the id the model wrote, Mistral v13's) unless it
        is missing or already taken in this reply, else a fresh one."""

    def ended(self, call: ToolCall) -> None:
        """A call is over (kept in order for `parse_tool_calls`)."""


@dataclass
class OpenCall:
    """A call that started: what was sent of it."""

    index: int
    id: str
    name: str
    sent: list[str] = field(default_factory=list)


class BlockReader(ABC):
    """Reads one block of calls. `block` holds its text from the opening on; `scan` reads what is new
    and says whether the block is over (then `rest` is the text after it, to be read outside);
    `finish` ends a reply that stopped inside the block."""

    def __init__(self, sink: CallSink, block: str, pos: int) -> None:
        self.sink = sink
        self.block = block
        self.rest: str | None = None
        self._pos = pos  # read up to here
        self._block_calls = 0  # calls started in this block
        self._consumed = 0  # the block's text up to here is accounted for by the calls sent

    @abstractmethod
    def scan(self, out: list[StreamEvent]) -> bool:
        """Read the block's new text, emitting events; True when the block is over (`rest` is set)."""

    @abstractmethod
    def finish(self, truncated: bool, out: list[StreamEvent]) -> None:
        """The reply ended inside the block (`truncated`: by max_tokens): end what started, release the rest."""

    # ---- calls ------------------------------------------------------------------------------------
    def start_call(self, name: str, out: list[StreamEvent], own_id: str | None = None) -> OpenCall:
        index, call_id = self.sink.next_call(own_id)
        self._block_calls += 1
        out.append(CallStart(index, call_id, name))
        return OpenCall(index, call_id, name)

    @staticmethod
    def send(call: OpenCall, text: str, out: list[StreamEvent]) -> None:
        if text:
            call.sent.append(text)
            out.append(ArgumentsDelta(call.index, text))

    def end_call(self, call: OpenCall, complete: bool, out: list[StreamEvent]) -> None:
        done = ToolCall(call.id, call.name, "".join(call.sent), complete=complete)
        self.sink.ended(done)
        out.append(CallEnd(call.index, done))

    # ---- leaving the block ------------------------------------------------------------------------
    def leave(self, resume: int) -> None:
        """The block is over; reading goes on outside from `resume`."""
        self.rest = self.block[resume:]

    def release(self, upto: int, out: list[StreamEvent]) -> None:
        """Text of the block up to `upto` that is not a call goes out as text: all of it when no call
        started (the opening included), else what follows the calls if it is more than their markup."""
        if self._block_calls == 0:
            text = self.block[:upto]
        else:
            text = self.block[self._consumed:upto]
            text = "" if not text.strip(MARKUP) else text
        if text:
            out.append(TextEvent(text))


def only_known_with_prefix(known: frozenset[str], prefix: str) -> str | None:
    """The one known name that starts with `prefix` (a name a token budget cut), else None."""
    matches = [n for n in sorted(known) if n.startswith(prefix)]
    return matches[0] if len(matches) == 1 else None
