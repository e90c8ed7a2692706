"""The per-request reasoning settings: which markers, how many tokens, where the reply starts."""

from __future__ import annotations

from dataclasses import dataclass

from chatserve.reasoning.budget import budget_for_effort
from chatserve.reasoning.specs import ReasoningParserSpec, reasoning_parser_named


@dataclass(frozen=True)
class ReasoningConfig:
    """How the engine splits (and bounds) one request's reasoning (``SamplingParams.reasoning``).

    ``parser``: a name in ``REASONING_PARSERS``. ``budget_tokens``: reasoning tokens allowed before
    the engine forces the end marker (None: unbounded). ``starts_in_reasoning``: the rendered prompt
    already ends in the opening marker, so the first generated token is reasoning.
    """

    parser: str
    budget_tokens: int | None = None
    starts_in_reasoning: bool = False

    def __post_init__(self) -> None:
        reasoning_parser_named(self.parser)
        budget = self.budget_tokens
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 0):
            raise ValueError(f"reasoning.budget_tokens must be an integer >= 0 or None; got {budget!r}")
        if not isinstance(self.starts_in_reasoning, bool):
            raise ValueError(f"reasoning.starts_in_reasoning must be a bool; got {self.starts_in_reasoning!r}")

    @property
    def spec(self) -> ReasoningParserSpec:
        return reasoning_parser_named(self.parser)


def prompt_opens_reasoning(spec: ReasoningParserSpec, prompt_text: str) -> bool:
    """Whether the rendered prompt ends inside an open reasoning block (its last marker opens one)."""
    tail = prompt_text.rstrip()
    return tail.endswith(spec.start)


def reasoning_config_for(
    parser: str | None,
    prompt_text: str,
    *,
    effort: str | None = None,
    budget_tokens: int | None = None,
    enable_thinking: bool | None = None,
    api: str = "openai",
) -> ReasoningConfig | None:
    """One request's reasoning config from its API's controls, or None when nothing is to be split.

    None when the model has no parser, or thinking is turned off (``enable_thinking=False``) and the
    template left no open block. An explicit ``budget_tokens`` wins over ``effort``; ``effort`` goes
    through the budget table (``ValueError`` naming the API's field for an unknown value). With
    thinking off but an open block rendered anyway (a template that ignores the switch), the budget
    is 0: the end marker is forced at once.
    """
    if parser is None:
        return None
    spec = reasoning_parser_named(parser)
    starts = prompt_opens_reasoning(spec, prompt_text)
    if budget_tokens is not None:
        if isinstance(budget_tokens, bool) or not isinstance(budget_tokens, int) or budget_tokens < 0:
            raise ValueError(f"budget_tokens must be an integer >= 0; got {budget_tokens!r}")
        budget: int | None = budget_tokens
    elif effort is not None:
        budget = budget_for_effort(effort, api=api)
    else:
        budget = None
    if enable_thinking is False:
        if not starts:
            return None
        budget = 0
    return ReasoningConfig(parser=spec.name, budget_tokens=budget, starts_in_reasoning=starts)
