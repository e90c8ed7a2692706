"""How each model family spells a tool call in its reply: the formats `--tool-call-parser` names.

vLLM's names, and the spellings those families were trained on:

- `xlam` (xLAM / APIGen, what SmolLM2 was trained on): one block holding a JSON list,
  `<tool_call>[{"name": "f", "arguments": {...}}, ...]</tool_call>`.
- `hermes` (Qwen2/2.5/3, Hermes, most templates that render `tools`): one block per call,
  `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`.
- `llama3_json` (Llama 3.1+ JSON calls): a bare object `{"name": "f", "parameters": {...}}`, with or
  without a leading `<|python_tag|>`, several separated by `;`.
- `mistral`: after `[TOOL_CALLS]`, a JSON list of calls (v3 tokenizers), `f[ARGS]{...}` (v11 templates)
  or `f[CALL_ID]id[ARGS]{...}` (v13 templates: Magistral, Mistral Small 3.2, Devstral), `[TOOL_CALLS]`
  again before each further call in the last two; all three are read (v13's id becomes the call's
  id), and the constraint writes the spelling the model's template uses. Call ids are 9 alphanumerics
  (Mistral's templates refuse any other).
- `qwen3_coder`: XML, `<tool_call>\\n<function=f>\\n<parameter=p>\\nvalue\\n</parameter>\\n</function>\\n</tool_call>`,
  each value typed from the function's schema.
- `pythonic` (Llama 3.2/4's pythonic calls): a Python list of calls, `[f(a=1, b="x"), g()]`.

A `ToolFormat` is plain data: the openings and closing of a block, how its calls are written
(`syntax`: which reader reads them, `chatserve.tools.parser`), the key its constrained spelling
writes, and how its call ids look. The grammar that makes a model write one is `chatserve.tools.grammar`.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass
from typing import Literal

from chatserve.tools.spec import new_call_id

_ALNUM = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """9 random alphanumerics: the only call id Mistral's chat templates accept."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9))


@dataclass(frozen=True)
class ToolFormat:
    """One way of spelling calls in a reply.

    `openings`: text that opens a block of calls; those in `kept` are the calls' own first character
    (llama's `{`, pythonic's `[`), read as part of them. `closing`: the block's end tag; "" when the block
    ends where its calls do. `syntax`: the reader of what a block holds ("json" objects with a name and
    arguments, mistral's `name[ARGS]{...}` among them; "xml" for qwen3_coder; "pythonic").
    `list_in_block`: the constrained spelling is one JSON list of calls in one block (xlam, mistral v3).
    `call_separator`: what stands between two calls of one block besides a list's commas (llama's ";").
    `arguments_key`: the key the constrained spelling writes the arguments under.
    `bare_name`: calls may be mistral's `name[ARGS]{...}`; `call_id_tag`: the constrained spelling is
    `name[CALL_ID]id[ARGS]{...}` (mistral v13), the id 9 alphanumerics the model writes.
    """

    name: str
    syntax: Literal["json", "xml", "pythonic"] = "json"
    openings: tuple[str, ...] = ("<tool_call>",)
    closing: str = "</tool_call>"
    kept: tuple[str, ...] = ()
    list_in_block: bool = False
    call_separator: str = ""
    bare_name: bool = False
    arguments_key: str = "arguments"
    mistral_ids: bool = False
    call_id_tag: bool = False

    @property
    def opening(self) -> str:
        """The opening the constrained spelling writes (the first one)."""
        return self.openings[0]

    def new_call_id(self) -> str:
        return mistral_call_id() if self.mistral_ids else new_call_id()


XLAM = ToolFormat("xlam", list_in_block=True)
HERMES = ToolFormat("hermes")
LLAMA3_JSON = ToolFormat("llama3_json", openings=("<|python_tag|>", "{"), closing="", kept=("{",),
                         call_separator=";", arguments_key="parameters")
MISTRAL = ToolFormat("mistral", openings=("[TOOL_CALLS]",), closing="", list_in_block=True, bare_name=True,
                     mistral_ids=True)
"""Mistral as v3 tokenizers write it: a JSON list after `[TOOL_CALLS]` (the v11 spelling is read too)."""
MISTRAL_V11 = ToolFormat("mistral", openings=("[TOOL_CALLS]",), closing="", bare_name=True, mistral_ids=True)
"""Mistral as v11 templates write it: `[TOOL_CALLS]name[ARGS]{...}` per call (the other spellings are read too)."""
MISTRAL_V13 = ToolFormat("mistral", openings=("[TOOL_CALLS]",), closing="", bare_name=True, mistral_ids=True,
                         call_id_tag=True)
"""Mistral as v13 templates write it: `[TOOL_CALLS]name[CALL_ID]id[ARGS]{...}` per call (the others read too)."""
QWEN3_CODER = ToolFormat("qwen3_coder", syntax="xml")
PYTHONIC = ToolFormat("pythonic", syntax="pythonic", openings=("[",), closing="", kept=("[",))

TOOL_FORMATS: dict[str, ToolFormat] = {f.name: f for f in (HERMES, XLAM, LLAMA3_JSON, MISTRAL, QWEN3_CODER, PYTHONIC)}
TOOL_CALL_PARSERS = tuple(TOOL_FORMATS)  # the --tool-call-parser choices


def tool_format_named(name: str) -> ToolFormat:
    try:
        return TOOL_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of: {', '.join(TOOL_CALL_PARSERS)}") from None
