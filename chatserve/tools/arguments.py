"""Arguments written in another syntax (qwen3_coder's XML parameters, pythonic's keyword arguments),
turned into the JSON object OpenAI's `arguments` carries, piece by piece as they are generated.

`ArgumentsWriter` produces the object's JSON text in pieces whose concatenation is the whole object:
`{"city": "` then a string value's characters as they arrive (JSON-escaped), `"`, then `, "days": 3`
once a non-string value is whole, then `}`. `typed_value` gives a parameter's raw text the type its
schema declares, as vLLM's qwen3_coder parser does (an integer parameter's `3` is 3, a string's is "3").
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any


def json_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def escaped(chunk: str) -> str:
    """`chunk` as the inside of a JSON string (escaping is per character, so pieces concatenate)."""
    return json.dumps(chunk, ensure_ascii=False)[1:-1]


def parameter_types(schema: Mapping[str, Any] | None, name: str) -> tuple[str, ...]:
    """The JSON types a parameter's schema allows (empty: not declared)."""
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    prop = props.get(name) if isinstance(props, Mapping) else None
    if not isinstance(prop, Mapping):
        return ()
    kind = prop.get("type")
    if isinstance(kind, str):
        return (kind,)
    if isinstance(kind, list):
        return tuple(k for k in kind if isinstance(k, str))
    if isinstance(prop.get("enum"), list) and prop["enum"] and all(isinstance(v, str) for v in prop["enum"]):
        return ("string",)
    options = prop.get("anyOf") or prop.get("oneOf")
    if isinstance(options, list):
        return tuple(o["type"] for o in options if isinstance(o, Mapping) and isinstance(o.get("type"), str))
    return ()


def is_string_parameter(schema: Mapping[str, Any] | None, name: str) -> bool:
    """Whether the value is text as written (streamed as it comes): a parameter whose only type is string and
    whose values are not a fixed few (an enum's or const's value is one word, sent whole with no layout around it)."""
    props = schema.get("properties") if isinstance(schema, Mapping) else None
    prop = props.get(name) if isinstance(props, Mapping) else None
    if isinstance(prop, Mapping) and ("enum" in prop or "const" in prop):
        return False
    return [t for t in parameter_types(schema, name) if t != "null"] == ["string"]


def typed_value(raw: str, types: tuple[str, ...]) -> Any:
    """A parameter's raw text as the value its schema's types make of it; text that is not such a value
    stays a string (the schema check is the client's, as with any other call)."""
    if raw.strip().lower() in ("null", "none") and (not types or "null" in types or "string" not in types):
        return None
    for kind in types:
        value = _as_type(raw.strip(), kind)
        if value is not _NO:
            return value
    if not types:
        value = _literal(raw.strip())
        return raw if value is _NO else value
    return raw


_NO = object()


def _as_type(raw: str, kind: str) -> Any:
    if kind == "string":
        return _NO
    if kind == "integer":
        try:
            return int(raw)
        except ValueError:
            return _NO
    if kind == "number":
        try:
            number = float(raw)
        except ValueError:
            return _NO
        return int(number) if number.is_integer() and not any(c in raw for c in ".eE") else number
    if kind == "boolean":
        return {"true": True, "false": False}.get(raw.lower(), _NO)
    if kind in ("object", "array"):
        value = _literal(raw)
        ok = isinstance(value, dict) if kind == "object" else isinstance(value, list)
        return value if ok else _NO
    return _NO


def _literal(raw: str) -> Any:
    """JSON, else a Python literal (pythonic calls, and models that write Python in XML parameters)."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return _NO
    if isinstance(value, tuple):
        value = list(value)
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return _NO
    return value


def literal_value(raw: str) -> Any:
    """A Python (or JSON) literal's value; a ValueError if it is neither."""
    value = _literal(raw)
    if value is _NO:
        raise ValueError(f"not a literal: {raw!r}")
    return value


class ArgumentsWriter:
    """The JSON text of an arguments object, in the pieces a stream sends."""

    def __init__(self) -> None:
        self.members = 0

    def key(self, name: str, string_value: bool) -> str:
        """The text before a member's value (and its opening quote, for a string value streamed as it comes)."""
        piece = ("{" if self.members == 0 else ", ") + json_text(name) + ": " + ('"' if string_value else "")
        self.members += 1
        return piece

    def close(self) -> str:
        return "}" if self.members else "{}"
