"""``speculative_config`` in vLLM's JSON shape, validated once (an unknown key is an error naming it)."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any, Literal

SpecMethod = Literal["ngram"]
SPEC_METHODS: tuple[str, ...] = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are made and how many are verified a step.

    ``num_speculative_tokens`` is the most draft tokens one sequence verifies in a step; the proposer
    adapts below it (see ``proposer``). ``prompt_lookup_min/max`` bound the n-gram the ngram drafter
    matches (vLLM's names). ``disable_by_batch_size``: no drafts while at least this many sequences
    decode (a big batch is compute-bound: a rejected draft then costs a full token's work).
    """

    method: SpecMethod = "ngram"
    num_speculative_tokens: int = 5
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    disable_by_batch_size: int | None = 8

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{name} {why}")

        if self.method not in SPEC_METHODS:
            raise bad("method", f"must be one of {', '.join(SPEC_METHODS)}; got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, f"must be an integer >= 1; got {value!r}")
        if self.num_speculative_tokens > 32:
            raise bad("num_speculative_tokens", f"must be at most 32; got {self.num_speculative_tokens}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"({self.prompt_lookup_min}) must not exceed prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None and (
            not isinstance(self.disable_by_batch_size, int) or isinstance(self.disable_by_batch_size, bool)
            or self.disable_by_batch_size < 1
        ):
            raise bad("disable_by_batch_size", f"must be an integer >= 1 or null; got {self.disable_by_batch_size!r}")


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A JSON text (the flag), a dict (``LLM(speculative_config=...)``) or a config; None: off.

    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}`` as in vLLM; a key
    we do not know is an error, never silently ignored.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        if not value.strip():
            return None
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object; got {type(value).__name__}")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"speculative_config.{unknown[0]} is not a known option (known: {', '.join(sorted(known))})")
    if "method" not in value:
        raise ValueError("speculative_config.method is required (ngram)")
    return SpeculativeConfig(**value)
