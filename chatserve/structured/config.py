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

from dataclasses import dataclass
from typing import Any

from chatserve.json_options import read_json_options
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
    options = read_json_options("structured_outputs_config", value, StructuredOutputsConfig)
    if options is None:
        return StructuredOutputsConfig()
    value = options
    return StructuredOutputsConfig(**value)


def whitespace_runs(text: str) -> list[int]:
    """The lengths of the runs of JSON whitespace between tokens of ``text`` (string contents,
    escapes included, skipped): what ``max_whitespace`` bounds, measured on an output (the tests and
    ``benchmarks/serving/probe_json_whitespace.py`` read replies with it)."""
    runs: list[int] = []
    run, in_string, escaped = 0, False, False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch in " \t\n\r":
            run += 1
            continue
        if run:
            runs.append(run)
        run = 0
        in_string = ch == '"'
    if run:
        runs.append(run)
    return runs
