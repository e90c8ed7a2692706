"""Bounds on the JSON a client nests inside a request, and on what the server writes back.

A request body is parsed by pydantic (whose JSON parser has its own nesting limit and refuses
lone surrogate escapes), but two kinds of JSON inside it are the server's to check:

- **Values the server walks**: a JSON schema (`response_format`, tool `parameters`, Anthropic's
  `input_schema`, ...) is validated by jsonschema and compiled by xgrammar, both recursive, so a
  schema nested a hundred levels deep would be a `RecursionError` (a 500). `check_value` walks a
  value once, without recursion, and refuses it past `MAX_DEPTH` container levels, with a number
  that is not finite (NaN cannot be written back as JSON), or with a lone surrogate.
- **JSON sent as text** (`guided_json` as a string, a tool call's `arguments`): `json.loads`
  recurses too, and decodes `"\\ud800"` into a lone surrogate that no tokenizer or UTF-8 encoder
  takes. `load_text` measures the nesting *before* parsing (a linear scan), parses, then checks
  the value as above.

On the way out, `escape_surrogates` makes JSON text that holds a lone surrogate (a model's reply
can decode to one: a tool call whose arguments say `"\\ud800"`) encodable as UTF-8, by writing
each as its `\\uXXXX` escape, which is what the model wrote.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from typing import Any

MAX_DEPTH = 64
"""The most container levels (objects and arrays) a schema or a JSON text may nest. A schema that
deep has 32 levels of `properties`; no real tool or response schema comes near."""

_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_SURROGATE = re.compile("[\ud800-\udfff]")


class JSONLimitError(ValueError):
    """A value or text past one of the bounds; the message says which, without echoing the value."""


def text_depth(text: str) -> int:
    """How deep the arrays and objects of JSON `text` nest, found without parsing it (strings are
    skipped as JSON reads them, so a bracket inside one does not count); linear in the text."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    if not brackets:
        return 0
    return max(0, max(itertools.accumulate(map(_STEP.__getitem__, brackets))))


def check_value(value: Any, *, max_depth: int = MAX_DEPTH, what: str = "the value") -> None:
    """Refuse (JSONLimitError) a value nested past `max_depth` levels, holding a number that is not
    finite, or a string (or key) with a lone surrogate. One iterative walk, no recursion."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            if depth + 1 > max_depth:
                raise JSONLimitError(f"{what} nests deeper than {max_depth} levels of objects and arrays")
            for key, item in node.items():
                if isinstance(key, str) and _SURROGATE.search(key):
                    raise JSONLimitError(f"{what} holds a lone surrogate (\\ud800-\\udfff), which is not text")
                stack.append((item, depth + 1))
        elif isinstance(node, list):
            if depth + 1 > max_depth:
                raise JSONLimitError(f"{what} nests deeper than {max_depth} levels of objects and arrays")
            stack.extend((item, depth + 1) for item in node)
        elif isinstance(node, str):
            if _SURROGATE.search(node):
                raise JSONLimitError(f"{what} holds a lone surrogate (\\ud800-\\udfff), which is not text")
        elif isinstance(node, float) and not math.isfinite(node):
            name = "NaN" if math.isnan(node) else ("Infinity" if node > 0 else "-Infinity")
            raise JSONLimitError(f"{what} holds {name}, which is not a JSON number")


def _refuse_constant(name: str) -> Any:
    raise JSONLimitError(f"{name} is not a JSON number")


def load_text(text: str, *, max_depth: int = MAX_DEPTH, what: str = "the JSON text") -> Any:
    """Parse JSON `text` within the bounds: JSONLimitError past them, json.JSONDecodeError (also a
    ValueError) if it is not JSON at all."""
    if text_depth(text) > max_depth:
        raise JSONLimitError(f"{what} nests deeper than {max_depth} levels of objects and arrays")
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except RecursionError:  # (the scan above makes this unreachable; never a 500 if it is not)
        raise JSONLimitError(f"{what} nests deeper than {max_depth} levels of objects and arrays") from None
    check_value(value, max_depth=max_depth, what=what)
    return value


def _escape(match: re.Match[str]) -> str:
    return f"\\u{ord(match.group()):04x}"


def escape_surrogates(text: str) -> str:
    """JSON text (as json.dumps(ensure_ascii=False) writes it) with each lone surrogate written as
    its escape, so it encodes as UTF-8. A surrogate can only be inside a JSON string there, where
    the escape means the same character."""
    return _SURROGATE.sub(_escape, text)


def has_surrogates(text: str) -> bool:
    return _SURROGATE.search(text) is not None
