"""Request bodies of `/v1/chat/completions` and `/v1/completions`, validated by pydantic before any work.

The fields they share with every API family (sampling, messages, tools, structured outputs) and
the rules every body keeps (nulls, refused fields, unknown fields) are in `chat/protocol.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar

from pydantic import Field, ValidationInfo, field_validator, model_validator

from chatserve.reasoning.budget import budget_for_effort
from chatserve.server.chat.protocol import (
    MAX_INT32,
    REFUSED_CHAT,
    REFUSED_SAMPLING,
    RESERVED_TEMPLATE_KWARGS,
    ChatMessage,
    PositiveInt,
    Refusal,
    SamplingFields,
    ToolChoiceField,
    ToolDefinition,
    check_length,
    check_tools,
    field_error,
)

# vLLM's fields that chat and completions serve (a session turn refuses them: its prompt is its kept history)
OPENAI_SERVED = frozenset({"truncate_prompt_tokens", "return_tokens_as_token_ids", "prompt_logprobs"})
REFUSED_OPENAI: Mapping[str, Refusal] = {k: v for k, v in REFUSED_SAMPLING.items() if k not in OPENAI_SERVED}
TruncatePromptTokens = Annotated[int, Field(ge=-1, le=MAX_INT32)]


class OpenAIFields(SamplingFields):
    """What chat and completions take beyond the shared sampling fields (vLLM's extras)."""

    # keep the prompt's last N tokens (-1: the model's context length less one), as vLLM
    truncate_prompt_tokens: TruncatePromptTokens | None = None
    # logprobs' tokens spelled "token_id:N" (for tokens that are not valid text on their own)
    return_tokens_as_token_ids: bool = False
    # vLLM's: each prompt token's logprob, rank and the top N (0..20) in the reply; such a request does not
    # read the prefix cache (every prompt position is computed), though it writes it
    prompt_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("truncate_prompt_tokens must be >= 1, or -1 for the model's context length")
        return value


class ChatCompletionRequest(OpenAIFields):
    refused: ClassVar[Mapping[str, Refusal]] = {**REFUSED_OPENAI, **REFUSED_CHAT}

    messages: Annotated[list[ChatMessage], Field(min_length=1, fail_fast=True)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    # Passed to the chat template as variables (e.g. Qwen3's enable_thinking), as vLLM does.
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ToolDefinition], Field(fail_fast=True)] | None = None
    tool_choice: ToolChoiceField | None = None
    parallel_tool_calls: bool = True
    # vLLM's: the reply's content starts with the last message's content (when that message has the
    # reply's role: assistant, or any role with add_generation_prompt false)
    echo: bool = False
    # vLLM's: the last (assistant) message is left open and the reply continues it (with
    # add_generation_prompt false; both true is a 400, as vLLM)
    continue_final_message: bool = False
    # how much the model may reason (the budget table, docs/reasoning.md); a model without a reasoning
    # parser refuses any value but "none" (ChatAdapter.admit)
    reasoning_effort: str | None = None

    @field_validator("reasoning_effort")
    @classmethod
    def _known_effort(cls, effort: str | None) -> str | None:
        if effort is not None:
            budget_for_effort(effort, api="openai")  # a ValueError naming the field and the values
        return effort

    @field_validator("messages", mode="before")
    @classmethod
    def _messages_bounded(cls, value: Any, info: ValidationInfo) -> Any:
        return check_length(value, info, "max_messages", "messages")

    @field_validator("tools", mode="before")
    @classmethod
    def _tools_bounded(cls, value: Any, info: ValidationInfo) -> Any:
        return check_length(value, info, "max_tools", "tools")

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables_only(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in kwargs or {}:
            if key in RESERVED_TEMPLATE_KWARGS or not key.isidentifier():
                raise ValueError(f"{key[:64]!r} cannot be set through chat_template_kwargs (use the request's own "
                                 f"fields; template variables must be identifiers)")
        return kwargs

    @model_validator(mode="after")
    def _consistent_chat(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs requires logprobs to be true")
        check_tools(self.tools, self.tool_choice)
        if self.continue_final_message and self.add_generation_prompt:
            raise field_error("continue_final_message", "continue_final_message needs add_generation_prompt false "
                                                        "(the reply continues the last message instead of a new turn)")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise field_error("continue_final_message", "continue_final_message needs the last message to be the "
                                                        "assistant's, to continue")
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def enable_thinking(self) -> bool | None:
        """`chat_template_kwargs.enable_thinking` (Qwen3's switch) when sent as a boolean, else None."""
        value = (self.chat_template_kwargs or {}).get("enable_thinking")
        return value if isinstance(value, bool) else None


TokenId = Annotated[int, Field(ge=-MAX_INT32 - 1, le=MAX_INT32)]
PromptInput = str | Annotated[list[str], Field(min_length=1, fail_fast=True)] | Annotated[
    list[TokenId], Field(min_length=1, fail_fast=True)
] | Annotated[list[Annotated[list[TokenId], Field(min_length=1, fail_fast=True)]], Field(min_length=1, fail_fast=True)]


class CompletionRequest(OpenAIFields):
    refused: ClassVar[Mapping[str, Refusal]] = REFUSED_OPENAI

    prompt: PromptInput
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    best_of: PositiveInt | None = None
    max_tokens: PositiveInt | None = 16  # OpenAI's default for completions (also when sent as null)
    # text after the insertion: fill-in-the-middle, for models whose vocabulary has FIM tokens
    # (openai/fim.py; a 400 naming the model otherwise)
    suffix: str | None = None

    @model_validator(mode="after")
    def _consistent_completion(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise field_error("best_of", "best_of different from n is not supported by this server")
        if self.suffix is not None and self.echo:
            raise field_error("suffix", "echo with suffix is not supported: the prompt run is the text around the "
                                        "insertion, not the prompt sent")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
