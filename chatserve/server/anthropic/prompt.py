"""A Messages request as the chat template's conversation, rendered so that agents keep their prefix.

Agents send the same long prefix on every turn (tools, system prompt, environment), and a prefix
cache only pays if that prefix renders to the same tokens every time. Three rules keep it so:

- The `x-anthropic-billing-header:` block Claude Code puts first in `system` (`cc_version=...`,
  in some set-ups a per-request `cch=` hash) is dropped: it says nothing to the model and would
  make every request's first tokens differ.
- Inline `system` messages render where they stand, never hoisted to the top (that would change
  the first turn's tokens when a later turn adds one). A template that refuses a system turn
  there gets its text folded into the next user turn (or the previous one), in place.
- The text blocks of one message join with one fixed separator (`BLOCK_SEPARATOR`), so a message
  sent as blocks on one turn and as the equal joined string on the next renders to the same tokens.

Tool results that are not text (Claude Code's Read on a PNG) render as a fixed placeholder, and
deferred tools (`defer_loading: true`) are left out of the tool list until a `tool_reference`
names them, then rendered where the reference stands (callable from then on).
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from chatserve.engine.input_processor import InputProcessor, PromptError
from chatserve.server.anthropic.protocol import (
    MessageParam,
    MessagesBase,
    TextBlock,
    ThinkingBlock,
    ToolParam,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from chatserve.server.chat.tool_request import ToolPlan
from chatserve.server.errors import bad_request
from chatserve.tools import FunctionTool, ToolChoice

BILLING_HEADER = "x-anthropic-billing-header:"
BLOCK_SEPARATOR = "\n\n"
"""Between the text blocks of one message (and of one tool result)."""
NOT_TEXT_PLACEHOLDER = "[{kind} content omitted: this model reads text only]"
ERROR_PREFIX = "Error: "
"""What a `tool_result` with `is_error: true` starts with."""


@dataclass(frozen=True)
class Breakpoint:
    """A `cache_control` mark: the prompt's first `position` tokens are to stay cached for `ttl_s`."""

    position: int
    ttl_s: float


@dataclass
class RenderedMessages:
    ids: list[int]
    plan: ToolPlan | None
    breakpoints: list[Breakpoint]


def _is_billing_header(text: str) -> bool:
    return text.lstrip().startswith(BILLING_HEADER)


def system_text(system: str | list[TextBlock] | None) -> str:
    """The top-level system prompt, the billing header dropped (a block of it, or its lines in a string)."""
    if system is None:
        return ""
    if isinstance(system, str):
        return "\n".join(line for line in system.split("\n") if not _is_billing_header(line)).strip("\n")
    return BLOCK_SEPARATOR.join(b.text for b in system if not _is_billing_header(b.text))


def _tool_result_text(block: ToolResultBlock, deferred: dict[str, ToolParam], loaded: set[str]) -> str:
    if isinstance(block.content, str):
        text = block.content
    else:
        parts = []
        for b in block.content:
            if isinstance(b, TextBlock):
                parts.append(b.text)
            elif isinstance(b, ToolReferenceBlock):
                tool = deferred.get(b.tool_name)
                if tool is None:
                    parts.append(f"[tool_reference: no deferred tool is named {b.tool_name!r}]")
                else:
                    loaded.add(tool.name)
                    parts.append("Tool loaded: " + json.dumps(_function(tool).to_template()["function"], ensure_ascii=False))
            else:
                parts.append(NOT_TEXT_PLACEHOLDER.format(kind=b.type))
        text = BLOCK_SEPARATOR.join(parts)
    return ERROR_PREFIX + text if block.is_error else text


def _function(tool: ToolParam) -> FunctionTool:
    return FunctionTool(tool.name, tool.description, tool.input_schema)


def _message_turns(m: MessageParam, deferred: dict[str, ToolParam], loaded: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as template turns (a user message with tool results is several)."""
    blocks = m.blocks()
    if m.role == "system":
        text = BLOCK_SEPARATOR.join(b.text for b in blocks if isinstance(b, TextBlock) and not _is_billing_header(b.text))
        return [{"role": "system", "content": text}] if text else []
    if m.role == "assistant":
        text = BLOCK_SEPARATOR.join(b.text for b in blocks if isinstance(b, TextBlock))
        turn: dict[str, Any] = {"role": "assistant", "content": text}
        # thinking blocks (their signatures checked before rendering: thinking.with_verified_thinking) are
        # the turn's reasoning, in the template's own variable; redacted_thinking is unreadable and left out
        thoughts = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
        if thoughts:
            turn["reasoning_content"] = BLOCK_SEPARATOR.join(thoughts)
        calls = [b for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.input}}
                                  for c in calls]
        return [turn]
    turns: list[dict[str, Any]] = []
    pending: list[str] = []
    for b in blocks:
        if isinstance(b, TextBlock):
            pending.append(b.text)
        elif isinstance(b, ToolResultBlock):
            if pending:
                turns.append({"role": "user", "content": BLOCK_SEPARATOR.join(pending)})
                pending = []
            turns.append({"role": "tool", "tool_call_id": b.tool_use_id,
                          "content": _tool_result_text(b, deferred, loaded)})
    if pending or not turns:
        turns.append({"role": "user", "content": BLOCK_SEPARATOR.join(pending)})
    return turns


def conversation(body: MessagesBase, upto: tuple[int, int] | None = None) -> tuple[list[dict[str, Any]], set[str]]:
    """The template conversation and the deferred tools it loads; `upto` (message, block): stop after that block."""
    deferred = {t.name: t for t in body.tools or [] if t.defer_loading}
    loaded: set[str] = set()
    turns: list[dict[str, Any]] = []
    system = system_text(body.system)
    if system:
        turns.append({"role": "system", "content": system})
    for i, m in enumerate(body.messages):
        if upto is not None and i > upto[0]:
            break
        if upto is not None and i == upto[0] and isinstance(m.content, list):
            m = MessageParam.model_construct(role=m.role, content=m.content[:upto[1] + 1])
        turns.extend(_message_turns(m, deferred, loaded))
    return turns, loaded


def fold_inline_system(turns: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For templates that refuse a system turn past the first: each one's text joins the next user
    turn (else the previous one), where it stands; no turn moves."""
    out = [dict(t) for t in turns]
    k = 1
    while k < len(out):
        if out[k]["role"] != "system":
            k += 1
            continue
        text = out.pop(k)["content"]
        after = next((j for j in range(k, len(out)) if out[j]["role"] == "user"), None)
        before = next((j for j in range(k - 1, -1, -1) if out[j]["role"] == "user"), None)
        if after is not None:
            out[after]["content"] = text + BLOCK_SEPARATOR + out[after]["content"]
        elif before is not None:
            out[before]["content"] = out[before]["content"] + BLOCK_SEPARATOR + text
        else:
            out.insert(k, {"role": "user", "content": text})
            k += 1
    return out


def tool_plan(body: MessagesBase, processor: InputProcessor, chat_template: str | None, loaded: set[str],
              tool_parser: str | None = None) -> ToolPlan | None:
    """The request's tools as the shared ToolPlan: listed ones in the prompt, deferred ones callable once loaded."""
    if not body.tools:
        return None
    listed = [_function(t) for t in body.tools if not t.defer_loading]
    callable_ = [_function(t) for t in body.tools if not t.defer_loading or t.name in loaded]
    choice_param = body.tool_choice
    if choice_param is None or choice_param.type == "auto":
        choice = ToolChoice("auto")
    elif choice_param.type == "any":
        choice = ToolChoice("required")
    elif choice_param.type == "tool":
        choice = ToolChoice("named", choice_param.name)
    else:
        choice = ToolChoice("none")
    if choice.mode == "named" and choice.name not in {t.name for t in callable_}:
        raise bad_request(f"tool_choice names {choice.name!r}, a deferred tool no tool_reference has loaded yet",
                          param="tool_choice.name")
    parallel = not (choice_param is not None and choice_param.disable_parallel_tool_use)
    return ToolPlan(callable_, choice, parallel, processor.tool_rendering(chat_template, tool_parser), rendered=listed)


def _final_prefill(body: MessagesBase) -> bool:
    """A final assistant message is a prefill the reply continues (text only, no trailing whitespace, as Anthropic)."""
    last = body.messages[-1]
    if last.role != "assistant":
        return False
    blocks = last.blocks()
    where = f"messages.{len(body.messages) - 1}"
    if any(isinstance(b, ToolUseBlock) for b in blocks):
        raise bad_request(f"{where}: a final assistant message (a prefill) cannot hold tool_use blocks; send their "
                          "tool_result in a user message", param=where)
    text = BLOCK_SEPARATOR.join(b.text for b in blocks if isinstance(b, TextBlock))
    if text != text.rstrip():
        raise bad_request(f"{where}: final assistant content cannot end with trailing whitespace", param=where)
    return bool(text)


def render(body: MessagesBase, processor: InputProcessor, chat_template: str | None,
           *, with_breakpoints: bool = True, tool_parser: str | None = None,
           template_kwargs: dict[str, Any] | None = None) -> RenderedMessages:
    """The request's exact prompt ids, its tool plan and where its cache_control breakpoints fall
    (`tool_parser`: --tool-call-parser; `template_kwargs`: variables for the template, `enable_thinking`)."""
    turns, loaded = conversation(body)
    plan = tool_plan(body, processor, chat_template, loaded, tool_parser)
    tools = plan.template_tools() if plan is not None else None
    continuing = _final_prefill(body)
    fold = False

    def text_of(conv: list[dict[str, Any]], final: bool) -> str:
        return processor.render_chat_text(fold_inline_system(conv) if fold else conv,
                                          add_generation_prompt=final and not continuing, chat_template=chat_template,
                                          tools=tools, param="messages", continue_final_message=final and continuing,
                                          tool_parser=tool_parser, **(template_kwargs or {}))

    try:
        text = text_of(turns, True)
    except PromptError:
        if not any(t["role"] == "system" for t in turns[1:]):
            raise
        fold = True  # this template refuses system turns past the first: fold them in place
        text = text_of(turns, True)
    if not with_breakpoints:
        return RenderedMessages(list(processor.tokenizer.encode(text, add_special_tokens=False)), plan, [])
    ids, token_ends = _tokens_and_ends(processor.tokenizer, text)
    breakpoints = []
    for upto, ttl in _marks(body):
        conv = ([{"role": "system", "content": system_text(body.system)}] if system_text(body.system) else []) \
            if upto is None else conversation(body, upto)[0]
        if not conv:
            continue
        try:
            prefix = text_of(conv, False)
        except PromptError:
            continue  # a partial conversation this template cannot render: no lease, never an error
        # NOTE: the whole prompt is tokenized once: a breakpoint is the tokens that end within the text the
        # prompt shares with the rendering up to the marked block (the template decides where that ends)
        if token_ends is not None:
            position = bisect.bisect_right(token_ends, _common_prefix(prefix, text))
        else:  # a tokenizer without offsets: the prefix tokenized on its own
            position = _common_prefix(processor.tokenizer.encode(prefix, add_special_tokens=False), ids)
        breakpoints.append(Breakpoint(position, ttl))
    return RenderedMessages(ids, plan, breakpoints)


def _marks(body: MessagesBase) -> list[tuple[tuple[int, int] | None, float]]:
    """Each cache_control mark: (message, block) or None for the tools-and-system head, and its TTL."""
    marks: list[tuple[tuple[int, int] | None, float]] = []
    head = [t.cache_control for t in body.tools or [] if t.cache_control is not None]
    if isinstance(body.system, list):
        head += [b.cache_control for b in body.system if b.cache_control is not None]
    if head:
        marks.append((None, max(c.seconds for c in head)))
    for i, m in enumerate(body.messages):
        if isinstance(m.content, list):
            for j, b in enumerate(m.content):
                control = getattr(b, "cache_control", None)
                if control is not None:
                    marks.append(((i, j), control.seconds))
    return marks


def _tokens_and_ends(tokenizer: Any, text: str) -> tuple[list[int], list[int] | None]:
    """The text's token ids (as `encode` gives them) and where in the text each token ends (None: a
    slow tokenizer, which has no offsets)."""
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [end for _, end in enc["offset_mapping"]]
    return list(tokenizer.encode(text, add_special_tokens=False)), None


def _common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """How long a prefix two texts (or id lists) share."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # the first difference, by halving (texts of tens of KB)
    while lo < hi:
        mid = (lo + hi) // 2
        if a[lo:mid + 1] == b[lo:mid + 1]:
            lo = mid + 1
        else:
            hi = mid
    return lo
