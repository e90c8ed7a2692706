"""The reasoning parsers by vLLM's names: which markers open and close a model's reasoning.

A parser here is data, not code: the markers of one family. The one splitter
(:mod:`chatserve.reasoning.splitter`) reads any family's markers, so adding a family is one entry.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningParserSpec:
    """One family's reasoning markers (``--reasoning-parser NAME``).

    ``start`` / ``end`` open and close the reasoning. ``template_markers``: text that, found in a
    chat template, says the template belongs to this family (``detect_reasoning_parser``).
    """

    name: str
    start: str
    end: str
    template_markers: tuple[str, ...] = ()


_THINK = ("<think>", "</think>")

# vLLM's names. deepseek_r1 and qwen3 share the markers: they differ only in which templates detect them.
REASONING_PARSERS: dict[str, ReasoningParserSpec] = {
    "deepseek_r1": ReasoningParserSpec("deepseek_r1", *_THINK, template_markers=("<｜Assistant｜><think>", "<｜Assistant｜>")),
    "qwen3": ReasoningParserSpec("qwen3", *_THINK, template_markers=("enable_thinking", "</think>")),
    "mistral": ReasoningParserSpec("mistral", "[THINK]", "[/THINK]", template_markers=("[THINK]",)),
}


def reasoning_parser_named(name: str) -> ReasoningParserSpec:
    """The parser called ``name``; ``ValueError`` naming the choices otherwise."""
    spec = REASONING_PARSERS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(f"reasoning_parser: unknown parser {name!r}; choose one of {', '.join(sorted(REASONING_PARSERS))}")
    return spec


def detect_reasoning_parser(chat_template: str | None) -> str | None:
    """The parser a chat template's own markers name (Qwen3, DeepSeek-R1, Mistral Magistral), else None.

    DeepSeek-R1 is checked first (its assistant tag is unmistakable, and its templates also close
    ``</think>``), then Mistral's ``[THINK]``, then Qwen3's ``enable_thinking`` / ``</think>``.
    """
    if not chat_template:
        return None
    for name in ("deepseek_r1", "mistral", "qwen3"):
        if any(marker in chat_template for marker in REASONING_PARSERS[name].template_markers):
            return name
    return None
