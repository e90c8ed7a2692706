"""Reading a JSON call object that was cut off (max_tokens) at any character.

The stream parser (`chatserve.tools.json_reader`) reads whole calls as they arrive; when a reply's
token budget ends inside one before its name and arguments were both known, `partial_call` names the
call (its written name, or the one known tool a cut name or no name can only be) and gives its
arguments' text as far as generated, as vLLM does for a named tool choice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

_WS = " \t\n\r"
CUT_KEY = "\x00"  # marks a member name cut before its closing quote (_partial_object)


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def _value_end(text: str, i: int) -> int | None:
    """Where the JSON value starting at `i` ends (one past it); None if `text` ends first. Assumes a
    well-formed prefix (what a grammar let through): only strings and nesting are tracked."""
    if i >= len(text):
        return None
    if text[i] not in '"{[':  # a number, true, false or null: up to the next delimiter
        for j in range(i, len(text)):
            if text[j] in _WS or text[j] in ",}]":
                return j
        return None
    depth, in_string, escaped = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
                if depth == 0:
                    return j + 1
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def _partial_string(text: str) -> str:
    """The characters of a string literal cut before its closing quote (`text` starts after the opening one)."""
    for cut in (text, text[:-1], text[:-2], text[:-3], text[:-4], text[:-5]):  # a cut escape sequence
        try:
            return str(json.loads('"' + cut + '"'))
        except ValueError:
            continue
    return ""


def _partial_object(text: str, i: int) -> tuple[dict[str, tuple[int, int | None]], int | None]:
    """The members of the object starting at `text[i] == "{"`, cut anywhere: {key: (value start, value
    end or None)}, and where the object ends (None: cut). A key cut in the middle is CUT_KEY + its prefix."""
    members: dict[str, tuple[int, int | None]] = {}
    i = _skip_ws(text, i + 1)
    while i < len(text):
        if text[i] == "}":
            return members, i + 1
        if text[i] == ",":
            i = _skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            return members, None
        key_end = _value_end(text, i)
        if key_end is None:
            members[CUT_KEY + _partial_string(text[i + 1:])] = (len(text), None)
            return members, None
        key = str(json.loads(text[i:key_end]))
        i = _skip_ws(text, key_end)
        if i >= len(text) or text[i] != ":":
            members[key] = (len(text), None)
            return members, None
        start = _skip_ws(text, i + 1)
        end = _value_end(text, start)
        members[key] = (start, end)
        if end is None:
            return members, None
        i = _skip_ws(text, end)
    return members, None


@dataclass(frozen=True)
class PartialCall:
    """A call read out of a block that was cut off (max_tokens): its arguments are the text as far as
    it was generated, as generated (`complete`: they are a whole JSON object)."""

    name: str
    arguments: str
    complete: bool


def _name_of(text: str, members: dict[str, tuple[int, int | None]], known: list[str]) -> str | None:
    """The call's function: its whole name if known, else the one known name its cut name (or, with
    no name written yet, the one known name) can be."""
    span = members.get("name")
    if span is not None and span[1] is not None:
        name = json.loads(text[span[0]:span[1]])
        return name if isinstance(name, str) and name in known else None
    if span is not None:  # cut inside the name's string
        prefix = _partial_string(text[span[0] + 1:]) if text[span[0]:span[0] + 1] == '"' else ""
    else:
        cut_keys = [k[1:] for k in members if k.startswith(CUT_KEY)]
        if any(k for k in members if not k.startswith(CUT_KEY)) or (cut_keys and not "name".startswith(cut_keys[0])):
            return None
        prefix = ""
    matches = [n for n in known if n.startswith(prefix)]
    return matches[0] if len(matches) == 1 else None


def _partial_call(text: str, start: int, known: list[str]) -> tuple[PartialCall | None, int | None]:
    members, end = _partial_object(text, start)
    name = _name_of(text, members, known)
    if name is None:
        return None, end
    span = members.get("arguments", members.get("parameters"))
    if span is None:
        return PartialCall(name, "", False), end
    raw = text[span[0]:span[1] if span[1] is not None else len(text)]
    if raw.startswith('"'):  # the arguments as a JSON string holding their JSON text
        raw = str(json.loads(raw)) if span[1] is not None else _partial_string(raw[1:])
    try:
        whole = isinstance(json.loads(raw), dict)
    except ValueError:
        whole = False
    return PartialCall(name, raw, whole), end


def partial_call(text: str, start: int, known: list[str]) -> PartialCall | None:
    """The call whose object starts at `text[start] == "{"` and was cut off at the end of `text`: its
    function (the name written, or the one of `known` a cut name or no name can only be) and its
    arguments' text as far as generated; None if it cannot be named."""
    return _partial_call(text, start, known)[0]
