"""Which template renders a request with tools, and which format its replies' calls are read in.

By default the format is the one the chat template itself writes calls in, found once per template by
rendering a probe conversation (a tool offered, one call to it, its result) and looking at how the
call came out: `<function=...>` is qwen3_coder, `[TOOL_CALLS]` mistral (its list, its `name[ARGS]`
or its `name[CALL_ID]id[ARGS]` spelling), `name(...)` in a list pythonic, `{"name": ..., "parameters": ...}` llama3_json,
`<tool_call>[...]` xlam, `<tool_call>{...}` hermes (also the guess for a template that renders tools
but no calls). A template that ignores tools (SmolLM2's) gets chatserve's shipped xLAM template, the
format SmolLM2 was trained on.

`--tool-call-parser NAME` forces a format. A template that already writes it is used as it is; any
other gets chatserve's shipped ChatML template for that format (`templates/chatml_<name>_tools.jinja`),
which describes the tools in the system prompt the way vLLM's example templates do and renders
calls and results in that format, so the model sees how to call and the next turn's prompt extends
this one's.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

from chatserve.tools.formats import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_V11,
    MISTRAL_V13,
    PYTHONIC,
    QWEN3_CODER,
    XLAM,
    ToolFormat,
    tool_format_named,
)

_PROBE = "chatserve_probe_tool"
_PROBE_TOOLS = [{"type": "function", "function": {"name": _PROBE, "description": "probe", "parameters": {
    "type": "object", "properties": {"probe_arg": {"type": "string"}}}}}]
_QUESTION = "chatserve probe question"
_PROBE_MESSAGES: list[dict[str, Any]] = [{"role": "user", "content": _QUESTION}]
_PROBE_CALL: list[dict[str, Any]] = [
    {"role": "user", "content": _QUESTION},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "chatprobe", "type": "function", "function": {"name": _PROBE, "arguments": {"probe_arg": "x"}}}]},
    {"role": "tool", "tool_call_id": "chatprobe", "name": _PROBE, "content": "probe result"},
]


@dataclass(frozen=True)
class ToolRendering:
    """How a request with tools is rendered and how its replies spell calls.

    `chat_template` None means the model's own template; `own_template` says whether the template is
    the model's (or the --chat-template one) rather than a shipped one."""

    chat_template: str | None
    format: ToolFormat
    own_template: bool


def shipped_format_template(fmt: ToolFormat) -> str:
    """chatserve's ChatML template for `fmt` (the xLAM one is SmolLM2's)."""
    path = f"templates/chatml_{fmt.name}_tools.jinja"
    return resources.files("chatserve.tools").joinpath(path).read_text(encoding="utf-8")


def _render(tokenizer: Any, messages: list[dict[str, Any]], chat_template: str | None, **kwargs: Any) -> str:
    return str(tokenizer.apply_chat_template(messages, tokenize=False, chat_template=chat_template, **kwargs))


def format_in_text(text: str) -> ToolFormat:
    """The format a rendered probe call is spelled in (hermes when no call is recognisable)."""
    if f"<function={_PROBE}>" in text:
        return QWEN3_CODER
    at = text.find("[TOOL_CALLS]")
    if at >= 0:
        rest = text[at + len("[TOOL_CALLS]"):].lstrip()
        if rest.startswith("[") or rest.startswith("{"):
            return MISTRAL
        return MISTRAL_V13 if rest.startswith(f"{_PROBE}[CALL_ID]") else MISTRAL_V11
    if f"{_PROBE}(" in text:
        return PYTHONIC
    if "<tool_call>" in text:
        after = text[text.find("<tool_call>") + len("<tool_call>"):].lstrip()
        return XLAM if after.startswith("[") else HERMES
    if '"parameters"' in text and f'"name": "{_PROBE}"' in text.replace('"name":"', '"name": "'):
        return LLAMA3_JSON
    return HERMES


def detect_tool_format(tokenizer: Any, chat_template: str | None) -> ToolFormat | None:
    """The format `chat_template` (None: the tokenizer's) writes calls in; None if it ignores tools."""
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        return None
    try:
        plain = _render(tokenizer, _PROBE_MESSAGES, chat_template)
        with_tools = _render(tokenizer, _PROBE_MESSAGES, chat_template, tools=_PROBE_TOOLS)
    except Exception:  # noqa: BLE001 - a template that cannot render the probe does not render tools
        return None
    if plain == with_tools or _PROBE not in with_tools:
        return None
    try:
        with_call = _render(tokenizer, _PROBE_CALL, chat_template, tools=_PROBE_TOOLS, add_generation_prompt=False)
    except Exception:  # noqa: BLE001 - renders tools but not a call: the old guess
        return HERMES
    return format_in_text(with_call[with_call.rfind(_QUESTION) + len(_QUESTION):])  # the reply, not the instructions


def tool_rendering_for(tokenizer: Any, chat_template: str | None, parser: str | None = None) -> ToolRendering:
    """The template and format of requests with tools: `parser` (--tool-call-parser) forces the format."""
    detected = detect_tool_format(tokenizer, chat_template)
    if parser is None:
        if detected is None:
            return ToolRendering(shipped_format_template(XLAM), XLAM, own_template=False)
        return ToolRendering(chat_template, detected, own_template=True)
    forced = tool_format_named(parser)
    if detected is not None and detected.name == forced.name:
        return ToolRendering(chat_template, detected, own_template=True)
    if forced.name == "mistral":
        forced = MISTRAL_V11  # the spelling the shipped template writes
    return ToolRendering(shipped_format_template(forced), forced, own_template=False)


_MISTRAL_ID = re.compile(r"[A-Za-z0-9]{9}")


def mistral_template_id(call_id: str) -> str:
    """A call id as Mistral's templates accept it (9 alphanumerics): as it is if it is one, else its last 9
    alphanumerics (vLLM's truncation), padded from a hash of it when it has fewer; the same id always
    gives the same text, so a conversation re-renders to the same prompt."""
    if _MISTRAL_ID.fullmatch(call_id):
        return call_id
    alnum = re.sub(r"[^A-Za-z0-9]", "", call_id)
    if len(alnum) >= 9:
        return alnum[-9:]
    return (alnum + hashlib.sha256(call_id.encode()).hexdigest())[:9]


def messages_for_format(messages: Sequence[Mapping[str, Any]], fmt: ToolFormat) -> list[Mapping[str, Any]]:
    """The conversation as the format's templates take it: for mistral, call ids other clients made
    (`call_...`, Anthropic's `toolu_...`) become 9 alphanumerics in calls and results alike."""
    if not fmt.mistral_ids:
        return list(messages)
    out: list[Mapping[str, Any]] = []
    for m in messages:
        entry = dict(m)
        if isinstance(entry.get("tool_calls"), list):
            entry["tool_calls"] = [{**c, "id": mistral_template_id(c["id"])} if isinstance(c, Mapping) and
                                   isinstance(c.get("id"), str) else c for c in entry["tool_calls"]]
        if isinstance(entry.get("tool_call_id"), str):
            entry["tool_call_id"] = mistral_template_id(entry["tool_call_id"])
        out.append(entry)
    return out
