"""The request vocabulary every API family shares, validated by pydantic before any work is done.

Sampling fields, chat messages, tools, `response_format` / structured outputs, and the refusal
tables; the bodies themselves are in `openai/protocol.py` (chat and text completions),
`sessions/protocol.py` (session turns) and `responses/protocol.py` (the Responses API).

Strict types (no "0.5" for a float, no 1.0 for an int, no NaN or Infinity), ranges as OpenAI
documents them, and vLLM's extra sampling fields (top_k, min_p, repetition_penalty, ...) so the
clients written for either keep working. Three rules hold for every body and every nested object:

- JSON `null` for an optional field means its default (clients forward unset settings as None).
- A field that OpenAI or vLLM defines and that would change the reply (logit_bias, beam search,
  ...) but is not implemented is refused with a 400 naming it (`REFUSED_*` below) unless it has
  its neutral value: never silently served without it. Tools and structured outputs are served
  (`tools`, `tool_choice`, `response_format`, `structured_outputs` and vLLM's `guided_*`).
- Any other unknown field is ignored, as OpenAI-compatible servers commonly do; docs/openai-api.md lists
  the known ones that are ignored on purpose.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from chatserve.server.json_checks import MAX_DEPTH, JSONLimitError, check_value, load_text, text_depth
from chatserve.server.settings import ServerSettings

_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1
MAX_INT32 = 2**31 - 1
MAX_BAD_WORD_CHARS = 256  # a bad word longer than this is a 400 (as a stop sequence past max_stop_length)
"""The largest count (max_tokens, n, min_tokens, token ids) any request may send: a number past it is a
400 of its own, said without echoing the value (a 4,300-digit one cannot even be printed)."""

Temperature = Annotated[float, Field(ge=0.0, le=2.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
Seed = Annotated[int, Field(ge=_SEED_MIN, le=_SEED_MAX)]
PositiveInt = Annotated[int, Field(ge=1, le=MAX_INT32)]
Count = Annotated[int, Field(ge=0, le=MAX_INT32)]
# NOTE: the sampler keeps top_k in an int64 tensor shared by the whole batch; a value that does not
# fit would kill the engine loop for everyone, so it is bounded here (far above any vocabulary size).
TopK = Annotated[int, Field(ge=-1, le=2**31 - 1)]


def field_error(field: str, message: str, kind: str = "field_error") -> PydanticCustomError:
    """A validation error that names `field` (relative to the object being validated) as the 400's param.

    `kind` other than "field_error" becomes the 400's `code` too (e.g. "unsupported_field")."""
    return PydanticCustomError(kind, message, {"field": field})


# ---- refused fields: (is the value neutral?, what is not supported) ---------------------------------
Refusal = tuple[Callable[[Any], bool], str]


def _unset(v: Any) -> bool:
    return v is False or v == [] or v == {}


def _one_of(*neutral: Any) -> Callable[[Any], bool]:
    return lambda v: _unset(v) or any(v == x and type(v) is type(x) for x in neutral)


_LEGACY_FUNCTIONS = "the legacy functions / function_call fields (send tools / tool_choice instead)"
REFUSED_SAMPLING: Mapping[str, Refusal] = {
    "guided_whitespace_pattern": (_unset, "guided_whitespace_pattern"),
    # other ways to change which tokens come out
    "logits_processors": (_unset, "logits_processors"),
    "use_beam_search": (_unset, "beam search"),
    "length_penalty": (_one_of(1, 1.0), "length_penalty (beam search)"),
    # served by chat and completions (openai/protocol.py: OPENAI_SERVED), not by a session turn
    "prompt_logprobs": (_unset, "prompt_logprobs in a session turn (chat and completions serve it)"),
    "truncate_prompt_tokens": (_unset, "truncate_prompt_tokens"),
    "return_tokens_as_token_ids": (_unset, "return_tokens_as_token_ids"),
}
REFUSED_CHAT: Mapping[str, Refusal] = {
    "functions": (_unset, _LEGACY_FUNCTIONS),
    "function_call": (_one_of("none", "auto"), _LEGACY_FUNCTIONS),
    "chat_template": (_unset, "a chat template sent with the request"),
    "documents": (_unset, "documents for the chat template"),
    "add_special_tokens": (_unset, "add_special_tokens in chat completions"),
    "best_of": (_one_of(1), "best_of in chat completions"),
    "audio": (_unset, "audio output"),
    "modalities": (_one_of(["text"]), 'modalities other than ["text"]'),
    "web_search_options": (_unset, "web search"),
    "verbosity": (_unset, "verbosity"),
}
REFUSED_MESSAGE: Mapping[str, Refusal] = {
    "function_call": (_unset, _LEGACY_FUNCTIONS),
    "audio": (_unset, "audio in messages"),
}
# Chat-template options of a session turn (the session's own template renders it).
REFUSED_SESSION: Mapping[str, Refusal] = {
    "chat_template_kwargs": (_unset, "chat_template_kwargs in a session turn"),
    "continue_final_message": (_unset, "continue_final_message in a session turn"),
    "chat_template": REFUSED_CHAT["chat_template"],
}
# Keys of chat_template_kwargs that would override how the server itself renders the prompt, or that
# name a parameter of the functions the kwargs pass through (InputProcessor.render_chat, our
# apply_chat_template, transformers' apply_chat_template and render_jinja_template): sent as a template
# variable, `self` or `tokenizer` would be "got multiple values for argument" (tests/server/test_hostile_inputs.py
# checks this list against those signatures).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "conversations", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "param", "self", "tokenizer", "sanitize_control_tokens",
    "template_kwargs", "kwargs", "tool_parser",
})


# ---- bounds on lists and on the JSON inside a body (docs/openai-api.md, "Limits") -------------------
def list_limit(info: ValidationInfo, name: str) -> int:
    """A list-length flag of ServerSettings: the server's (parse_model passes its settings as the
    validation context), else the default."""
    settings = (info.context or {}).get("settings") if isinstance(info.context, dict) else None
    if settings is None:
        return ServerSettings.__dataclass_fields__[name].default
    return getattr(settings, name)


def check_length(value: Any, info: ValidationInfo, name: str, what: str) -> Any:
    """A list past its flag is refused before any item is validated (one error, not one per item)."""
    if isinstance(value, list):
        limit = list_limit(info, name)
        if len(value) > limit:
            raise ValueError(f"at most {limit} {what} are allowed, got {len(value)}")
    return value


def _schema_object(value: dict[str, Any]) -> dict[str, Any]:
    try:
        check_value(value, what="the JSON schema")
    except JSONLimitError as exc:
        raise ValueError(str(exc)) from None
    return value


SchemaObject = Annotated[dict[str, Any], AfterValidator(_schema_object)]
"""A JSON schema as a request sends it: an object nested at most MAX_DEPTH levels, with finite numbers."""


def _json_text(value: str) -> str:
    try:
        load_text(value)
    except JSONLimitError as exc:
        raise ValueError(str(exc)) from None
    except ValueError as exc:
        raise ValueError(f"not valid JSON: {exc}") from None
    return value


def schema_or_text(value: Any) -> Any:
    """A schema (or structural tag) sent as an object or as JSON text, within the bounds either way."""
    if isinstance(value, dict):
        return _schema_object(value)
    if isinstance(value, str):
        return _json_text(value)
    return value


def _call_arguments(value: str) -> str:
    """A call's arguments: any text (a model may have written broken JSON), but JSON that cannot be
    read back safely (too deep, a lone surrogate) is refused."""
    if text_depth(value) > MAX_DEPTH:
        raise ValueError(f"the arguments' JSON nests deeper than {MAX_DEPTH} levels of objects and arrays")
    try:
        load_text(value, what="the arguments' JSON")
    except JSONLimitError as exc:
        raise ValueError(str(exc)) from None
    except ValueError:
        pass  # not JSON: rendered as the text it is
    return value


CallArguments = Annotated[str, AfterValidator(_call_arguments)]


class StrictModel(BaseModel):
    """Strict types, no NaN or Infinity, null meaning the default, refused fields refused: the base of every body."""

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
    refused: ClassVar[Mapping[str, Refusal]] = {}

    @model_validator(mode="before")
    @classmethod
    def _nulls_are_defaults(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, (neutral, what) in cls.refused.items():
            if data.get(name) is not None and not neutral(data[name]):
                raise field_error(name, f"this server does not support {what}; leave {name} out or send null",
                                  "unsupported_field")
        return {k: v for k, v in data.items() if v is not None}


class StreamOptions(StrictModel):
    include_usage: bool = False
    # chatserve: log the stream's events so a dropped client resumes it (GET .../{id}/stream, Last-Event-ID)
    resumable: bool = False


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


_NON_TEXT_PARTS = {
    "image_url": "image", "input_image": "image", "image": "image", "input_audio": "audio", "audio": "audio",
    "file": "file", "input_file": "file", "video_url": "video", "video": "video",
}


# ---- tools and structured outputs -------------------------------------------------------------------
FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")]


class ToolCallFunction(StrictModel):
    name: str
    arguments: CallArguments  # JSON text, as OpenAI sends it


class ToolCallIn(StrictModel):
    """A call in an earlier assistant message (sent back by the client with the tool's result)."""

    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class FunctionDefinition(StrictModel):
    name: FunctionName
    description: str | None = None
    parameters: SchemaObject | None = None
    strict: bool | None = None


class ToolDefinition(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceField = Literal["none", "auto", "required"] | NamedToolChoice


class JSONSchemaSpec(StrictModel):
    name: Annotated[str, Field(max_length=64)] = "response"
    description: str | None = None
    # OpenAI's field is `schema`; pydantic reserves that name on models, hence the alias.
    json_schema: Annotated[SchemaObject, Field(alias="schema")] = Field(default_factory=lambda: {"type": "object"})
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)


class ResponseFormat(StrictModel):
    """`response_format`: text, json_object, json_schema, or vLLM's structural_tag."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JSONSchemaSpec | None = None
    format: SchemaObject | None = None  # structural_tag (xgrammar's format object)
    structures: Annotated[list[SchemaObject], Field(fail_fast=True)] | None = None  # structural_tag, vLLM's legacy shape
    triggers: Annotated[list[str], Field(fail_fast=True)] | None = None

    @model_validator(mode="after")
    def _needs_its_part(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise field_error("json_schema", 'response_format of type "json_schema" needs a json_schema object')
        if self.type == "structural_tag" and self.format is None and self.structures is None:
            raise field_error("format", 'response_format of type "structural_tag" needs a format object')
        return self


class StructuredOutputsField(StrictModel):
    """vLLM's `structured_outputs` extra field: at most one kind, and the JSON whitespace options.

    `disable_any_whitespace` / `max_whitespace` override the server's `--structured-outputs-config`
    for this request's JSON grammar (whichever field it came from: response_format, tools, this).
    A key we do not know is a 400 naming it (vLLM #48765: never silently ignored); vLLM's options
    we do not implement are accepted only with their neutral values.
    """

    refused: ClassVar[Mapping[str, Refusal]] = {
        "disable_fallback": (_unset, "structured_outputs.disable_fallback (there is one backend, xgrammar)"),
        "disable_additional_properties": (_unset, "structured_outputs.disable_additional_properties"),
        "whitespace_pattern": (lambda v: v == "", "structured_outputs.whitespace_pattern (use max_whitespace or "
                                                  "disable_any_whitespace)"),
        "backend": (lambda v: v in ("auto", "xgrammar"), "structured_outputs backends other than xgrammar"),
    }

    json_schema: Annotated[dict[str, Any] | str | None, Field(alias="json")] = None
    regex: str | None = None
    choice: Annotated[list[str], Field(min_length=1, fail_fast=True)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict[str, Any] | str | None = None
    disable_any_whitespace: bool | None = None
    max_whitespace: Count | None = None

    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)

    _bounded = field_validator("json_schema", "structural_tag")(schema_or_text)

    @model_validator(mode="before")
    @classmethod
    def _known_options_only(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {"json"} | set(cls.refused)
        for key in data:
            if key not in known:
                names = ", ".join(sorted((set(cls.model_fields) - {"json_schema"}) | {"json"}))
                raise field_error(str(key)[:64], f"{str(key)[:64]!r} is not a known structured_outputs option "
                                                 f"(known: {names})", "unknown_field")
        return data

    def whitespace_options(self) -> dict[str, Any]:
        """The whitespace options this request set (for StructuredOutputsParams), none if unset."""
        return {k: getattr(self, k) for k in ("disable_any_whitespace", "max_whitespace") if getattr(self, k) is not None}

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputsField:
        kinds = [k for k in ("json_schema", "regex", "choice", "grammar", "structural_tag")
                 if getattr(self, k) is not None] + (["json_object"] if self.json_object else [])
        if len(kinds) > 1:
            names = ", ".join("json" if k == "json_schema" else k for k in kinds)
            raise ValueError(f"set exactly one of json, regex, choice, grammar, json_object, structural_tag; got {names}")
        return self

    def is_empty(self) -> bool:
        return all(getattr(self, k) is None for k in ("json_schema", "regex", "choice", "grammar", "structural_tag")) \
            and not self.json_object


class ChatMessage(StrictModel):
    refused: ClassVar[Mapping[str, Refusal]] = REFUSED_MESSAGE

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(fail_fast=True)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCallIn], Field(fail_fast=True)] | None = None  # assistant messages that called tools
    tool_call_id: str | None = None  # tool messages: the call this is the result of
    # assistant messages: the reply's reasoning sent back, under either name a server sent it in (vLLM's
    # `reasoning`, the older `reasoning_content`); rendered through the template's `reasoning_content`
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _tool_fields_fit_the_role(self) -> ChatMessage:
        if self.role == "tool" and not self.tool_call_id:
            raise field_error("tool_call_id", 'a message with role "tool" needs the tool_call_id of the call it answers')
        if self.tool_calls and self.role != "assistant":
            raise field_error("tool_calls", 'only assistant messages may carry tool_calls')
        for name in ("reasoning", "reasoning_content"):
            if getattr(self, name) is not None and self.role != "assistant":
                raise field_error(name, f"only assistant messages may carry {name} (a reply's reasoning sent back)")
        if self.reasoning is not None and self.reasoning_content is not None and self.reasoning != self.reasoning_content:
            raise field_error("reasoning_content", "reasoning and reasoning_content differ; they are two names of the "
                                                   "same reasoning: send one of them (or both the same)")
        return self

    def reasoning_text(self) -> str | None:
        """The reasoning sent back with this assistant message, whichever name it came under."""
        return self.reasoning if self.reasoning is not None else self.reasoning_content

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """A non-text part is refused by name, not as a dump of every union member it failed."""
        if content is None or isinstance(content, str):
            return content
        if not isinstance(content, list):
            raise ValueError("content must be a string or a list of text parts")
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and not isinstance(part.get("text"), str):
                raise field_error(str(i), 'a content part of type "text" needs "text": a string')
            if not isinstance(kind, str):
                raise field_error(str(i), 'each content part must be an object with a "type" (only "text" is supported)')
            if kind != "text":
                medium = _NON_TEXT_PARTS.get(kind)
                what = f"{medium} input is" if medium else "content parts other than text are"
                # NOTE: pydantic fills {name} from the context; the client's `kind` only goes in that way.
                raise PydanticCustomError(
                    "unsupported_content",
                    "content part of type '{kind}': " + what + " not supported by this model, which reads "
                    "text only; send the message as text",
                    {"field": str(i), "kind": kind[:40]},
                )
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class SamplingFields(StrictModel):
    """Fields shared by chat and text completions (and a session turn)."""

    refused: ClassVar[Mapping[str, Refusal]] = REFUSED_SAMPLING

    model: str | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    n: PositiveInt = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # chatserve: what a lost connection means, "abort" (default) or "detach" / {"mode", "lease_seconds"}
    # (checked, with the server's limits, by runs.DisconnectPolicy.parse: one 400 naming the exact field)
    disconnect_policy: Any = None
    stop: str | Annotated[list[str], Field(fail_fast=True)] | None = None
    max_tokens: PositiveInt | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    user: str | None = None
    # vLLM extensions
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_token_ids: Annotated[list[Count], Field(fail_fast=True)] | None = None
    include_stop_str_in_output: bool = False
    # chatserve: opt this request out of the server's speculative decoding (same output, plain speed)
    speculative_decoding: bool = True
    # vLLM's request controls (docs/openai-api.md, "Request fields"): scheduling priority (lower first;
    # served under --scheduling-policy priority, else a 400 unless 0), and per-token rules: OpenAI's
    # logit_bias (token id as a string -> -100..100), allowed_token_ids, bad_words
    priority: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] = 0
    logit_bias: dict[str, Any] | None = None  # (values checked as a whole below: one error, not one per key)
    allowed_token_ids: Annotated[list[Count], Field(min_length=1, fail_fast=True)] | None = None
    bad_words: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_BAD_WORD_CHARS)]],
                         Field(fail_fast=True)] | None = None
    # prefix cache (docs/prefix-cache.md): vLLM's salt (share cached KV only with the same salt), and
    # OpenAI's prompt_cache_key, which leases this prompt's prefix for prompt_cache_retention
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* spellings
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[str], Field(min_length=1, fail_fast=True)] | None = None
    guided_grammar: str | None = None
    structural_tag: dict[str, Any] | str | None = None

    _bounded = field_validator("guided_json", "structural_tag")(schema_or_text)

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _stop_token_ids_bounded(cls, value: Any, info: ValidationInfo) -> Any:
        return check_length(value, info, "max_stop_token_ids", "stop_token_ids")

    @field_validator("bad_words", mode="before")
    @classmethod
    def _bad_words_bounded(cls, value: Any, info: ValidationInfo) -> Any:
        return check_length(value, info, "max_bad_words", "bad_words")

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, Any] | None) -> dict[str, Any] | None:
        for key, value in (bias or {}).items():
            if not key.isdigit() or int(key) > MAX_INT32:
                raise ValueError(f"logit_bias keys must be token ids (non-negative integers as strings), got {key[:32]!r}")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not -100 <= value <= 100:
                raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {str(value)[:32]} for token {key}")
        return bias

    @model_validator(mode="after")
    def _consistent(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options is only allowed when stream is true")
        return self

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def check_tools(tools: list[ToolDefinition] | None, tool_choice: Any) -> None:
    """Function names unique; a tool_choice other than none/auto needs tools, a named one a tool of that name.
    Linear in the number of tools (a set of the names seen)."""
    names = [t.function.name for t in tools or []]
    seen: set[str] = set()
    for i, name in enumerate(names):
        if name in seen:
            raise field_error(f"tools.{i}.function.name", f"two tools are named {name!r}; function names must be unique")
        seen.add(name)
    if isinstance(tool_choice, NamedToolChoice):
        if tool_choice.function.name not in seen:
            known = ", ".join(repr(n) for n in names[:20]) or "none"
            more = f", and {len(names) - 20} more" if len(names) > 20 else ""
            raise field_error("tool_choice", f"tool_choice names the function {tool_choice.function.name!r}, which is "
                                             f"not in tools (tools: {known}{more})")
    elif tool_choice == "required" and not names:
        raise field_error("tool_choice", 'tool_choice "required" needs at least one tool in tools')
