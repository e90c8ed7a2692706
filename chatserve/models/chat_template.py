"""Chat templates rendered with Jinja2 directly, as transformers' `apply_chat_template` renders them.

Why: importing transformers costs about a second of every start (its lazy module tables alone), and
a GGUF served before has everything else cached (models/saved_tokenizer.py). This module is the
rendering half of that tokenizer: the same sandboxed environment (trim_blocks, lstrip_blocks, the
loopcontrols extension, a `{% generation %}` tag), the same globals and filters (`raise_exception`,
`strftime_now`, `tojson` with `ensure_ascii=False`, a limited `dict` and a `namespace` that refuses
underscore names), the same preparation of the messages (objects to dicts, None values dropped, every
value rebuilt from plain JSON types, reasoning aliased to `reasoning_content` and `thinking`) and the
same `continue_final_message` cut. Mirrors transformers 5.x's `render_jinja_template`;
tests/models/test_saved_tokenizer.py renders every template of the tests through both and compares.
What this does not do (`return_assistant_tokens_mask`, `sanitize_control_tokens`, tools given as
Python functions) goes to transformers, imported then.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Mapping
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning is passed under; the first is the one chat templates read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks its span for
    assistant masks, which this module does not compute)."""

    tags = {"generation"}

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        environment.extend(activate_tracker=_no_tracker)

    def parse(self, parser: Any) -> jinja2.nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


@contextmanager
def _no_tracker(*_: Any) -> Any:
    yield


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' override: no HTML escaping (Jinja's own filter escapes <, >, &, ')
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:  # noqa: A002 - the name templates call it with
    return datetime.now().strftime(format)


class _TemplateDict:
    """`dict(...)` inside a template, without attribute access to the real type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's namespace, refusing underscore-prefixed names (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's own signature trick
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
                "Please rename the attribute.")


@lru_cache(maxsize=32)
def compile_template(chat_template: str) -> jinja2.Template:
    """The template compiled once per text, in transformers' environment."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(chat_template)


def _message_objects_to_dicts(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {key: _message_objects_to_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_message_objects_to_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_message_objects_to_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _message_objects_to_dicts(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _message_objects_to_dicts(value.model_dump())
    return value


def normalize_messages(conversation: Any) -> list[dict]:
    """Message objects to dicts, keys whose value is None dropped (templates handle a missing key)."""
    messages = _message_objects_to_dicts(getattr(conversation, "messages", conversation))
    normalized = []
    for message in messages:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        normalized.append({key: value for key, value in message.items() if value is not None})
    return normalized


def plain_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON types (anything else becomes "<TypeName>"): all a template sees."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {plain_data(key): plain_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [plain_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(plain_data(item) for item in value)
    np = sys.modules.get("numpy")  # (a numpy scalar can only exist where numpy was imported)
    if np is not None and isinstance(value, np.generic):
        return plain_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return plain_data(value.model_dump())
    return f"<{type(value).__name__}>"


def _alias_reasoning_fields(chat: list) -> list:
    aliased = []
    for message in chat:
        if isinstance(message, dict):
            reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def _tool_schemas(tools: list | None) -> list | None:
    if tools is None:
        return None
    schemas = []
    for tool in tools:
        if isinstance(tool, dict):
            schemas.append(tool)
        elif callable(tool):  # a Python function: its schema from its signature and docstring, as transformers makes it
            import inspect

            if not (inspect.isfunction(tool) or inspect.ismethod(tool)):
                raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                                 "and a docstring suitable for auto-conversion to a schema.")
            from transformers.utils.chat_template_utils import get_json_schema

            schemas.append(get_json_schema(tool))
        else:
            raise ValueError("Tools should either be a JSON schema, or a callable function with type hints "
                             "and a docstring suitable for auto-conversion to a schema.")
    return schemas


def render(chat_template: str, conversation: list[dict], *, tools: list | None = None, documents: list | None = None,
           add_generation_prompt: bool = False, continue_final_message: bool | str = False, **kwargs: Any) -> str:
    """One normalized conversation (`normalize_messages`) through `chat_template`, as transformers'
    `render_jinja_template` renders it; `kwargs` are the template's variables (the special tokens included)."""
    compiled = compile_template(chat_template)
    tool_schemas = plain_data(_tool_schemas(tools))
    if documents is not None:
        for document in documents:
            if not isinstance(document, dict):
                raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    documents, kwargs = plain_data(documents), plain_data(kwargs)
    chat = plain_data(conversation)
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    chat = _alias_reasoning_fields(chat)
    final_message: Any = None
    if continue_final_message:
        if not chat:
            raise ValueError("continue_final_message is set but the conversation is empty!")
        field = continue_final_message if isinstance(continue_final_message, str) else "content"
        if (final_message := chat[-1].get(field)) is None:
            raise ValueError(f'continue_final_message is set but the final message has no "{field}" to continue!')
        fields = [field]
        if field in REASONING_FIELDS:  # reasoning is copied under several names: tag every copy
            fields = [f for f in REASONING_FIELDS if chat[-1].get(f) == final_message]
        if not any(f in chat_template for f in fields):
            raise ValueError(f'continue_final_message is set to "{field}" but this is not an accepted field in the '
                             "chat_template")
        if isinstance(final_message, (list, tuple)):
            for block in reversed(final_message):
                if "text" in block:
                    final_message = block["text"]
                    block["text"] = block["text"] + _CONTINUE_TAG
                    break
            else:
                raise ValueError("continue_final_message is set but we could not find any text to continue in the "
                                 "final message!")
        else:
            for f in fields:
                chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    rendered = compiled.render(messages=chat, tools=tool_schemas, documents=documents,
                               add_generation_prompt=add_generation_prompt, **kwargs)
    if continue_final_message:
        if final_message.strip() not in rendered or _CONTINUE_TAG.strip() not in rendered:
            raise ValueError(
                "continue_final_message is set but the final message does not appear in the chat after applying the "
                "chat template! This can happen if the chat template deletes portions of the final message. Please "
                "verify the chat template and final message in your chat to ensure they are compatible."
                f"Final message to continue: {final_message.strip()}\nRendered chat:\n{rendered}")
        tag_at = rendered.rindex(_CONTINUE_TAG.strip())
        if rendered[tag_at:tag_at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
            rendered = rendered[:tag_at]
        else:  # the template trimmed the message's trailing space
            rendered = rendered[:tag_at].rstrip()
    return rendered
