"""Tool calls out of a reply's text, as it streams (`ToolCallStreamParser`) or all at once (`parse_tool_calls`).

One incremental parser serves every API's stream (OpenAI chat `delta.tool_calls`, Responses
`function_call_arguments.delta`, Anthropic `input_json_delta`), and `parse_tool_calls` is that same
parser fed the whole reply, so a streamed and a whole reply cannot hold different calls.

What it emits, in order:

- `TextEvent`: text outside calls, as soon as it cannot be the start of an opening `<tool_call>`
  (a possible opening is held back the way the detokenizer holds back a possible stop string).
- `CallStart(index, id, name)`: a call begins. Sent once the call's `"name"` is complete and names a
  tool of the request, and its `"arguments"` object has begun (`{`), or, with the arguments written
  first or as a JSON string, once both are known. Until then the block is held back.
- `ArgumentsDelta(index, text)`: the next piece of the arguments object's JSON text exactly as the
  model generated it (whitespace included), sent as it is generated and only once the scanner has
  checked it continues valid JSON. The call's final `arguments` is the concatenation of its deltas
  (not a re-serialisation), so what a client assembled and what a body holds are the same string.
- `CallEnd(index, call)`: the call is over; `call` is the whole `ToolCall` (`call.arguments` is the
  concatenation above, `call.complete` says whether it is a whole JSON object).

Parallel calls (a JSON list in one block, xLAM; or one block per call, Hermes) come one after the
other, each under its own index.

The block is read by an incremental JSON scanner (each character looked at once), which knows when
it is inside a string: a closing `</tool_call>` inside an argument's string is text of that
argument, not the end of the block.

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

import json
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

from chatserve.tools.formats import ToolFormat, partial_call
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

_WS = " \t\n\r"
_MARKUP = _WS + ",[]{}"  # what a block holds around its calls: dropped, not text, once a call was sent
_HEX = frozenset("0123456789abcdefABCDEF")
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*|(?:\.[0-9]+)?[eE][+-]?[0-9]*)?)?")
_LITERALS = ("true", "false", "null")
_NAME_KEY, _ARGS_KEYS = "name", ("arguments", "parameters")


def _partial_opening_len(text: str, opening: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `opening`."""
    for k in range(min(len(opening) - 1, len(text)), 0, -1):
        if text.endswith(opening[:k]):
            return k
    return 0


class _Malformed(Exception):
    """The block stopped being calls of known tools at `at` (a position in the block)."""

    def __init__(self, at: int) -> None:
        self.at = at


class _Closed(Exception):
    """The closing tag spans block[start:end]."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end


@dataclass
class _Call:
    """The call object being read: where it is in the block and what is known of it."""

    start: int  # its "{"
    key: str | None = None  # what the member being read is: "name", "args" or None (another key)
    name: str | None = None
    args_start: int | None = None  # the arguments value's first character
    args_end: int | None = None  # one past its last, once it is whole
    args_text: str | None = None  # arguments given as a JSON string (decoded), or "{}" when there are none
    index: int | None = None  # set when the call started
    id: str = ""
    sent: list[str] = field(default_factory=list)
    emitted: int = 0  # block position up to which the arguments' text was sent


class ToolCallStreamParser:
    """Feed text deltas; get text to show now and calls as they are generated. Call `finish()` at the end."""

    def __init__(self, fmt: ToolFormat, known_names: Collection[str], make_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self.known = frozenset(known_names)
        self.make_id = make_id
        self.calls: list[ToolCall] = []  # the calls that ended, in order
        self._started = 0
        self._buffer = ""  # outside a block: text held back as a possible opening
        self._block: str | None = None  # inside a block: its text from the opening on
        self._reset_block()

    @property
    def called(self) -> bool:
        """Whether the reply called tools: at least one call, each of them whole."""
        return bool(self.calls) and all(c.complete for c in self.calls)

    # ---- the stream -------------------------------------------------------------------------------
    def feed(self, text: str) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        if self._block is None:
            self._buffer += text
        else:
            self._block += text
        self._run(out)
        return out

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """The end of the reply: whatever is still held back comes out. An unclosed block that no call
        started from is text, unless the reply was `truncated` (cut by max_tokens) and its call can be
        named: then it is a call, partial. A started call ends as far as it got."""
        out: list[StreamEvent] = []
        if self._block is None:
            if self._buffer:
                out.append(TextEvent(self._buffer))
            self._buffer = ""
            return out
        block, cur = self._block, self._call
        cut = self._tag_start if self._tag_start is not None else len(block)
        if cur is not None and cur.index is None and truncated:
            p = partial_call(block[:cut], cur.start, sorted(self.known))
            if p is not None:
                self._start(cur, p.name, out)
                if p.arguments:
                    self._send(cur, p.arguments, out)
                self._end(cur, p.complete, out)
                self._consumed = cut
        elif cur is None and truncated and self._block_calls == 0 and len(self.known) == 1 and self._nothing_yet():
            only = _Call(cut)
            self._start(only, next(iter(self.known)), out)
            self._end(only, False, out)
            self._consumed = cut
        if self._call is not None and self._call.index is not None:
            self._end_started(cut, out)
        if self._block_calls == 0:
            rest = block
        else:
            rest = block[self._consumed:cut]
            rest = "" if not rest.strip(_MARKUP) else rest
        if rest:
            out.append(TextEvent(rest))
        self._block = None
        self._reset_block()
        return out

    # ---- outside and inside blocks ----------------------------------------------------------------
    def _run(self, out: list[StreamEvent]) -> None:
        opening = self.fmt.opening
        while True:
            if self._block is not None:
                if not self._scan(out):
                    return
                continue
            start = self._buffer.find(opening)
            if start >= 0:
                if start:
                    out.append(TextEvent(self._buffer[:start]))
                self._block, self._buffer = self._buffer[start:], ""
                self._reset_block()
                self._pos = len(opening)
                continue
            keep = _partial_opening_len(self._buffer, opening)
            ready = self._buffer[: len(self._buffer) - keep]
            self._buffer = self._buffer[len(ready):]
            if ready:
                out.append(TextEvent(ready))
            return

    def _reset_block(self) -> None:
        self._pos = 0
        self._stack: list[list[str | None]] = []  # frames [kind "o"/"a", state, role "calls"/"call"/"args"/None]
        self._top_done = False
        self._token: str | None = None  # inside a "str", "num" or "lit"
        self._token_start = 0
        self._escape = 0  # in a string: 1 after a backslash, 2..5 inside a \uXXXX
        self._capture: str | None = None  # what the string being read is: "key", "name", "args" or None
        self._tag_start: int | None = None  # a closing tag being matched from here
        self._call: _Call | None = None
        self._consumed = 0  # the block's text up to here is accounted for by the calls sent
        self._block_calls = 0

    def _scan(self, out: list[StreamEvent]) -> bool:
        """Read the block's new text; True when the block is over (the rest of the text is outside it)."""
        try:
            self._read(out)
        except _Closed as closed:
            if self._top_done:
                self._leave(closed.end, out)
            else:  # closed before its calls were: what was started ends, the closing tag goes with it
                self._malformed(closed.start, closed.end if self._block_calls else closed.start, out)
            return True
        except _Malformed as bad:
            self._malformed(bad.at, bad.at, out)
            return True
        cur = self._call
        if cur is not None and cur.index is not None:
            self._flush(cur, self._tag_start if self._tag_start is not None else self._pos, out)
        return False

    def _leave(self, resume: int, out: list[StreamEvent]) -> None:
        assert self._block is not None
        self._buffer = self._block[resume:]
        self._block = None
        self._reset_block()

    def _malformed(self, at: int, resume: int, out: list[StreamEvent]) -> None:
        """The block is not calls from `at` on: end what started, release what is not a call as text, and
        read on from `resume` outside a block."""
        assert self._block is not None
        cur = self._call
        if cur is not None and cur.index is not None:
            self._end_started(at, out)
        if self._block_calls == 0:
            text = self._block[:at]
        else:
            text = self._block[self._consumed:at]
            text = "" if not text.strip(_MARKUP) else text
        if text:
            out.append(TextEvent(text))
        self._leave(resume, out)

    def _nothing_yet(self) -> bool:
        """Only whitespace after the opening, or a list's "[" and whitespace."""
        if not self._stack:
            return not self._top_done and self._token is None
        return len(self._stack) == 1 and self._stack[0][2] == "calls" and self._stack[0][1] == "value_or_end"

    # ---- calls ------------------------------------------------------------------------------------
    def _start(self, cur: _Call, name: str, out: list[StreamEvent]) -> None:
        cur.name, cur.index, cur.id = name, self._started, self.make_id()
        self._started += 1
        self._block_calls += 1
        out.append(CallStart(cur.index, cur.id, name))

    def _maybe_start(self, cur: _Call, out: list[StreamEvent]) -> None:
        if cur.index is not None or cur.name is None:
            return
        if cur.args_end is not None or cur.args_text is not None or cur.args_start is not None:
            self._start(cur, cur.name, out)
            if cur.args_start is not None and cur.args_text is None:
                cur.emitted = cur.args_start

    def _send(self, cur: _Call, text: str, out: list[StreamEvent]) -> None:
        assert cur.index is not None
        cur.sent.append(text)
        out.append(ArgumentsDelta(cur.index, text))

    def _flush(self, cur: _Call, limit: int, out: list[StreamEvent]) -> None:
        """Send the arguments' text read so far (up to `limit`, never past their end)."""
        assert self._block is not None
        if cur.args_text is not None:
            if not cur.sent and cur.args_text:
                self._send(cur, cur.args_text, out)
            return
        if cur.args_start is None:
            return
        upto = min(limit, cur.args_end) if cur.args_end is not None else limit
        if upto > cur.emitted:
            self._send(cur, self._block[cur.emitted:upto], out)
            cur.emitted = upto

    def _end(self, cur: _Call, complete: bool, out: list[StreamEvent]) -> None:
        assert cur.index is not None and cur.name is not None
        call = ToolCall(cur.id, cur.name, "".join(cur.sent), complete=complete)
        self.calls.append(call)
        out.append(CallEnd(cur.index, call))
        if cur is self._call:
            self._call = None

    def _end_started(self, at: int, out: list[StreamEvent]) -> None:
        """End the started call as far as the block was good (up to `at`)."""
        cur = self._call
        assert cur is not None
        self._flush(cur, at, out)
        whole = cur.args_text is not None or cur.args_end is not None
        self._consumed = max(self._consumed, cur.args_end if cur.args_end is not None else
                             cur.emitted if cur.args_start is not None else at)
        self._end(cur, whole, out)

    # ---- the scanner ------------------------------------------------------------------------------
    def _read(self, out: list[StreamEvent]) -> None:
        """Advance over the block's unread text. Raises _Closed at a closing tag, _Malformed where the
        text stops being calls; otherwise leaves `_pos` at the end."""
        text = self._block
        assert text is not None
        closing = self.fmt.closing
        n = len(text)
        i = self._pos
        try:
            while i < n:
                token = self._token
                if token == "str":
                    if self._escape:
                        ch = text[i]
                        if self._escape == 1:
                            if ch == "u":
                                self._escape = 5
                            elif ch in '"\\/bfnrt':
                                self._escape = 0
                            else:
                                raise _Malformed(i)
                        elif ch in _HEX:
                            self._escape = 0 if self._escape == 2 else self._escape - 1
                        else:
                            raise _Malformed(i)
                        i += 1
                        continue
                    m = _STRING_STOP.search(text, i)
                    if m is None:
                        i = n
                        break
                    j = m.start()
                    if text[j] == "\\":
                        self._escape = 1
                        i = j + 1
                        continue
                    if text[j] != '"':
                        raise _Malformed(j)  # a control character: not JSON
                    i = j + 1
                    self._token = None
                    self._string_done(text, i, out)
                    continue
                ch = text[i]
                if token == "num":
                    if ch in _NUMBER_CHARS:
                        if not _NUMBER_PREFIX.fullmatch(text, self._token_start, i + 1):
                            raise _Malformed(i)
                        i += 1
                        continue
                    if not _NUMBER.fullmatch(text, self._token_start, i):
                        raise _Malformed(i)
                    self._token = None  # and `ch` is read below, where the number ended
                elif token == "lit":
                    word = text[self._token_start:i + 1]
                    if not any(w.startswith(word) for w in _LITERALS):
                        raise _Malformed(i)
                    i += 1
                    if word in _LITERALS:
                        self._token = None
                    continue
                if self._tag_start is not None:
                    if ch != closing[i - self._tag_start]:
                        raise _Malformed(self._tag_start)
                    i += 1
                    if i - self._tag_start == len(closing):
                        raise _Closed(self._tag_start, i)
                    continue
                if ch in _WS:
                    i += 1
                    continue
                if ch == closing[0]:
                    self._tag_start = i
                    i += 1
                    if len(closing) == 1:
                        raise _Closed(i - 1, i)
                    continue
                self._structural(text, i, ch, out)
                i += 1
        finally:
            self._pos = i

    def _structural(self, text: str, i: int, ch: str, out: list[StreamEvent]) -> None:
        """`ch` at `i`, outside any string, number or literal."""
        stack = self._stack
        if not stack:
            if self._top_done:
                raise _Malformed(i)  # only whitespace and the closing tag after the calls
            if ch == "{":
                self._open_call(i)
            elif ch == "[":
                stack.append(["a", "value_or_end", "calls"])
            else:
                raise _Malformed(i)
            return
        frame = stack[-1]
        kind, state, role = frame
        if kind == "o":
            if state in ("key_or_end", "key") and ch == '"':
                frame[1] = "colon"
                self._begin_token("str", i, "key" if role == "call" else None)
            elif state == "colon" and ch == ":":
                frame[1] = "value"
            elif state == "value":
                frame[1] = "comma_or_end"
                self._value(i, ch, role, out)
            elif state == "comma_or_end" and ch == ",":
                frame[1] = "key"
            elif state in ("key_or_end", "comma_or_end") and ch == "}":
                stack.pop()
                self._closed_value(i + 1, role, out)
            else:
                raise _Malformed(i)
            return
        if state in ("value_or_end", "value") and ch != "]":
            frame[1] = "comma_or_end"
            if role == "calls":
                if ch != "{":
                    raise _Malformed(i)
                self._open_call(i)
            else:
                self._value(i, ch, None, out)
        elif state == "comma_or_end" and ch == ",":
            frame[1] = "value"
        elif ch == "]" and state in ("value_or_end", "comma_or_end"):
            if role == "calls" and state == "value_or_end":
                raise _Malformed(i)  # an empty list calls nothing
            stack.pop()
            self._closed_value(i + 1, role, out)
        else:
            raise _Malformed(i)

    def _begin_token(self, kind: str, i: int, capture: str | None = None) -> None:
        self._token, self._token_start, self._capture, self._escape = kind, i, capture, 0

    def _open_call(self, i: int) -> None:
        self._stack.append(["o", "key_or_end", "call"])
        self._call = _Call(i)

    def _value(self, i: int, ch: str, parent_role: str | None, out: list[StreamEvent]) -> None:
        """A value begins at `i` with `ch`, inside a frame of `parent_role`."""
        capture = None
        if parent_role == "call":
            cur = self._call
            assert cur is not None
            if cur.key == "name":
                if ch != '"':
                    raise _Malformed(i)
                capture = "name"
            elif cur.key == "args":
                cur.args_start = i
                if ch == "{":
                    self._stack.append(["o", "key_or_end", "args"])
                    self._maybe_start(cur, out)
                    return
                if ch != '"':
                    raise _Malformed(i)  # arguments are an object (or its JSON text)
                capture = "args"
        if ch == '"':
            self._begin_token("str", i, capture)
        elif ch == "{":
            self._stack.append(["o", "key_or_end", None])
        elif ch == "[":
            self._stack.append(["a", "value_or_end", None])
        elif ch == "-" or "0" <= ch <= "9":
            self._begin_token("num", i)
        elif ch in "tfn":
            self._begin_token("lit", i)
        else:
            raise _Malformed(i)

    def _string_done(self, text: str, end: int, out: list[StreamEvent]) -> None:
        capture, start = self._capture, self._token_start
        self._capture = None
        if capture is None:
            return
        cur = self._call
        assert cur is not None
        value = json.loads(text[start:end])
        if capture == "key":
            if value == _NAME_KEY:
                if cur.name is not None or cur.key == "name":
                    raise _Malformed(start)
                cur.key = "name"
            elif value in _ARGS_KEYS:
                if cur.args_start is not None:
                    raise _Malformed(start)  # two arguments members: which one is meant is anyone's guess
                cur.key = "args"
            else:
                cur.key = None
        elif capture == "name":
            if value not in self.known:
                raise _Malformed(start)
            cur.name, cur.key = value, None
            self._maybe_start(cur, out)
        else:  # arguments as the JSON text of an object
            try:
                args = json.loads(value)
            except ValueError:
                raise _Malformed(start) from None
            if not isinstance(args, dict):
                raise _Malformed(start)
            cur.args_text, cur.args_end, cur.key = value, end, None
            self._maybe_start(cur, out)

    def _closed_value(self, end: int, role: str | None, out: list[StreamEvent]) -> None:
        """A container closed just before `end`."""
        cur = self._call
        if role == "args":
            assert cur is not None
            cur.args_end, cur.key = end, None
        elif role == "call":
            assert cur is not None
            if cur.name is None:
                raise _Malformed(cur.start)  # a call names its function
            if cur.args_start is None:
                cur.args_text = "{}"
            self._maybe_start(cur, out)
            self._flush(cur, end, out)
            self._end(cur, True, out)
            self._consumed = end
        if not self._stack:
            self._top_done = True


def parse_tool_calls(text: str, fmt: ToolFormat, known_names: Collection[str],
                     make_id: Callable[[], str] = new_call_id, truncated: bool = False) -> ParsedReply:
    """A whole reply: its text (None if it was only calls and whitespace) and its calls (`truncated`:
    the reply was cut by max_tokens, so a block it left open holds partial calls). The same parser
    as the stream, fed the whole text: the same calls, the same text."""
    parser = ToolCallStreamParser(fmt, known_names, make_id)
    events = parser.feed(text) + parser.finish(truncated)
    content = "".join(e.text for e in events if isinstance(e, TextEvent))
    if parser.calls and not content.strip():
        return ParsedReply(None, parser.calls)
    return ParsedReply(content, parser.calls)
