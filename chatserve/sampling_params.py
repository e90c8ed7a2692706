"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``.

Validation happens once, here, when the request is built, so a bad value becomes
a 400 that names the offending field instead of a NaN or an index error deep
inside a batched sampler step that also carries other users' requests.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from chatserve.reasoning.config import ReasoningConfig

OutputKind = Literal["cumulative", "delta", "final_only"]

# Bounds that OpenAI documents; vLLM uses the same ones.
_MAX_LOGPROBS = 20
_LOGIT_BIAS_RANGE = 100.0
_PENALTY_RANGE = 2.0
_REPETITION_PENALTY_MIN, _REPETITION_PENALTY_MAX = 1e-3, 1e3
_TOP_K_MAX = 2**31 - 1
# torch.Generator.manual_seed accepts any value that fits in 64 bits, signed or not.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


def _check_int(name: str, value: object, *, optional: bool = False) -> None:
    """Reject non-ints, including bools: ``max_tokens=True`` is a client bug, not 1."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        want = "an int or None" if optional else "an int"
        raise ValueError(f"{name} must be {want}, got {value!r}")


def _as_float(name: str, value: object) -> float:
    """Accept ints and floats (JSON ``1`` is a valid temperature) but not bools, strings or NaN."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return result


StructuredKind = Literal["json", "regex", "choice", "grammar", "json_object", "structural_tag"]
STRUCTURED_KINDS: tuple[StructuredKind, ...] = get_args(StructuredKind)


def check_whitespace_options(prefix: str, disable_any_whitespace: Any, max_whitespace: Any) -> None:
    """Types and ranges of the two whitespace options (None: not set); errors name ``<prefix>.<key>``."""
    if disable_any_whitespace is not None and not isinstance(disable_any_whitespace, bool):
        raise ValueError(f"{prefix}.disable_any_whitespace must be a bool; got {disable_any_whitespace!r}")
    if max_whitespace is not None and (
        isinstance(max_whitespace, bool) or not isinstance(max_whitespace, int) or max_whitespace < 0
    ):
        raise ValueError(f"{prefix}.max_whitespace must be an integer >= 0; got {max_whitespace!r}")


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output to a grammar, shaped like vLLM's ``StructuredOutputsParams``.

    Exactly one kind is set (else ``ValueError`` naming the fields); the engine compiles it with
    xgrammar off the step loop, caches the compiled grammar by :meth:`cache_key`, and masks every
    token the grammar cannot take next. When the grammar is complete the sequence finishes with
    ``finish_reason="stop"``.

    - ``json``: a JSON Schema (a dict, or its JSON text). The output is one JSON value that validates.
    - ``regex``: the whole output fullmatches it (xgrammar's regex dialect: no lookaround, no backrefs).
    - ``choice``: the output is exactly one of these strings.
    - ``grammar``: EBNF as xgrammar takes it (GBNF-compatible, as llama.cpp's grammars), rule ``root``.
    - ``json_object``: any JSON value whose top level is an object (OpenAI's ``{"type": "json_object"}``).
    - ``structural_tag``: xgrammar 0.2.9's structural tag, a dict (or its JSON text) of the shape
      ``{"type": "structural_tag", "format": FORMAT}`` where FORMAT is one of (nest freely):

      * ``{"type": "const_string", "value": "..."}``
      * ``{"type": "json_schema", "json_schema": {...schema...}}``
      * ``{"type": "regex", "pattern": "..."}``, ``{"type": "grammar", "grammar": "root ::= ..."}``
      * ``{"type": "any_text"}`` (optionally ``"excludes": [...]``)
      * ``{"type": "sequence", "elements": [FORMAT, ...]}``, ``{"type": "or", "elements": [FORMAT, ...]}``
      * ``{"type": "tag", "begin": "<tool_call>", "content": FORMAT, "end": "</tool_call>"}``
        (``end`` may be a list of strings)
      * ``{"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": [TAG, ...],
        "at_least_one": false, "stop_after_first": false}``: free text until a trigger (a prefix of
        a tag's ``begin``) appears, then that tag, then free text again; ``at_least_one=true`` forces a
        call, ``stop_after_first=true`` ends the grammar after the first tag.
      * ``{"type": "tags_with_separator", "tags": [TAG, ...], "separator": ",", "at_least_one": ..., "stop_after_first": ...}``:
        only tags (no free text) separated by ``separator``.

      Example for ``tool_choice="auto"`` in SmolLM2's xLAM format (free text, or one call whose
      arguments follow the function's schema)::

          {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<tool_call>"],
           "tags": [{"type": "tag", "begin": "<tool_call>",
                     "content": {"type": "json_schema", "json_schema": CALLS_SCHEMA},
                     "end": "</tool_call>"}],
           "stop_after_first": true}}

      The legacy form ``{"structures": [{"begin", "schema", "end"}], "triggers": [...]}`` (vLLM's
      older ``structural_tag`` response format) is accepted too and converted.

    Two options (not kinds) shape the whitespace of every JSON grammar (json, json_object, and the
    JSON inside a structural tag); None takes the engine's ``structured_outputs_config``:

    - ``disable_any_whitespace``: no whitespace between JSON tokens, separators ``","`` and ``":"``.
    - ``max_whitespace``: the longest run of whitespace between two JSON tokens (0: none).

    Whitespace inside string values is never restricted. The options are part of :meth:`cache_key`.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool | None = None
    max_whitespace: int | None = None

    def __post_init__(self) -> None:
        check_whitespace_options("structured_outputs", self.disable_any_whitespace, self.max_whitespace)
        chosen = [k for k in STRUCTURED_KINDS if self._is_set(k)]
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(STRUCTURED_KINDS)}; got {got}")
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a bool, got {self.json_object!r}")
        for name in ("json", "structural_tag"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (dict, str)):
                raise ValueError(f"structured_outputs.{name} must be a dict or a JSON string, got {type(value).__name__}")
            if isinstance(value, str):
                try:
                    json.loads(value)
                except ValueError as exc:
                    raise ValueError(f"structured_outputs.{name}: not valid JSON: {exc}") from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}")
            if not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError("structured_outputs.choice must contain only non-empty strings")
            self.choice = list(self.choice)

    def _is_set(self, kind: str) -> bool:
        value = getattr(self, kind)
        return value is True if kind == "json_object" else value is not None

    @property
    def kind(self) -> StructuredKind:
        """Which of the kinds is set (the field name an error message names)."""
        return next(k for k in STRUCTURED_KINDS if self._is_set(k))

    @property
    def spec(self) -> str:
        """The set kind's value as canonical text (dicts as sorted JSON), so equal specs compare equal."""
        value = getattr(self, self.kind)
        if self.kind == "json_object":
            return ""
        if self.kind == "choice":
            return json.dumps(value)
        if isinstance(value, dict):
            return json.dumps(value, sort_keys=True, separators=(",", ":"))
        if self.kind in ("json", "structural_tag"):
            return json.dumps(json.loads(value), sort_keys=True, separators=(",", ":"))
        return str(value)

    @property
    def whitespace_key(self) -> str:
        """The whitespace options as text ("" when neither is set: the engine's defaults apply)."""
        if self.disable_any_whitespace is None and self.max_whitespace is None:
            return ""
        return f"disable_any_whitespace={self.disable_any_whitespace},max_whitespace={self.max_whitespace}"

    def cache_key(self) -> tuple[str, str, str]:
        """What the grammar compiler's cache is keyed by: (kind, canonical spec, whitespace options)."""
        return (self.kind, self.spec, self.whitespace_key)


@dataclass
class SamplingParams:
    """How to pick the tokens of one request; see the module docstring for why it validates eagerly.

    After ``__post_init__``: ``stop`` is a ``list[str]``, ``stop_token_ids`` a
    ``list[int]``, ``top_k`` is 0 when disabled (``-1`` is accepted as vLLM's
    spelling of "disabled"), and float fields are Python floats.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: OutputKind = "cumulative"
    structured_outputs: StructuredOutputsParams | None = None
    # NOTE: a per-request opt-out of speculative decoding (when the engine has a speculative_config);
    # the output is the same either way, only the speed differs.
    speculative_decoding: bool = True
    # A reasoning model's split and budget (chatserve.reasoning): the engine puts the reasoning in
    # CompletionOutput.reasoning, the answer alone in text, and forces the end marker at the budget.
    reasoning: ReasoningConfig | None = None
    # ---- vLLM's request controls (docs/openai-api.md, "Request fields"): applied per row by the sampler,
    # so a request gets the same tokens alone or batched.
    # Scheduling: lower is served first (vLLM's meaning); served under the engine's "priority" policy.
    priority: int = 0
    # token id -> a bias added to its logit before sampling (OpenAI's range, -100..100).
    logit_bias: dict[int, float] | None = None
    # only these token ids may be sampled.
    allowed_token_ids: list[int] | None = None
    # words that must not be generated: a word's last token is banned when its tokens before it were
    # just generated (vLLM's rule), each word with and without a leading space; the engine fills
    # bad_words_token_ids from its tokenizer (InputProcessor.check_params).
    bad_words: list[str] | None = None
    # the top-N logprobs of every prompt token after the first (vLLM's prompt_logprobs, N in 0..20).
    prompt_logprobs: int | None = None
    # keep only the last N prompt tokens (-1: as many as the model's context allows), before any check.
    truncate_prompt_tokens: int | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)
    # stop_token_ids as a set, so the per-token check is O(1) (kept in step by __post_init__ and clone)
    stop_token_id_set: frozenset[int] = field(default=frozenset(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")

        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        _check_int("top_k", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        if self.top_k > _TOP_K_MAX:
            # NOTE: the batched sampler packs top_k into an int64 tensor with other users' rows; a
            # value that overflows it would fail the whole step, so refuse it here, per request.
            raise ValueError(f"top_k must be at most {_TOP_K_MAX} (values above the vocabulary size act as 0), got {self.top_k}")

        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        # Logits are divided or multiplied by it in float32: a tiny value rounds to 0 there (and a
        # masked -inf logit times 0 is NaN), a huge one overflows. The range keeps every logit finite.
        if not _REPETITION_PENALTY_MIN <= self.repetition_penalty <= _REPETITION_PENALTY_MAX:
            raise ValueError(f"repetition_penalty must be in [{_REPETITION_PENALTY_MIN}, {_REPETITION_PENALTY_MAX}] "
                             f"(1 disables it), got {self.repetition_penalty}")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -_PENALTY_RANGE <= value <= _PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-{_PENALTY_RANGE}, {_PENALTY_RANGE}], got {value}")
            setattr(self, name, value)

        _check_int("seed", self.seed, optional=True)
        if self.seed is not None and not _SEED_MIN <= self.seed <= _SEED_MAX:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        self.stop_token_id_set = frozenset(self.stop_token_ids)

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "speculative_decoding"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")

        _check_int("max_tokens", self.max_tokens, optional=True)
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(
                f"max_tokens must be >= 1 or None (generate until the context is full), got {self.max_tokens}"
            )

        _check_int("min_tokens", self.min_tokens)
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > max_tokens={self.max_tokens}"
            )

        _check_int("logprobs", self.logprobs, optional=True)
        if self.logprobs is not None and not 0 <= self.logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {_MAX_LOGPROBS}] or None, got {self.logprobs}")

        if self.output_kind not in get_args(OutputKind):
            raise ValueError(f"output_kind must be one of {get_args(OutputKind)}, got {self.output_kind!r}")

        if isinstance(self.structured_outputs, dict):
            try:
                self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as exc:
                raise ValueError(f"structured_outputs: {exc}") from None
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(
                f"structured_outputs must be a StructuredOutputsParams or None, got {type(self.structured_outputs).__name__}"
            )

        if self.reasoning is not None and not isinstance(self.reasoning, ReasoningConfig):
            raise ValueError(f"reasoning must be a ReasoningConfig or None, got {type(self.reasoning).__name__}")

        self._check_request_controls()

    def _check_request_controls(self) -> None:
        """priority, logit_bias, allowed_token_ids, bad_words, prompt_logprobs, truncate_prompt_tokens:
        types and ranges here; token ids against the vocabulary where the engine knows it (check_params)."""
        _check_int("priority", self.priority)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {self.logit_bias!r}")
            bias: dict[int, float] = {}
            for key, value in self.logit_bias.items():
                token = int(key) if isinstance(key, str) and key.isdigit() else key
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {key!r}")
                value = _as_float(f"logit_bias[{token}]", value)
                if not -_LOGIT_BIAS_RANGE <= value <= _LOGIT_BIAS_RANGE:
                    raise ValueError(f"logit_bias values must be in [-{_LOGIT_BIAS_RANGE:g}, {_LOGIT_BIAS_RANGE:g}], "
                                     f"got {value} for token {token}")
                bias[token] = value
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError(f"allowed_token_ids must be a non-empty list of token ids, got {ids!r}")
            for token in ids:
                if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                    raise ValueError(f"allowed_token_ids must contain only token ids (ints >= 0), got {token!r}")
            self.allowed_token_ids = sorted(set(ids))
        if self.bad_words is not None:
            words = [self.bad_words] if isinstance(self.bad_words, str) else self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise ValueError(f"bad_words must be a list of non-empty strings, got {self.bad_words!r}")
            self.bad_words = list(words) or None
        _check_int("prompt_logprobs", self.prompt_logprobs, optional=True)
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= _MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {_MAX_LOGPROBS}] or None (the whole vocabulary, vLLM's -1, "
                             f"is not served), got {self.prompt_logprobs}")
        _check_int("truncate_prompt_tokens", self.truncate_prompt_tokens, optional=True)
        if self.truncate_prompt_tokens is not None and not (self.truncate_prompt_tokens == -1
                                                            or self.truncate_prompt_tokens >= 1):
            raise ValueError(f"truncate_prompt_tokens must be >= 1, or -1 (the model's context length), got "
                             f"{self.truncate_prompt_tokens}")

    @property
    def has_token_rules(self) -> bool:
        """Whether the sampler must change this row's logits for logit_bias, allowed_token_ids or bad_words."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @staticmethod
    def _normalise_stop(stop: object) -> list[str]:
        """One list shape for the detokenizer; an empty stop string would match everywhere, so reject it."""
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"stop must be a string, a list of strings or None, got {stop!r}")
        for item in items:
            if not isinstance(item, str):
                raise ValueError(f"stop must contain only strings, got {item!r}")
            if not item:
                raise ValueError("stop must not contain empty strings (they would match at every position)")
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(ids: object) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints or None, got {ids!r}")
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"stop_token_ids must contain only non-negative ints, got {token_id!r}")
        return list(ids)

    @property
    def is_greedy(self) -> bool:
        """Greedy rows take the batched argmax path and never consume random numbers."""
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must look at the request's token history at all."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone(self) -> SamplingParams:
        """A deep copy, so per-request edits (e.g. capping max_tokens) never leak into shared defaults."""
        out = copy.deepcopy(self)
        out.stop_token_id_set = frozenset(out.stop_token_ids or ())
        return out

    def is_stop_token(self, token: int) -> bool:
        """Whether `token` is one of stop_token_ids: a set lookup, so a long list costs nothing per token
        (the set is made from the list at construction and by clone)."""
        return token in self.stop_token_id_set
