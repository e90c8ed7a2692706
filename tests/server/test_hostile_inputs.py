"""Hostile request bodies (issue 51): every one is a 4xx in its API's own error shape, never a 500 or an
exception that escapes the app, and none holds the event loop.

The app runs in-process over `FakeEngine` (the real tokenizer, input processor and templates) behind
httpx's ASGITransport, which re-raises any exception the app lets escape (what uvicorn logs as
"Exception in ASGI application" before it drops the connection): a test here fails on one.

Two parts:
- **500s that became 4xx**: JSON schemas nested ~150 deep on every route that takes one, JSON sent
  as a deeply nested string (`guided_json`, a tool call's `arguments`), arguments that decode to a
  lone surrogate, `chat_template_kwargs` keys `self` / `tokenizer`, 4,300-digit and > 2^31-1
  counts, NaN inside free-form objects, and a reply the model is made to write with a lone
  surrogate escape (streamed, whole, and read back from the Responses store).
- **Floods**: each is answered while a short request is served meanwhile, checked by order through a
  handshake (the flood's work waits in its worker thread until the test has seen the short request
  answered; on the event loop that wait would block the short request, and the order flips), never by
  a clock. Plus the structural guarantees behind them: every list of every request model fails fast,
  limited lists are counted before their items are read, `check_tools` is linear, grammar compiles
  time out, are cancelled when nobody waits, and count against the queue limit.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from typing import Any

import httpx
import pytest

from chatserve.server import ServerSettings, create_app
from chatserve.server.chat import protocol as chat_protocol
from chatserve.server.json_checks import MAX_DEPTH, JSONLimitError, check_value, escape_surrogates, load_text, text_depth
from chatserve.sessions import InMemorySessionStore
from tests.helpers.asgi import app_client
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

CHAT = {"messages": [{"role": "user", "content": "Hi"}]}
MSG = {"model": "fake-model", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}
HUGE = int("9" * 4300)  # the longest integer the JSON parser takes; str() of it plus anything overflows
NESTED_TEXT = "[" * 5000 + "]" * 5000  # json.loads recurses past Python's limit on it


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(smollm_tokenizer) -> FakeEngine:
    return FakeEngine(smollm_tokenizer, max_model_len=1024)


def deep_schema(levels: int = 75) -> dict[str, Any]:
    """An object schema with `levels` levels of properties (2 JSON levels each: ~150 deep, under the
    body parser's limit of 200, far over what jsonschema's recursive check survives)."""
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def tool(parameters: Any, name: str = "f") -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


def assistant_call(arguments: str) -> list[dict[str, Any]]:
    """A conversation whose assistant turn called a tool with these `arguments`, and its result."""
    return [{"role": "user", "content": "x"},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function",
                                                   "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "r"}]


def assert_anthropic_error(resp: httpx.Response, status: int, field: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    assert body["type"] == "error" and set(body) == {"type", "error", "request_id"}, body
    assert body["error"]["type"] == "invalid_request_error", body
    if field is not None:
        assert body["error"]["message"].startswith(field), body
    return body["error"]


async def post_raw(client: httpx.AsyncClient, path: str, text: str) -> httpx.Response:
    return await client.post(path, content=text.encode(), headers={"content-type": "application/json"})


# ---- schemas nested ~150 deep: jsonschema's RecursionError was a 500 on every route ------------------
DEEP_OPENAI = [
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": deep_schema()}}}, "response_format.json_schema.schema"),
    ("/v1/chat/completions", {**CHAT, "tools": [tool(deep_schema())]}, "tools.0.function.parameters"),
    ("/v1/chat/completions", {**CHAT, "tools": [tool(deep_schema())], "tool_choice": "none"},
     "tools.0.function.parameters"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"json": deep_schema()}}, "structured_outputs.json"),
    ("/v1/chat/completions", {**CHAT, "guided_json": deep_schema()}, "guided_json"),
    ("/v1/completions", {"prompt": "x", "guided_json": deep_schema()}, "guided_json"),
    ("/v1/responses", {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": deep_schema()}]},
     "tools.0.parameters"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "x",
                                                         "schema": deep_schema()}}}, "text.format.schema"),
    # JSON sent as a string, nested past json.loads' recursion
    ("/v1/chat/completions", {**CHAT, "guided_json": NESTED_TEXT}, "guided_json"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"json": NESTED_TEXT}}, "structured_outputs.json"),
    ("/v1/chat/completions", {"messages": assistant_call(NESTED_TEXT)}, "messages.1.tool_calls.0.function.arguments"),
    ("/v1/responses", {"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": NESTED_TEXT},
                                 {"type": "function_call_output", "call_id": "c1", "output": "r"}]},
     "input.0.arguments"),
]


@pytest.mark.parametrize(("path", "payload", "param"), DEEP_OPENAI,
                         ids=[f"{p}-{param}" for p, _, param in DEEP_OPENAI])
async def test_deep_schemas_and_nested_json_text_are_400_naming_the_field(engine, path, payload, param) -> None:
    async with app_client(engine) as client:
        resp = await client.post(path, json=payload)
        after = await client.post("/v1/chat/completions", json=CHAT)
    assert_error(resp, 400, param=param, contains="deeper than")
    assert engine.requests[:-1] == [] and after.status_code == 200  # nothing queued; the server serves on


async def test_deep_schema_in_a_session_turn_is_400(engine) -> None:
    async with app_client(engine, InMemorySessionStore()) as client:
        sid = (await client.post("/v1/sessions", json={})).json()["id"]
        resp = await client.post(f"/v1/sessions/{sid}/messages", json={
            "content": "x", "stream": False, "tools": [tool(deep_schema())]})
        turn = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "x", "stream": False})
    assert_error(resp, 400, param="tools.0.function.parameters", contains="deeper than")
    assert turn.status_code == 200  # the refused turn took no lock and left nothing behind


@pytest.mark.parametrize(("extra", "field"), [
    ({"tools": [{"name": "f", "input_schema": deep_schema()}]}, "tools.0.input_schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": deep_schema()}}}, "output_config.format.schema"),
    ({"output_format": {"type": "json_schema", "schema": deep_schema()}}, "output_format.schema"),
])
async def test_deep_schemas_on_the_messages_api_are_400_in_anthropics_shape(engine, extra, field) -> None:
    async with app_client(engine) as client:
        resp = await client.post("/v1/messages", json={**MSG, **extra})
    err = assert_anthropic_error(resp, 400, field)
    assert "deeper than" in err["message"] and engine.requests == []


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_grammar": ""}, "guided_grammar"),
    ({"guided_choice": [""]}, "guided_choice"),
    ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
    ({"structured_outputs": {"choice": ["a", ""]}}, "structured_outputs.choice"),
])
async def test_constraints_the_engine_refuses_are_400_naming_the_field(engine, extra, param) -> None:
    async with app_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json={**CHAT, **extra})
    err = assert_error(resp, 400, param=param, contains="must")
    assert err["message"].startswith(f"{param}: must"), err
    assert engine.requests == []


# ---- decoded arguments with a lone surrogate: the tokenizer's TypeError was a 500 -----------------------
async def test_arguments_that_decode_to_a_lone_surrogate_are_400(engine) -> None:
    arguments = '{"city": "\\ud800"}'
    async with app_client(engine) as client:
        chat = await client.post("/v1/chat/completions", json={"messages": assistant_call(arguments)})
        responses = await client.post("/v1/responses", json={"input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": arguments},
            {"type": "function_call_output", "call_id": "c1", "output": "r"}]})
        guided = await client.post("/v1/chat/completions", json={**CHAT, "guided_json": '{"enum": ["\\udc00"]}'})
    assert_error(chat, 400, param="messages.1.tool_calls.0.function.arguments", contains="surrogate")
    assert_error(responses, 400, param="input.0.arguments", contains="surrogate")
    assert_error(guided, 400, param="guided_json", contains="surrogate")
    assert engine.requests == []


async def test_arguments_that_are_not_json_are_still_rendered_as_text(engine) -> None:
    async with app_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": assistant_call("{broken: json")})
    assert resp.status_code == 200, resp.text


# ---- chat_template_kwargs that name a parameter of the renderer ------------------------------------------
@pytest.mark.parametrize("key", ["self", "tokenizer", "conversations", "sanitize_control_tokens"])
async def test_template_kwargs_naming_the_renderers_parameters_are_400(engine, key) -> None:
    async with app_client(engine) as client:
        resp = await client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {key: 1}})
    assert_error(resp, 400, param="chat_template_kwargs", contains=repr(key))


def test_reserved_template_kwargs_cover_every_parameter_of_the_rendering_path() -> None:
    """A transformers upgrade that adds a parameter to apply_chat_template shows up here, not as a 500."""
    from transformers import PreTrainedTokenizerBase
    from transformers.utils import chat_template_utils

    from chatserve.engine import input_processor
    from chatserve.models import chat_template
    from chatserve.models.saved_tokenizer import SavedTokenizer

    functions = [PreTrainedTokenizerBase.apply_chat_template, chat_template_utils.render_jinja_template,
                 input_processor.apply_chat_template, input_processor.InputProcessor.render_chat,
                 SavedTokenizer.apply_chat_template, chat_template.render]
    names = {name for fn in functions for name, p in inspect.signature(fn).parameters.items()
             if p.kind is not inspect.Parameter.VAR_KEYWORD}
    assert names <= chat_protocol.RESERVED_TEMPLATE_KWARGS, names - chat_protocol.RESERVED_TEMPLATE_KWARGS


# ---- counts past int32: a 4,300-digit number could not even be printed in the error -----------------------
COUNTS = [
    ("/v1/chat/completions", {**CHAT, "max_tokens": HUGE}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": HUGE}, "max_completion_tokens"),
    ("/v1/chat/completions", {**CHAT, "n": HUGE}, "n"),
    ("/v1/chat/completions", {**CHAT, "min_tokens": HUGE}, "min_tokens"),
    ("/v1/chat/completions", {**CHAT, "stop_token_ids": [HUGE]}, "stop_token_ids.0"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 2**31}, "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2**31}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": HUGE}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
    ("/v1/completions", {"prompt": [1, HUGE]}, "prompt"),
    ("/v1/responses", {"input": "x", "max_output_tokens": HUGE}, "max_output_tokens"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 2**31}, "max_output_tokens"),
]


@pytest.mark.parametrize(("path", "payload", "param"), COUNTS, ids=[f"{p}-{param}-{len(str(json.dumps(b)))}"
                                                                    for p, b, param in COUNTS])
async def test_counts_past_int32_are_400_in_every_api(engine, path, payload, param) -> None:
    async with app_client(engine) as client:
        resp = await client.post(path, json=payload)
    err = assert_error(resp, 400)
    assert err["param"] is not None and err["param"].startswith(param), err
    assert "9999" not in err["message"] and engine.requests == []


async def test_counts_past_int32_in_a_session_and_on_the_messages_api(engine) -> None:
    async with app_client(engine, InMemorySessionStore()) as client:
        sid = (await client.post("/v1/sessions", json={})).json()["id"]
        turn = await client.post(f"/v1/sessions/{sid}/messages", json={"content": "x", "max_tokens": HUGE})
        defaults = await client.post("/v1/sessions", json={"defaults": {"max_tokens": HUGE}})
        fork = await client.post(f"/v1/sessions/{sid}/fork", json={"keep_turns": HUGE})
        messages = await client.post("/v1/messages", json={**MSG, "max_tokens": HUGE})
    assert_error(turn, 400, param="max_tokens")
    assert_error(defaults, 400, param="defaults.max_tokens")
    assert_error(fork, 400, param="keep_turns")
    assert_anthropic_error(messages, 400, "max_tokens")


# ---- NaN inside free-form objects: refused at input, not a reply that cannot be encoded ------------------
async def test_nan_inside_responses_tool_parameters_with_tool_choice_none_is_400(engine) -> None:
    text = ('{"input": "x", "tool_choice": "none", "tools": [{"type": "function", "name": "f", '
            '"parameters": {"type": "object", "default": NaN}}]}')
    async with app_client(engine) as client:
        resp = await post_raw(client, "/v1/responses", text)
        listed = await client.get("/v1/responses/nope")
    assert_error(resp, 400, contains="NaN")
    assert engine.requests == [] and listed.status_code == 404


@pytest.mark.parametrize(("path", "text", "contains"), [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", '
                             '"function": {"name": "f", "parameters": {"x": Infinity}}}], "tool_choice": "none"}',
     "holds Infinity"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"v": NaN}}',
     "not valid JSON"),
    ("/v1/sessions", '{"metadata": {"score": NaN}}', "not valid JSON"),
])
async def test_nan_anywhere_in_a_body_is_400(engine, path, text, contains) -> None:
    async with app_client(engine, InMemorySessionStore()) as client:
        resp = await post_raw(client, path, text)
        listed = await client.get("/v1/sessions")
    assert_error(resp, 400, contains=contains)
    assert listed.status_code == 200 and listed.json()["data"] == []


async def test_messages_api_refuses_nan_in_tool_input(engine) -> None:
    text = json.dumps({**MSG, "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1.5}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "r"}]}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}}]}).replace("1.5", "NaN")
    async with app_client(engine) as client:
        resp = await post_raw(client, "/v1/messages", text)
    assert_anthropic_error(resp, 400)


# ---- a reply forced to hold a lone surrogate: escaped on the way out (streamed, whole, stored) ------------
SURROGATE_CALL = '<tool_call>[{"name": "f", "arguments": {"a": "\\ud800"}}]</tool_call>'
F_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


@pytest.fixture
def surrogate_engine(smollm_tokenizer) -> FakeEngine:
    return FakeEngine(smollm_tokenizer, reply=SURROGATE_CALL, max_model_len=1024)


def _no_surrogates(text: str) -> str:
    text.encode("utf-8")  # would raise on a raw surrogate
    return text


async def test_a_reply_with_a_lone_surrogate_is_escaped_on_chat(surrogate_engine) -> None:
    body = {**CHAT, "tools": [tool(F_SCHEMA)]}
    async with app_client(surrogate_engine) as client:
        whole = await client.post("/v1/chat/completions", json=body)
        stream = await client.post("/v1/chat/completions", json={**body, "stream": True})
    assert whole.status_code == 200, whole.text
    assert stream.status_code == 200 and "[DONE]" in _no_surrogates(stream.text)
    call = whole.json()["choices"][0]["message"]["tool_calls"][0]
    assert json.loads(call["function"]["arguments"]) == {"a": "\ud800"}  # the escape the model wrote, read back


async def test_a_reply_with_a_lone_surrogate_is_stored_and_read_back_on_responses(surrogate_engine) -> None:
    body = {"input": "x", "tools": [{"type": "function", "name": "f", "parameters": F_SCHEMA}]}
    async with app_client(surrogate_engine) as client:
        created = await client.post("/v1/responses", json=body)
        assert created.status_code == 200, created.text
        rid = created.json()["id"]
        got = await client.get(f"/v1/responses/{rid}")
        stream = await client.post("/v1/responses", json={**body, "stream": True})
        items = await client.get(f"/v1/responses/{rid}/input_items")
    assert got.status_code == 200 and got.json()["output"] == created.json()["output"]
    assert [i["type"] for i in got.json()["output"]] == ["function_call"]
    assert stream.status_code == 200 and "response.completed" in _no_surrogates(stream.text)
    assert items.status_code == 200


async def test_a_reply_with_a_lone_surrogate_is_escaped_on_messages(surrogate_engine) -> None:
    body = {**MSG, "max_tokens": 256, "tools": [{"name": "f", "input_schema": F_SCHEMA}]}
    async with app_client(surrogate_engine) as client:
        whole = await client.post("/v1/messages", json=body)
        stream = await client.post("/v1/messages", json={**body, "stream": True})
    assert whole.status_code == 200, whole.text
    assert [(b["type"], b["input"]) for b in whole.json()["content"]] == [("tool_use", {"a": "\ud800"})]
    assert stream.status_code == 200 and "message_stop" in _no_surrogates(stream.text)


async def test_a_reply_with_a_lone_surrogate_is_stored_in_a_session(surrogate_engine) -> None:
    async with app_client(surrogate_engine, InMemorySessionStore()) as client:
        sid = (await client.post("/v1/sessions", json={})).json()["id"]
        turn = await client.post(f"/v1/sessions/{sid}/messages", json={
            "content": "x", "stream": False, "tools": [tool(F_SCHEMA)]})
        got = await client.get(f"/v1/sessions/{sid}")
    assert turn.status_code == 200, turn.text
    assert got.status_code == 200, got.text


# ---- the JSON bounds themselves ---------------------------------------------------------------------------
def test_text_depth_skips_strings_and_escapes() -> None:
    assert text_depth('{"a": [1, {"b": "[[[[[[["}]}') == 3
    assert text_depth('["\\"[[[[", "]]]"]') == 1
    assert text_depth("not json at all") == 0
    assert text_depth(NESTED_TEXT) == 5000


def test_load_text_and_check_value_bounds() -> None:
    ok = "[" * MAX_DEPTH + "]" * MAX_DEPTH
    assert load_text(ok) is not None
    for bad in ("[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1), '{"a": NaN}', '["\\ud800"]', '{"\\udfff": 1}'):
        with pytest.raises(JSONLimitError):
            load_text(bad)
    with pytest.raises(json.JSONDecodeError):
        load_text("{nope")
    with pytest.raises(JSONLimitError):
        check_value({"a": [float("inf")]})
    deep: Any = 1
    for _ in range(100_000):  # no recursion: a value far deeper than the stack is refused, not a crash
        deep = [deep]
    with pytest.raises(JSONLimitError):
        check_value(deep)
    assert escape_surrogates('{"a":"x\ud800y"}') == '{"a":"x\\ud800y"}'


# ---- structural guarantees behind the flood fixes -----------------------------------------------------------
def _request_models() -> list[type]:
    from chatserve.server.anthropic import protocol as anthropic_protocol
    from chatserve.server.openai import protocol as openai_protocol
    from chatserve.server.responses import protocol as responses_protocol
    from chatserve.server.sessions import protocol as sessions_protocol

    return [openai_protocol.ChatCompletionRequest, openai_protocol.CompletionRequest, responses_protocol.ResponsesRequest,
            sessions_protocol.SessionMessageRequest, sessions_protocol.SessionRegenerateRequest,
            sessions_protocol.CreateSessionRequest, sessions_protocol.UpdateSessionRequest,
            sessions_protocol.ForkSessionRequest, anthropic_protocol.MessagesRequest, anthropic_protocol.CountTokensRequest]


def _core_nodes(node: Any) -> Any:
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _core_nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _core_nodes(value)


@pytest.mark.parametrize("model", _request_models(), ids=lambda m: m.__name__)
def test_every_list_of_every_request_model_fails_fast(model) -> None:
    """A list of 700k bad items is one error, not 700k (building them took seconds of event-loop time)."""
    lists = [n for n in _core_nodes(model.__pydantic_core_schema__) if n.get("type") == "list"]
    assert all(n.get("fail_fast") for n in lists), [n for n in lists if not n.get("fail_fast")]
    for n in _core_nodes(model.__pydantic_core_schema__):  # no dict whose values can fail one by one
        if n.get("type") == "dict":
            values = n.get("values_schema", {})
            assert values.get("type") == "any" or model.__name__ == "ResponsesRequest", n


def extra_errors(message: str) -> int:
    """N of a 400's "(and N more errors)"."""
    found = re.search(r"\(and (\d+) more errors?\)", message)
    return int(found.group(1)) if found else 0


async def test_a_flood_of_invalid_list_items_is_one_error(engine) -> None:
    ints = ",".join(["1"] * 700_000)
    async with app_client(engine, max_body_bytes=8 * 1024 * 1024) as client:
        bad = await post_raw(client, "/v1/chat/completions", '{"messages": [{"role": "user", "content": "x"}], '
                                                             '"stop": [' + ints + "]}")
        choice = await post_raw(client, "/v1/completions", '{"prompt": "x", "guided_choice": [' + ints + "]}")
        many = await post_raw(client, "/v1/chat/completions", '{"messages": [' + ints + "]}")
        anthropic = await post_raw(client, "/v1/messages", json.dumps(MSG)[:-1] + ', "stop_sequences": [' + ints + "]}")
        valid = await client.post("/v1/chat/completions", json={**CHAT, "stop_token_ids": list(range(300))})
        tools = await client.post("/v1/chat/completions", json={**CHAT, "tools": [tool(None, f"t{i}") for i in range(1025)]})
        metadata = await client.post("/v1/responses", json={"input": "x", "metadata": {str(i): "x" * 600 for i in range(10_000)}})
        words = await client.post("/v1/completions", json={"prompt": "x", "bad_words": [f"w{i}" for i in range(100_000)]})
    for resp in (bad, choice):  # the first bad item ended the list's validation (one error per union member)
        assert extra_errors(assert_error(resp, 400)["message"]) <= 2, resp.text
    assert_error(many, 400, param="messages", contains="at most 1024 messages")  # counted before any is read
    assert extra_errors(assert_anthropic_error(anthropic, 400)["message"]) <= 2
    assert_error(valid, 400, param="stop_token_ids", contains="at most 256 stop_token_ids")
    assert_error(tools, 400, param="tools", contains="at most 1024 tools")
    assert_error(metadata, 400, param="metadata", contains="at most 16 keys")
    assert_error(words, 400, param="bad_words", contains="at most 256 bad_words")  # refused before any is tokenised
    assert engine.requests == []


async def test_a_flood_of_unknown_keys_is_one_error(engine) -> None:
    """The Responses API refuses unknown fields (as OpenAI does): the first one, not one error per key."""
    unknown = {f"k{i}": 1 for i in range(100_000)}
    async with app_client(engine, max_body_bytes=8 * 1024 * 1024) as client:
        top = await client.post("/v1/responses", json={"input": "x", **unknown})
        nested = await client.post("/v1/responses", json={"input": "x", "tools": [
            {"type": "function", "name": "f", **unknown}]})
    err = assert_error(top, 400, param="k0", contains="Extra inputs are not permitted")
    assert extra_errors(err["message"]) == 0, err
    err = assert_error(nested, 400, param="tools.0.k0")
    assert extra_errors(err["message"]) == 0, err


async def test_the_list_limits_are_flags(engine) -> None:
    async with app_client(engine, max_tools=2, max_stop_token_ids=1, max_bad_words=2) as client:
        tools = await client.post("/v1/chat/completions", json={**CHAT, "tools": [tool(None, f"t{i}") for i in range(3)]})
        ids = await client.post("/v1/chat/completions", json={**CHAT, "stop_token_ids": [1, 2]})
        words = await client.post("/v1/chat/completions", json={**CHAT, "bad_words": ["a", "b", "c"]})
        long_word = await client.post("/v1/chat/completions", json={**CHAT, "bad_words": ["x" * 257]})
        msg = await client.post("/v1/messages", json={**MSG, "tools": [
            {"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(3)]})
        ok = await client.post("/v1/chat/completions", json={**CHAT, "tools": [tool(None, "a"), tool(None, "b")],
                                                             "stop_token_ids": [7]})
    assert_error(tools, 400, param="tools", contains="at most 2 tools")
    assert_error(ids, 400, param="stop_token_ids", contains="at most 1 stop_token_ids")
    assert_error(words, 400, param="bad_words", contains="at most 2 bad_words")
    assert_error(long_word, 400, param="bad_words.0", contains="at most 256 characters")
    assert_anthropic_error(msg, 400, "tools")
    assert ok.status_code == 200, ok.text
    assert engine.requests[-1].params.stop_token_ids == [7] and engine.requests[-1].params.is_stop_token(7)


class _CountingName(str):
    """A function name that counts the comparisons made with it."""

    compared = 0

    def __eq__(self, other: object) -> bool:
        _CountingName.compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_check_tools_is_linear() -> None:
    """Quadratic duplicate detection held the loop 21 s on a 2 MiB tools list; a set makes it linear."""
    from types import SimpleNamespace

    n = 3000
    tools = [SimpleNamespace(function=SimpleNamespace(name=_CountingName(f"t{i}"))) for i in range(n)]
    _CountingName.compared = 0
    chat_protocol.check_tools(tools, "auto")  # type: ignore[arg-type]
    assert _CountingName.compared < 10 * n, _CountingName.compared
    tools.append(SimpleNamespace(function=SimpleNamespace(name=_CountingName("t5"))))
    with pytest.raises(Exception, match="two tools are named 't5'"):
        chat_protocol.check_tools(tools, "auto")  # type: ignore[arg-type]


# ---- floods answered while a short request is served, by order ---------------------------------------------
class Handshake:
    """Holds a piece of a flood's work in its worker thread until the test has seen the short request
    answered (or 10 s passed: then `timed_out`, which is what happens when the work runs on the event loop,
    since the short request cannot be answered while the loop is blocked)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.timed_out = False
        self.order: list[str] = []

    def wrap(self, fn: Any, when: Any = lambda *a, **k: True) -> Any:
        def held(*args: Any, **kwargs: Any) -> Any:
            if when(*args, **kwargs) and not self.entered.is_set():
                self.entered.set()
                self.timed_out = not self.go.wait(timeout=10)
            return fn(*args, **kwargs)

        return held

    async def run(self, flood: Any, short: Any) -> tuple[httpx.Response, httpx.Response]:
        async def flood_then_note() -> httpx.Response:
            resp = await flood()
            self.order.append("flood")
            return resp

        task = asyncio.ensure_future(flood_then_note())
        while not self.entered.is_set() and not task.done():
            await asyncio.sleep(0.001)
        quick = await short()
        self.order.append("short")
        self.go.set()
        resp = await task
        assert not self.timed_out and self.order == ["short", "flood"], (self.order, self.timed_out)
        return resp, quick


async def test_a_flood_body_is_validated_off_the_event_loop(engine, monkeypatch) -> None:
    from chatserve.server import http_input

    hand = Handshake()
    monkeypatch.setattr(http_input, "parse_model", hand.wrap(http_input.parse_model,
                                                             lambda model, body, *a: len(body) > 1024 * 1024))
    flood = '{"messages": [{"role": "user", "content": "x"}], "stop": [' + ",".join(["1"] * 700_000) + "]}"
    async with app_client(engine, max_body_bytes=4 * 1024 * 1024) as client:
        resp, quick = await hand.run(lambda: post_raw(client, "/v1/chat/completions", flood),
                                     lambda: client.post("/v1/chat/completions", json=CHAT))
    assert extra_errors(assert_error(resp, 400, contains="Input should be a valid string")["message"]) <= 2
    assert quick.status_code == 200 and quick.json()["choices"][0]["message"]["content"]


async def test_a_big_tools_list_is_rendered_off_the_event_loop(engine, monkeypatch) -> None:
    from chatserve.server.openai import routes as openai_routes

    hand = Handshake()
    monkeypatch.setattr(openai_routes, "chat_token_ids", hand.wrap(
        openai_routes.chat_token_ids, lambda ctx, body: body.tools is not None))
    tools = [tool({"type": "object", "properties": {f"p{j}": {"type": "string"} for j in range(20)}}, f"t{i}")
             for i in range(1024)]
    async with app_client(engine, max_body_bytes=8 * 1024 * 1024) as client:
        resp, quick = await hand.run(lambda: client.post("/v1/chat/completions", json={**CHAT, "tools": tools}),
                                     lambda: client.post("/v1/chat/completions", json={**CHAT, "stream": True}))
    assert quick.status_code == 200 and "[DONE]" in quick.text
    assert resp.status_code in (200, 400), resp.text  # served, or a prompt over the context: answered either way


async def test_tokenizing_and_schema_checks_run_off_the_event_loop(engine, monkeypatch) -> None:
    from chatserve.server import pipeline

    hand = Handshake()
    monkeypatch.setattr(pipeline, "_checked", hand.wrap(
        pipeline._checked, lambda ctx, spec, names: isinstance(spec.prompts[0], str) and len(spec.prompts[0]) > 1000))
    async with app_client(engine) as client:
        resp, quick = await hand.run(
            lambda: client.post("/v1/completions", json={"prompt": "word " * 200_000, "guided_json": {"type": "object"}}),
            lambda: client.post("/v1/chat/completions", json=CHAT))
    assert_error(resp, 400, param="prompt", code="context_length_exceeded")
    assert quick.status_code == 200


@pytest.mark.parametrize("route", ["messages", "responses", "sessions"])
async def test_every_api_renders_its_prompt_off_the_event_loop(engine, monkeypatch, route) -> None:
    from chatserve.server.anthropic import routes as anthropic_routes
    from chatserve.server.responses import routes as responses_routes
    from chatserve.server.sessions import routes as sessions_routes

    hand = Handshake()
    long = "word " * 5000
    async with app_client(engine, InMemorySessionStore()) as client:
        if route == "messages":
            monkeypatch.setattr(anthropic_routes, "render", hand.wrap(anthropic_routes.render))
            flood = lambda: client.post("/v1/messages", json={**MSG, "messages": [{"role": "user", "content": long}]})  # noqa: E731
        elif route == "responses":
            monkeypatch.setattr(responses_routes, "chat_prompt_ids", hand.wrap(responses_routes.chat_prompt_ids))
            flood = lambda: client.post("/v1/responses", json={"input": long})  # noqa: E731
        else:
            sid = (await client.post("/v1/sessions", json={})).json()["id"]
            monkeypatch.setattr(sessions_routes, "first_turn_ids", hand.wrap(sessions_routes.first_turn_ids))
            flood = lambda: client.post(f"/v1/sessions/{sid}/messages", json={"content": long, "stream": False})  # noqa: E731
        resp, quick = await hand.run(flood, lambda: client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}))
    assert quick.status_code == 200
    assert 400 <= resp.status_code < 500  # the prompt is over the context: refused, once the flood was let go


# ---- grammar compiles: a time limit, cancelled when nobody waits, counted by the queue limit -----------------
def compiling_engine(tokenizer: Any, **kwargs: Any) -> FakeEngine:
    """A FakeEngine (the real engine's grammar check and compiler service) compiling on one thread, so one
    slow compile keeps the next one queued."""
    return FakeEngine(tokenizer, grammar_compile_threads=1, **kwargs)


def _blocking_compiles(service: Any, monkeypatch: Any, match: str) -> tuple[threading.Event, list[str]]:
    """Compiles of specs whose text holds `match` wait for the returned event; every compile is listed."""
    release, compiled = threading.Event(), []
    real = service._compile_uncached

    def compile_(spec: Any) -> Any:
        compiled.append(spec.spec)
        if match in spec.spec:
            release.wait(timeout=60)
        return real(spec)

    monkeypatch.setattr(service, "_compile_uncached", compile_)
    return release, compiled


async def test_a_grammar_that_compiles_too_long_is_400_naming_the_field(smollm_tokenizer, monkeypatch) -> None:
    engine = compiling_engine(smollm_tokenizer, max_model_len=1024)
    release, _ = _blocking_compiles(engine.structured, monkeypatch, "slow")
    try:
        async with app_client(engine, grammar_compile_timeout_s=0.2) as client:
            slow = await client.post("/v1/chat/completions", json={**CHAT, "response_format": {
                "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "title": "slow"}}}})
            queued = await client.post("/v1/chat/completions", json={**CHAT, "guided_regex": "[a-z]{1,20000}"})
            release.set()
            while engine.structured.pending():
                await asyncio.sleep(0.01)
            again = await client.post("/v1/chat/completions", json={**CHAT, "guided_regex": "[a-z]{1,5}"})
            bad = await client.post("/v1/chat/completions", json={**CHAT, "guided_regex": "(unclosed"})
    finally:
        release.set()
        engine.structured.shutdown()
    assert_error(slow, 400, param="response_format.json_schema.schema", code="grammar_timeout",
                 contains="did not compile within 0.2 s")
    # the one compile thread was still busy with the slow grammar: the next one never started (503, retry)
    assert_error(queued, 503, param="guided_regex", code="grammar_compiler_busy")
    assert queued.headers["retry-after"] == "1"
    assert again.status_code == 200, again.text
    assert_error(bad, 400, param="guided_regex", code="invalid_grammar")
    assert len(engine.requests) == 1


async def test_a_queued_compile_nobody_waits_for_is_cancelled(smollm_tokenizer, monkeypatch) -> None:
    from chatserve.sampling_params import SamplingParams, StructuredOutputsParams

    engine = compiling_engine(smollm_tokenizer)
    service = engine.structured
    release, compiled = _blocking_compiles(service, monkeypatch, "blocker")
    try:
        blocker = asyncio.ensure_future(engine.check_structured_outputs(
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="blocker"))))
        while not compiled:
            await asyncio.sleep(0.001)
        waiting = asyncio.ensure_future(engine.check_structured_outputs(
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="queued-[0-9]"))))
        while service.pending() < 2:
            await asyncio.sleep(0.001)
        waiting.cancel()  # its client left
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert service.pending() == 1  # the queued compile is gone
        release.set()
        await blocker
    finally:
        release.set()
        service.shutdown()
    assert compiled == ["blocker"]  # the cancelled one never ran
    assert service.stats().cached == 1


async def test_a_client_that_leaves_while_its_grammar_compiles_ends_the_wait(engine) -> None:
    """Driven over raw ASGI: the client disconnects (receive() says so) while its request waits for
    its grammar; the wait is cancelled, nothing is queued, and the request is not counted any more."""
    app = create_app(engine, None, ServerSettings(serve_web=False), None)
    engine.structured_gate = asyncio.Event()
    left = asyncio.Event()
    body = json.dumps({**CHAT, "guided_regex": "[a-z]+"}).encode()
    sent: list[dict[str, Any]] = []
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop(0)
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions", "query_string": b"",
             "root_path": "", "headers": [(b"host", b"test"), (b"content-type", b"application/json"),
                                          (b"content-length", str(len(body)).encode())],
             "client": ("127.0.0.1", 1), "server": ("test", 80)}
    task = asyncio.ensure_future(app(scope, receive, send))
    while not engine.checked_structured:
        await asyncio.sleep(0.001)
    ctx = app.state.ctx
    assert ctx.preparing == 1 and ctx.num_live_requests == 1  # counted by the queue limit meanwhile
    left.set()
    await task
    assert engine.structured_cancelled == 1 and engine.requests == [] and ctx.preparing == 0
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]


async def test_requests_waiting_for_their_grammar_count_against_the_queue_limit(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, max_num_seqs=1)
    engine.structured_gate = asyncio.Event()
    async with app_client(engine, max_queue_len=1) as client:
        waiting = [asyncio.ensure_future(client.post("/v1/chat/completions", json={**CHAT, "guided_regex": f"[a-z]{{{i}}}"}))
                   for i in (1, 2)]
        while len(engine.checked_structured) < 2:
            await asyncio.sleep(0.001)
        shed = await client.post("/v1/chat/completions", json=CHAT)
        engine.structured_gate.set()
        done = await asyncio.gather(*waiting)
    assert_error(shed, 503, code="queue_full")
    assert [r.status_code for r in done] == [200, 200]
    assert engine.structured_timeouts == [10.0, 10.0]  # --grammar-compile-timeout-s reaches the engine
