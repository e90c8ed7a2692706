"""Each family's tool-call format without a model (issue 55): llama3_json, mistral (its three spellings),
qwen3_coder and pythonic, beside hermes and xlam.

Recorded replies are parsed whole and streamed in every chunking: text before and after a call stays
text, two calls in one reply come back in order, the arguments arrive in more than one piece and
concatenate to the final arguments, a reply cut inside a call (max_tokens) gives the call partial, and
what only looks like a call stays text. The grammars compile and admit exactly the well-formed calls
with schema-valid arguments; a family's template is recognised by the call it renders; a format forced
on the default (SmolLM2) template renders the tools in that format's way; an unknown parser name is a
start-up error naming the flag and the choices.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from chatserve.engine.input_processor import InputProcessor
from chatserve.sampling_params import StructuredOutputsParams
from chatserve.server import ServerSettings
from chatserve.tools import (
    HERMES,
    LLAMA3_JSON,
    MISTRAL,
    MISTRAL_V11,
    MISTRAL_V13,
    PYTHONIC,
    QWEN3_CODER,
    TOOL_CALL_PARSERS,
    XLAM,
    FunctionTool,
    ToolCallStreamParser,
    ToolChoice,
    parse_tool_calls,
    tool_grammar,
)
from chatserve.tools.parser import ArgumentsDelta, CallStart, TextEvent
from chatserve.tools.rendering import detect_tool_format, mistral_template_id
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.tiny_families import tool_template

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                                   "metric": {"type": "boolean"}}, "required": ["city"]}
SCHEMAS: dict[str, dict[str, Any]] = {"get_weather": WEATHER_PARAMS, "get_time": {"type": "object", "properties": {}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_PARAMS}}
TOOLS = [FunctionTool("get_weather", None, WEATHER_PARAMS), FunctionTool("get_time", None, SCHEMAS["get_time"])]

# (format, a recorded reply: text, two calls, text; the calls' arguments as JSON values)
RECORDED = [
    (LLAMA3_JSON, 'Checking. {"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                  '{"name": "get_time", "parameters": {}} Done.'),
    (LLAMA3_JSON, 'Checking. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}; '
                  '{"name": "get_time", "parameters": {}} Done.'),
    (MISTRAL, 'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}[TOOL_CALLS]get_time[ARGS]{} Done.'),
    (MISTRAL, 'Checking. [TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris", "days": 2}'
              '[TOOL_CALLS]get_time[CALL_ID]Zy9xW8vU7[ARGS]{} Done.'),
    (MISTRAL_V13, 'Checking. [TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris", "days": 2}'
                  '[TOOL_CALLS]get_time[ARGS]{} Done.'),
    (MISTRAL, 'Checking. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, '
              '"id": "abcDEF123"}, {"name": "get_time", "arguments": {}}] Done.'),
    (QWEN3_CODER, "Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                  "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n"
                  "</function>\n</tool_call> Done."),
    (QWEN3_CODER, "Checking.<tool_call><function=get_weather><parameter=city>Paris</parameter><parameter=days>2"
                  "</parameter></function></tool_call><tool_call><function=get_time></function></tool_call> Done."),
    (PYTHONIC, 'Checking. [get_weather(city="Paris", days=2), get_time()] Done.'),
    (HERMES, 'Checking. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call> Done.'),
    (XLAM, 'Checking. <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, '
           '{"name": "get_time", "arguments": {}}]</tool_call> Done.'),
]


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


def stream(fmt: Any, text: str, step: int, truncated: bool = False) -> list[Any]:
    parser = ToolCallStreamParser(fmt, SCHEMAS, ids())
    events: list[Any] = []
    for i in range(0, len(text), step):
        events += parser.feed(text[i:i + step])
    return events + parser.finish(truncated)


@pytest.mark.parametrize(("fmt", "text"), RECORDED, ids=[f"{f.name}-{i}" for i, (f, _) in enumerate(RECORDED)])
def test_recorded_reply_text_around_two_calls(fmt, text) -> None:
    parsed = parse_tool_calls(text, fmt, SCHEMAS, ids())
    assert parsed.content is not None
    assert parsed.content.split() == ["Checking.", "Done."], parsed.content
    assert [(c.name, json.loads(c.arguments), c.complete) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": 2}, True), ("get_time", {}, True)]
    for step in (1, 2, 5, 64):  # any chunking: the same text, the same calls, arguments in pieces
        events = stream(fmt, text, step)
        assert "".join(e.text for e in events if isinstance(e, TextEvent)) == parsed.content
        starts = [e for e in events if isinstance(e, CallStart)]
        assert [(s.index, s.name) for s in starts] == [(0, "get_weather"), (1, "get_time")]
        pieces = [e.text for e in events if isinstance(e, ArgumentsDelta) and e.index == 0]
        assert "".join(pieces) == parsed.tool_calls[0].arguments
        if step == 1:
            assert len(pieces) > 1, "the arguments stream as they are generated"


@pytest.mark.parametrize(("fmt", "text", "arguments"), [
    (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"city": "Pa', '{"city": "Pa'),
    (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Pa', '{"city": "Pa'),
    (MISTRAL, "[TOOL_CALLS]get_wea", ""),
    (MISTRAL, '[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Pa', '{"city": "Pa'),
    (MISTRAL, "[TOOL_CALLS]get_weather[CALL_ID]abcD", ""),
    (MISTRAL, "[TOOL_CALLS]get_weather[CALL_", ""),
    (QWEN3_CODER, "<tool_call>\n<function=get_weather>\n<parameter=city>\nPa", '{"city": "Pa'),
    (PYTHONIC, '[get_weather(city="Pa', '{"city": "Pa'),
])
def test_a_call_cut_by_max_tokens_is_a_partial_call(fmt, text, arguments) -> None:
    parsed = parse_tool_calls(text, fmt, SCHEMAS, ids(), truncated=True)
    assert parsed.content is None
    assert [(c.name, c.arguments, c.complete) for c in parsed.tool_calls] == [("get_weather", arguments, False)]


@pytest.mark.parametrize(("fmt", "text"), [
    (LLAMA3_JSON, "Use {x} or {\"a\": 1} in code; then {\"name\": \"nope\", \"parameters\": {}}."),
    (MISTRAL, "[TOOL_CALLS]unknown_fn[ARGS]{}"),
    (MISTRAL, "[TOOL_CALLS]unknown_fn[CALL_ID]abcDEF123[ARGS]{}"),
    (MISTRAL, "[TOOL_CALLS]get_time[CALL_ID]abc-DEF12[ARGS]{}"),
    (MISTRAL, "[TOOL_CALLS]get_time[CALLS]{}"),
    (MISTRAL, "[TOOL_CALLS]get_time[CALL_ID]abcDEF123[CALL_ID]abcDEF123[ARGS]{}"),
    (QWEN3_CODER, "<tool_call>\n<function=unknown_fn>\n</function>\n</tool_call>"),
    (PYTHONIC, "See [1], [a link](x) and [unknown_fn(a=1)]."),
])
def test_what_is_not_a_call_of_a_known_tool_stays_text(fmt, text) -> None:
    parsed = parse_tool_calls(text, fmt, SCHEMAS, ids())
    assert parsed.tool_calls == [] and parsed.content == text
    assert "".join(e.text for e in stream(fmt, text, 1) if isinstance(e, TextEvent)) == text


def test_xml_and_pythonic_values_are_typed_from_the_schema() -> None:
    xml = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n12 \"Rue\"\n</parameter>\n<parameter=days>\n3\n"
           "</parameter>\n<parameter=metric>\nTrue\n</parameter>\n</function>\n</tool_call>")
    (call,) = parse_tool_calls(xml, QWEN3_CODER, SCHEMAS).tool_calls
    assert json.loads(call.arguments) == {"city": '12 "Rue"', "days": 3, "metric": True}
    py = "[get_weather(city='it\\'s', days=3, metric=False, extra=[1, None])]"
    (call,) = parse_tool_calls(py, PYTHONIC, SCHEMAS).tool_calls
    assert json.loads(call.arguments) == {"city": "it's", "days": 3, "metric": False, "extra": [1, None]}


def test_mistral_ids_are_nine_alphanumerics() -> None:
    for _ in range(20):
        (call,) = parse_tool_calls("[TOOL_CALLS]get_time[ARGS]{}", MISTRAL, SCHEMAS).tool_calls
        assert len(call.id) == 9 and call.id.isalnum()
    (call,) = parse_tool_calls('{"name": "get_time", "parameters": {}}', LLAMA3_JSON, SCHEMAS).tool_calls
    assert call.id.startswith("call_")
    # another client's ids render as 9 alphanumerics, the same every time
    assert mistral_template_id("abcDEF123") == "abcDEF123"
    assert mistral_template_id("call_abcdefghijklmnop") == "hijklmnop"
    short = mistral_template_id("toolu_1")
    assert len(short) == 9 and short.isalnum() and short == mistral_template_id("toolu_1")


V13_REPLY = ('Checking. [TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Paris", "days": 2}'
             '[TOOL_CALLS]get_time[CALL_ID]Zy9xW8vU7[ARGS]{} Done.')


@pytest.mark.parametrize("fmt", [MISTRAL, MISTRAL_V11, MISTRAL_V13])
def test_mistral_v13_calls_keep_the_ids_the_model_wrote(fmt) -> None:
    parsed = parse_tool_calls(V13_REPLY, fmt, SCHEMAS, ids())
    assert [(c.id, c.name) for c in parsed.tool_calls] == [("abcDEF123", "get_weather"), ("Zy9xW8vU7", "get_time")]
    for step in (1, 2, 5, 64):  # streamed: the id is known before the arguments, so the call starts with it
        starts = [e for e in stream(fmt, V13_REPLY, step) if isinstance(e, CallStart)]
        assert [(s.id, s.name) for s in starts] == [("abcDEF123", "get_weather"), ("Zy9xW8vU7", "get_time")]
    # an id that is not 9 alphanumerics, or one already given in the reply, is replaced by the format's own
    again = parse_tool_calls("[TOOL_CALLS]get_time[CALL_ID]abcDEF123[ARGS]{}[TOOL_CALLS]get_time[CALL_ID]abcDEF123"
                             "[ARGS]{}[TOOL_CALLS]get_time[CALL_ID]short[ARGS]{}", fmt, SCHEMAS, ids())
    assert [c.id for c in again.tool_calls] == ["abcDEF123", "call_0", "call_1"]


# ---- grammars ---------------------------------------------------------------------------------------------
GOOD = {
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "days": 2}',
    "mistral_v13": '[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"city": "Oslo", "days": 2}',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                   "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "pythonic": '[get_weather(city="Oslo", days=2)]',
}
MISSING_CITY = {
    "llama3_json": '{"name": "get_weather", "parameters": {"days": 2}}',
    "mistral": '[TOOL_CALLS]get_weather[ARGS]{"days": 2}',
    "mistral_v13": '[TOOL_CALLS]get_weather[CALL_ID]abcDEF123[ARGS]{"days": 2}',
    "qwen3_coder": "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
    "pythonic": "[get_weather(days=2)]",
}
TWO = {
    "llama3_json": GOOD["llama3_json"] + '; {"name": "get_time", "parameters": {}}',
    "mistral": GOOD["mistral"] + "[TOOL_CALLS]get_time[ARGS]{}",
    "mistral_v13": GOOD["mistral_v13"] + "[TOOL_CALLS]get_time[CALL_ID]Zy9xW8vU7[ARGS]{}",
    "qwen3_coder": GOOD["qwen3_coder"] + "\n<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
    "pythonic": GOOD["pythonic"][:-1] + ", get_time()]",
}
FORMATS = {"llama3_json": LLAMA3_JSON, "mistral": MISTRAL_V11, "mistral_v13": MISTRAL_V13, "qwen3_coder": QWEN3_CODER,
           "pythonic": PYTHONIC}


def _accepts(tokenizer: Any, tag: dict[str, Any], text: str, whole: bool = True) -> bool:
    import xgrammar as xgr

    from chatserve.structured.compiler import GrammarCompilerService

    service = _SERVICES.setdefault(id(tokenizer), GrammarCompilerService(tokenizer, len(tokenizer), [tokenizer.eos_token_id]))
    matcher = xgr.GrammarMatcher(service.compile(StructuredOutputsParams(structural_tag=tag)),
                                 terminate_without_stop_token=True)
    return bool(matcher.accept_string(text)) and (matcher.is_terminated() or not whole)


_SERVICES: dict[int, Any] = {}


@pytest.mark.parametrize("name", list(FORMATS))
def test_each_formats_grammar_admits_exactly_well_formed_calls(smollm_tokenizer, name) -> None:
    fmt = FORMATS[name]
    required = tool_grammar(fmt, TOOLS, ToolChoice("required"), parallel=True)
    single = tool_grammar(fmt, TOOLS, ToolChoice("required"), parallel=False)
    named = tool_grammar(fmt, TOOLS, ToolChoice("named", "get_time"))
    auto = tool_grammar(fmt, TOOLS, ToolChoice("auto"))
    assert required and single and named and auto
    assert _accepts(smollm_tokenizer, required, GOOD[name]) and _accepts(smollm_tokenizer, required, TWO[name])
    assert not _accepts(smollm_tokenizer, required, MISSING_CITY[name]), "arguments held to the schema"
    assert not _accepts(smollm_tokenizer, required, "Sure, here you go.")
    assert _accepts(smollm_tokenizer, single, GOOD[name]) and not _accepts(smollm_tokenizer, single, TWO[name])
    assert not _accepts(smollm_tokenizer, named, GOOD[name]), "a named choice calls only that function"
    if name == "qwen3_coder":  # a value never runs on past the tag that ends it
        assert not _accepts(smollm_tokenizer, required, GOOD[name].replace("Oslo", "Oslo</parameter>\n<x"))
    assert _accepts(smollm_tokenizer, auto, "Just text, [1] and {braces}.", whole=False)
    assert _accepts(smollm_tokenizer, auto, "Let me look. " + GOOD[name], whole=False)


def test_the_mistral_list_spelling_is_a_json_list_after_its_tag(smollm_tokenizer) -> None:
    tag = tool_grammar(MISTRAL, TOOLS, ToolChoice("required"))
    assert tag is not None and tag["format"]["begin"] == "[TOOL_CALLS]"
    assert _accepts(smollm_tokenizer, tag, '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]')
    assert not _accepts(smollm_tokenizer, tag, "[TOOL_CALLS]get_time[ARGS]{}")


def test_the_mistral_v13_spelling_writes_a_nine_alphanumeric_id(smollm_tokenizer) -> None:
    tag = tool_grammar(MISTRAL_V13, TOOLS, ToolChoice("named", "get_time"))
    assert tag is not None
    assert _accepts(smollm_tokenizer, tag, "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e[ARGS]{}")
    for wrong in ("[TOOL_CALLS]get_time[ARGS]{}", "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4[ARGS]{}",
                  "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D4e5[ARGS]{}", "[TOOL_CALLS]get_time[CALL_ID]a1B2c3D_e[ARGS]{}"):
        assert not _accepts(smollm_tokenizer, tag, wrong), wrong


# ---- templates ----------------------------------------------------------------------------------------------
def processor(tokenizer: Any) -> InputProcessor:
    return InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=4096, max_model_len_note="",
                          num_kv_blocks=1024, block_size=16)


@pytest.mark.parametrize(("template", "fmt"), [
    ("llama3.1_json", LLAMA3_JSON), ("mistral_v11", MISTRAL_V11), ("mistral_v13", MISTRAL_V13), ("mistral_v3", MISTRAL),
    ("qwen3_coder", QWEN3_CODER), ("llama3.2_pythonic", PYTHONIC),
])
def test_a_family_template_is_recognised_by_the_call_it_renders(smollm_tokenizer, template, fmt) -> None:
    text = tool_template(template)
    assert detect_tool_format(smollm_tokenizer, text) == fmt
    rendering = processor(smollm_tokenizer).tool_rendering(text)
    assert rendering.own_template and rendering.format == fmt and rendering.chat_template == text
    forced = processor(smollm_tokenizer).tool_rendering(text, fmt.name)  # forcing its own format changes nothing
    assert forced == rendering


ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.mark.parametrize(("parser", "shows"), [
    ("llama3_json", ['Respond in the format {"name": function name, "parameters": dictionary', '"name": "get_weather"']),
    ("mistral", ["[AVAILABLE_TOOLS]", "[TOOL_CALLS]func_name[ARGS]"]),
    ("qwen3_coder", ["<name>get_weather</name>", "<function=example_function_name>"]),
    ("pythonic", ["[func_name1(params_name1=params_value1", '"name": "get_weather"']),
    ("hermes", ["<tools>", '{"name": <function-name>, "arguments": <args-json-object>}']),
])
def test_a_format_forced_on_the_default_template_describes_the_tools_its_way(smollm_tokenizer, parser, shows) -> None:
    p = processor(smollm_tokenizer)
    rendering = p.tool_rendering(None, parser)
    assert not rendering.own_template and rendering.format.name == parser
    text = smollm_tokenizer.decode(p.render_chat(ASK, tools=[WEATHER], tool_parser=parser))
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    for piece in shows:
        assert piece in text, (piece, text)
    # the call and its result come back in that format, and the next turn extends this one
    call_args = {"city": "Paris", "days": 2}
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "abcDEF123", "type": "function", "function": {"name": "get_weather", "arguments": call_args}}]},
        {"role": "tool", "tool_call_id": "abcDEF123", "content": "sunny"}]
    second = smollm_tokenizer.decode(p.render_chat(history, tools=[WEATHER], tool_parser=parser))
    assert second.startswith(text)
    reply = second[len(text):second.index("<|im_end|>", len(text))]
    (call,) = parse_tool_calls(reply, rendering.format, SCHEMAS).tool_calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", call_args)


def test_without_a_forced_parser_smollm_keeps_xlam(smollm_tokenizer) -> None:
    rendering = processor(smollm_tokenizer).tool_rendering()
    assert rendering.format is XLAM and not rendering.own_template


# ---- the flag -----------------------------------------------------------------------------------------------
def test_the_flag_takes_vllms_names_and_refuses_others() -> None:
    import typing

    from chatserve.cli import build_parser

    hint = typing.get_type_hints(ServerSettings)["tool_call_parser"]
    assert typing.get_args(typing.get_args(hint)[0]) == TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match=r"--tool-call-parser: unknown parser 'nope'; choose one of: hermes, xlam"):
        ServerSettings(tool_call_parser="nope")  # type: ignore[arg-type]
    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--tool-call-parser", "nope"])
    args = parser.parse_args(["serve", "--tool-call-parser", "qwen3_coder"])
    assert args.tool_call_parser == "qwen3_coder"


@pytest.mark.anyio
@pytest.mark.parametrize(("parser", "reply", "begin"), [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', '{"name": "get_weather", "parameters": '),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>",
     "<tool_call>\n<function=get_weather>\n"),
])
async def test_the_server_forces_the_flags_format_on_the_default_template(smollm_tokenizer, parser, reply, begin) -> None:
    from tests.helpers.asgi import app_client

    engine = FakeEngine(smollm_tokenizer, reply=reply, max_model_len=2048)
    async with app_client(engine, tool_call_parser=parser) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER],
                                                                "tool_choice": "required"})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    fmt = engine.checked_structured[0].structural_tag["format"]  # parallel calls: tags with a separator
    assert fmt["type"] == "tags_with_separator" and fmt["tags"][0]["begin"] == begin
    assert "get_weather" in smollm_tokenizer.decode(engine.requests[0].prompt.prompt_token_ids)


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
