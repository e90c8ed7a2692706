"""What one HTTP request produced, per choice: the deltas as they arrive, their sum, the token counts.

These are plain values between the engine side (`generation.Generation` makes `ChoiceDelta`s) and
the wire side (`chunks` turns them into OpenAI objects), so neither needs to know the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from chatserve.server.chat.cache_usage import usage_extension


@dataclass
class ChoiceDelta:
    """New output of one choice since the last delta."""

    index: int  # choice index across all prompts: prompt_index * n + output index
    text: str
    token_ids: list[int]
    logprobs: Any  # SampleLogprobs | None
    finish_reason: str | None
    stop_reason: str | int | None = None
    error: str | None = None  # with finish_reason "error": why this choice could not go on
    reasoning: str | None = None  # new reasoning text (the parser's; `text` is only ever the answer)


@dataclass
class Usage:
    """OpenAI's `usage` object; `cached_tokens` is known once every engine request has ended."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    reasoning_tokens: int | None = None
    """Completion tokens spent reasoning (up to and including the end marker); None: the request was not
    parsed for reasoning (then `completion_tokens_details` is left out, as before reasoning existed)."""
    # our extension (`cache_usage.usage_extension`): matched length and why the cache missed
    chatserve: dict[str, Any] = field(default_factory=lambda: usage_extension([]))

    def as_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
            **({} if self.reasoning_tokens is None
               else {"completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}),
            "chatserve": self.chatserve,
        }


@dataclass
class ChoiceState:
    """Everything one choice produced so far."""

    text: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    has_logprobs: bool = False
    error: str | None = None

    @property
    def content(self) -> str:
        return "".join(self.text)

    @property
    def reasoning_text(self) -> str | None:
        """The reply's reasoning, None when it had none (a session stores it apart from the answer)."""
        return "".join(self.reasoning) or None


class Accumulator:
    """Everything a request produced so far, per choice: the non-streaming body and the session turn."""

    def __init__(self, num_choices: int) -> None:
        self.choices = [ChoiceState() for _ in range(num_choices)]

    def add(self, d: ChoiceDelta) -> None:
        c = self.choices[d.index]
        if d.text:
            c.text.append(d.text)
        if d.reasoning:
            c.reasoning.append(d.reasoning)
        c.token_ids.extend(d.token_ids)
        if d.logprobs is not None:
            c.has_logprobs = True
            c.logprobs.extend(d.logprobs)
        if d.finish_reason:
            c.finish_reason = d.finish_reason
            c.stop_reason = d.stop_reason
        if d.error:
            c.error = d.error

    def first_error(self) -> str | None:
        """The error of the first choice that ended with finish_reason "error", if any."""
        return next((c.error or "generation failed" for c in self.choices if c.finish_reason == "error"), None)

    def merged_delta(self, index: int) -> ChoiceDelta:
        """One choice's whole output as a single delta (what the non-streaming body formats)."""
        c = self.choices[index]
        return ChoiceDelta(index, c.content, c.token_ids, c.logprobs if c.has_logprobs else None, c.finish_reason,
                           reasoning=c.reasoning_text)
