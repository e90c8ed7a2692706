"""A chat request's tools: which may be called, how the prompt renders them, and how replies are read.

`plan_tools` turns the validated `tools` / `tool_choice` / `parallel_tool_calls` into a `ToolPlan`
(the template and call format come from the input processor's `tool_rendering`: the template's own
format, or the one --tool-call-parser forces), and
`conversation` turns the request's messages into what chat templates expect: assistant calls as
`tool_calls` with their arguments as objects, tool results as `role: "tool"` messages, reasoning sent
back as `reasoning_content` (Qwen3's template variable, the name vLLM passes templates too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from chatserve.engine.input_processor import InputProcessor, ToolRendering
from chatserve.server.chat.protocol import ChatMessage, NamedToolChoice, ToolDefinition
from chatserve.server.json_checks import load_text
from chatserve.tools import FunctionTool, ToolCallStreamParser, ToolChoice, ToolFormat


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools mean for its prompt, its grammar and its reply."""

    tools: list[FunctionTool]
    choice: ToolChoice
    parallel: bool
    rendering: ToolRendering
    rendered: list[FunctionTool] | None = None
    """The tools the prompt lists, set by the Messages API: its deferred tools are callable once a
    `tool_reference` loads them, where the reference stands, never in the list (that would move the prefix),
    and its listed tools stay in the prompt under tool_choice "none" too, as Anthropic keeps them (an agent
    that sends "none" on one turn keeps its cached prefix). None: OpenAI's rule, `tools` unless "none"."""

    @property
    def format(self) -> ToolFormat:
        return self.rendering.format

    @property
    def parses_calls(self) -> bool:
        """Whether replies are read for calls (not with tool_choice "none")."""
        return bool(self.choice.allowed(self.tools))

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The `tools=` of the chat template: OpenAI's requests offer none with tool_choice "none"; see `rendered`."""
        if self.rendered is not None:
            return [t.to_template() for t in self.rendered] or None
        return [t.to_template() for t in self.tools] if self.parses_calls and self.tools else None

    def callable_schemas(self) -> dict[str, dict[str, Any]]:
        """The tools a reply may call, each with its arguments schema (qwen3_coder's parameters are typed by it)."""
        return {t.name: t.arguments_schema for t in self.choice.allowed(self.tools)}

    def parser(self, make_id: Callable[[], str] | None = None) -> ToolCallStreamParser:
        """A stream parser of this plan's format; call ids are the format's unless `make_id` is given."""
        return ToolCallStreamParser(self.format, self.callable_schemas(), make_id)


def plan_tools(tools: list[ToolDefinition] | None, tool_choice: Any, parallel: bool, processor: InputProcessor,
               chat_template: str | None, tool_parser: str | None = None) -> ToolPlan | None:
    """`tool_parser`: --tool-call-parser (None: the template's own format)."""
    if not tools:
        return None
    specs = [FunctionTool(t.function.name, t.function.description, t.function.parameters) for t in tools]
    choice = ToolChoice("named", tool_choice.function.name) if isinstance(tool_choice, NamedToolChoice) \
        else ToolChoice.from_openai(tool_choice)
    return ToolPlan(specs, choice, parallel, processor.tool_rendering(chat_template, tool_parser))


def _arguments_value(text: str) -> Any:
    """A call's arguments as the object templates render (its JSON text if it is not JSON, or not JSON
    within the bounds the request models check: json_checks.load_text)."""
    try:
        return load_text(text)
    except ValueError:
        return text


def conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as chat templates take them ("developer" is "system" to a template)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            entry["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments_value(c.function.arguments)}} for c in m.tool_calls]
        reasoning = m.reasoning_text()
        if reasoning is not None:  # the template's own variable (Qwen3's; templates without it ignore it)
            entry["reasoning_content"] = reasoning
        if m.role == "tool":
            entry["tool_call_id"] = m.tool_call_id
            if m.name:
                entry["name"] = m.name
        out.append(entry)
    return out
