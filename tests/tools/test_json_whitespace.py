"""Issue #35: JSON grammars that cannot run away on whitespace, and tool calls cut honestly.

Every JSON grammar we compile bounds each run of whitespace between tokens (default 8,
`--structured-outputs-config` / `LLM(structured_outputs_config=...)` server-wide, the request's
`structured_outputs.{disable_any_whitespace, max_whitespace}` per request); whitespace inside string
values is untouched. A forced tool call cut by max_tokens comes back as a partial call with
finish_reason "length", never as the template's markup in `content`.

Mechanisms, not phrasing: the model runs at temperature 1.0 with fixed seeds, and each check is on
what the grammar guarantees (a JSON-aware scan of the decoded output, the compile cache's key,
the reply's shape), so it holds on every CPU tier and dtype.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest
import xgrammar as xgr
from pydantic import BaseModel

from chatserve import LLM, EngineArgs, SamplingParams
from chatserve.sampling_params import StructuredOutputsParams
from chatserve.structured import GrammarCompilerService, StructuredOutputsConfig, parse_structured_outputs_config
from chatserve.structured.config import DEFAULT_MAX_WHITESPACE, whitespace_runs
from chatserve.tools import HERMES, XLAM, FunctionTool, ToolChoice, parse_tool_calls, tool_grammar
from tests.helpers.net import HTTP
from tests.helpers.server import SHARED_API_KEY as API_KEY
from tests.helpers.server import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
SEEDS = range(6)
CITY_SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
               "required": ["city", "country"]}
# A prompt that invites whitespace: the example the model sees is spread over many lines.
SPREAD = ("Reply with a JSON object giving a city and its country, laid out like this, with blank lines:\n"
          "{\n\n\n\n\n\n\n\n\n\n\n\n      \"city\"   :    \"...\"  ,\n\n\n\n\n\n\n\n\n\n\n      \"country\":  \"...\"\n\n\n\n\n\n\n\n\n\n}")
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a city",
                                         "parameters": WEATHER_PARAMS}}
ASK = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]

pytestmark = pytest.mark.timeout(900)


def longest_run(text: str) -> int:
    return max(whitespace_runs(text), default=0)


def test_the_scanner_skips_strings_and_escapes():
    assert whitespace_runs('{ "a  b" :\n\n"c\\"   d"  }') == [1, 1, 2, 2]
    assert longest_run('["x\\\\"   ,1]') == 3
    assert longest_run('{"a":"' + " " * 40 + '"}') == 0


# ---- config: flag, LLM(), errors that name the key -----------------------------------------------
def test_config_defaults_and_errors_name_the_key():
    assert parse_structured_outputs_config(None) == StructuredOutputsConfig(False, DEFAULT_MAX_WHITESPACE)
    assert DEFAULT_MAX_WHITESPACE == 8
    cfg = parse_structured_outputs_config('{"disable_any_whitespace": true, "backend": "xgrammar"}')
    assert cfg.disable_any_whitespace and cfg.max_whitespace == DEFAULT_MAX_WHITESPACE
    assert parse_structured_outputs_config({"max_whitespace": 0}).max_whitespace == 0
    for bad, key in (('{"max_whitespace": -1}', "structured_outputs_config.max_whitespace"),
                     ('{"max_whitespace": "lots"}', "structured_outputs_config.max_whitespace"),
                     ('{"disable_any_whitespace": "yes"}', "structured_outputs_config.disable_any_whitespace"),
                     ('{"whitespace_pattern": " "}', "structured_outputs_config.whitespace_pattern"),
                     ('{"backend": "outlines"}', "structured_outputs_config.backend"),
                     ("[1]", "structured_outputs_config"), ("{oops", "structured_outputs_config")):
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            EngineArgs(structured_outputs_config=bad)
    with pytest.raises(ValueError, match=r"structured_outputs\.max_whitespace"):
        StructuredOutputsParams(json_object=True, max_whitespace=-2)
    with pytest.raises(ValueError, match=r"structured_outputs\.disable_any_whitespace"):
        StructuredOutputsParams(json_object=True, disable_any_whitespace=1)  # type: ignore[arg-type]


def test_bad_flag_value_is_an_error_naming_the_key(capsys):
    from chatserve.cli import main

    # refused when the options are read, before any model is loaded
    assert main(["serve", "--structured-outputs-config", '{"max_whitespace": -3}']) == 2
    assert "structured_outputs_config.max_whitespace" in capsys.readouterr().err
    assert main(["serve", "--structured-outputs-config", '{"disable_any_whitespaces": true}']) == 2
    assert "structured_outputs_config.disable_any_whitespaces" in capsys.readouterr().err


# ---- the compiled grammars --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def service(smollm_tokenizer):
    svc = GrammarCompilerService(smollm_tokenizer, len(smollm_tokenizer), [smollm_tokenizer.eos_token_id])
    yield svc
    svc.shutdown()


def accepts(service: GrammarCompilerService, spec: StructuredOutputsParams, text: str) -> bool:
    return bool(xgr.GrammarMatcher(service.compile(spec)).accept_string(text))


SCHEMA_KINDS = {
    "json_object": lambda **o: StructuredOutputsParams(json_object=True, **o),
    "json_schema": lambda **o: StructuredOutputsParams(json=CITY_SCHEMA, **o),
}


@pytest.mark.parametrize("kind", sorted(SCHEMA_KINDS))
def test_json_grammars_bound_whitespace_between_tokens_but_not_inside_strings(service, kind):
    make = SCHEMA_KINDS[kind]
    ws = " \n" * 4  # 8 characters: the default's limit
    assert accepts(service, make(), '{' + ws + '"city"' + ws + ':' + ws + '"Paris ' + " " * 30 + '",\n"country": "France"}')
    assert not accepts(service, make(), '{' + ws + ' "city": "Paris", "country": "France"}')  # a run of 9
    assert not accepts(service, make(), '{"city": "Paris",' + "\n" * 9 + '"country": "France"}')
    assert accepts(service, make(max_whitespace=2), '{ "city": "Paris",\n "country": "France"}')
    assert not accepts(service, make(max_whitespace=2), '{"city":   "Paris", "country": "France"}')
    # compact: no whitespace between tokens, separators "," and ":" (so the bare `"` stays legal)
    for compact in (make(disable_any_whitespace=True), make(max_whitespace=0)):
        assert accepts(service, compact, '{"city":"Paris   ","country":"France"}')
        assert not accepts(service, compact, '{"city": "Paris","country":"France"}')
        assert not accepts(service, compact, '{"city":"Paris", "country":"France"}')


def test_the_options_are_in_the_cache_key_so_the_grammar_differs(service):
    base = StructuredOutputsParams(json=CITY_SCHEMA)
    keys = {service.cache_key(base), service.cache_key(StructuredOutputsParams(json=CITY_SCHEMA, max_whitespace=2)),
            service.cache_key(StructuredOutputsParams(json=CITY_SCHEMA, disable_any_whitespace=True))}
    assert len(keys) == 3
    # the request's value equal to the server's default is the same grammar (one compile)
    assert service.cache_key(StructuredOutputsParams(json=CITY_SCHEMA, max_whitespace=8)) == service.cache_key(base)
    assert service.cache_key(StructuredOutputsParams(json=CITY_SCHEMA, max_whitespace=0)) == \
        service.cache_key(StructuredOutputsParams(json=CITY_SCHEMA, disable_any_whitespace=True))
    # grammars that are not JSON do not depend on it
    assert service.cache_key(StructuredOutputsParams(regex="a+", max_whitespace=1)) == \
        service.cache_key(StructuredOutputsParams(regex="a+"))
    before = service.stats().misses
    service.compile(StructuredOutputsParams(json=CITY_SCHEMA, max_whitespace=3))
    service.compile(StructuredOutputsParams(json=CITY_SCHEMA, max_whitespace=4))
    assert service.stats().misses == before + 2


def test_an_engine_config_changes_the_default(smollm_tokenizer):
    compact = GrammarCompilerService(smollm_tokenizer, len(smollm_tokenizer), [smollm_tokenizer.eos_token_id],
                                     config=StructuredOutputsConfig(disable_any_whitespace=True))
    try:
        assert not accepts(compact, StructuredOutputsParams(json_object=True), '{"a": 1}')
        assert accepts(compact, StructuredOutputsParams(json_object=True), '{"a":1}')
        # a request may widen it again
        assert accepts(compact, StructuredOutputsParams(json_object=True, disable_any_whitespace=False), '{"a": 1}')
    finally:
        compact.shutdown()


@pytest.mark.parametrize("fmt", [XLAM, HERMES], ids=lambda f: f.name)
def test_tool_call_arguments_and_structural_tags_are_bounded_too(service, fmt):
    tools = [FunctionTool("get_weather", None, WEATHER_PARAMS)]
    tag = tool_grammar(fmt, tools, ToolChoice("required"))
    assert tag is not None

    def call(args: str) -> str:
        if fmt is XLAM:
            return '<tool_call>[{"name":"get_weather","arguments":' + args + '}]</tool_call>'
        return '<tool_call>\n{"name": "get_weather", "arguments": ' + args + '}\n</tool_call>'

    default = StructuredOutputsParams(structural_tag=tag)
    assert accepts(service, default, call('{ "city" : "Paris" }'))
    assert not accepts(service, default, call('{' + "\n" * 9 + '"city": "Paris"}'))
    compact = StructuredOutputsParams(structural_tag=tag, disable_any_whitespace=True)
    assert accepts(service, compact, call('{"city":"Paris  "}'))
    assert not accepts(service, compact, call('{"city": "Paris"}'))
    # a tag's own JSON (a response_format json_schema through a structural tag) likewise
    own = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": CITY_SCHEMA}}
    assert not accepts(service, StructuredOutputsParams(structural_tag=own), '{"city":' + " " * 9 + '"a", "country": "b"}')
    assert accepts(service, StructuredOutputsParams(structural_tag=own), '{"city":' + " " * 8 + '"a", "country": "b"}')


# ---- the real model, temperature 1.0, fixed seeds -------------------------------------------------
def sampled(seed: int, spec: StructuredOutputsParams, max_tokens: int = 64) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, structured_outputs=spec)


def token_by_token(llm: LLM, token_ids: list[int]) -> str:
    """The output as the tokens add up (each prefix decoded), so a run split across tokens is one run."""
    tok = llm.get_tokenizer()
    return tok.decode(token_ids, skip_special_tokens=True)


@pytest.mark.parametrize("kind", sorted(SCHEMA_KINDS))
def test_the_default_bound_holds_token_for_token(llm_default, kind):
    specs = {"json_object": StructuredOutputsParams(json_object=True),
             "json_schema": StructuredOutputsParams(json=CITY_SCHEMA)}
    convo = [{"role": "user", "content": SPREAD}]
    outs = llm_default.chat([convo] * len(SEEDS), [sampled(s, specs[kind]) for s in SEEDS])
    for out in outs:
        o = out.outputs[0]
        text = o.text
        for n in range(1, len(o.token_ids) + 1):  # every prefix: the bound never broke on the way
            assert longest_run(token_by_token(llm_default, list(o.token_ids[:n]))) <= DEFAULT_MAX_WHITESPACE, text
        if o.finish_reason == "stop":
            json.loads(text)  # a finished reply parses
        else:
            assert o.finish_reason == "length"


def test_the_per_request_options_hold_token_for_token(llm_default):
    convo = [{"role": "user", "content": SPREAD}]
    for opts, bound in (({"max_whitespace": 1}, 1), ({"disable_any_whitespace": True}, 0)):
        spec = StructuredOutputsParams(json=CITY_SCHEMA, **opts)
        outs = llm_default.chat([convo] * 4, [sampled(s, spec, 48) for s in range(4)])
        for out in outs:
            text = out.outputs[0].text
            assert longest_run(text) <= bound, (opts, text)
    # and the engine compiled one grammar per setting (the cache key holds the options)
    svc = llm_default.engine.structured
    assert svc.cache_key(StructuredOutputsParams(json=CITY_SCHEMA, max_whitespace=1)) != \
        svc.cache_key(StructuredOutputsParams(json=CITY_SCHEMA))


def test_an_engine_wide_compact_config(tiny_model_path):
    llm = LLM(str(tiny_model_path), dtype="float32", num_threads=1, structured_outputs_config={"disable_any_whitespace": True})
    spec = StructuredOutputsParams(json_object=True)
    outs = llm.generate([{"prompt_token_ids": [100 + i, 200, 300]} for i in range(4)],
                        [sampled(s, spec, 40) for s in range(4)])
    for out in outs:  # a random model picks whitespace wherever it is allowed: here it never is
        assert longest_run(out.outputs[0].text) == 0, out.outputs[0].text
    wide = llm.generate([{"prompt_token_ids": [100 + i, 200, 300]} for i in range(4)],
                        [sampled(s, StructuredOutputsParams(json_object=True, max_whitespace=3), 40) for s in range(4)])
    assert all(longest_run(o.outputs[0].text) <= 3 for o in wide)


@pytest.fixture(scope="module")
def tiny_model_path(tmp_path_factory):
    """A tiny random Llama with the real SmolLM2 tokenizer: it picks whitespace wherever the grammar lets it."""
    from chatserve.models.loader import load_tokenizer, resolve_model
    from tests.conftest import write_tiny_checkpoint

    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny-ws"), "llama", load_tokenizer(resolve_model(None)))


# ---- honest truncation: parsing ---------------------------------------------------------------------
@pytest.mark.parametrize(("fmt", "text", "calls"), [
    (XLAM, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Par', [("get_weather", '{"city": "Par', False)]),
    (XLAM, '<tool_call>[{"name": "get_ti', [("get_time", "", False)]),
    (XLAM, '<tool_call>[{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "get_time", "arguments": {"ci',
     [("get_weather", '{"city": "Rome"}', True), ("get_time", '{"ci', False)]),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"city": "R', [("get_time", '{"city": "R', False)]),
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"city": "R"}}\n</tool_call>\n<tool_call>\n{"name": "get_we',
     [("get_time", '{"city": "R"}', True), ("get_weather", "", False)]),
])
def test_a_cut_block_is_partial_calls_not_markup(fmt, text, calls):
    names = ["get_weather", "get_time"]
    parsed = parse_tool_calls(text, fmt, names, truncated=True)
    assert parsed.content is None
    assert [(c.name, c.arguments, c.complete) for c in parsed.tool_calls] == calls
    # not cut by the budget (a stop string, an EOS): a call that had started streaming (its name and
    # arguments' "{" were out) stays a call as far as it got; a block no call started from stays text
    plain = parse_tool_calls(text, fmt, names)
    assert [(c.name, c.arguments) for c in plain.tool_calls] == [(n, a) for n, a, _ in calls[:len(plain.tool_calls)]]
    assert plain.tool_calls or "<tool_call>" in (plain.content or "")


def test_a_cut_block_whose_function_cannot_be_named_stays_text():
    text = '<tool_call>[{"name": "get_'
    assert parse_tool_calls(text, XLAM, ["get_weather", "get_time"], truncated=True).content == text
    assert [c.name for c in parse_tool_calls(text, XLAM, ["get_time"], truncated=True).tool_calls] == ["get_time"]


# ---- honest truncation: the engine and the live server ---------------------------------------------
def test_llm_chat_returns_a_cut_forced_call_partial(llm_default):
    outs = llm_default.chat(ASK, SamplingParams(temperature=1.0, seed=3, max_tokens=12), tools=[WEATHER, TIME],
                            tool_choice={"type": "function", "function": {"name": "get_time"}})
    o = outs[0].outputs[0]
    assert o.finish_reason == "length"
    (call,) = o.tool_calls
    assert call.name == "get_time" and not call.complete


@pytest.fixture(scope="module")
def server(shared_server: ServerProcess) -> ServerProcess:
    return shared_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def post(server: ServerProcess, body: dict[str, Any]) -> httpx.Response:
    return HTTP.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=300,
                      json={"model": MODEL, "messages": ASK, **body})


def test_unknown_structured_outputs_option_is_a_400_naming_it(server):
    for so, param in (({"json_object": True, "disable_any_whitespaces": True}, "structured_outputs.disable_any_whitespaces"),
                      ({"max_whitespace": -1}, "structured_outputs.max_whitespace"),
                      ({"disable_any_whitespace": "yes"}, "structured_outputs.disable_any_whitespace"),
                      ({"whitespace_pattern": r"[ ]?"}, "structured_outputs.whitespace_pattern")):
        r = post(server, {"structured_outputs": so, "max_tokens": 4})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and err["type"] == "invalid_request_error", err
        assert param.split(".")[-1] in err["message"]
    # vLLM's neutral values are accepted
    ok = post(server, {"structured_outputs": {"json_object": True, "disable_fallback": False}, "max_tokens": 4})
    assert ok.status_code == 200, ok.text


def test_per_request_disable_any_whitespace_is_honoured_over_http(server):
    for fmt in ({"type": "json_object"}, {"type": "json_schema", "json_schema": {"name": "c", "schema": CITY_SCHEMA}}):
        for seed in range(3):
            r = post(server, {"messages": [{"role": "user", "content": SPREAD}], "response_format": fmt, "seed": seed,
                              "temperature": 1.0, "max_tokens": 40, "structured_outputs": {"disable_any_whitespace": True}})
            assert r.status_code == 200, r.text
            text = r.json()["choices"][0]["message"]["content"]
            assert longest_run(text) == 0, text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_a_cut_forced_call_reaches_the_openai_sdk_as_a_tool_call(client, tool_choice):
    name = "get_weather" if tool_choice == "required" else "get_time"
    tools = [WEATHER] if tool_choice == "required" else [WEATHER, TIME]
    kwargs: dict[str, Any] = {"model": MODEL, "messages": ASK, "tools": tools, "tool_choice": tool_choice,
                              "temperature": 1.0, "seed": 7, "max_tokens": 10}
    r = client.chat.completions.create(**kwargs)
    choice = r.choices[0]
    assert choice.finish_reason == "length", choice
    assert choice.message.content is None, choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == name
    assert "<tool_call>" not in call.function.arguments and "</tool_call>" not in call.function.arguments

    calls: dict[int, dict[str, Any]] = {}
    finish, text = None, ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            text += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": None, "arguments": ""})
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
    assert finish == "length" and text == ""
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    # the same seed: the same partial arguments as the body
    assert (calls[0]["name"], calls[0]["arguments"]) == (name, call.function.arguments)


def test_a_cut_forced_call_in_the_responses_api_is_an_incomplete_item(client):
    resp = client.responses.create(
        model=MODEL, input="What is the time in Rome? Use the tool.", max_output_tokens=10, temperature=1.0,
        tools=[{"type": "function", "name": "get_time", "description": "Get the time in a city",
                "parameters": WEATHER_PARAMS}], tool_choice={"type": "function", "name": "get_time"})
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    (item,) = resp.output
    assert item.type == "function_call" and item.name == "get_time" and item.status == "incomplete"


class City(BaseModel):
    city: str
    country: str


def test_a_cut_json_reply_keeps_finish_reason_length(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": SPREAD}], temperature=1.0,
                                       seed=1, max_tokens=5, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "length"
    with pytest.raises(openai.LengthFinishReasonError):  # the SDK's own answer to a cut structured reply
        client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": SPREAD}], temperature=1.0,
                                      seed=1, max_tokens=5, response_format=City)
