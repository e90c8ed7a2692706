"""Request bodies of the OpenAI-compatible API, validated by pydantic before any work is done.

Strict types (no "0.5" for a float, no 1.0 for an int, no NaN or Infinity), ranges as OpenAI
documents them, and vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ...) so the
clients written for either keep working. Unknown fields are ignored, as OpenAI-compatible servers
commonly do, except features we do not implement (tools, logit_bias, ...), which are refused
with a 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int, Field(ge=_SEED_MIN, le=_SEED_MAX)]
PositiveInt = Annotated[int, Field(ge=1)]
# NOTE: the sampler keeps top_k in an int64 tensor shared by the whole batch; a value that does not
# fit would kill the engine loop for everyone, so it is bounded here (far above any vocabulary size).
TopK = Annotated[int, Field(ge=-1, le=2**31 - 1)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class _SamplingFields(_Strict):
    """Fields shared by chat and text completions."""

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    max_tokens: PositiveInt | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extensions
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Annotated[int, Field(ge=0)] = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _SamplingFields:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(_SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveInt | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    add_generation_prompt: bool = True
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_unsupported_chat(self) -> ChatCompletionRequest:
        if self.tools or self.functions:
            raise ValueError("tools and function calling are not supported by this server")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError("tool_choice is not supported by this server")
        if self.response_format is not None and self.response_format.get("type", "text") != "text":
            raise ValueError("response_format other than {\"type\": \"text\"} is not supported by this server")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self

    def effective_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


PromptInput = str | Annotated[list[str], Field(min_length=1)] | Annotated[list[int], Field(min_length=1)] | Annotated[
    list[Annotated[list[int], Field(min_length=1)]], Field(min_length=1)
]


class CompletionRequest(_SamplingFields):
    prompt: PromptInput
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: PositiveInt | None = None
    max_tokens: PositiveInt | None = 16  # OpenAI's default for completions

    @model_validator(mode="after")
    def _refuse_unsupported_completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of different from n is not supported by this server")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]
