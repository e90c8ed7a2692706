"""The body of `POST /v1/responses`, validated before any work, and its translation into the chat side's types.

The same rules as every other body (protocol.py's `StrictModel`: strict types, null meaning the
default, refused fields refused), plus one more: a field OpenAI's Responses API has and this
server does not serve is refused by name, and so is any field neither OpenAI nor we define
(OpenAI answers those with a 400 too), because a Responses client that sends one expects it to act.

Nothing is served twice: tools, tool_choice and text.format become the chat request's
`ToolDefinition`s, tool choice and `ResponseFormat` (`chat_tools`, `chat_tool_choice`,
`sampling_fields`), and from there the chat route's own planning, grammar and sampling code runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, ValidationInfo, field_validator, model_validator

from chatserve.reasoning import budget_for_effort
from chatserve.server.chat.protocol import (
    CallArguments,
    FunctionDefinition,
    FunctionName,
    JSONSchemaSpec,
    NamedFunction,
    NamedToolChoice,
    Penalty,
    PositiveInt,
    Refusal,
    ResponseFormat,
    SamplingFields,
    SchemaObject,
    Seed,
    StrictModel,
    Temperature,
    ToolDefinition,
    TopK,
    TopP,
    _one_of,
    _unset,
    check_length,
    check_tools,
    field_error,
)

_FORBID = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, populate_by_name=True)
_LENIENT = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, populate_by_name=True)



class ForbidModel(StrictModel):
    """A Responses object that refuses fields it does not know, as OpenAI does: the first unknown key
    is the 400 (pydantic's own `extra="forbid"` makes one error per key, and building 200k of them
    held the event loop for seconds)."""

    model_config = _FORBID

    @model_validator(mode="before")
    @classmethod
    def _first_unknown_field(cls, data: Any) -> Any:
        if isinstance(data, dict):
            known = _known_keys(cls)
            for key in data:
                if key not in known:
                    raise field_error(str(key)[:64], "Extra inputs are not permitted")
        return data


_KNOWN_KEYS: dict[type, frozenset[str]] = {}


def _known_keys(cls: type[StrictModel]) -> frozenset[str]:
    """A model's field names and aliases (computed once per model)."""
    keys = _KNOWN_KEYS.get(cls)
    if keys is None:
        keys = _KNOWN_KEYS[cls] = frozenset(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
    return keys


INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TOOL_TYPES = ("function",)


# ---- input items --------------------------------------------------------------------------------
class InputText(StrictModel):
    model_config = _LENIENT
    type: Literal["input_text", "output_text", "text"]
    text: str


class RefusalPart(StrictModel):
    model_config = _LENIENT
    type: Literal["refusal"]
    refusal: str


def _part_kind(v: Any) -> str | None:
    return v.get("type") if isinstance(v, dict) else getattr(v, "type", None)


ContentPart = Annotated[
    Annotated[InputText, Tag("input_text")] | Annotated[InputText, Tag("output_text")] |
    Annotated[InputText, Tag("text")] | Annotated[RefusalPart, Tag("refusal")],
    Discriminator(_part_kind),
]

_NON_TEXT = {"input_image": "image", "input_file": "file", "input_audio": "audio", "image_url": "image"}


def _check_parts(content: Any) -> Any:
    """Text parts only; any other kind is refused by name (this model reads text)."""
    if not isinstance(content, list):
        return content
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if not isinstance(kind, str):
            raise field_error(str(i), 'each content part must be an object with a "type" ("input_text" or "output_text")')
        if kind not in ("input_text", "output_text", "text", "refusal"):
            medium = _NON_TEXT.get(kind)
            what = f"{medium} input is" if medium else "content parts of this type are"
            raise field_error(str(i), f"content part of type {kind[:40]!r}: {what} not supported by this model, which "
                                      "reads text only", "unsupported_content")
    return content


class MessageItem(StrictModel):
    """A message: the user's, a system/developer instruction, or an earlier assistant reply sent back."""

    model_config = _LENIENT  # clients send back output items whole (status, annotations, logprobs, ...)
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | Annotated[list[ContentPart], Field(fail_fast=True)]
    id: str | None = None
    status: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _check_parts(value)

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text if isinstance(p, InputText) else p.refusal for p in self.content)


class FunctionCallItem(StrictModel):
    """A call the model made earlier (sent back with its output)."""

    model_config = _LENIENT
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: CallArguments
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(StrictModel):
    """A tool's result, answering a call by its call_id."""

    model_config = _LENIENT
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | Annotated[list[ContentPart], Field(fail_fast=True)]
    id: str | None = None
    status: str | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _text_parts(cls, value: Any) -> Any:
        return _check_parts(value)

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(p.text if isinstance(p, InputText) else p.refusal for p in self.output)


class ReasoningTextPart(StrictModel):
    model_config = _LENIENT
    type: Literal["reasoning_text"]
    text: str


class SummaryTextPart(StrictModel):
    model_config = _LENIENT
    type: Literal["summary_text"]
    text: str


class ReasoningItem(StrictModel):
    """An earlier reply's reasoning sent back: rendered as the next assistant turn's `reasoning_content`.

    Its text is the `encrypted_content` this server sealed (authenticated: an edited or foreign value is
    a 400 naming it), else its `content` as sent; a summary alone is not the reasoning and renders nothing.
    """

    model_config = _LENIENT
    type: Literal["reasoning"]
    id: str | None = None
    summary: Annotated[list[SummaryTextPart], Field(fail_fast=True)] = []
    content: Annotated[list[ReasoningTextPart], Field(fail_fast=True)] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def text(self) -> str | None:
        """The reasoning as sent in `content` (None: no content parts)."""
        if not self.content:
            return None
        return "".join(p.text for p in self.content)


def _item_kind(v: Any) -> str | None:
    if isinstance(v, dict):
        return v.get("type", "message")  # an EasyInputMessage has no "type"
    return getattr(v, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")] |
    Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_kind),
]


# A string, or items: told apart up front, so an error names the item at fault, not the string it is not.
InputField = Annotated[
    Annotated[Annotated[str, Field(min_length=1)], Tag("text")] |
    Annotated[Annotated[list[InputItem], Field(min_length=1, fail_fast=True)], Tag("items")],
    Discriminator(lambda v: "text" if isinstance(v, str) else "items"),
]


# ---- tools, tool_choice, text.format --------------------------------------------------------------
class FunctionTool(ForbidModel):
    model_config = _FORBID
    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: SchemaObject | None = None
    strict: bool | None = None


class FunctionToolChoice(ForbidModel):
    model_config = _FORBID
    type: Literal["function"]
    name: str


class TextFormat(ForbidModel):
    """`text.format`: plain text, any JSON object, or JSON matching a schema (constrained decoding)."""

    model_config = _FORBID
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(max_length=64)] | None = None
    description: str | None = None
    json_schema: SchemaObject | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_json_schema(self) -> TextFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise field_error("schema", 'text.format of type "json_schema" needs a schema')
        if self.type != "json_schema" and (self.json_schema is not None or self.name is not None):
            raise field_error("schema", f'name and schema belong to text.format of type "json_schema", not {self.type!r}')
        return self


class TextConfig(ForbidModel):
    refused: ClassVar[Mapping[str, Refusal]] = {"verbosity": (_one_of("medium"), "text.verbosity")}
    model_config = _FORBID
    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningParam(ForbidModel):
    """`reasoning`: how much the model may think (`effort`, through the budget table of
    chatserve/reasoning/budget.py) and the summary a client asks for, accepted as vLLM accepts it:
    no summary is written (a reasoning item's `summary` is empty; its `content` has the text whole)."""

    refused: ClassVar[Mapping[str, Refusal]] = {
        "context": (_one_of("auto"), "reasoning.context (which earlier reasoning renders is the chat template's choice)"),
        "mode": (_one_of("standard"), "reasoning.mode other than standard"),
    }
    model_config = _FORBID
    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # (the older name of summary)
    context: Any = None
    mode: Any = None

    @field_validator("effort")
    @classmethod
    def _known_effort(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                budget_for_effort(value, api="responses")
            except ValueError as exc:
                raise ValueError(str(exc)) from None
        return value


INCLUDABLE = ("reasoning.encrypted_content",)
"""What `include` may ask for: the reasoning items' sealed text (the rest of OpenAI's list needs its hosted tools)."""


class StreamOptions(ForbidModel):
    model_config = _FORBID
    include_obfuscation: bool = False  # padding against length side channels: we send none either way


# Responses fields that would change the reply and are not served (unless neutral).
REFUSED_RESPONSES: Mapping[str, Refusal] = {
    "prompt": (_unset, "prompt templates"),
    "conversation": (_unset, "conversations (chain responses with previous_response_id)"),
    "max_tool_calls": (_unset, "max_tool_calls"),
    "top_logprobs": (_one_of(0), "top_logprobs"),
    "context_management": (_unset, "context_management"),
    "service_tier": (_one_of("auto", "default"), "service tiers other than auto/default"),
    "prompt_cache_options": (_unset, "prompt_cache_options"),
}


class ResponsesRequest(ForbidModel):
    """`POST /v1/responses`."""

    refused: ClassVar[Mapping[str, Refusal]] = REFUSED_RESPONSES
    model_config = _FORBID

    model: str | None = None
    input: InputField
    instructions: str | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    tools: Annotated[list[FunctionTool], Field(fail_fast=True)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: PositiveInt | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = None
    """(at most 16 keys: counted before the keys and values are checked, see `_metadata_bounded`)"""
    truncation: Literal["disabled", "auto"] = "disabled"
    user: str | None = None  # stored and echoed; no effect on the reply
    safety_identifier: str | None = None  # idem
    # leases the prompt's prefix for prompt_cache_retention (docs/prefix-cache.md); cache_salt: vLLM's salt
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    cache_salt: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    # reasoning models (docs/reasoning.md): the effort, and the reasoning items' sealed text
    reasoning: ReasoningParam | None = None
    include: Annotated[list[str], Field(fail_fast=True)] | None = None
    # the prompt/conversation/... fields of REFUSED_RESPONSES: declared so that forbid does not pre-empt
    # the refusal's clearer message; only their neutral values ever get here
    prompt: Any = None
    conversation: Any = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: Any = None
    service_tier: str | None = None
    prompt_cache_options: Any = None
    # vLLM's sampling extras, as its Responses endpoint takes them
    top_k: TopK | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    seed: Seed | None = None
    ignore_eos: bool = False
    # chatserve's extension (as on Chat Completions): what a lost connection means, "abort" or "detach"
    # with a lease; background responses detach by default (see responses/routes.py)
    disconnect_policy: Any = None

    @field_validator("input", mode="before")
    @classmethod
    def _known_item_types(cls, value: Any, info: ValidationInfo) -> Any:
        """An item type we cannot take (web search calls, item_reference, ...) by its name."""
        check_length(value, info, "max_messages", "input items")
        if isinstance(value, list):
            for i, item in enumerate(value):
                if not isinstance(item, dict):
                    raise field_error(str(i), "each input item must be an object")
                kind = item.get("type", "message")
                if kind not in INPUT_ITEM_TYPES:
                    raise field_error(f"{i}.type", f"input items of type {str(kind)[:40]!r} are not supported; "
                                                   f"send {', '.join(INPUT_ITEM_TYPES)}", "unsupported_field")
        return value

    @field_validator("include")
    @classmethod
    def _includable(cls, value: list[str] | None) -> list[str] | None:
        for i, name in enumerate(value or []):
            if name not in INCLUDABLE:
                raise field_error(str(i), f"include {name[:60]!r} is not produced by this server; it can include "
                                          f"{', '.join(INCLUDABLE)}", "unsupported_field")
        return value

    @property
    def include_sealed_reasoning(self) -> bool:
        """`include: ["reasoning.encrypted_content"]`: reasoning items carry their sealed text."""
        return "reasoning.encrypted_content" in (self.include or [])

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_bounded(cls, value: Any) -> Any:
        if isinstance(value, dict) and len(value) > 16:
            raise ValueError(f"metadata has at most 16 keys, got {len(value)}")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools_only(cls, value: Any, info: ValidationInfo) -> Any:
        check_length(value, info, "max_tools", "tools")
        if isinstance(value, list):
            for i, tool in enumerate(value):
                kind = tool.get("type") if isinstance(tool, dict) else None
                if kind != "function":
                    raise field_error(f"{i}.type", f"tools of type {str(kind)[:40]!r} are not supported; only function "
                                                   "tools are (hosted tools need OpenAI's servers)", "unsupported_field")
        return value

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice_only(cls, value: Any) -> Any:
        if isinstance(value, dict) and value.get("type") != "function":
            raise field_error("type", f"tool_choice of type {str(value.get('type'))[:40]!r} is not supported; send "
                                      '"none", "auto", "required" or {"type": "function", "name": ...}', "unsupported_field")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ResponsesRequest:
        if self.truncation != "disabled":
            raise field_error("truncation", 'truncation "auto" is not supported: an input over the context is a 400 '
                                            '(send "disabled" or leave it out)', "unsupported_field")
        if self.metadata is not None and len(self.metadata) > 16:
            raise field_error("metadata", f"metadata has at most 16 keys, got {len(self.metadata)}")
        if self.background and not self.store:
            raise field_error("background", "background responses must be stored: leave store true")
        if self.stream_options is not None and not self.stream:
            raise field_error("stream_options", "stream_options is only allowed when stream is true")
        check_tools(self.chat_tools(), self.chat_tool_choice())
        return self

    # ---- the chat side's view of this request ----------------------------------------------------
    def chat_tools(self) -> list[ToolDefinition] | None:
        if not self.tools:
            return None
        return [ToolDefinition(type="function", function=FunctionDefinition(
            name=t.name, description=t.description, parameters=t.parameters, strict=t.strict)) for t in self.tools]

    def chat_tool_choice(self) -> Any:
        if isinstance(self.tool_choice, FunctionToolChoice):
            return NamedToolChoice(type="function", function=NamedFunction(name=self.tool_choice.name))
        return self.tool_choice

    def response_format(self) -> ResponseFormat | None:
        fmt = self.text.format if self.text is not None else None
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return ResponseFormat(type="json_object")
        assert fmt.json_schema is not None
        spec = JSONSchemaSpec(name=fmt.name or "response", description=fmt.description, json_schema=fmt.json_schema,
                              strict=fmt.strict)
        return ResponseFormat(type="json_schema", json_schema=spec)

    def sampling_fields(self) -> SamplingFields:
        """The chat/completions sampling fields this request means (what build_sampling_params and
        request_constraint read); validated already, so constructed without a second validation."""
        return SamplingFields.model_construct(
            model=self.model, temperature=self.temperature, top_p=self.top_p, max_tokens=self.max_output_tokens,
            top_k=self.top_k, min_p=self.min_p, repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            ignore_eos=self.ignore_eos, response_format=self.response_format(), cache_salt=self.cache_salt,
            prompt_cache_key=self.prompt_cache_key, prompt_cache_retention=self.prompt_cache_retention,
        )

    def text_config(self) -> dict[str, Any]:
        """The response object's `text`: the format as sent (text by default)."""
        fmt = self.text.format if self.text is not None and self.text.format is not None else None
        if fmt is None:
            return {"format": {"type": "text"}}
        out: dict[str, Any] = {"type": fmt.type}
        if fmt.type == "json_schema":
            out.update(name=fmt.name or "response", schema=fmt.json_schema, description=fmt.description,
                       strict=fmt.strict)
        return {"format": out}
