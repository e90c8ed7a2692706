"""Anthropic's Messages API request bodies, validated before any work is done.

The same rules as the OpenAI bodies (`chat/protocol.py`'s `StrictModel`): strict types, no NaN or
Infinity, JSON null meaning the default, ranges as Anthropic documents them (`temperature` 0 to 1).
Content blocks are checked one by one with an error that names the block
(`messages.2.content.1.type`), because a client that sends one unknown block type needs to know
which. Fields that agents send and that change nothing here (`context_management`,
`service_tier`, `container`, `mcp_servers`, `metadata`; `thinking` and `output_config.effort` on a
server whose model does not reason) are accepted and listed as ignored in docs/anthropic.md; any
other unknown field is ignored too, as the OpenAI routes do. `thinking` follows Anthropic's rules
(`budget_tokens` at least 1024 and below `max_tokens`), and `output_config.effort` must be a name of
the budget table (chatserve/reasoning/budget.py).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from chatserve.reasoning import budget_for_effort
from chatserve.server.chat.protocol import SchemaObject, StrictModel, check_length, field_error

MAX_INT32 = 2**31 - 1
MAX_BREAKPOINTS = 4
"""Anthropic allows at most four `cache_control` breakpoints in one request (a fifth is a 400)."""

ToolName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,128}$")]


class CacheControl(StrictModel):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def seconds(self) -> float:
        return 3600.0 if self.ttl == "1h" else 300.0


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=256)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolReferenceBlock(StrictModel):
    """A deferred tool (`defer_loading: true`) loaded into the conversation, found by a tool-search tool."""

    type: Literal["tool_reference"]
    tool_name: str
    cache_control: CacheControl | None = None


class OtherBlock(StrictModel):
    """A block inside a `tool_result` that is not text (an image Claude Code's Read returns, a
    document, a search result): rendered as a fixed placeholder, never refused (the session would
    be dead for good: the client sends it back on every later turn)."""

    type: str
    cache_control: CacheControl | None = None


ResultBlock = TextBlock | ToolReferenceBlock | OtherBlock


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | Annotated[list[ResultBlock], Field(fail_fast=True)] = ""
    is_error: bool = False
    cache_control: CacheControl | None = None

    @model_validator(mode="before")
    @classmethod
    def _typed_content(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("content"), list):
            blocks = []
            for i, raw in enumerate(data["content"]):
                if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
                    raise field_error(f"content.{i}.type", "each block must be an object with a string type")
                kind = {"text": TextBlock, "tool_reference": ToolReferenceBlock}.get(raw["type"], OtherBlock)
                blocks.append(kind.model_validate(raw))
            data = {**data, "content": blocks}
        return data


class ThinkingBlock(StrictModel):
    """An earlier reply's thinking sent back; its `signature` (this server's, checked in
    `thinking.thinking_text`) is what lets it render as the model's own reasoning."""

    type: Literal["thinking"]
    thinking: str
    signature: str


class RedactedThinkingBlock(StrictModel):
    type: Literal["redacted_thinking"]
    data: str


ContentBlock = TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock

_BLOCKS: dict[str, type[StrictModel]] = {
    "text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
    "redacted_thinking": RedactedThinkingBlock,
}
_NOT_READ = {"image": "images", "document": "documents", "search_result": "search results",
             "container_upload": "container uploads"}
_ROLE_BLOCKS = {
    "user": {"text", "tool_result"},
    "assistant": {"text", "tool_use", "thinking", "redacted_thinking"},
    "system": {"text"},
}


class MessageParam(StrictModel):
    """One turn: `user`, `assistant`, or an inline `system` turn (Claude Code sends its environment so)."""

    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[ContentBlock], Field(fail_fast=True)]

    @model_validator(mode="before")
    @classmethod
    def _typed_blocks(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("content"), list):
            return data
        role = data.get("role")
        blocks = []
        for i, raw in enumerate(data["content"]):
            if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
                raise field_error(f"content.{i}", "each content block must be an object with a string type")
            kind = raw["type"]
            if kind in _NOT_READ:
                raise field_error(f"content.{i}", f"{_NOT_READ[kind]} ({kind!r} blocks) are not supported: this "
                                                   "server's model reads text only", "unsupported_content")
            if kind not in _BLOCKS:
                raise field_error(f"content.{i}.type", f"unknown content block type {kind!r} (this server reads "
                                                        f"{', '.join(sorted(_BLOCKS))})")
            if role in _ROLE_BLOCKS and kind not in _ROLE_BLOCKS[role]:
                raise field_error(f"content.{i}.type", f"a {role} message cannot hold {kind!r} blocks")
            blocks.append(_BLOCKS[kind].model_validate(raw))
        return {**data, "content": blocks}

    def blocks(self) -> list[ContentBlock]:
        """The content as blocks (a string is one text block)."""
        if isinstance(self.content, str):
            return [TextBlock(type="text", text=self.content)]
        return list(self.content)


class ToolParam(StrictModel):
    """A client tool. Server tools (`web_search_...`, `code_execution_...`) run on Anthropic's side and are refused."""

    type: Literal["custom"] | None = None
    name: ToolName
    description: str | None = None
    input_schema: SchemaObject
    strict: bool | None = None
    cache_control: CacheControl | None = None
    defer_loading: bool = False
    """Not rendered until a `tool_reference` block names it (Anthropic's tool search)."""

    @model_validator(mode="before")
    @classmethod
    def _client_tool(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("type") not in (None, "custom"):
            raise field_error("type", f"server tools ({data.get('type')!r}) run on Anthropic's side and are not "
                                      "available on this server; send client tools (name, input_schema)")
        return data


class ToolChoiceParam(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoiceParam:
        if self.type == "tool" and not self.name:
            raise field_error("name", 'tool_choice {"type": "tool"} needs the name of a tool')
        return self


MIN_THINKING_BUDGET = 1024
"""Anthropic's smallest `thinking.budget_tokens`."""


class ThinkingParam(StrictModel):
    """`enabled` (with `budget_tokens`: the engine ends the reasoning there), `adaptive` (the model's own
    length, bounded by `output_config.effort` when sent) or `disabled` (the template's `enable_thinking`
    off); `display: "omitted"` sends thinking blocks with empty text and a signature that still carries it.
    Changes nothing on a server whose model does not reason (docs/anthropic.md)."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Annotated[int, Field(le=MAX_INT32)] | None = None
    display: Literal["summarized", "omitted"] | None = None

    @model_validator(mode="after")
    def _budget(self) -> ThinkingParam:
        if self.type == "enabled" and self.budget_tokens is None:
            raise field_error("budget_tokens", 'thinking {"type": "enabled"} needs budget_tokens')
        if self.type == "enabled" and self.budget_tokens is not None and self.budget_tokens < MIN_THINKING_BUDGET:
            raise field_error("budget_tokens", f"budget_tokens must be at least {MIN_THINKING_BUDGET}, got "
                                               f"{self.budget_tokens}")
        if self.type != "enabled" and self.budget_tokens is not None:
            raise field_error("budget_tokens", f'budget_tokens belongs to thinking {{"type": "enabled"}}, not '
                                               f'{self.type!r}')
        return self

    @property
    def omitted(self) -> bool:
        return self.display == "omitted"


class JsonOutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: Annotated[SchemaObject, Field(alias="schema")]


class OutputConfig(StrictModel):
    effort: str | None = None
    """How long the model may think: a name of the budget table (chatserve/reasoning/budget.py)."""
    format: JsonOutputFormat | None = None

    @field_validator("effort")
    @classmethod
    def _known_effort(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                budget_for_effort(value, api="messages")
            except ValueError as exc:
                raise ValueError(str(exc)) from None
        return value


class Metadata(StrictModel):
    user_id: Annotated[str, Field(max_length=512)] | None = None


class MessagesBase(StrictModel):
    """What a Messages request and a `count_tokens` request share: the conversation and its tools."""

    model: Annotated[str, Field(min_length=1)]
    messages: Annotated[list[MessageParam], Field(min_length=1, fail_fast=True)]
    system: str | Annotated[list[TextBlock], Field(fail_fast=True)] | None = None
    tools: Annotated[list[ToolParam], Field(fail_fast=True)] | None = None
    tool_choice: ToolChoiceParam | None = None
    thinking: ThinkingParam | None = None
    output_config: OutputConfig | None = None
    output_format: JsonOutputFormat | None = None  # the older spelling of output_config.format (pydantic-ai)
    # accepted and ignored (docs/anthropic.md)
    context_management: Any = None
    mcp_servers: Any = None
    container: Any = None
    service_tier: Any = None
    # chatserve / vLLM: requests share cached KV only with requests of the same salt
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_bounded(cls, value: Any, info: ValidationInfo) -> Any:
        return check_length(value, info, "max_tools", "tools")

    @model_validator(mode="before")
    @classmethod
    def _max_tokens_range(cls, data: Any) -> Any:
        # A number past int32 is a 400 of its own (never an overflow deeper down), said without
        # echoing a 4,000-digit value back.
        if isinstance(data, dict):
            value = data.get("max_tokens")
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_INT32:
                raise field_error("max_tokens", f"max_tokens must be at most {MAX_INT32}")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> MessagesBase:
        names = [t.name for t in self.tools or []]
        seen: set[str] = set()
        for i, name in enumerate(names):
            if name in seen:
                raise field_error(f"tools.{i}.name", f"two tools are named {name!r}; tool names must be unique")
            seen.add(name)
        choice = self.tool_choice
        if choice is not None and choice.type in ("any", "tool") and not names:
            raise field_error("tool_choice", f'tool_choice {{"type": "{choice.type}"}} needs at least one tool in tools')
        if choice is not None and choice.type == "tool" and choice.name not in seen:
            raise field_error("tool_choice.name", f"tool_choice names the tool {choice.name!r}, which is not in tools")
        if self.output_format is not None and self.output_config is not None and self.output_config.format is not None:
            raise field_error("output_format", "send output_config.format or output_format, not both")
        self._check_breakpoints()
        self._check_tool_results()
        return self

    def _check_breakpoints(self) -> None:
        where = [f"tools.{i}" for i, t in enumerate(self.tools or []) if t.cache_control is not None]
        if isinstance(self.system, list):
            where += [f"system.{i}" for i, b in enumerate(self.system) if b.cache_control is not None]
        for i, m in enumerate(self.messages):
            if isinstance(m.content, list):
                where += [f"messages.{i}.content.{j}" for j, b in enumerate(m.content)
                          if getattr(b, "cache_control", None) is not None]
        if len(where) > MAX_BREAKPOINTS:
            raise field_error(where[MAX_BREAKPOINTS], f"A maximum of {MAX_BREAKPOINTS} blocks with cache_control may be "
                                                      f"provided. Found {len(where)}.")

    def _check_tool_results(self) -> None:
        """Every tool_result answers a tool_use of an earlier assistant message."""
        calls: set[str] = set()
        for i, m in enumerate(self.messages):
            if isinstance(m.content, str):
                continue
            for j, b in enumerate(m.content):
                if isinstance(b, ToolUseBlock):
                    calls.add(b.id)
                elif isinstance(b, ToolResultBlock) and b.tool_use_id not in calls:
                    raise field_error(f"messages.{i}.content.{j}.tool_use_id",
                                      f"tool_result block(s) provided with tool_use_id {b.tool_use_id!r}, but no "
                                      "tool_use block with this id precedes it")

    def json_schema(self) -> tuple[dict[str, Any], str] | None:
        """The structured output asked for, and the field it came from."""
        if self.output_config is not None and self.output_config.format is not None:
            return self.output_config.format.schema_, "output_config.format.schema"
        if self.output_format is not None:
            return self.output_format.schema_, "output_format.schema"
        return None


class MessagesRequest(MessagesBase):
    """`POST /v1/messages`."""

    max_tokens: Annotated[int, Field(ge=1)]
    stream: bool = False
    stop_sequences: Annotated[list[str], Field(fail_fast=True)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=MAX_INT32)] | None = None
    metadata: Metadata | None = None

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        thinking = self.thinking
        if thinking is not None and thinking.budget_tokens is not None and thinking.budget_tokens >= self.max_tokens:
            raise field_error("thinking.budget_tokens", f"max_tokens ({self.max_tokens}) must be greater than "
                                                        f"thinking.budget_tokens ({thinking.budget_tokens})")
        return self


class CountTokensRequest(MessagesBase):
    """`POST /v1/messages/count_tokens`: the conversation alone."""
