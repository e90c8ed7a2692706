"""Real Anthropic clients, unchanged, against a live `chatserve serve`: `POST /v1/messages` as our users reach it.

The official `anthropic` SDK (create, the `messages.stream` helpers, a tool-use loop, `count_tokens`, a stream
left early, the models list, errors), `langchain-anthropic`, pydantic-ai's Anthropic model (`NativeOutput`
included), litellm's `anthropic/` provider, and the Claude Code CLI itself (`claude -p`, then `--continue`),
plus a replay of the request Claude Code sends (tests/fixtures/claude_code_request.json, captured from the CLI
by `python -m tests.helpers.claude_code capture`), plain and with a per-request `cch=` hash in its billing
header: the next turn of each must read at least 95% of its prompt from the prefix cache.

What is checked is the protocol, never the wording of a 135M model: tokens came back, stop reasons, usage
fields as Anthropic counts them (`input_tokens` excludes cache reads), the shape of `tool_use` blocks, the SSE
framing. After each test the server is idle with every KV block free or cached (`assert_idle`).

The server is the documented Claude Code set-up: the default model (trained context 8,192) stretched to
32,768 tokens by a YaRN rope override, since Claude Code's first request is ~13,000 tokens, and served under
Claude Code's default model name too. The CLI's conversation and the replays share one cold prefill of
Claude Code's prompt (`relocate` moves the captured paths to the CLI's HOME and working directory).

Run: HF_HUB_OFFLINE=1 .venv/bin/python -m pytest -q -n 0 tests/clients/test_client_compat_anthropic.py
(the CLI comes from scripts/install_claude_code.sh; make setup-redis runs it).

Versions are pinned in pyproject.toml's dev extras and scripts/install_claude_code.sh (the CLI, from npm, which
`make setup-redis` runs); a missing CLI fails its tests with how to install it. Nothing here leaves 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.clients.test_client_compat import aborts, assert_idle
from tests.helpers import claude_code as cc
from tests.helpers.net import HTTP
from tests.helpers.server import ServerProcess, start_server

MODEL = "SmolLM2-135M-Instruct"
API_KEY = "anthropic-compat-key"
MAX_MODEL_LEN = 32768
YARN = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}}
# The model Claude Code 2.1.328 asks for when nothing says otherwise: served as a second name, so the CLI runs
# with no model variable at all and sends the system prompt the fixture holds (a model variable changes it),
# which lets the fixture's replays and the CLI's turns share one cold prefill of the ~10k tokens before the
# environment block.
CLAUDE_CODE_MODEL = "claude-opus-5-5"
SERVE_ARGS = ("--max-model-len", str(MAX_MODEL_LEN), "--hf-overrides", json.dumps(YARN), "--max-num-seqs", "8",
              "--sse-keepalive-s", "0.05", "--served-model-name", MODEL, CLAUDE_CODE_MODEL)
MAX_TOKENS = 24
PROMPT = "Write two sentences about a lighthouse."
CHAT = [{"role": "user", "content": PROMPT}]
# A reply that goes on for a long time (for the stream left early): counting, with the count begun as a prefill.
COUNT = [{"role": "user", "content": "Count from 1 to 500, separated by commas."},
         {"role": "assistant", "content": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"}]
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32}},
                     "required": ["city"]},
}
CACHED_AT_LEAST = 0.95
# anthropic 2.10.0's create() and stream() no longer take sampling parameters (the API's newest models dropped
# them); the server still reads them (temperature 0 to 1, top_p, top_k), so tests send them as extra body.
GREEDY = {"extra_body": {"temperature": 0}}
STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "model_context_window_exceeded"}

pytestmark = pytest.mark.timeout(900)


# ---- the server and clients ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server():
    srv = start_server(*SERVE_ARGS, api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(autouse=True)
def server_idle_after(request):
    """After every test: nothing runs or waits, the cache invariants hold, no block is held by a request."""
    yield
    if "server" in request.fixturenames:
        assert_idle(request.getfixturevalue("server"))


def sdk(srv: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=API_KEY, max_retries=0, timeout=300)


def anthropic_headers(**extra: str) -> dict[str, str]:
    """What Claude Code and litellm send: the key as `x-api-key` (the SDK sends `Authorization: Bearer`)."""
    return {"x-api-key": API_KEY, "anthropic-version": "2023-06-01", "content-type": "application/json", **extra}


def post_messages(srv: ServerProcess, body: dict[str, Any], path: str = "/v1/messages",
                  headers: dict[str, str] | None = None) -> dict[str, Any]:
    """A Messages request over plain HTTP; a streamed one is read to its end and assembled (`cc.assemble`)."""
    headers = headers or anthropic_headers()
    if not body.get("stream"):
        r = HTTP.post(f"{srv.url}{path}", json=body, headers=headers, timeout=600)
        assert r.status_code == 200, f"POST {path}: {r.status_code} {r.text[:2000]}"
        return r.json()
    with HTTP.stream("POST", f"{srv.url}{path}", json=body, headers=headers, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            raise AssertionError(f"POST {path} (stream): {r.status_code} {r.text[:2000]}")
        assert r.headers["content-type"].startswith("text/event-stream"), r.headers
        return cc.assemble(cc.messages_sse(r.iter_lines()))


def assert_message(msg: dict[str, Any], max_tokens: int) -> None:
    """A complete Messages reply, in the API's shape, whatever the model said."""
    assert msg["type"] == "message" and msg["role"] == "assistant", msg
    assert msg["id"].startswith("msg_"), msg["id"]
    assert msg["stop_reason"] in STOP_REASONS, msg["stop_reason"]
    usage = msg["usage"]
    assert usage["input_tokens"] >= 0 and 0 < usage["output_tokens"] <= max_tokens, usage
    assert {"cache_read_input_tokens", "cache_creation_input_tokens"} <= set(usage), usage
    if msg["stop_reason"] == "max_tokens":
        assert usage["output_tokens"] == max_tokens, usage


def prompt_tokens(usage: Any) -> int:
    """The whole prompt, as Anthropic counts it: `input_tokens` excludes cache reads and writes."""
    u = usage if isinstance(usage, dict) else usage.model_dump()
    return u["input_tokens"] + (u.get("cache_read_input_tokens") or 0) + (u.get("cache_creation_input_tokens") or 0)


# ---- the anthropic SDK -------------------------------------------------------------------------------------
def test_anthropic_create_and_stream_helpers(server):
    client = sdk(server)
    kwargs = dict(model=MODEL, max_tokens=MAX_TOKENS, messages=CHAT, **GREEDY)
    client.messages.create(**kwargs)  # puts the prompt in the prefix cache: the next ones take one numeric path
    msg = client.messages.create(**kwargs)
    assert_message(msg.model_dump(), MAX_TOKENS)
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.model == MODEL
    assert msg.usage.cache_read_input_tokens > 0  # the same prompt again: a prefix-cache hit, counted

    with client.messages.stream(**kwargs) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == msg.content[0].text  # greedy: the stream says what the non-streamed reply said
    assert final.content[0].text == text and final.stop_reason == msg.stop_reason
    assert final.usage.output_tokens == msg.usage.output_tokens
    assert prompt_tokens(final.usage) == prompt_tokens(msg.usage)

    with client.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
    assert events[0] == "message_start" and events[-1] == "message_stop", events
    assert "content_block_start" in events and "text" in events and "content_block_stop" in events, events

    # A system prompt as a string and as text blocks, and stop_sequences: accepted, the reply well formed.
    for system in ("You are terse.", [{"type": "text", "text": "You are terse."}]):
        r = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=CHAT, system=system,
                                   extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 40},
                                   stop_sequences=["\n\n"], metadata={"user_id": "u-1"})
        assert_message(r.model_dump(), MAX_TOKENS)
        if r.stop_reason == "stop_sequence":
            assert r.stop_sequence == "\n\n"


def test_anthropic_raw_stream_framing(server):
    """The bytes under the SDK: every frame named by its `event:` line, usage with cache counts up front."""
    body = {"model": MODEL, "max_tokens": MAX_TOKENS, "messages": CHAT, "temperature": 0, "stream": True}
    for path in ("/v1/messages", "/v1/messages?beta=true"):
        msg = post_messages(server, body, path)
        assert_message(msg, MAX_TOKENS)
        start = msg["start_usage"]
        assert {"input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"} <= set(start), start
        assert prompt_tokens(start) == prompt_tokens(msg["usage"]) > 0
        assert [b["type"] for b in msg["content"]] == ["text"]
    full = post_messages(server, {**body, "stream": False})
    assert full["content"][0]["text"] == msg["content"][0]["text"]


def test_anthropic_count_tokens(server):
    client = sdk(server)
    system = "You are a helpful assistant."
    counted = client.messages.count_tokens(model=MODEL, messages=CHAT, system=system).input_tokens
    assert counted > 0
    msg = client.messages.create(model=MODEL, max_tokens=4, messages=CHAT, system=system, **GREEDY)
    assert prompt_tokens(msg.usage) == counted
    with_tools = client.messages.count_tokens(model=MODEL, messages=CHAT, system=system, tools=[WEATHER_TOOL])
    assert with_tools.input_tokens > counted
    # Claude Code's billing header is no part of the prompt, in count_tokens as in /v1/messages.
    billing = {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.661; cc_entrypoint=sdk-cli;"}
    blocks = client.messages.count_tokens(model=MODEL, messages=CHAT, system=[billing, {"type": "text", "text": system}])
    assert blocks.input_tokens == counted


def test_anthropic_tool_use_loop(server):
    client = sdk(server)
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    forced = {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}
    msg = client.messages.create(model=MODEL, max_tokens=128, messages=messages, tools=[WEATHER_TOOL],
                                 tool_choice=forced, **GREEDY)
    assert msg.stop_reason == "tool_use", msg
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert len(uses) == 1 and msg.content[-1].type == "tool_use", msg.content
    use = uses[0]
    assert use.id.startswith("toolu_") and use.name == "get_weather"
    assert isinstance(use.input, dict) and isinstance(use.input["city"], str) and len(use.input["city"]) <= 32

    # The loop: the reply as it came, then the tool's result; the model answers in text.
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": [{"type": "text", "text": "Sunny, 21 C."}]}]}]
    answer = client.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=messages, tools=[WEATHER_TOOL],
                                    tool_choice={"type": "none"}, **GREEDY)
    assert_message(answer.model_dump(), MAX_TOKENS)
    assert answer.stop_reason != "tool_use" and all(b.type == "text" for b in answer.content), answer.content
    # A tool_result as a plain string, and one marked as an error: accepted.
    messages[-1] = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                 "content": "no such city", "is_error": True}]}
    assert_message(client.messages.create(model=MODEL, max_tokens=8, messages=messages, tools=[WEATHER_TOOL],
                                          **GREEDY).model_dump(), 8)

    # Streamed, with `any`: the call's arguments arrive as input_json_delta events, which the helper assembles into
    # its input. (One call: how many parallel calls a 135M model makes, and whether they fit, is its own business.)
    with client.messages.stream(model=MODEL, max_tokens=128, messages=messages[:1], tools=[WEATHER_TOOL],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}, **GREEDY) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use", final
    streamed_uses = [(i, b) for i, b in enumerate(final.content) if b.type == "tool_use"]
    assert len(streamed_uses) == 1 and final.content[-1].type == "tool_use", final.content
    index, block = streamed_uses[0]
    assert block.name == "get_weather" and block.id.startswith("toolu_")
    joined = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                     and e.delta.type == "input_json_delta" and e.index == index)
    assert joined and json.loads(joined) == block.input and isinstance(block.input["city"], str)


def test_anthropic_stream_left_early_frees_its_blocks(server):
    client = sdk(server)
    before = aborts(server, "client_disconnect")
    got = 0
    with client.messages.stream(model=MODEL, max_tokens=400, messages=COUNT, **GREEDY) as stream:
        message_id = None
        for event in stream:
            if event.type == "message_start":
                message_id = event.message.id
            if event.type == "content_block_delta" and event.delta.type == "text_delta" and event.delta.text:
                got += 1
                if got >= 3:
                    break
    assert got == 3 and message_id and message_id.startswith("msg_")
    assert_idle(server)  # the request ended with the connection, and its blocks are back
    assert aborts(server, "client_disconnect") == before + 1
    # The cancel endpoint knows the request by the id the client saw.
    state = HTTP.post(f"{server.url}/v1/requests/{message_id}/cancel", headers=server.headers, timeout=30)
    assert state.status_code == 200, state.text
    assert state.json()["finish_reason"] == "abort" and state.json()["completion_tokens"] < 400


def test_anthropic_models_and_errors(server):
    client = sdk(server)
    page = client.models.list()
    ids = [m.id for m in page.data]
    assert MODEL in ids and all(m.type == "model" and m.display_name and m.created_at for m in page.data)
    assert page.first_id == ids[0] and page.last_id == ids[-1] and page.has_more is False
    assert client.models.retrieve(MODEL).id == MODEL
    # The OpenAI shape is still what a request without anthropic-version gets.
    plain = HTTP.get(f"{server.url}/v1/models", headers=server.headers, timeout=30).json()
    assert plain["object"] == "list" and plain["data"][0]["object"] == "model"

    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=MODEL, max_tokens=8, messages=[])
    assert bad.value.body["type"] == "error" and bad.value.body["error"]["type"] == "invalid_request_error"
    assert "messages" in bad.value.body["error"]["message"] and bad.value.request_id
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=8, messages=CHAT)
    assert denied.value.body["error"]["type"] == "authentication_error"
    r = HTTP.post(f"{server.url}/v1/messages", headers={**anthropic_headers(), "x-api-key": "wrong"},
                  json={"model": MODEL, "max_tokens": 8, "messages": CHAT}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


# ---- langchain-anthropic -----------------------------------------------------------------------------------
def test_langchain_anthropic_invoke_stream_and_bind_tools(server):
    from langchain_anthropic import ChatAnthropic
    from langchain_core.tools import tool

    llm = ChatAnthropic(model=MODEL, base_url=server.url, api_key=API_KEY, max_tokens=MAX_TOKENS, temperature=0,
                        max_retries=0, default_request_timeout=300)
    msg = llm.invoke(PROMPT)
    assert msg.text and msg.response_metadata["stop_reason"] in STOP_REASONS
    assert msg.usage_metadata["input_tokens"] > 0 and 0 < msg.usage_metadata["output_tokens"] <= MAX_TOKENS

    chunks = list(llm.stream(PROMPT))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert total.text == msg.text  # greedy, the prompt cached by the call before
    assert total.usage_metadata["output_tokens"] == msg.usage_metadata["output_tokens"]

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "Sunny"

    tooled = llm.model_copy(update={"max_tokens": 128}).bind_tools([get_weather], tool_choice="get_weather",
                                                                    parallel_tool_calls=False)
    ai = tooled.invoke("What is the weather in Paris?")
    assert len(ai.tool_calls) == 1, ai
    call = ai.tool_calls[0]
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str) and call["id"].startswith("toolu_")
    assert ai.response_metadata["stop_reason"] == "tool_use"


# ---- pydantic-ai ------------------------------------------------------------------------------------------
def _pydantic_model(server: ServerProcess):
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    provider = AnthropicProvider(api_key=API_KEY, base_url=server.url)
    # pydantic-ai knows which Claude models take `output_config.format`; a local model is told it does.
    profile = {**(provider.model_profile(MODEL) or {}), "supports_json_schema_output": True}
    return AnthropicModel(MODEL, provider=provider, profile=profile)


def test_pydantic_ai_anthropic_run_stream_and_native_output(server):
    from pydantic import BaseModel
    from pydantic_ai import Agent, NativeOutput

    settings = {"temperature": 0, "max_tokens": MAX_TOKENS}
    result = Agent(_pydantic_model(server), model_settings=settings).run_sync(PROMPT)
    assert isinstance(result.output, str) and result.output
    assert result.usage.input_tokens > 0 and 0 < result.usage.output_tokens <= MAX_TOKENS

    async def stream() -> tuple[str, str]:
        agent = Agent(_pydantic_model(server), model_settings=settings)
        async with agent.run_stream(PROMPT) as run:
            parts = [d async for d in run.stream_text(delta=True)]
            return "".join(parts), await run.get_output()

    streamed, output = asyncio.run(stream())
    assert streamed == output == result.output

    class City(BaseModel):
        city: str
        country: str

    agent = Agent(_pydantic_model(server), output_type=NativeOutput(City),
                  model_settings={"temperature": 0, "max_tokens": 128})
    city = agent.run_sync("Name a city in France and its country.").output
    assert isinstance(city, City) and isinstance(city.city, str)  # the grammar made it parse


# ---- litellm --------------------------------------------------------------------------------------------
def test_litellm_anthropic_provider(server):
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of the price list at import
    import litellm

    common = dict(model=f"anthropic/{MODEL}", api_base=server.url, api_key=API_KEY, temperature=0)
    kwargs = dict(**common, messages=CHAT, max_tokens=MAX_TOKENS)
    full = litellm.completion(**kwargs)
    assert full.choices[0].message.content and full.choices[0].finish_reason in ("stop", "length")
    assert full.usage.prompt_tokens > 0 and 0 < full.usage.completion_tokens <= MAX_TOKENS
    chunks = list(litellm.completion(**kwargs, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == \
        [full.choices[0].finish_reason]

    tools = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER_TOOL["description"],
                                               "parameters": WEATHER_TOOL["input_schema"]}}]
    called = litellm.completion(**common, max_tokens=128, tools=tools, parallel_tool_calls=False,
                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    calls = called.choices[0].message.tool_calls
    assert calls and calls[0].function.name == "get_weather" and called.choices[0].finish_reason == "tool_calls"
    assert isinstance(json.loads(calls[0].function.arguments)["city"], str)


# ---- Claude Code ------------------------------------------------------------------------------------------
CLAUDE_ENV = {
    "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "64",
    # Claude Code sends no temperature (the API's default, 1.0). Sampled at 1.0 under Claude Code's 13k-token
    # prompt, the 135M model ran past the 64-token cap on every first reply tried; Claude Code then asks it to
    # resume, up to three times, and exits 1 ("API Error: Claude's response exceeded the 64 output token
    # maximum") when the last is cut too: a pass or a failure by chance. Greedy, it ends in ~17 tokens: Claude
    # Code's own CLAUDE_CODE_EXTRA_BODY (JSON merged into each request body) sets that. Greedy alone was not
    # enough: the prompt holds the test's own paths and the date, so the reply differs between runs, and a
    # clean clone's run went past the cap four times (exit 1). So the reply's length is the grammar's, not the
    # model's: a JSON string of at most 8 characters (output_config.format, a few tokens whatever the model
    # says), and tool_choice none (the tools stay in the prompt, as Anthropic keeps them; no call is parsed).
    # What is tested is the mechanism: both turns answer through chatserve and the second reads its prompt
    # from the cache.
    "CLAUDE_CODE_EXTRA_BODY": json.dumps({
        "temperature": 0, "tool_choice": {"type": "none"},
        "output_config": {"format": {"type": "json_schema", "schema": {"type": "string", "maxLength": 8}}}}),
}


def prompt_metrics(srv: ServerProcess) -> tuple[float, float]:
    """(prompt tokens looked up in the prefix cache, those found), as the server counts them."""
    m = srv.metrics()
    return m.get("chatserve:prefix_cache_queries_total", 0.0), m.get("chatserve:prefix_cache_hits_total", 0.0)


def claude_turn(srv: ServerProcess, args: list[str], home: Path, work: Path) -> dict[str, Any]:
    """One headless Claude Code turn against the server; its `--output-format json` result."""
    queries = prompt_metrics(srv)[0]
    done = cc.run_claude([*args, "--output-format", "json"], base_url=srv.url, home=home, cwd=work,
                         api_key=API_KEY, timeout=600, **CLAUDE_ENV)
    assert done.returncode == 0, f"claude {args}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    result = json.loads(done.stdout)
    assert result["type"] == "result" and result["subtype"] == "success" and result["is_error"] is False, result
    assert isinstance(result["result"], str)
    usage = result["usage"]
    assert usage["output_tokens"] > 0 and prompt_tokens(usage) > 10_000, usage  # Claude Code's ~13k-token prompt
    assert result["modelUsage"], result
    assert prompt_metrics(srv)[0] - queries >= prompt_tokens(usage) * 0.9  # it went through this server
    return result


@pytest.fixture(scope="module")
def claude_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """The HOME and working directory of the CLI's conversation, which the fixture's replays are moved to."""
    base = tmp_path_factory.mktemp("claude-code")
    return base / "home", base / "work"


@pytest.fixture(scope="module")
def captured(claude_dirs) -> dict[str, Any]:
    """The captured requests as the CLI sends them from `claude_dirs`: Claude Code writes its HOME and working
    directory into the system prompt, so moved there they share the CLI's ~10k tokens before the environment
    block, and the suite pays for one cold prefill of Claude Code's prompt, not two."""
    return cc.relocate(cc.load_fixture(), *claude_dirs)


def test_claude_code_two_turns_reuse_the_cache(server, claude_dirs):
    cc.claude_binary()  # fails with how to install it, if set-up could not
    home, work = claude_dirs
    first = claude_turn(server, ["-p", "hello"], home, work)
    second = claude_turn(server, ["-p", "--continue", "Say that again."], home, work)
    assert second["session_id"] == first["session_id"]  # the same conversation, continued
    cached = cc.cached_fraction(second["usage"])
    assert cached >= CACHED_AT_LEAST, (f"turn 2 read {cached:.1%} of its prompt from the cache: {second['usage']}\n"
                                       f"server log:\n{server.log()[-2000:]}")


# ---- the captured Claude Code request, replayed ------------------------------------------------------------
def test_claude_code_fixture_is_the_captured_shape():
    """What the replays below stand for (and what the capture must keep recording when it is redone)."""
    fx = cc.load_fixture()
    t1, t2 = fx["turn1"], fx["turn2"]
    assert t1["path"] == "/v1/messages?beta=true" and t1["headers"]["anthropic-version"]
    body = t1["body"]
    assert body["model"] == CLAUDE_CODE_MODEL  # the second name the server is started with
    assert body["stream"] is True and body["max_tokens"] > MAX_MODEL_LEN
    assert body["system"][0]["text"].startswith(cc.BILLING_PREFIX) and "cch=" not in body["system"][0]["text"]
    assert [m["role"] for m in body["messages"]] == ["user", "system"]  # the environment, inline
    assert [m["role"] for m in t2["body"]["messages"]] == ["user", "system", "assistant", "user"]
    assert isinstance(t2["body"]["messages"][1]["content"], str)  # the same text, sent as a string on turn 2
    assert any(t.get("defer_loading") for t in body["tools"])
    a, b = cc.with_cch(body), cc.with_cch(body)
    assert a["system"][0]["text"] != b["system"][0]["text"] and "cch=" in a["system"][0]["text"]
    assert a["system"][1:] == body["system"][1:]
    # Claude Code's paths are in its prompt, and relocate moves every one of them.
    assert fx["capture_cwd"] in json.dumps(body) and fx["capture_home"] in json.dumps(body["system"])
    moved = json.dumps(cc.relocate(fx, Path("/elsewhere/h"), Path("/elsewhere/w"))["turn1"])
    assert fx["capture_cwd"] not in moved and fx["capture_home"] not in moved
    assert cc.project_slug(fx["capture_cwd"]) not in moved and cc.project_slug("/elsewhere/w") in moved


@pytest.mark.parametrize("variant", ["plain", "cch"])
def test_claude_code_request_replayed_next_turn_cached(server, variant, captured):
    fx = captured
    headers = {**fx["turn1"]["headers"], "x-api-key": API_KEY}
    path = fx["turn1"]["path"]
    turn1 = dict(fx["turn1"]["body"])  # as captured, model name included (served as a second name)
    if variant == "cch":
        turn1 = cc.with_cch(turn1)
    if variant == "plain":
        # As sent (max_tokens 128,000, past the window): accepted and clamped. Left after its first tokens.
        with HTTP.stream("POST", f"{server.url}{path}", json=turn1, headers=headers, timeout=600) as r:
            if r.status_code != 200:
                r.read()
                raise AssertionError(f"the captured request as sent: {r.status_code} {r.text[:2000]}")
            for event, _ in cc.messages_sse(_until_first_delta(r.iter_lines())):
                assert event != "error"
        assert_idle(server)
    # As the CLI test's Claude Code sends it: CLAUDE_CODE_MAX_OUTPUT_TOKENS=64, temperature 0 (CLAUDE_CODE_EXTRA_BODY).
    turn1 = {**turn1, "max_tokens": 64, "temperature": 0}
    first = post_messages(server, turn1, path, headers)
    assert_message(first, 64)
    assert prompt_tokens(first["usage"]) > 10_000, first["usage"]
    turn2 = next_turn_body(fx, turn1, first)
    if variant == "cch":
        assert turn2["system"][0]["text"] != turn1["system"][0]["text"]  # a new hash, as each request has
    second = post_messages(server, turn2, path, headers)
    assert_message(second, 64)
    cached = cc.cached_fraction(second["usage"])
    assert cached >= CACHED_AT_LEAST, f"turn 2 ({variant}) read {cached:.1%} of its prompt from the cache: {second['usage']}"
    assert cc.cached_fraction(second["start_usage"]) == cached  # message_start already says so


def next_turn_body(fx: dict[str, Any], turn1: dict[str, Any], reply: dict[str, Any]) -> dict[str, Any]:
    return cc.next_turn(fx, turn1, reply["content"], "Say that again.")


def _until_first_delta(lines: Any) -> Any:
    """The raw lines up to the end of the first content_block_delta frame (then the caller leaves)."""
    seen_delta = False
    for line in lines:
        yield line
        if line.startswith("event:") and line[6:].strip() == "content_block_delta":
            seen_delta = True
        if seen_delta and line == "":
            return


def test_count_tokens_of_the_captured_request(server, captured):
    """count_tokens takes the whole captured request (tools, inline system turn) and drops the billing header."""
    fx = captured
    body = {k: v for k, v in fx["turn1"]["body"].items()
            if k in ("model", "messages", "system", "tools", "thinking", "tool_choice", "output_config")}
    headers = {**fx["turn1"]["headers"], "x-api-key": API_KEY}
    r = HTTP.post(f"{server.url}/v1/messages/count_tokens?beta=true", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text[:2000]
    plain = r.json()["input_tokens"]
    assert plain > 10_000
    r = HTTP.post(f"{server.url}/v1/messages/count_tokens?beta=true", json=cc.with_cch(body), headers=headers, timeout=120)
    assert r.status_code == 200 and r.json()["input_tokens"] == plain, r.text[:2000]


def test_malformed_messages_get_anthropic_errors(server):
    """A malformed body through plain HTTP: Anthropic's error shape with a request id, never a 5xx."""
    for body in ({"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "nope"}]}]},
                 {"model": MODEL, "max_tokens": "eight", "messages": CHAT},
                 {"model": MODEL, "max_tokens": 8, "messages": [
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "x"}]}]}):
        r = HTTP.post(f"{server.url}/v1/messages", json=body, headers=anthropic_headers(), timeout=30)
        assert 400 <= r.status_code < 500, (body, r.status_code, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
        assert isinstance(err["error"]["message"], str) and err["error"]["message"]
        assert r.headers.get("request-id"), r.headers
