"""Tool calling: what a tool is, how each model family's replies spell a call, and how to parse and constrain them.

A leaf layer (it imports only `sampling_params`): the input processor renders with the template
`tool_rendering_for` picks, the server and the offline `LLM` parse replies with its parser, and both
build the grammar of `tool_choice` "required" / named / "auto" with `tool_grammar`.
"""

from chatserve.tools.formats import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_V11,
    MISTRAL_V13,
    PYTHONIC,
    QWEN3_CODER,
    TOOL_CALL_PARSERS,
    XLAM,
    ToolFormat,
    tool_format_named,
)
from chatserve.tools.grammar import tool_grammar
from chatserve.tools.parser import ParsedReply, ToolCallStreamParser, parse_tool_calls
from chatserve.tools.spec import FunctionTool, ToolCall, ToolChoice, new_call_id, shipped_tool_template

__all__ = [
    "HERMES", "LLAMA3_JSON", "MISTRAL", "MISTRAL_V11", "MISTRAL_V13", "PYTHONIC", "QWEN3_CODER", "TOOL_CALL_PARSERS", "XLAM",
    "FunctionTool", "ParsedReply", "ToolCall", "ToolCallStreamParser", "ToolChoice", "ToolFormat", "new_call_id",
    "parse_tool_calls", "shipped_tool_template", "tool_format_named", "tool_grammar",
]
