"""Tool calling and structured outputs without a model: the parsers, the grammars, the templates, and
the HTTP layer over `FakeEngine` (whose scripted reply plays the model's).

What a real model does with them (the grammar forcing a call, real clients reading it) is in
tests/clients/test_client_compat_tools.py; the grammar engine itself in tests/engine/test_structured_outputs.py.
"""

from __future__ import annotations

import itertools
import json
from typing import Any

import httpx
import pytest

from chatserve.engine.input_processor import InputProcessor
from chatserve.sampling_params import StructuredOutputsParams
from chatserve.server import ServerSettings, create_app
from chatserve.tools import HERMES, XLAM, FunctionTool, ToolCallStreamParser, ToolChoice, parse_tool_calls, tool_grammar
from chatserve.tools.parser import CallEvent, TextEvent
from tests.helpers.asgi import app_client
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.streams import parse_sse_lines

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL_TEXT = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def ids() -> Any:
    counter = itertools.count()
    return lambda: f"call_{next(counter)}"


# ---- parsing --------------------------------------------------------------------------------------
def test_whole_reply_with_only_a_call_has_null_content() -> None:
    parsed = parse_tool_calls(CALL_TEXT, XLAM, {"get_weather"}, ids())
    assert parsed.content is None
    assert [(c.id, c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("call_0", "get_weather", {"city": "Paris"})]


def test_text_before_a_call_is_content_and_parallel_calls_keep_their_order() -> None:
    text = 'Let me check. <tool_call>[{"name": "get_weather", "arguments": {"city": "A"}}, ' \
           '{"name": "get_time", "arguments": {}}]</tool_call>'
    parsed = parse_tool_calls(text, XLAM, {"get_weather", "get_time"}, ids())
    assert parsed.content == "Let me check. "
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]


@pytest.mark.parametrize("text", [
    '<tool_call>[{"name": "unknown_fn", "arguments": {}}]</tool_call>',  # not a tool of this request
    '<tool_call>[{"name": get_weather, "arguments": {}}]</tool_call>',  # not JSON
    '<tool_call>[{"name": "get_weather"',  # never closed, and no call had started (its arguments had not begun)
    "I use <tool_ sometimes",  # only a partial opening
])
def test_what_is_not_a_call_of_a_known_tool_stays_text(text) -> None:
    # (a call that had started streaming stays a call: tests/tools/test_tool_call_streaming.py)
    parsed = parse_tool_calls(text, XLAM, {"get_weather"}, ids())
    assert parsed.tool_calls == [] and parsed.content == text


def test_hermes_blocks_one_call_each() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n' \
           '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    parsed = parse_tool_calls(text, HERMES, {"get_weather", "get_time"}, ids())
    assert [c.name for c in parsed.tool_calls] == ["get_weather", "get_time"]
    assert parsed.content is None


@pytest.mark.parametrize("step", [1, 2, 3, 7])
def test_streaming_holds_back_a_possible_opening_and_agrees_with_the_whole_parse(step) -> None:
    text = "Sure <tool_cal is not it. " + CALL_TEXT + " done"
    parser = ToolCallStreamParser(XLAM, {"get_weather"}, ids())
    events = []
    for i in range(0, len(text), step):
        fed = parser.feed(text[i:i + step])
        # never releases text that could still be the opening of a call
        for e in fed:
            if isinstance(e, TextEvent):
                assert "<tool_call>" not in e.text
        events += fed
    events += parser.finish()
    streamed_text = "".join(e.text for e in events if isinstance(e, TextEvent))
    calls = [e.call for e in events if isinstance(e, CallEvent)]
    whole = parse_tool_calls(text, XLAM, {"get_weather"}, ids())
    assert streamed_text == whole.content == "Sure <tool_cal is not it.  done"
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole.tool_calls]


# ---- grammars --------------------------------------------------------------------------------------
TOOLS = [FunctionTool.from_openai(WEATHER), FunctionTool.from_openai(TIME)]


def test_required_grammar_is_one_block_of_calls_with_each_functions_schema() -> None:
    tag = tool_grammar(XLAM, TOOLS, ToolChoice("required"), parallel=False)
    assert tag is not None and tag["type"] == "structural_tag"
    fmt = tag["format"]
    assert (fmt["type"], fmt["begin"], fmt["end"]) == ("tag", "<tool_call>", "</tool_call>")
    schema = fmt["content"]["json_schema"]
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    StructuredOutputsParams(structural_tag=tag)  # a valid structured-outputs kind


def test_named_grammar_allows_only_that_function_and_auto_triggers_on_the_opening() -> None:
    named = tool_grammar(XLAM, TOOLS, ToolChoice("named", "get_time"))
    assert named is not None
    assert named["format"]["content"]["json_schema"]["items"]["properties"]["name"] == {"const": "get_time"}
    auto = tool_grammar(XLAM, TOOLS, ToolChoice("auto"))
    assert auto is not None and auto["format"]["type"] == "triggered_tags"
    assert auto["format"]["triggers"] == ["<tool_call>"] and auto["format"]["stop_after_first"] is True
    assert tool_grammar(XLAM, TOOLS, ToolChoice("none")) is None
    hermes = tool_grammar(HERMES, TOOLS, ToolChoice("required"), parallel=True)
    assert hermes is not None and hermes["format"]["type"] == "tags_with_separator"
    assert hermes["format"]["tags"][0]["begin"] == '<tool_call>\n{"name": "get_weather", "arguments": '


# ---- templates -------------------------------------------------------------------------------------
def processor(tokenizer: Any) -> InputProcessor:
    return InputProcessor(tokenizer, vocab_size=len(tokenizer), max_model_len=4096, max_model_len_note="",
                          num_kv_blocks=1024, block_size=16)


def test_smollm_template_ignores_tools_so_the_shipped_xlam_template_renders_them(smollm_tokenizer) -> None:
    p = processor(smollm_tokenizer)
    rendering = p.tool_rendering()
    assert rendering.format is XLAM and not rendering.own_template
    text = smollm_tokenizer.decode(p.render_chat(ASK, tools=[WEATHER]))
    assert "<tools>[" in text and '"name": "get_weather"' in text and text.endswith("<|im_start|>assistant\n")
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    text = smollm_tokenizer.decode(p.render_chat(history, tools=[WEATHER]))
    assert CALL_TEXT + "<|im_end|>" in text and "<tool_response>sunny</tool_response>" in text
    # without tools the model's own template is used, token for token
    assert p.render_chat(ASK) == list(smollm_tokenizer.encode(
        smollm_tokenizer.apply_chat_template(ASK, tokenize=False, add_generation_prompt=True), add_special_tokens=False))


QWEN_LIKE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{%- endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_renders_tools_is_used_itself_with_hermes_calls(smollm_tokenizer) -> None:
    p = processor(smollm_tokenizer)
    rendering = p.tool_rendering(QWEN_LIKE)
    assert rendering.own_template and rendering.format is HERMES and rendering.chat_template == QWEN_LIKE
    text = smollm_tokenizer.decode(p.render_chat(ASK, tools=[WEATHER], chat_template=QWEN_LIKE))
    assert text.startswith("<|im_start|>system\n# Tools\n<tools>") and "get_weather" in text


# ---- over HTTP, with a scripted reply ----------------------------------------------------------------
@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


client_for = app_client


def stream_chunks(resp: httpx.Response) -> list[dict[str, Any]]:
    events = parse_sse_lines(resp.text.replace("\r\n", "\n").split("\n"))
    assert events[-1][1] == "[DONE]", events[-1]
    return [json.loads(data) for _, data in events[:-1]]


@pytest.mark.anyio
async def test_a_call_comes_back_as_tool_calls_with_null_content(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=CALL_TEXT, max_model_len=1024)
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER],
                                                                "tool_choice": "required"})
    assert resp.status_code == 200, resp.text
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # the grammar asked of the engine forces exactly such a block, and the prompt offered the tool
    (asked,) = engine.checked_structured
    assert asked.structural_tag["format"]["begin"] == "<tool_call>"
    assert engine.requests[0].params.structured_outputs == asked
    assert "<tools>[" in smollm_tokenizer.decode(engine.requests[0].prompt.prompt_token_ids)


@pytest.mark.anyio
async def test_streamed_call_deltas_reassemble_to_the_same_call(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply="Checking. " + CALL_TEXT, max_model_len=1024)
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "stream": True})
        whole = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER]})
    chunks = stream_chunks(resp)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    content = "".join(d.get("content") or "" for d in deltas)
    calls: dict[int, dict[str, Any]] = {}
    pieces = 0
    for d in deltas:
        for tc in d.get("tool_calls", []):
            entry = calls.setdefault(tc["index"], {"id": None, "name": None, "arguments": ""})
            if "id" in tc:
                assert entry["id"] is None and entry["arguments"] == "", "id and name come first"
                entry.update(id=tc["id"], name=tc["function"]["name"])
            pieces += bool(tc["function"].get("arguments"))
            entry["arguments"] += tc["function"].get("arguments", "")
    assert pieces > 1, "the arguments stream in pieces as they are generated"
    assert content == "Checking. "
    assert "<tool_call>" not in content
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    w = whole.json()["choices"][0]["message"]
    assert w["content"] == "Checking. "
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c["function"]["name"], c["function"]["arguments"]) for c in w["tool_calls"]]
    # auto: a grammar that lets text through until the opening
    assert engine.checked_structured[0].structural_tag["format"]["type"] == "triggered_tags"


@pytest.mark.anyio
async def test_tool_choice_none_offers_no_tools_and_parses_no_calls(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=CALL_TEXT, max_model_len=1024)
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "none"})
    msg = resp.json()["choices"][0]["message"]
    assert msg["content"] == CALL_TEXT and "tool_calls" not in msg
    assert engine.checked_structured == []
    assert "<tools>" not in smollm_tokenizer.decode(engine.requests[0].prompt.prompt_token_ids)


@pytest.mark.anyio
async def test_a_tool_result_turn_renders_the_call_and_its_result(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply="It is sunny in Paris.", max_model_len=1024)
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny, 21C"}]
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": history, "tools": [WEATHER]})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0] == {"index": 0, "message": {"role": "assistant", "content": "It is sunny in Paris.",
                                                                 "refusal": None}, "logprobs": None, "finish_reason": "stop"}
    prompt = smollm_tokenizer.decode(engine.requests[0].prompt.prompt_token_ids)
    assert CALL_TEXT in prompt and "<tool_response>sunny, 21C</tool_response>" in prompt


@pytest.mark.anyio
@pytest.mark.parametrize(("extra", "param", "contains"), [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "not in tools"),
    ({"tool_choice": "required", "tools": None}, "tool_choice", "at least one tool"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name", "unique"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name", None),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 12}}}},
     "response_format.json_schema.schema", "invalid JSON schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "needs a json_schema"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex", "at most one"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0.tool_call_id", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, None, None),  # empty list is fine
])
async def test_bad_tool_and_format_fields_are_400_naming_the_field(smollm_tokenizer, extra, param, contains) -> None:
    engine = FakeEngine(smollm_tokenizer, max_model_len=1024)
    body = {"messages": ASK, "tools": [WEATHER], **extra}
    body = {k: v for k, v in body.items() if v is not None}
    async with client_for(engine) as client:
        resp = await client.post("/v1/chat/completions", json=body)
    if param is None:
        assert resp.status_code == 200, resp.text
        return
    assert_error(resp, 400, param=param, contains=contains)
    assert engine.requests == []


@pytest.mark.anyio
@pytest.mark.parametrize(("extra", "kind", "param"), [
    ({"response_format": {"type": "json_object"}}, "json_object", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, "json",
     "response_format.json_schema.schema"),
    ({"structured_outputs": {"regex": "[a-z]+"}}, "regex", "structured_outputs.regex"),
    ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
    ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
])
async def test_structured_fields_reach_the_engine_and_a_compile_error_is_a_400_before_queueing(
        smollm_tokenizer, extra, kind, param) -> None:
    engine = FakeEngine(smollm_tokenizer, reply='{"a": 1}', max_model_len=1024)
    async with client_for(engine) as client:
        ok = await client.post("/v1/chat/completions", json={"messages": ASK, **extra})
        ok_cmpl = await client.post("/v1/completions", json={"prompt": "Hi", **extra})
        engine.structured_error = f"structured_outputs.{kind}: cannot compile this"
        bad = await client.post("/v1/chat/completions", json={"messages": ASK, **extra})
    assert ok.status_code == 200 and ok_cmpl.status_code == 200, (ok.text, ok_cmpl.text)
    assert [r.params.structured_outputs.kind for r in engine.requests] == [kind, kind]
    err = assert_error(bad, 400, param=param, code="invalid_grammar", contains="cannot compile")
    assert err["message"].startswith(param + ":")
    assert len(engine.requests) == 2  # nothing queued for the refused one


# ---- session turns with tools ------------------------------------------------------------------------
@pytest.mark.anyio
async def test_session_tool_turn_stores_the_call_tokens_and_the_result_turn_extends_them(smollm_tokenizer) -> None:
    from chatserve.sessions import InMemorySessionStore

    engine = FakeEngine(smollm_tokenizer, reply=CALL_TEXT, max_model_len=1024)
    store = InMemorySessionStore()
    app = create_app(engine, store, ServerSettings(serve_web=False))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30) as client:
        sid = (await client.post("/v1/sessions", json={"system_prompt": "Be brief."})).json()["id"]
        first = await client.post(f"/v1/sessions/{sid}/messages", json={
            "content": "Weather in Paris?", "tools": [WEATHER], "tool_choice": "required", "stream": False})
        assert first.status_code == 200, first.text
        choice = first.json()["choices"][0]
        assert choice["finish_reason"] == "tool_calls"
        (call,) = choice["message"]["tool_calls"]
        engine.reply_ids = list(smollm_tokenizer.encode("Sunny in Paris.", add_special_tokens=False))
        second = await client.post(f"/v1/sessions/{sid}/messages", json={
            "tool_results": [{"tool_call_id": call["id"], "content": "sunny"}], "tools": [WEATHER], "stream": False})
        assert second.status_code == 200, second.text
        assert second.json()["choices"][0]["message"]["content"] == "Sunny in Paris."
        missing = await client.post(f"/v1/sessions/{sid}/messages", json={"stream": False})
    assert_error(missing, 400, param="content")
    turn1, turn2 = engine.requests
    history = turn1.prompt.prompt_token_ids + engine_reply_ids(smollm_tokenizer, CALL_TEXT)
    # the second prompt is the first prompt plus the call exactly as generated, then the result
    assert turn2.prompt.prompt_token_ids[:len(history)] == history
    first_text = smollm_tokenizer.decode(turn1.prompt.prompt_token_ids)
    assert first_text.startswith("<|im_start|>system\nBe brief.") and "<tools>[" in first_text
    tail = smollm_tokenizer.decode(turn2.prompt.prompt_token_ids[len(history):])
    assert "<tool_response>sunny</tool_response>" in tail and tail.endswith("<|im_start|>assistant\n")
    assert turn1.params.structured_outputs is not None


def engine_reply_ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.anyio
async def test_a_grammar_failing_mid_generation_ends_that_request_with_an_error(smollm_tokenizer) -> None:
    # a model that does not follow the mask: "{" is taken, "]" is a dead end for the JSON grammar
    engine = FakeEngine(smollm_tokenizer, reply="{]", max_model_len=1024, follow_grammar=False)
    body = {"messages": ASK, "response_format": {"type": "json_object"}}
    async with client_for(engine) as client:
        whole = await client.post("/v1/chat/completions", json=body)
        streamed = await client.post("/v1/chat/completions", json={**body, "stream": True})
        healthy = await client.get("/health")
    assert_error(whole, 500, code="generation_error", contains="the grammar rejected token")
    events = parse_sse_lines(streamed.text.replace("\r\n", "\n").split("\n"))
    assert events[-1][1] != "[DONE]"
    assert json.loads(events[-1][1])["error"]["code"] == "generation_error"
    assert healthy.status_code == 200


@pytest.mark.anyio
async def test_chat_template_flag_replaces_the_models_template_and_its_tool_format(smollm_tokenizer, tmp_path) -> None:
    path = tmp_path / "qwen_like.jinja"
    path.write_text(QWEN_LIKE)
    reply = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    engine = FakeEngine(smollm_tokenizer, reply=reply, max_model_len=1024)
    async with client_for(engine, chat_template=str(path)) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER], "tool_choice": "required"})
    (call,) = resp.json()["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    assert smollm_tokenizer.decode(engine.requests[0].prompt.prompt_token_ids).startswith("<|im_start|>system\n# Tools")
    assert engine.checked_structured[0].structural_tag["format"]["tags"][0]["begin"].startswith('<tool_call>\n{"name": "get_weather"')
    with pytest.raises(ValueError, match="chat_template"):
        ServerSettings(chat_template=str(tmp_path / "missing.jinja")).load_chat_template()


# ---- the grammars compile and take exactly the calls they promise ----------------------------------------
GRAMMAR_CASES = [
    (XLAM, ToolChoice("required"), True, None, CALL_TEXT, True),
    (XLAM, ToolChoice("named", "get_time"), True, None, '<tool_call>[{"name": "get_time", "arguments": {}}]</tool_call>', True),
    (XLAM, ToolChoice("named", "get_time"), True, None, CALL_TEXT, False),  # another function
    (XLAM, ToolChoice("required"), True, None, '<tool_call>[{"name": "get_weather", "arguments": {}}]</tool_call>',
     False),  # "city" is required by the schema
    (XLAM, ToolChoice("required"), True, None, "Sure!", False),
    (XLAM, ToolChoice("auto"), True, None, "Sure! " + CALL_TEXT, True),
    (XLAM, ToolChoice("auto"), True, None, "Just text.", True),
    (XLAM, ToolChoice("auto"), True, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
     '{"a": 1}', True),
    (HERMES, ToolChoice("required"), True, None,
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True),
    (HERMES, ToolChoice("auto"), False, None, 'Hm. <tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>', True),
]


@pytest.mark.parametrize(("fmt", "choice", "parallel", "reply_schema", "text", "accepted"), GRAMMAR_CASES)
def test_tool_grammars_compile_and_take_exactly_their_calls(smollm_tokenizer, fmt, choice, parallel, reply_schema, text,
                                                            accepted) -> None:
    import xgrammar as xgr

    from chatserve.structured.compiler import GrammarCompilerService

    service = _compiler_service(smollm_tokenizer, GrammarCompilerService)
    tag = tool_grammar(fmt, TOOLS, choice, parallel, reply_schema)
    compiled = service.compile(StructuredOutputsParams(structural_tag=tag))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    ok = matcher.accept_string(text) and matcher.is_terminated() if choice.mode != "auto" or reply_schema else \
        matcher.accept_string(text)
    assert bool(ok) == accepted


_SERVICES: dict[int, Any] = {}


def _compiler_service(tokenizer: Any, cls: Any) -> Any:
    if id(tokenizer) not in _SERVICES:
        _SERVICES[id(tokenizer)] = cls(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    return _SERVICES[id(tokenizer)]


# ---- offline: LLM.chat(tools=...) with the real model -----------------------------------------------------
def test_llm_chat_with_required_tools_returns_parsed_calls_that_validate(llm_default) -> None:
    import jsonschema

    from chatserve.sampling_params import SamplingParams

    (out,) = llm_default.chat(ASK, SamplingParams(temperature=0, max_tokens=160), tools=[WEATHER], tool_choice="required")
    o = out.outputs[0]
    assert o.finish_reason == "stop", o.text
    (call,) = o.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    (plain,) = llm_default.chat(ASK, SamplingParams(temperature=0, max_tokens=4))
    assert plain.outputs[0].tool_calls is None  # no tools: nothing parsed, nothing constrained
