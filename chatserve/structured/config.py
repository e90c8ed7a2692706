"""``structured_outputs_config`` in vLLM's JSON shape, and how a JSON grammar spends whitespace.

xgrammar's JSON grammars allow any amount of whitespace between tokens, and a small model can
loop on grammar-legal newlines until ``max_tokens`` (vLLM #38696). Every JSON grammar chatserve
compiles (json_object, json_schema, tool-call arguments, the JSON inside structural tags, the
Responses API's ``text.format``) therefore bounds each run of whitespace between tokens to
``max_whitespace`` characters (default 8); ``disable_any_whitespace`` allows none at all, with the
compact separators ``","`` and ``":"`` (so a bare ``"`` after them stays legal, vLLM #58067).
Whitespace inside string values is never touched.

The server-wide setting is ``--structured-outputs-config '{"disable_any_whitespace": true}'`` (or
``{"max_whitespace": 2}``), ``LLM(structured_outputs_config=...)`` offline; a request overrides it
with ``structured_outputs: {"disable_any_whitespace": ..., "max_whitespace": ...}``. A key we do not
know is an error naming it, never silently ignored (vLLM #48765).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from chatserve.sampling_params import check_whitespace_options

DEFAULT_MAX_WHITESPACE = 8
# The backends vLLM's config names that we are (or that mean "whatever the server has").
BACKENDS: tuple[str, ...] = ("auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """The engine's structured-outputs defaults (a request may override the whitespace ones).

    ``max_whitespace``: the longest run of whitespace a JSON grammar allows between two tokens.
    ``disable_any_whitespace``: none at all, separators ``","`` and ``":"`` (wins over max_whitespace).
    ``backend``: accepted for vLLM's spelling; xgrammar is the only one ("auto" means it too).
    """

    disable_any_whitespace: bool = False
    max_whitespace: int = DEFAULT_MAX_WHITESPACE
    backend: str = "xgrammar"

    def __post_init__(self) -> None:
        check_whitespace_options("structured_outputs_config", self.disable_any_whitespace, self.max_whitespace)
        if self.backend not in BACKENDS:
            raise ValueError(f"structured_outputs_config.backend must be one of {', '.join(BACKENDS)} (chatserve "
                             f"compiles grammars with xgrammar); got {self.backend!r}")


def parse_structured_outputs_config(value: str | dict[str, Any] | StructuredOutputsConfig | None) -> StructuredOutputsConfig:
    """A JSON text (the flag), a dict (``LLM(structured_outputs_config=...)``) or a config; None: the defaults."""
    if isinstance(value, StructuredOutputsConfig):
        return value
    if value is None:
        return StructuredOutputsConfig()
    if isinstance(value, str):
        if not value.strip():
            return StructuredOutputsConfig()
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"structured_outputs_config must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs_config must be a JSON object; got {type(value).__name__}")
    known = {f.name for f in fields(StructuredOutputsConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"structured_outputs_config.{unknown[0]} is not a known option "
                         f"(known: {', '.join(sorted(known))})")
    return StructuredOutputsConfig(**value)
