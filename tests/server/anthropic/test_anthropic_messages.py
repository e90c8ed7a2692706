"""The Messages API's mechanisms, in-process over the scripted engine (tests/helpers/fake_engine.py):
what prompt a body becomes (the billing header gone, inline system turns in place, blocks joined as
strings, deferred tools, a prefill continued), the cache_control leases and salt the engine is
handed, the stream's framing and stop reasons, usage as Anthropic counts it, and every bad body
answered 4xx in Anthropic's shape naming the field. The real clients (the anthropic SDK, Claude
Code, ...) against a real server are tests/clients/test_client_compat_anthropic.py's.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from chatserve.core.cache_lease import CacheLease
from chatserve.server.anthropic.events import stop_reason
from chatserve.server.anthropic.prompt import BLOCK_SEPARATOR, NOT_TEXT_PLACEHOLDER, fold_inline_system, render
from chatserve.server.anthropic.protocol import MessagesRequest
from tests.helpers.asgi import app_client
from tests.helpers.fake_engine import FakeEngine

REPLY = "Hello there, friend."
CALL = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
MODEL = "fake-model"
WEATHER = {"name": "get_weather", "description": "Weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HEADERS = {"anthropic-version": "2023-06-01"}

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def engine(smollm_tokenizer) -> FakeEngine:
    return FakeEngine(smollm_tokenizer, reply=REPLY, max_model_len=2048, num_kv_blocks=256)


def body(**fields: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"model": MODEL, "max_tokens": 64, "messages": [{"role": "user", "content": "Hi"}]}
    out.update(fields)
    return out


async def wait_for(predicate: Any) -> None:
    for _ in range(2000):
        if predicate():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("condition not reached")


async def post(engine: FakeEngine, payload: Any, path: str = "/v1/messages", **settings: Any) -> Any:
    async with app_client(engine, **settings) as client:
        return await client.post(path, json=payload, headers=HEADERS)


def sse_frames(text: str) -> list[tuple[str | None, dict[str, Any]]]:
    """(event, data) of every frame; asserts each data frame has its `event:` line."""
    frames = []
    for raw in text.replace("\r\n", "\n").split("\n\n"):
        lines = [line for line in raw.split("\n") if line and not line.startswith(":")]
        if not lines:
            continue
        event = next((line[len("event: "):] for line in lines if line.startswith("event: ")), None)
        data = "".join(line[len("data: "):] for line in lines if line.startswith("data: "))
        assert event is not None, f"a frame without its event line: {raw!r}"
        frames.append((event, json.loads(data)))
    return frames


def prompt_ids(engine: FakeEngine, index: int = -1) -> list[int]:
    return engine.requests[index].prompt.prompt_token_ids


# ---- the prompt -----------------------------------------------------------------------------------
async def test_billing_header_is_dropped_so_a_per_request_hash_keeps_the_prefix(engine) -> None:
    def system(cch: str) -> list[dict[str, Any]]:
        return [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.328; cc_entrypoint=cli; cch={cch};"},
                {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}}]

    for cch in ("1a2b3", "9f8e7"):
        r = await post(engine, body(system=system(cch)))
        assert r.status_code == 200, r.text
    first, second = prompt_ids(engine, 0), prompt_ids(engine, 1)
    assert first == second
    text = engine.tokenizer.decode(first)
    assert "billing" not in text and "cch=" not in text and "You are Claude Code." in text
    r = await post(engine, body(system=system("ab")), path="/v1/messages/count_tokens")
    assert r.json() == {"input_tokens": len(first)}


async def test_inline_system_turn_stays_in_place_and_blocks_equal_their_joined_string(engine) -> None:
    env_blocks = [{"type": "text", "text": "<env>cwd: /repo</env>"}, {"type": "text", "text": "Today is Sunday."}]
    turn1 = [{"role": "user", "content": "first"}, {"role": "system", "content": env_blocks},
             {"role": "user", "content": [{"type": "text", "text": "list files"}]}]
    r = await post(engine, body(system="Be brief.", messages=turn1))
    assert r.status_code == 200, r.text
    reply = r.json()["content"][0]["text"]
    # the next turn sends the inline system message as the joined string, and the user turn as a string
    turn2 = [{"role": "user", "content": "first"},
             {"role": "system", "content": "<env>cwd: /repo</env>" + BLOCK_SEPARATOR + "Today is Sunday."},
             {"role": "user", "content": "list files"}, {"role": "assistant", "content": reply},
             {"role": "user", "content": "and now?"}]
    r = await post(engine, body(system="Be brief.", messages=turn2))
    assert r.status_code == 200, r.text
    first, second = prompt_ids(engine, 0), prompt_ids(engine, 1)
    # the whole first prompt (generation prompt included) is a prefix of the second
    assert second[:len(first)] == first
    text = engine.tokenizer.decode(second)
    assert text.index("Be brief.") < text.index("first") < text.index("<env>") < text.index("list files")


def test_a_template_that_refuses_inline_system_turns_gets_them_folded_in_place(smollm_tokenizer) -> None:
    from chatserve.engine.input_processor import InputProcessor

    strict = ("{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
              "{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
              "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    processor = InputProcessor(smollm_tokenizer, vocab_size=len(smollm_tokenizer), max_model_len=2048,
                               max_model_len_note="", num_kv_blocks=64, block_size=16)
    req = MessagesRequest.model_validate(body(system="S", messages=[
        {"role": "user", "content": "one"}, {"role": "system", "content": "ENV"}, {"role": "user", "content": "two"}]))
    text = smollm_tokenizer.decode(render(req, processor, strict).ids)
    assert text.count("<|im_start|>system") == 1
    assert text.index("one") < text.index("ENV" + BLOCK_SEPARATOR + "two")
    # folding never moves a turn: with no user turn after it, the text joins the one before
    turns = [{"role": "system", "content": "S"}, {"role": "user", "content": "u"}, {"role": "system", "content": "E"}]
    assert fold_inline_system(turns) == [{"role": "system", "content": "S"}, {"role": "user", "content": "u" + BLOCK_SEPARATOR + "E"}]


async def test_deferred_tools_render_only_where_a_tool_reference_loads_them(engine) -> None:
    lazy = {"name": "lazy_tool", "description": "Loaded on demand", "defer_loading": True,
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}}}
    search = {"name": "ToolSearch", "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}}}
    turn1 = [{"role": "user", "content": "find the lazy tool"}]
    r = await post(engine, body(tools=[search, lazy], messages=turn1))
    assert r.status_code == 200, r.text
    first = prompt_ids(engine, 0)
    assert "lazy_tool" not in engine.tokenizer.decode(first)
    turn2 = turn1 + [
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "ToolSearch", "input": {"query": "lazy"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "tool_reference", "tool_name": "lazy_tool"},
                                                  {"type": "tool_reference", "tool_name": "no_such_tool"}]}]}]
    r = await post(engine, body(tools=[search, lazy], messages=turn2))
    assert r.status_code == 200, r.text
    second = engine.tokenizer.decode(prompt_ids(engine, 1))
    tools_list = second[second.index("<tools>"):second.index("</tools>")]
    assert "lazy_tool" not in tools_list  # the listed tools (the prefix) did not change
    assert second.index("lazy_tool") > second.index("find the lazy tool")
    assert "no_such_tool" in second
    # loaded, it can be forced; before, naming it is a 400, never a 500
    r = await post(engine, body(tools=[search, lazy], messages=turn1, tool_choice={"type": "tool", "name": "lazy_tool"}))
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


async def test_tool_choice_none_keeps_the_tools_in_the_prompt(engine) -> None:
    """As Anthropic keeps them: an agent that sends tool_choice none on one turn keeps its cached prefix."""
    for choice in ({"type": "auto"}, {"type": "none"}):
        r = await post(engine, body(tools=[WEATHER], tool_choice=choice))
        assert r.status_code == 200, r.text
    auto, none = prompt_ids(engine, 0), prompt_ids(engine, 1)
    assert auto == none and "get_weather" in engine.tokenizer.decode(none)


async def test_non_text_tool_results_render_as_a_placeholder(engine) -> None:
    messages = [{"role": "user", "content": "read the png"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_9", "name": "Read", "input": {"p": "a.png"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9", "is_error": False,
                                              "content": [{"type": "image", "source": {"type": "base64", "data": "AAAA"}}]}]}]
    read = {"name": "Read", "input_schema": {"type": "object"}}
    r = await post(engine, body(tools=[read], messages=messages))
    assert r.status_code == 200, r.text
    assert NOT_TEXT_PLACEHOLDER.format(kind="image") in engine.tokenizer.decode(prompt_ids(engine))


async def test_a_final_assistant_message_is_continued(engine) -> None:
    r = await post(engine, body(messages=[{"role": "user", "content": "Name a colour"},
                                          {"role": "assistant", "content": "The colour is"}]))
    assert r.status_code == 200, r.text
    text = engine.tokenizer.decode(prompt_ids(engine))
    assert text.endswith("The colour is")
    r = await post(engine, body(messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y "}]))
    assert r.status_code == 400 and "trailing whitespace" in r.json()["error"]["message"]


# ---- prefix cache: leases and salt ------------------------------------------------------------------
async def test_cache_control_breakpoints_become_leases_at_their_block_ends(engine) -> None:
    messages = [{"role": "user", "content": [{"type": "text", "text": "long shared context " * 20,
                                              "cache_control": {"type": "ephemeral", "ttl": "1h"}},
                                             {"type": "text", "text": "question"}]}]
    system = [{"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}]
    r = await post(engine, body(system=system, messages=messages, cache_salt="tenant-a"))
    assert r.status_code == 200, r.text
    salt, leases = engine.cache_options_seen[-1]
    assert salt == "tenant-a"
    ids = prompt_ids(engine)
    assert [lease.ttl_s for lease in leases] == [300.0, 3600.0]
    assert all(isinstance(lease, CacheLease) for lease in leases)
    system_end, context_end = (lease.position for lease in leases)
    tok = engine.tokenizer
    assert tok.decode(ids[:system_end]).rstrip().endswith("sys<|im_end|>")
    assert "long shared context" in tok.decode(ids[system_end:context_end])
    assert "question" not in tok.decode(ids[:context_end]) and "question" in tok.decode(ids[context_end:])
    # usage: the breakpoints' prefix is cache creation (5m and 1h apart), the rest input; they sum to the prompt
    usage = r.json()["usage"]
    assert usage["cache_creation"] == {"ephemeral_5m_input_tokens": system_end,
                                       "ephemeral_1h_input_tokens": context_end - system_end}
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] + usage["cache_creation_input_tokens"] == len(ids)


async def test_prompt_cache_key_and_cache_salt_on_the_openai_routes(engine) -> None:
    async with app_client(engine) as client:
        r = await client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "prompt_cache_key": "agent-7",
            "prompt_cache_retention": "24h", "cache_salt": "s1"})
        assert r.status_code == 200, r.text
        salt, leases = engine.cache_options_seen[-1]
        assert salt == "s1" and len(leases) == 1 and leases[0].ttl_s == 86400.0
        assert leases[0].position >= len(prompt_ids(engine))
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


# ---- output ------------------------------------------------------------------------------------------
async def test_stream_framing_event_lines_ping_and_no_done(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY, max_model_len=2048)
    async with app_client(engine, sse_keepalive_s=0.001) as client:
        r = await client.post("/v1/messages", json=body(stream=True), headers=HEADERS)
    assert r.status_code == 200 and r.headers["request-id"].startswith("msg_")
    assert "[DONE]" not in r.text
    frames = [f for f in sse_frames(r.text) if f[0] != "ping"]
    kinds = [e for e, _ in frames]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"]
    assert all(e == d["type"] for e, d in frames)
    start = frames[0][1]["message"]
    assert start["id"] == r.headers["request-id"] and start["content"] == [] and start["stop_reason"] is None
    text = "".join(d["delta"]["text"] for e, d in frames if e == "content_block_delta")
    assert text == REPLY
    delta = frames[-2][1]
    assert delta["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == len(engine.reply_ids) + 1  # (and the end token)


async def test_keepalive_is_a_ping_event_and_the_cancel_endpoint_takes_the_message_id(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=REPLY, max_model_len=2048, hold=True)
    async with app_client(engine, sse_keepalive_s=0.01) as client:
        task = asyncio.ensure_future(client.post("/v1/messages", json=body(stream=True), headers=HEADERS))
        await wait_for(lambda: engine.requests and engine.requests[0].num_sent == 1)
        await asyncio.sleep(0.3)  # room for keepalives while the reply is held (their count is not checked)
        mid = engine.requests[0].request_id
        assert mid.startswith("msg_")
        cancel = await client.post(f"/v1/requests/{mid}/cancel")
        resp = await task
    assert cancel.status_code == 200, cancel.text
    assert 'event: ping\r\ndata: {"type":"ping"}\r\n\r\n' in resp.text
    frames = [f for f in sse_frames(resp.text) if f[0] != "ping"]
    assert [e for e, _ in frames][-2:] == ["message_delta", "message_stop"]
    assert frames[-2][1]["delta"]["stop_reason"] == "end_turn"
    assert engine.requests[0].metrics.finish_reason == "abort"


async def test_tool_use_streams_and_whole_give_the_same_blocks(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply="Let me check. " + CALL, max_model_len=2048)
    payload = body(tools=[WEATHER], messages=[{"role": "user", "content": "weather in Paris?"}])
    async with app_client(engine) as client:
        whole = (await client.post("/v1/messages", json=payload, headers=HEADERS)).json()
        streamed = await client.post("/v1/messages", json={**payload, "stream": True}, headers=HEADERS)
    assert whole["stop_reason"] == "tool_use"
    assert [b["type"] for b in whole["content"]] == ["text", "tool_use"]
    call = whole["content"][1]
    assert call["id"].startswith("toolu_") and call["name"] == "get_weather" and call["input"] == {"city": "Paris"}
    frames = sse_frames(streamed.text)
    starts = [d["content_block"] for e, d in frames if e == "content_block_start"]
    assert [s["type"] for s in starts] == ["text", "tool_use"]
    partial = "".join(d["delta"]["partial_json"] for e, d in frames
                      if e == "content_block_delta" and d["delta"]["type"] == "input_json_delta")
    assert json.loads(partial) == {"city": "Paris"}
    assert frames[-2][1]["delta"]["stop_reason"] == "tool_use"


def test_stop_reasons() -> None:
    assert stop_reason("stop", None, False, False) == "end_turn"
    assert stop_reason("stop", "###", False, False) == "stop_sequence"
    assert stop_reason("stop", 2, False, False) == "end_turn"
    assert stop_reason("stop", None, True, False) == "tool_use"
    assert stop_reason("length", None, False, False) == "max_tokens"
    assert stop_reason("length", None, True, True) == "model_context_window_exceeded"


async def test_max_tokens_over_the_window_is_clamped_not_refused(engine) -> None:
    r = await post(engine, body(max_tokens=128000))
    assert r.status_code == 200, r.text
    assert engine.requests[-1].params.max_tokens == engine.max_model_len - len(prompt_ids(engine))
    r = await post(engine, body(max_tokens=int("9" * 4300)))
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("max_tokens: max_tokens must be at most 2147483647")
    r = await post(engine, body(max_tokens=3, stream=False))
    assert r.json()["stop_reason"] == "max_tokens"


# ---- errors ------------------------------------------------------------------------------------------
TOOL_USE = {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_a", "name": "get_weather", "input": {}}]}
BAD_BODIES = [
    (body(messages=[]), 400, "messages"),
    (body(messages=[{"role": "user", "content": [{"type": "hologram", "x": 1}]}]), 400, "messages.0.content.0.type"),
    (body(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), 400, "messages.0.content.0"),
    (body(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "r"}]}]),
     400, "messages.0.content.0.tool_use_id"),
    (body(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "r"}]}]),
     400, "messages.0.content.0.type"),
    (body(max_tokens="64"), 400, "max_tokens"),
    (body(max_tokens=0), 400, "max_tokens"),
    (body(temperature=1.5), 400, "temperature"),
    (body(messages=[{"role": "robot", "content": "x"}]), 400, "messages.0.role"),
    (body(tools=[WEATHER, WEATHER]), 400, "tools.1.name"),
    (body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400, "tools.0.type"),
    (body(tool_choice={"type": "any"}), 400, "tool_choice"),
    (body(tool_choice={"type": "tool", "name": "nope"}, tools=[WEATHER]), 400, "tool_choice.name"),
    (body(thinking={"type": "enabled"}), 400, "thinking.budget_tokens"),
    (body(stop_sequences=[""]), 400, "stop_sequences"),
    (body(model="claude-sonnet-4-5"), 404, "model: "),
    (body(messages=[{"role": "user", "content": [
        {"type": "text", "text": str(i), "cache_control": {"type": "ephemeral"}} for i in range(5)]}]),
     400, "messages.0.content.4"),
    (body(output_config={"format": {"type": "json_schema", "schema": {"type": "object", "properties": 3}}}),
     400, "output_config.format.schema"),
    ([1, 2], 400, None),
]


@pytest.mark.parametrize("payload,status,field", BAD_BODIES)
async def test_bad_bodies_answer_in_anthropics_shape_naming_the_field(engine, payload, status, field) -> None:
    r = await post(engine, payload)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and set(err) == {"type", "error", "request_id"}
    assert err["error"]["type"] == {400: "invalid_request_error", 404: "not_found_error"}[status]
    if field is not None:
        assert err["error"]["message"].startswith(field), err
    assert r.headers["request-id"] == err["request_id"]
    assert not engine.requests  # nothing reached the engine


async def test_oversize_prompt_and_body(engine) -> None:
    r = await post(engine, body(messages=[{"role": "user", "content": "word " * 3000}]))
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("prompt is too long: ")
    assert "> 2047 maximum" in r.json()["error"]["message"]
    r = await post(engine, body(messages=[{"role": "user", "content": "x" * 5000}]), max_body_bytes=4096)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"


async def test_api_key_as_x_api_key_or_bearer(engine) -> None:
    async with app_client(engine, api_key="k1") as client:
        r = await client.post("/v1/messages", json=body(), headers=HEADERS)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert (await client.post("/v1/messages", json=body(), headers={**HEADERS, "x-api-key": "k1"})).status_code == 200
        assert (await client.post("/v1/messages", json=body(),
                                  headers={**HEADERS, "Authorization": "Bearer k1"})).status_code == 200
        assert (await client.post("/v1/messages", json=body(), headers={**HEADERS, "x-api-key": "k2"})).status_code == 401


async def test_models_in_anthropics_shape(engine) -> None:
    async with app_client(engine, served_model_name=MODEL, served_model_aliases=("alias-b",)) as client:
        page = (await client.get("/v1/models", headers=HEADERS)).json()
        assert [m["id"] for m in page["data"]] == [MODEL, "alias-b"]
        first = page["data"][0]
        assert first["type"] == "model" and first["display_name"] == MODEL
        assert first["max_input_tokens"] == engine.max_model_len - 1 and first["created_at"].endswith("Z")
        assert page["has_more"] is False and page["first_id"] == MODEL and page["last_id"] == "alias-b"
        page = (await client.get("/v1/models?limit=1", headers=HEADERS)).json()
        assert page["has_more"] is True and [m["id"] for m in page["data"]] == [MODEL]
        assert (await client.get("/v1/models/alias-b", headers=HEADERS)).json()["id"] == "alias-b"
        missing = await client.get("/v1/models/nope", headers=HEADERS)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        openai = (await client.get("/v1/models")).json()
        assert openai["object"] == "list" and openai["data"][0]["object"] == "model"
