"""The block reader of the JSON formats (hermes, xlam, llama3_json, mistral): an incremental JSON scanner.

Each character is looked at once. It knows when it is inside a string, so a closing tag inside an
argument's string is text of that argument, not the end of the block. A call object is
`{"name": ..., "arguments" | "parameters": {...} or its JSON text}` in any member order; a block holds
one, a list of them (xlam, mistral v3), several separated by the format's `call_separator` (llama's
`;`), or mistral's `name[ARGS]{...}` (v11) or `name[CALL_ID]id[ARGS]{...}` (v13, whose id, 9 alphanumerics,
becomes the call's). A call starts once its name names a known tool and its
arguments object has begun; its arguments then stream as their JSON text exactly as generated, each
piece sent once the scanner checked it continues valid JSON.

A format without a closing tag (llama3_json, mistral) ends the block where its calls end: at the
first character after them that is not whitespace or a separator.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from chatserve.tools.events import WS, BlockReader, CallSink, OpenCall, StreamEvent, only_known_with_prefix
from chatserve.tools.formats import ToolFormat
from chatserve.tools.json_partial import partial_call

_HEX = frozenset("0123456789abcdefABCDEF")
_STRING_STOP = re.compile(r'["\\\x00-\x1f]')
_NUMBER_CHARS = frozenset("0123456789+-.eE")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_NUMBER_PREFIX = re.compile(r"-?(?:(?:0|[1-9][0-9]*)(?:\.[0-9]*|(?:\.[0-9]+)?[eE][+-]?[0-9]*)?)?")
_BARE_NAME = re.compile(r"[A-Za-z0-9_.\-]*")
_BARE_ID = re.compile(r"[A-Za-z0-9]*")
_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")
_LITERALS = ("true", "false", "null")
_NAME_KEY, _ARGS_KEYS = "name", ("arguments", "parameters")
_ARGS_TAG, _CALL_ID_TAG = "[ARGS]", "[CALL_ID]"
_BARE_TAGS = (_ARGS_TAG, _CALL_ID_TAG)  # what may follow mistral's bare name


class _Malformed(Exception):
    """The block stopped being calls of known tools at `at` (a position in the block)."""

    def __init__(self, at: int) -> None:
        self.at = at


class _Closed(Exception):
    """The block's end spans block[start:end] (its closing tag; empty for a format without one)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end


@dataclass
class _Call:
    """The call object being read: where it is in the block and what is known of it."""

    start: int  # its "{" (a bare name's first character)
    key: str | None = None  # what the member being read is: "name", "args" or None (another key)
    name: str | None = None
    bare: bool = False  # mistral's name[ARGS]{...}: the arguments object is the call
    call_id: str | None = None  # mistral v13's own id (name[CALL_ID]id[ARGS]), when it is 9 alphanumerics
    args_start: int | None = None  # the arguments value's first character
    args_end: int | None = None  # one past its last, once it is whole
    args_text: str | None = None  # arguments given as a JSON string (decoded), or "{}" when there are none
    open: OpenCall | None = None  # set when the call started
    emitted: int = 0  # block position up to which the arguments' text was sent


class JsonBlockReader(BlockReader):
    def __init__(self, sink: CallSink, fmt: ToolFormat, block: str, pos: int) -> None:
        super().__init__(sink, block, pos)
        self.fmt = fmt
        self._stack: list[list[str | None]] = []  # frames [kind "o"/"a", state, role "calls"/"call"/"args"/None]
        self._top_done = False
        self._token: str | None = None  # inside a "str", "num", "lit", "bare" (a bare name) or "id" (mistral's call id)
        self._token_start = 0
        self._escape = 0  # in a string: 1 after a backslash, 2..5 inside a \uXXXX
        self._capture: str | None = None  # what the string being read is: "key", "name", "args" or None
        self._tag_start: int | None = None  # a closing tag (or mistral's [ARGS] / [CALL_ID]) being matched from here
        self._tag = fmt.closing
        self._call: _Call | None = None

    # ---- the block --------------------------------------------------------------------------------
    def scan(self, out: list[StreamEvent]) -> bool:
        try:
            self._read(out)
        except _Closed as closed:
            if self._top_done:
                self.leave(closed.end)
            else:  # closed before its calls were: what was started ends, the closing tag goes with it
                self._malformed(closed.start, closed.end if self._block_calls else closed.start, out)
            return True
        except _Malformed as bad:
            self._malformed(bad.at, bad.at, out)
            return True
        cur = self._call
        if cur is not None and cur.open is not None:
            self._flush(cur, self._tag_start if self._tag_start is not None else self._pos, out)
        return False

    def finish(self, truncated: bool, out: list[StreamEvent]) -> None:
        """The reply ended inside the block. An unclosed block that no call started from is text, unless
        the reply was `truncated` (cut by max_tokens) and its call can be named: then it is a call,
        partial. A started call ends as far as it got."""
        block, cur = self.block, self._call
        cut = self._tag_start if self._tag_start is not None and self._tag == self.fmt.closing else len(block)
        if cur is not None and cur.open is None and truncated:
            p = partial_call(block[:cut], cur.start, sorted(self.sink.known)) if not cur.bare else None
            name = p.name if p is not None else cur.name if cur.bare else None
            if name is not None:
                self._start(cur, name, out)
                if p is not None and p.arguments:
                    self._send(cur, p.arguments, out)
                self._end(cur, p is not None and p.complete, out)
                self._consumed = cut
        elif cur is None and truncated and self._block_calls == 0:
            name = self._cut_name(cut)
            if name is not None:
                only = _Call(cut)
                self._start(only, name, out)
                self._end(only, False, out)
                self._consumed = cut
        if self._call is not None and self._call.open is not None:
            self._end_started(cut, out)
        # a cut closing tag is the calls' markup; with no call in the block it is text like the rest
        self.release(cut if self._block_calls else len(block), out)

    def _cut_name(self, cut: int) -> str | None:
        """The one tool a block cut before any call was named can call: the only tool, or the one a cut
        bare name (mistral v11) can only be."""
        if self._token == "bare":
            return only_known_with_prefix(self.sink.known, self.block[self._token_start:cut])
        if self._tag_start is not None and self._tag in _BARE_TAGS:
            name = self.block[self._token_start:self._tag_start]
            return name if name in self.sink.known else None
        if len(self.sink.known) == 1 and self._nothing_yet():
            return next(iter(self.sink.known))
        return None

    def _malformed(self, at: int, resume: int, out: list[StreamEvent]) -> None:
        """The block is not calls from `at` on: end what started, release what is not a call as text, and
        read on from `resume` outside a block."""
        if at == resume == 0:  # a kept opening ("{") that begins no call: it is text, and reading goes on after it
            at = resume = 1
        cur = self._call
        if cur is not None and cur.open is not None:
            self._end_started(at, out)
        self.release(at, out)
        self.leave(resume)

    def _nothing_yet(self) -> bool:
        """Only whitespace after the opening, or a list's "[" and whitespace."""
        if not self._stack:
            return not self._top_done and self._token is None
        return len(self._stack) == 1 and self._stack[0][2] == "calls" and self._stack[0][1] == "value_or_end"

    # ---- calls ------------------------------------------------------------------------------------
    def _start(self, cur: _Call, name: str, out: list[StreamEvent]) -> None:
        cur.name = name
        cur.open = self.start_call(name, out, cur.call_id)

    def _maybe_start(self, cur: _Call, out: list[StreamEvent]) -> None:
        if cur.open is not None or cur.name is None:
            return
        if cur.args_end is not None or cur.args_text is not None or cur.args_start is not None:
            self._start(cur, cur.name, out)
            if cur.args_start is not None and cur.args_text is None:
                cur.emitted = cur.args_start

    def _send(self, cur: _Call, text: str, out: list[StreamEvent]) -> None:
        assert cur.open is not None
        self.send(cur.open, text, out)

    def _flush(self, cur: _Call, limit: int, out: list[StreamEvent]) -> None:
        """Send the arguments' text read so far (up to `limit`, never past their end)."""
        assert cur.open is not None
        if cur.args_text is not None:
            if not cur.open.sent and cur.args_text:
                self._send(cur, cur.args_text, out)
            return
        if cur.args_start is None:
            return
        upto = min(limit, cur.args_end) if cur.args_end is not None else limit
        if upto > cur.emitted:
            self._send(cur, self.block[cur.emitted:upto], out)
            cur.emitted = upto

    def _end(self, cur: _Call, complete: bool, out: list[StreamEvent]) -> None:
        assert cur.open is not None
        self.end_call(cur.open, complete, out)
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
        """Advance over the block's unread text. Raises _Closed at the block's end, _Malformed where the
        text stops being calls; otherwise leaves `_pos` at the end."""
        text = self.block
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
                if token == "bare":
                    j = _BARE_NAME.match(text, i).end()  # type: ignore[union-attr]
                    if j == n:
                        i = n
                        break
                    if text[j] != "[":
                        raise _Malformed(self._token_start)
                    self._token, self._tag, self._tag_start = None, _ARGS_TAG, j
                    i = j + 1
                    continue
                if token == "id":  # mistral v13's call id, then [ARGS]
                    j = _BARE_ID.match(text, i).end()  # type: ignore[union-attr]
                    if j == n:
                        i = n
                        break
                    cur = self._call
                    assert cur is not None
                    if text[j] != "[":
                        raise _Malformed(cur.start)
                    own = text[self._token_start:j]
                    cur.call_id = own if _MISTRAL_ID.fullmatch(own) else None  # else the format's own kind of id
                    self._token, self._tag, self._tag_start = None, _ARGS_TAG, j
                    i = j + 1
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
                    if ch != self._tag[i - self._tag_start]:
                        self._other_bare_tag(text, i)
                    i += 1
                    if i - self._tag_start == len(self._tag):
                        if self._tag in _BARE_TAGS:
                            self._bare_tag_done(i)
                            continue
                        raise _Closed(self._tag_start, i)
                    continue
                if ch in WS:
                    i += 1
                    continue
                closing = self.fmt.closing
                if closing and ch == closing[0]:
                    self._tag_start = i
                    i += 1
                    if len(closing) == 1:
                        raise _Closed(i - 1, i)
                    continue
                self._structural(text, i, ch, out)
                i += 1
        finally:
            self._pos = i

    def _other_bare_tag(self, text: str, i: int) -> None:
        """`text[i]` does not continue the tag being matched: right after a bare name, the other tag that
        may follow it ([ARGS] or [CALL_ID]) is matched instead if it fits; anything else is malformed."""
        assert self._tag_start is not None
        if self._tag not in _BARE_TAGS:
            raise _Malformed(self._tag_start)
        cur = self._call
        if cur is None:  # after the name: either tag
            seen = text[self._tag_start:i + 1]
            other = next((t for t in _BARE_TAGS if t.startswith(seen)), None)
            if other is not None:
                self._tag = other
                return
        raise _Malformed(cur.start if cur is not None else self._token_start)

    def _bare_tag_done(self, end: int) -> None:
        """mistral's `name[ARGS]` or `name[CALL_ID]` is read (or, after the id, its `[ARGS]`): the call's
        arguments object comes next, or first its id."""
        cur = self._call
        if cur is None:
            assert self._tag_start is not None
            name = self.block[self._token_start:self._tag_start]
            if name not in self.sink.known:
                raise _Malformed(self._token_start)
            self._call = _Call(self._token_start, key="args", name=name, bare=True)
            if self._tag == _CALL_ID_TAG:
                self._begin_token("id", end)
        self._tag_start, self._tag = None, self.fmt.closing

    def _structural(self, text: str, i: int, ch: str, out: list[StreamEvent]) -> None:
        """`ch` at `i`, outside any string, number or literal."""
        stack = self._stack
        if not stack:
            cur = self._call
            if cur is not None and cur.bare and cur.args_start is None:
                if ch != "{":
                    raise _Malformed(i)
                cur.args_start = i
                stack.append(["o", "key_or_end", "args"])
                self._maybe_start(cur, out)
            elif self._top_done:
                if self.fmt.call_separator and ch == self.fmt.call_separator:
                    self._top_done = False  # another call follows in this block
                elif self.fmt.closing:
                    raise _Malformed(i)  # only whitespace and the closing tag after the calls
                else:
                    raise _Closed(self._consumed, self._consumed)  # what follows is outside the block
            elif ch == "{":
                self._open_call(i)
            elif ch == "[":
                stack.append(["a", "value_or_end", "calls"])
            elif self.fmt.bare_name and (ch.isalnum() or ch == "_"):
                self._begin_token("bare", i)
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
            if value not in self.sink.known:
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
            if cur.bare:  # mistral's name[ARGS]{...}: the call is over with its arguments
                self._call_done(cur, end, out)
        elif role == "call":
            assert cur is not None
            if cur.name is None:
                raise _Malformed(cur.start)  # a call names its function
            if cur.args_start is None:
                cur.args_text = "{}"
            self._call_done(cur, end, out)
        elif role == "calls":
            self._consumed = end  # the list's "]": markup of the calls
        if not self._stack:
            self._top_done = True

    def _call_done(self, cur: _Call, end: int, out: list[StreamEvent]) -> None:
        self._maybe_start(cur, out)
        self._flush(cur, end, out)
        self._end(cur, True, out)
        self._consumed = end
