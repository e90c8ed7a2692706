"""The structured-outputs constraint of a request's `tool_choice` (and its `response_format`, if both are set).

- "required": the whole reply is tool-call blocks (at least one), nothing else.
- named: the whole reply is one block calling that function.
- "auto": free text until the opening `<tool_call>`, then a well-formed block (xgrammar's
  `triggered_tags`); with a response_format as well, the reply is either a call or that JSON.
- "none": no constraint from tools.

The result is xgrammar's structural-tag JSON (`{"type": "structural_tag", "format": {...}}`),
which `StructuredOutputsParams(structural_tag=...)` hands to the compiler.
"""

from __future__ import annotations

from typing import Any

from chatserve.tools.formats import ToolFormat
from chatserve.tools.spec import FunctionTool, ToolChoice


def tool_grammar(fmt: ToolFormat, tools: list[FunctionTool], choice: ToolChoice, parallel: bool = True,
                 reply_schema: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The structural tag that makes a reply obey `choice`; None when tools put no constraint on it.

    `reply_schema` is the JSON schema of a non-call reply (from response_format), used by "auto".
    """
    allowed = choice.allowed(tools)
    if not allowed:
        return None
    tags = fmt.block_tags(allowed, parallel)
    if choice.mode in ("required", "named"):
        single_block = fmt.list_in_block or choice.mode == "named" or not parallel
        if single_block:
            body: dict[str, Any] = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        else:
            body = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True}
        return {"type": "structural_tag", "format": body}
    if reply_schema is not None:
        call = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
        return {"type": "structural_tag", "format": {"type": "or", "elements": [
            call, {"type": "json_schema", "json_schema": reply_schema}]}}
    stop_after_first = fmt.list_in_block or not parallel
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": [fmt.opening], "tags": tags,
                                                 "at_least_one": False, "stop_after_first": stop_after_first}}
