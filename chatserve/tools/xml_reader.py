"""The block reader of qwen3_coder's XML calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A call starts at `<function=NAME>` when NAME is a tool of the request. Its arguments stream as the JSON
object the parameters make: `{"city": "` as soon as `<parameter=city>` is read, then the value's
characters as they are generated (one newline after the opening tag and one before the closing tag are
the template's, not the value's, as in Qwen's template and vLLM's parser), then `"`; a parameter
whose schema is not free text (an integer, an object, an enum...) is sent whole once its `</parameter>`
arrives, without the whitespace around it, typed from the schema (`chatserve.tools.arguments.typed_value`). `</function>` closes the
object. A block that is not such a call (no `<function=`, an unknown function) is text.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chatserve.tools.arguments import ArgumentsWriter, escaped, is_string_parameter, json_text, parameter_types, typed_value
from chatserve.tools.events import WS, BlockReader, CallSink, OpenCall, StreamEvent, only_known_with_prefix
from chatserve.tools.formats import ToolFormat

_FUNCTION, _PARAMETER = "<function=", "<parameter="
_END_PARAMETER, _END_FUNCTION = "</parameter>", "</function>"


class _Malformed(Exception):
    def __init__(self, at: int) -> None:
        self.at = at


def _literal_at(text: str, i: int, literal: str) -> bool | None:
    """Whether `literal` is at `text[i:]` (None: `text` ends inside what could still be it)."""
    have = text[i:i + len(literal)]
    if have == literal:
        return True
    return None if literal.startswith(have) else False


def _held_suffix(text: str, closing: str) -> int:
    """How many characters at the end of `text` could begin `closing`."""
    for k in range(min(len(closing) - 1, len(text)), 0, -1):
        if closing.startswith(text[-k:]):
            return k
    return 0


class XmlBlockReader(BlockReader):
    def __init__(self, sink: CallSink, fmt: ToolFormat, block: str, pos: int) -> None:
        super().__init__(sink, block, pos)
        self.closing = fmt.closing
        self._state = "open"  # open, name, body, param, value, after
        self._mark = pos  # where the name or value being read began
        self._call: OpenCall | None = None
        self._writer = ArgumentsWriter()
        self._param = ""
        self._string = False  # the value being read streams as text
        self._value_sent = 0  # the value's characters already sent

    def _schema(self) -> Mapping[str, Any] | None:
        assert self._call is not None
        return self.sink.schemas.get(self._call.name)

    def scan(self, out: list[StreamEvent]) -> bool:
        try:
            return self._read(out)
        except _Malformed as bad:
            if self._call is not None:
                self.end_call(self._call, False, out)
                self._call = None
            self.release(bad.at, out)
            self.leave(bad.at)
            return True

    def finish(self, truncated: bool, out: list[StreamEvent]) -> None:
        cut = len(self.block)
        if self._call is None and truncated and self._block_calls == 0:
            name = None
            if self._state == "name":
                name = only_known_with_prefix(self.sink.known, self.block[self._mark:])
            elif self._state == "open" and len(self.sink.known) == 1:
                name = next(iter(self.sink.known))
            if name is not None:
                self.end_call(self.start_call(name, out), False, out)
                self._consumed = cut
        elif self._call is not None:
            if self._state == "value" and self._string:
                self._stream_value(out, final=False)
            self.end_call(self._call, False, out)
            self._call = None
            self._consumed = cut
        elif self._state == "after":
            self._consumed = cut  # a cut closing tag: markup
        self.release(cut, out)

    def _read(self, out: list[StreamEvent]) -> bool:
        text = self.block
        while True:
            i = self._pos
            if self._state in ("open", "body", "after"):
                while i < len(text) and text[i] in WS:
                    i += 1
                self._pos = i
                if i >= len(text):
                    return False
            if self._state == "open":
                found = _literal_at(text, i, _FUNCTION)
                if found is None:
                    return False
                if not found:
                    raise _Malformed(i)
                self._state, self._pos = "name", i + len(_FUNCTION)
                self._mark = self._pos
            elif self._state == "name":
                end = text.find(">", i)
                if end < 0:
                    if "<" in text[i:] or "\n" in text[i:]:
                        raise _Malformed(self._mark)
                    self._pos = len(text)
                    return False
                name = text[self._mark:end].strip()
                if name not in self.sink.known:
                    raise _Malformed(self._mark)
                self._call = self.start_call(name, out)
                self._writer = ArgumentsWriter()
                self._state, self._pos = "body", end + 1
            elif self._state == "body":
                if (param := _literal_at(text, i, _PARAMETER)) is True:
                    self._state, self._pos = "param", i + len(_PARAMETER)
                    self._mark = self._pos
                elif (done := _literal_at(text, i, _END_FUNCTION)) is True:
                    assert self._call is not None
                    self.send(self._call, self._writer.close(), out)
                    self.end_call(self._call, True, out)
                    self._call = None
                    self._state, self._pos = "after", i + len(_END_FUNCTION)
                    self._consumed = self._pos
                elif param is None or done is None:
                    return False
                else:
                    raise _Malformed(i)
            elif self._state == "param":
                end = text.find(">", i)
                if end < 0:
                    self._pos = len(text)
                    return False
                self._param = text[self._mark:end].strip()
                self._string = is_string_parameter(self._schema(), self._param)
                if self._string:
                    assert self._call is not None
                    self.send(self._call, self._writer.key(self._param, True), out)
                self._state, self._pos, self._mark, self._value_sent = "value", end + 1, end + 1, 0
            elif self._state == "value":
                end = text.find(_END_PARAMETER, self._mark)
                if end < 0:
                    if self._string:
                        self._stream_value(out, final=False)
                    return False
                self._pos = end
                self._value_done(out)
                self._state, self._pos = "body", end + len(_END_PARAMETER)
            else:  # after the function: the closing tag
                found = _literal_at(text, i, self.closing)
                if found is None:
                    return False
                if not found:
                    raise _Malformed(i)
                self.leave(i + len(self.closing))
                return True

    def _value_text(self, upto: int) -> str:
        """The value as written up to `upto`, less the template's newline after the opening tag."""
        raw = self.block[self._mark:upto]
        return raw[1:] if raw.startswith("\n") else raw

    def _stream_value(self, out: list[StreamEvent], final: bool) -> None:
        """Send the string value's characters that cannot be the closing tag's start (or the newline before it)."""
        assert self._call is not None
        upto = len(self.block)
        if not final:
            if upto - self._mark < 1:
                return  # the value's first character may be the template's newline
            written = self.block[self._mark:]  # the closing tag may come with or without the template's newline
            upto -= max(_held_suffix(written, "\n" + _END_PARAMETER), _held_suffix(written, _END_PARAMETER))
        value = self._value_text(upto)
        if value[self._value_sent:]:
            self.send(self._call, escaped(value[self._value_sent:]), out)
            self._value_sent = len(value)

    def _value_done(self, out: list[StreamEvent]) -> None:
        assert self._call is not None
        value = self._value_text(self._pos)
        value = value[:-1] if value.endswith("\n") else value
        if self._string:
            rest = value[self._value_sent:]
            self.send(self._call, (escaped(rest) if rest else "") + '"', out)
            return
        # NOTE: the grammar (xgrammar's qwen_xml) takes whitespace around a value as layout, so a value that is not
        # streamed text (a number, an enum's word, an object) is read without it
        typed = typed_value(value.strip(), parameter_types(self._schema(), self._param))
        self.send(self._call, self._writer.key(self._param, False) + json_text(typed), out)
