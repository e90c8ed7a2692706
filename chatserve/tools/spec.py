"""What a function tool is, what a parsed call is, and which calls a request allows.

Plain values shared by the HTTP layer (which validates OpenAI's `tools` / `tool_choice` JSON
into them) and the offline `LLM.chat(..., tools=[...])`, which takes the same OpenAI dicts.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from importlib import resources
from typing import Any, Literal

_ID_ALPHABET = string.ascii_letters + string.digits


def new_call_id() -> str:
    """`call_` + 24 random characters, the shape of OpenAI's tool call ids."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(24))


def shipped_tool_template() -> str:
    """The xLAM/APIGen tool template shipped for SmolLM2 (and any ChatML model whose own template ignores tools)."""
    return resources.files("chatserve.tools").joinpath("templates/chatml_xlam_tools.jinja").read_text(encoding="utf-8")


@dataclass(frozen=True)
class FunctionTool:
    """One `{"type": "function", "function": {...}}` entry of `tools`."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: any object

    @property
    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters else {"type": "object"}

    def to_template(self) -> dict[str, Any]:
        """The OpenAI dict chat templates expect (`tools=` of apply_chat_template)."""
        function: dict[str, Any] = {"name": self.name, "parameters": self.arguments_schema}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}

    @classmethod
    def from_openai(cls, tool: dict[str, Any]) -> FunctionTool:
        """From an OpenAI tools entry (already validated by the server, or the offline caller's dict)."""
        fn = tool.get("function", tool)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError('each tool must be {"type": "function", "function": {"name": ..., "parameters": {...}}}')
        return cls(fn["name"], fn.get("description"), fn.get("parameters"))


@dataclass(frozen=True)
class ToolCall:
    """A parsed call: `arguments` is the JSON text of the arguments object, as OpenAI sends it.

    `complete` is False for a call the reply's token budget cut off (finish_reason "length"): its
    arguments are what was generated, which need not be valid JSON yet."""

    id: str
    name: str
    arguments: str
    complete: bool = True

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolChoice:
    """`tool_choice`: "none" (no calls), "auto" (text or calls), "required" (at least one), or one named function."""

    mode: Literal["none", "auto", "required", "named"] = "auto"
    name: str | None = None

    @classmethod
    def from_openai(cls, value: Any) -> ToolChoice:
        if value is None:
            return cls("auto")
        if value in ("none", "auto", "required"):
            return cls(value)
        if isinstance(value, dict) and isinstance(value.get("function"), dict) and isinstance(value["function"].get("name"), str):
            return cls("named", value["function"]["name"])
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')

    def allowed(self, tools: list[FunctionTool]) -> list[FunctionTool]:
        """The tools a reply may call."""
        if self.mode == "none":
            return []
        if self.mode == "named":
            return [t for t in tools if t.name == self.name]
        return list(tools)
