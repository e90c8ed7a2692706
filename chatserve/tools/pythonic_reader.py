"""The block reader of pythonic calls: a Python list of calls with keyword arguments,
`[get_weather(city="Paris", days=3), get_time()]` (Llama 3.2 / 4's pythonic format, vLLM's `pythonic`).

The block is the list from its `[`. A call starts at `name(` when name is a tool of the request. Its
arguments stream as the JSON object the keyword arguments make: `{"city": "` as soon as a string value
opens, its characters as they are generated (Python escapes decoded), `"` at its closing quote; any
other value (numbers, True/False/None, lists, dicts; JSON's true/false/null are taken too) is sent
whole once it ends. `)` closes the object. A `[` that does not begin such a list is text.
"""

from __future__ import annotations

import ast
import re

from chatserve.tools.arguments import ArgumentsWriter, escaped, json_text, literal_value
from chatserve.tools.events import WS, BlockReader, CallSink, OpenCall, StreamEvent, only_known_with_prefix

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]*")
_OPEN, _CLOSE = "([{", ")]}"


class _Malformed(Exception):
    def __init__(self, at: int) -> None:
        self.at = at


def _value_end(text: str, i: int) -> int | None:
    """Where a non-string literal starting at `i` ends (at the `,` or `)` after it); None: not yet known."""
    depth, quote, j = 0, "", i
    while j < len(text):
        ch = text[j]
        if quote:
            if ch == "\\":
                j += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in _OPEN:
            depth += 1
        elif ch in _CLOSE:
            if depth == 0:
                return j if ch == ")" else -1
            depth -= 1
        elif ch == "," and depth == 0:
            return j
        j += 1
    return None


class PythonicBlockReader(BlockReader):
    def __init__(self, sink: CallSink, block: str, pos: int) -> None:
        super().__init__(sink, block, pos + 1)  # past the "["
        self._state = "call"  # call, paren, arg, equals, value, string, next_arg, next_call
        self._mark = pos + 1
        self._call: OpenCall | None = None
        self._writer = ArgumentsWriter()
        self._key = ""
        self._quote = ""
        self._pending_name = ""  # the function of the call whose "(" is next (it starts with its first argument)

    def scan(self, out: list[StreamEvent]) -> bool:
        try:
            return self._read(out)
        except _Malformed as bad:
            at = max(bad.at, 1)
            if self._call is not None:
                self.end_call(self._call, False, out)
                self._call = None
            self.release(at, out)
            self.leave(at)
            return True

    def finish(self, truncated: bool, out: list[StreamEvent]) -> None:
        cut = len(self.block)
        if self._call is None and truncated and self._block_calls == 0 and self._state in ("call", "paren", "arg"):
            name = self._pending_name if self._state != "call" else \
                only_known_with_prefix(self.sink.known, self.block[self._mark:].strip())
            if name is not None:
                self.end_call(self.start_call(name, out), False, out)
                self._consumed = cut
        elif self._call is not None:
            self.end_call(self._call, False, out)
            self._call = None
            self._consumed = cut
        self.release(cut, out)

    def _read(self, out: list[StreamEvent]) -> bool:
        text = self.block
        while True:
            i = self._pos
            if self._state not in ("string", "value"):
                while i < len(text) and text[i] in WS:
                    i += 1
                self._pos = i
                if i >= len(text):
                    return False
            state = self._state
            if state in ("call", "arg"):
                m = _NAME.match(text, i)
                if m is None:
                    if state == "arg" and text[i] == ")":
                        self._end_call(i, out)
                        continue
                    raise _Malformed(i)
                if m.end() == len(text):
                    self._mark = i  # the name may go on
                    return False
                if state == "call":
                    self._name_read(text[i:m.end()], i, out)
                else:
                    self._key, self._state = text[i:m.end()], "equals"
                self._pos = m.end()
            elif state == "paren":
                if text[i] != "(":
                    raise _Malformed(self._mark)
                self._state, self._pos = "arg", i + 1
            elif state == "equals":
                if text[i] != "=":
                    raise _Malformed(i)
                self._state, self._pos = "value", i + 1
            elif state == "value":
                if not self._value(text, out):
                    return False
            elif state == "string":
                if not self._string(text, out):
                    return False
            elif state == "next_arg":
                if text[i] not in ",)":
                    raise _Malformed(i)
                if text[i] == ")":
                    self._end_call(i, out)
                else:
                    self._state, self._pos = "arg", i + 1
            else:  # next_call
                if text[i] == ",":
                    self._state, self._pos = "call", i + 1
                elif text[i] == "]":
                    self.leave(i + 1)
                    return True
                else:
                    raise _Malformed(i)

    def _name_read(self, name: str, at: int, out: list[StreamEvent]) -> None:
        if name not in self.sink.known:
            raise _Malformed(at)
        self._mark = at
        self._state = "paren"
        self._pending_name = name

    def _end_call(self, i: int, out: list[StreamEvent]) -> None:
        call = self._started(out)  # (`name()` with no arguments starts and ends here)
        self.send(call, self._writer.close(), out)
        self.end_call(call, True, out)
        self._call = None
        self._consumed = i + 1
        self._state, self._pos = "next_call", i + 1

    def _started(self, out: list[StreamEvent]) -> OpenCall:
        if self._call is None:
            self._call = self.start_call(self._pending_name, out)
            self._writer = ArgumentsWriter()
        return self._call

    def _value(self, text: str, out: list[StreamEvent]) -> bool:
        i = self._pos
        while i < len(text) and text[i] in WS:
            i += 1
        if i >= len(text):
            return False
        if text[i] in "'\"":
            if text.startswith(text[i] * 3, i):
                raise _Malformed(i)  # triple-quoted strings are not part of the format
            if i + 2 >= len(text) and text[i + 1:] in ("", text[i]):
                return False  # an empty string or the start of a triple quote: not known yet
            call = self._started(out)
            self.send(call, self._writer.key(self._key, True), out)
            self._quote, self._state, self._pos, self._mark = text[i], "string", i + 1, i + 1
            return True
        end = _value_end(text, i)
        if end is None:
            return False
        try:
            if end < 0:
                raise ValueError
            value = literal_value(text[i:end].strip())
        except ValueError:
            raise _Malformed(i) from None
        call = self._started(out)
        self.send(call, self._writer.key(self._key, False) + json_text(value), out)
        self._state, self._pos = "next_arg", end
        return True

    def _string(self, text: str, out: list[StreamEvent]) -> bool:
        """Stream a string value's characters up to its closing quote (an escape goes once it is whole)."""
        assert self._call is not None
        i = self._pos
        while i < len(text):
            ch = text[i]
            if ch == self._quote:
                self.send(self._call, escaped(self._decode(self._mark, i)) + '"', out)
                self._state, self._pos = "next_arg", i + 1
                return True
            if ch == "\n":
                raise _Malformed(i)
            if ch == "\\":
                end = self._escape_end(text, i)
                if end is None:
                    break
                i = end
                continue
            i += 1
        if i > self._mark:
            self.send(self._call, escaped(self._decode(self._mark, i)), out)
            self._mark = i
        self._pos = i
        return False

    def _decode(self, start: int, end: int) -> str:
        try:
            return str(ast.literal_eval(self._quote + self.block[start:end] + self._quote))
        except (ValueError, SyntaxError):
            raise _Malformed(start) from None

    @staticmethod
    def _escape_end(text: str, i: int) -> int | None:
        """One past the escape sequence at `text[i] == "\\"`; None if it is not whole yet."""
        if i + 1 >= len(text):
            return None
        width = {"x": 4, "u": 6, "U": 10}.get(text[i + 1], 2)
        return i + width if i + width <= len(text) else None
