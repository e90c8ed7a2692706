"""Request bodies of the session API (`/v1/sessions...`), validated by pydantic before any work.

A turn's sampling fields, messages and tools are the shared ones of `chat/protocol.py`, with the
same rules (nulls, refused fields, unknown fields).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator, model_validator

from chatserve.reasoning.budget import budget_for_effort
from chatserve.server.chat.protocol import (
    MAX_INT32,
    REFUSED_SAMPLING,
    REFUSED_SESSION,
    Penalty,
    PositiveInt,
    Refusal,
    SamplingFields,
    Seed,
    StrictModel,
    Temperature,
    ToolChoiceField,
    ToolDefinition,
    TopK,
    TopP,
    check_length,
    check_tools,
    field_error,
)


class SessionDefaults(StrictModel):
    """Sampling defaults stored with a session; each turn's own fields override them."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    max_tokens: PositiveInt | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    stop: str | Annotated[list[str], Field(max_length=16, fail_fast=True)] | None = None
    seed: Seed | None = None
    # not sampling: how long this session's cached KV stays leased after each turn (the server's
    # --kv-lease-seconds when unset; 0: no lease)
    kv_lease_seconds: Annotated[float, Field(ge=0.0, le=7 * 24 * 3600)] | None = None


class CreateSessionRequest(StrictModel):
    system_prompt: Annotated[str, Field(max_length=200_000)] | None = None
    metadata: dict[str, Any] | None = None
    ttl_seconds: Annotated[int, Field(ge=1, le=365 * 24 * 3600)] | None = None
    defaults: SessionDefaults | None = None


class UpdateSessionRequest(StrictModel):
    """PATCH /v1/sessions/{id}: the fields given change (`title: ""` clears the title); defaults
    replace the stored ones whole."""

    title: Annotated[str, Field(max_length=200)] | None = None
    metadata: dict[str, Any] | None = None
    defaults: SessionDefaults | None = None


class ForkSessionRequest(StrictModel):
    """POST /v1/sessions/{id}/fork: a new session with the first `keep_turns` turns of this one."""

    keep_turns: Annotated[int, Field(ge=0, le=MAX_INT32)]
    title: Annotated[str, Field(max_length=200)] | None = None
    metadata: dict[str, Any] | None = None


class ToolResult(StrictModel):
    """The result of one call of the last reply, handed back in a session turn."""

    tool_call_id: Annotated[str, Field(min_length=1)]
    content: str


class ReasoningEffortField(StrictModel):
    """A turn's `reasoning_effort`, as chat completions take it (the budget table, docs/reasoning.md)."""

    reasoning_effort: str | None = None

    @field_validator("reasoning_effort")
    @classmethod
    def _known_effort(cls, effort: str | None) -> str | None:
        if effort is not None:
            budget_for_effort(effort, api="openai")  # a ValueError naming the field and the values
        return effort


class SessionMessageRequest(ReasoningEffortField, SamplingFields):
    """One user turn; a session turn streams by default (it is a chat UI's main call)."""

    refused: ClassVar[Mapping[str, Refusal]] = {**REFUSED_SAMPLING, **REFUSED_SESSION}

    content: Annotated[str, Field(min_length=1)] | None = None
    stream: bool = True
    logprobs: bool = False
    # tools offered this turn, and the results of the calls the last reply made (then content is optional)
    tools: Annotated[list[ToolDefinition], Field(fail_fast=True)] | None = None
    tool_choice: ToolChoiceField | None = None
    parallel_tool_calls: bool = True
    tool_results: Annotated[list[ToolResult], Field(min_length=1, fail_fast=True)] | None = None

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_bounded(cls, value: Any, info: ValidationInfo) -> Any:
        return check_length(value, info, "max_tools", "tools")

    @field_validator("tool_results", mode="before")
    @classmethod
    def _results_bounded(cls, value: Any, info: ValidationInfo) -> Any:
        return check_length(value, info, "max_messages", "tool_results")

    @model_validator(mode="after")
    def _says_something(self) -> SessionMessageRequest:
        if self.content is None and self.tool_results is None:
            raise field_error("content", "a turn needs content (the user's message) or tool_results")
        check_tools(self.tools, self.tool_choice)
        return self

    @property
    def has_tools(self) -> bool:
        return bool(self.tools or self.tool_results)


class SessionRegenerateRequest(ReasoningEffortField, SamplingFields):
    """POST /v1/sessions/{id}/regenerate: a new reply to the last user message, in place of the last
    reply; the sampling fields of a turn (the stored user message is the content)."""

    refused: ClassVar[Mapping[str, Refusal]] = {**REFUSED_SAMPLING, **REFUSED_SESSION}

    stream: bool = True
    logprobs: bool = False
