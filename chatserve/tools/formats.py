"""How a model spells a tool call in its reply, and the structural tags that make it spell one.

Two formats, both opened by `<tool_call>` and closed by `</tool_call>`:

- `XLAM` (xLAM / APIGen, what SmolLM2 was trained on): one block holding a JSON list,
  `<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>`.
- `HERMES` (Qwen2/2.5/3, Hermes, and most templates that render `tools`): one block per call,
  `<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>`.

Each format can say which calls a block holds (`calls_in_block`) and build the xgrammar
structural-tag pieces (`block_tags`) whose output is exactly such a block with arguments that
validate against the function's schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from chatserve.tools.spec import FunctionTool

OPENING = "<tool_call>"
CLOSING = "</tool_call>"


def _call_object_schema(tool: FunctionTool) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.arguments_schema},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _as_call(item: Any) -> tuple[str, dict[str, Any]] | None:
    """{"name": str, "arguments": {...} or its JSON text} -> (name, arguments), else None."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", item.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return item["name"], args


@dataclass(frozen=True)
class ToolFormat:
    """One way of spelling calls; `list_in_block` says whether a block holds a list (xLAM) or one call (Hermes)."""

    name: str
    list_in_block: bool
    opening: str = OPENING
    closing: str = CLOSING

    def calls_in_block(self, inner: str) -> list[tuple[str, dict[str, Any]]] | None:
        """The calls between an opening and its closing; None if it is not valid JSON of calls."""
        try:
            value = json.loads(inner)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [_as_call(item) for item in items]
        if not calls or any(c is None for c in calls):
            return None
        return [c for c in calls if c is not None]

    def block_tags(self, tools: list[FunctionTool], parallel: bool) -> list[dict[str, Any]]:
        """Structural `tag` formats, each matching one whole block that calls one of `tools`."""
        if self.list_in_block:
            items: dict[str, Any] = {"anyOf": [_call_object_schema(t) for t in tools]} if len(tools) > 1 \
                else _call_object_schema(tools[0])
            schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
            if not parallel:
                schema["maxItems"] = 1
            return [{"type": "tag", "begin": self.opening, "content": {"type": "json_schema", "json_schema": schema},
                     "end": self.closing}]
        return [
            {"type": "tag", "begin": f'{self.opening}\n{{"name": {json.dumps(t.name)}, "arguments": ',
             "content": {"type": "json_schema", "json_schema": t.arguments_schema}, "end": f"}}\n{self.closing}"}
            for t in tools
        ]


XLAM = ToolFormat("xlam", list_in_block=True)
HERMES = ToolFormat("hermes", list_in_block=False)
_FORMATS = {f.name: f for f in (XLAM, HERMES)}


def tool_format_named(name: str) -> ToolFormat:
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool format {name!r}; known: {sorted(_FORMATS)}") from None
