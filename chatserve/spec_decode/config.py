"""``speculative_config`` in vLLM's JSON shape, validated once (an unknown key is an error naming it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from chatserve.json_options import read_json_options

SpecMethod = Literal["ngram", "suffix"]
SPEC_METHODS: tuple[str, ...] = ("ngram", "suffix")
# options that only one method reads: given with the other method they are an error, not ignored
_METHOD_OPTIONS: dict[str, frozenset[str]] = {
    "ngram": frozenset({"prompt_lookup_min", "prompt_lookup_max"}),
    "suffix": frozenset({
        "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
        "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob",
    }),
}
MAX_SPECULATIVE_TOKENS = 32


@dataclass(frozen=True)
class SpeculativeConfig:
    """How drafts are made and how many are verified a step.

    ``num_speculative_tokens`` is the most draft tokens one sequence verifies in a step; the proposer
    adapts below it (see ``proposer``); default 5 for ngram, and for suffix the tree depth capped at
    16 (the suffix drafter cuts its own drafts by probability, as in vLLM, where it defaults to the
    depth). ``prompt_lookup_min/max`` bound the n-gram the ngram drafter matches; the
    ``suffix_decoding_*`` options are the suffix drafter's (vLLM's names and meanings, see
    ``suffix``; ``max_cached_requests`` defaults to 256, not vLLM's 10,000, because our trees are
    Python objects, a few MiB per cached response). ``disable_by_batch_size``: no drafts while at
    least this many sequences decode (a big batch is compute-bound: a rejected draft then costs a
    full token's work).
    """

    method: SpecMethod = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 256
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = 8

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"speculative_config.{name} {why}")

        if self.method not in SPEC_METHODS:
            raise bad("method", f"must be one of {', '.join(SPEC_METHODS)}; got {self.method!r}")
        if self.num_speculative_tokens is None:
            default = 5 if self.method == "ngram" else min(16, self.suffix_decoding_max_tree_depth)
            object.__setattr__(self, "num_speculative_tokens", default)
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "suffix_decoding_max_tree_depth"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise bad(name, f"must be an integer >= 1; got {value!r}")
        if self.num_speculative_tokens is not None and self.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise bad("num_speculative_tokens", f"must be at most {MAX_SPECULATIVE_TOKENS}; got {self.num_speculative_tokens}")
        if self.suffix_decoding_max_tree_depth < 2:
            raise bad("suffix_decoding_max_tree_depth", f"must be at least 2; got {self.suffix_decoding_max_tree_depth}")
        cached = self.suffix_decoding_max_cached_requests
        if not isinstance(cached, int) or isinstance(cached, bool) or cached < 0:
            raise bad("suffix_decoding_max_cached_requests", f"must be an integer >= 0; got {cached!r}")
        factor = self.suffix_decoding_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or factor <= 0:
            raise bad("suffix_decoding_max_spec_factor", f"must be a number > 0; got {factor!r}")
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise bad("suffix_decoding_min_token_prob", f"must be a number in [0, 1]; got {prob!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise bad("prompt_lookup_min", f"({self.prompt_lookup_min}) must not exceed prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None and (
            not isinstance(self.disable_by_batch_size, int) or isinstance(self.disable_by_batch_size, bool)
            or self.disable_by_batch_size < 1
        ):
            raise bad("disable_by_batch_size", f"must be an integer >= 1 or null; got {self.disable_by_batch_size!r}")


def parse_speculative_config(value: str | dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A JSON text (the flag), a dict (``LLM(speculative_config=...)``) or a config; None: off.

    ``{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}`` or
    ``{"method": "suffix", "suffix_decoding_min_token_prob": 0.2}`` as in vLLM; a key we do not know,
    or one of the other method's, is an error, never silently ignored.
    """
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    options = read_json_options("speculative_config", value, SpeculativeConfig)
    if options is None:
        return None
    value = options
    if "method" not in value:
        raise ValueError(f"speculative_config.method is required ({' or '.join(SPEC_METHODS)})")
    method = value["method"]
    if method in _METHOD_OPTIONS:  # (an unknown method is refused by SpeculativeConfig, naming it)
        for other, others_keys in _METHOD_OPTIONS.items():
            given = sorted(others_keys & set(value)) if other != method else []
            if given:
                raise ValueError(f"speculative_config.{given[0]} applies to method {other}, not {method}")
    return SpeculativeConfig(**value)
