"""The structured-outputs constraint of a request's `tool_choice` (and its `response_format`, if both are set).

- "required": the whole reply is calls (at least one), nothing else.
- named: the whole reply is one call of that function.
- "auto": free text until what opens a call (xgrammar's `triggered_tags`), then a well-formed call;
  with a response_format as well, the reply is either calls or that JSON.
- "none": no constraint from tools.

Every format spells its calls its own way (`chatserve.tools.formats`); `spelling` says, per format,
the structural tags of one whole call of each tool (its arguments held to the tool's schema: a JSON
schema, the same schema as qwen3_coder's XML parameters, or pythonic keyword arguments whose values
are Python/JSON literals of each property's schema), what separates parallel calls, what wraps them
(a list's brackets) and what triggers a call in free text. The result is xgrammar's structural-tag
JSON (`{"type": "structural_tag", "format": {...}}`), which `StructuredOutputsParams(structural_tag=...)`
hands to the compiler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from chatserve.tools.formats import ToolFormat
from chatserve.tools.spec import FunctionTool, ToolChoice

Format = dict[str, Any]


@dataclass(frozen=True)
class Spelling:
    """How a format's constrained calls look: `calls` holds one tag per tool, each a whole call;
    `wrapper` the (begin, end) around a list of calls; `separator` what stands between two calls;
    `triggers` what begins a call (or the wrapper) in free text."""

    calls: list[Format]
    separator: str
    triggers: list[str]
    wrapper: tuple[str, str] | None = None


def _tag(begin: str, content: Format, end: str) -> Format:
    return {"type": "tag", "begin": begin, "content": content, "end": end}


def _schema(schema: dict[str, Any], style: str = "json") -> Format:
    out: Format = {"type": "json_schema", "json_schema": schema}
    if style != "json":
        out["style"] = style
    return out


def _qwen_xml(schema: dict[str, Any]) -> Format:
    """The parameters as XML; whitespace runs between and around them at most one character (the layout
    Qwen's template writes), so a value is never padded out by the model; and no value holds the tags that
    end it (xgrammar would otherwise let a string run on past a `</parameter>`, which every reader of the
    format, ours and vLLM's, takes as the value's end)."""
    return {**_schema(schema, "qwen_xml"), "max_whitespace_cnt": 1,
            "excludes": ["</parameter>", "<parameter=", "</function>"]}


def _const(text: str) -> Format:
    return {"type": "const_string", "value": text}


_MISTRAL_ID: Format = {"type": "regex", "pattern": "[A-Za-z0-9]{9}"}
"""A Mistral call id, as its templates take it: 9 alphanumerics."""


def _seq(*parts: Format | None) -> Format | None:
    items = [p for p in parts if p is not None]
    if not items:
        return None
    return items[0] if len(items) == 1 else {"type": "sequence", "elements": items}


def _one_of(formats: list[Format]) -> Format:
    return formats[0] if len(formats) == 1 else {"type": "or", "elements": formats}


# ---- pythonic keyword arguments ------------------------------------------------------------------
def _python_value(schema: Any) -> Format:
    """A property's value as a literal: Python's True/False/None for those types, JSON (which is a
    Python literal for strings, numbers, lists and objects without true/false/null) otherwise."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "boolean":
        return {"type": "or", "elements": [_const("True"), _const("False")]}
    if kind == "null":
        return _const("None")
    return _schema(schema if isinstance(schema, dict) else {})


def _keyword_arguments(schema: dict[str, Any]) -> Format | None:
    """`a=1, b="x"` for the schema's properties in their declared order: the required ones always, the
    optional ones each or not, with ", " only between two that are written."""
    props = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    required = set(schema.get("required") or ())
    items = [(_seq(_const(f"{name}="), _python_value(sub)), name in required) for name, sub in props.items()]

    def after_one(i: int) -> Format | None:  # items[i:], with something written before them
        if i == len(items):
            return None
        item, needed = items[i]
        first = _seq(_const(", "), item)
        assert first is not None
        return _seq(first if needed else {"type": "optional", "content": first}, after_one(i + 1))

    def from_start(i: int) -> Format | None:  # items[i:], with nothing written yet
        if i == len(items):
            return None
        item, needed = items[i]
        with_it = _seq(item, after_one(i + 1))
        assert with_it is not None
        if needed:
            return with_it
        without = from_start(i + 1)
        return with_it if without is None else {"type": "or", "elements": [with_it, without]}

    rest = from_start(0)
    if rest is not None and not any(needed for _, needed in items):
        return {"type": "optional", "content": rest}
    return rest


def _python_call(tool: FunctionTool) -> Format:
    args = _keyword_arguments(tool.arguments_schema)
    return _tag(f"{tool.name}(", args if args is not None else _const(""), ")")


# ---- each format's spelling ----------------------------------------------------------------------
def _call_object_schema(tool: FunctionTool, key: str) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.name}, key: tool.arguments_schema},
            "required": ["name", key], "additionalProperties": False}


def spelling(fmt: ToolFormat, tools: list[FunctionTool]) -> Spelling:
    if fmt.syntax == "xml":
        return Spelling([_tag(f"{fmt.opening}\n<function={t.name}>\n", _qwen_xml(t.arguments_schema),
                              f"</function>\n{fmt.closing}") for t in tools], "\n", [fmt.opening])
    if fmt.syntax == "pythonic":
        return Spelling([_python_call(t) for t in tools], ", ", [f"[{t.name}(" for t in tools], ("[", "]"))
    if fmt.list_in_block:
        return Spelling([_schema(_call_object_schema(t, fmt.arguments_key)) for t in tools], ", ", [fmt.opening],
                        (fmt.opening, fmt.closing))
    if fmt.call_id_tag:  # mistral v13: the model writes the call's id (9 alphanumerics), then its arguments
        return Spelling([_tag(f"{fmt.opening}{t.name}[CALL_ID]",
                              {"type": "sequence", "elements": [_MISTRAL_ID, _const("[ARGS]"), _schema(t.arguments_schema)]},
                              "") for t in tools], "", [fmt.opening])
    if fmt.bare_name:  # mistral v11
        return Spelling([_tag(f"{fmt.opening}{t.name}[ARGS]", _schema(t.arguments_schema), "") for t in tools],
                        "", [fmt.opening])
    key = json.dumps(fmt.arguments_key)
    if fmt.closing:  # hermes: one tagged block per call
        return Spelling([_tag(f'{fmt.opening}\n{{"name": {json.dumps(t.name)}, {key}: ',
                              _schema(t.arguments_schema), f"}}\n{fmt.closing}") for t in tools], "\n", [fmt.opening])
    # llama3_json: bare objects, ";"-separated
    return Spelling([_tag(f'{{"name": {json.dumps(t.name)}, {key}: ', _schema(t.arguments_schema), "}")
                     for t in tools], f"{fmt.call_separator} ", ['{"name": '])


def _wrapped_calls(fmt: ToolFormat, sp: Spelling, tools: list[FunctionTool], single: bool) -> Format:
    """The wrapper around one or more calls (one if `single`)."""
    assert sp.wrapper is not None
    begin, end = sp.wrapper
    if fmt.syntax == "json":  # a JSON list of call objects
        items = sp.calls[0]["json_schema"] if len(sp.calls) == 1 else {"anyOf": [c["json_schema"] for c in sp.calls]}
        schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
        if single:
            schema["maxItems"] = 1
        return _tag(begin, _schema(schema), end)
    inner = _one_of(sp.calls) if single else \
        {"type": "tags_with_separator", "tags": sp.calls, "separator": sp.separator, "at_least_one": True}
    return _tag(begin, inner, end)


def _triggered_pythonic(sp: Spelling, tools: list[FunctionTool], parallel: bool) -> Format:
    """Auto for pythonic: `[f(` triggers a list whose first call is f's (a bare "[" in prose stays free)."""
    more = {"type": "star", "content": _seq(_const(sp.separator), _one_of(sp.calls))} if parallel else None
    tags = [_tag(f"[{t.name}(", _seq(call["content"], _const(")"), more) or _const(""), "]")
            for t, call in zip(tools, sp.calls)]
    return {"type": "triggered_tags", "triggers": sp.triggers, "tags": tags, "at_least_one": False,
            "stop_after_first": True}


def tool_grammar(fmt: ToolFormat, tools: list[FunctionTool], choice: ToolChoice, parallel: bool = True,
                 reply_schema: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The structural tag that makes a reply obey `choice`; None when tools put no constraint on it.

    `reply_schema` is the JSON schema of a non-call reply (from response_format), used by "auto".
    """
    allowed = choice.allowed(tools)
    if not allowed:
        return None
    sp = spelling(fmt, allowed)
    single = choice.mode == "named" or not parallel
    if sp.wrapper is not None:
        calls = _wrapped_calls(fmt, sp, allowed, single)
    elif single:
        calls = _one_of(sp.calls)
    else:
        calls = {"type": "tags_with_separator", "tags": sp.calls, "separator": sp.separator, "at_least_one": True}
    if choice.mode in ("required", "named"):
        return {"type": "structural_tag", "format": calls}
    if reply_schema is not None:
        return {"type": "structural_tag", "format": {"type": "or", "elements": [calls, _schema(reply_schema)]}}
    if fmt.syntax == "pythonic":
        return {"type": "structural_tag", "format": _triggered_pythonic(sp, allowed, parallel)}
    if sp.wrapper is not None:
        return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": sp.triggers, "tags": [calls],
                                                     "at_least_one": False, "stop_after_first": True}}
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": sp.triggers, "tags": sp.calls,
                                                 "at_least_one": False, "stop_after_first": not parallel}}
