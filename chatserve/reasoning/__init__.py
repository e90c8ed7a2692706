"""Reasoning models: the parsers (markers by vLLM's names), the budget table, the per-request config.

The engine's output processor splits each sequence's text into reasoning and answer as tokens
arrive (:mod:`chatserve.reasoning.splitter`) and forces the end marker once a request's budget
is spent; the server's API adapters build the per-request :class:`ReasoningConfig` with
:func:`reasoning_config_for` from their own fields.
"""

from chatserve.reasoning.budget import budget_for_effort
from chatserve.reasoning.config import ReasoningConfig, reasoning_config_for
from chatserve.reasoning.specs import (
    REASONING_PARSERS,
    ReasoningParserSpec,
    detect_reasoning_parser,
    reasoning_parser_named,
)

__all__ = [
    "REASONING_PARSERS",
    "ReasoningConfig",
    "ReasoningParserSpec",
    "budget_for_effort",
    "detect_reasoning_parser",
    "reasoning_config_for",
    "reasoning_parser_named",
]
