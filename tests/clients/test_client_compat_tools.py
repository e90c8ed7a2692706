"""Tool calling and structured outputs through real clients, unchanged, against a live `chatserve serve`.

The default model (SmolLM2-135M-Instruct) is far too small to be trusted with tools on its own;
the point is that the grammar makes it well-formed anyway: with tool_choice "required" or a named
function every reply is a call whose arguments validate against the function's schema, and with
response_format json_schema every reply validates against the schema. What each client library
does with that (the openai SDK's `.parse()`, the Agents SDK's function tools and `output_type`,
LangChain's `bind_tools` / `with_structured_output`, LangGraph's ReAct agent, pydantic-ai's tools
and output types) is checked as their users would see it. Replies are short (small max_tokens,
small schemas) so this runs on a CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.helpers.net import HTTP
from tests.helpers.server import SHARED_API_KEY as API_KEY
from tests.helpers.server import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"],
                  "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather in a city",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "Get the current time in a city",
                                         "parameters": WEATHER_PARAMS}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

pytestmark = pytest.mark.timeout(600)

# NOTE: greedy by default. CHATSERVE_COMPAT_TEMPERATURE=1.0 runs every structured and tool check here
# sampled instead, seeded (CHATSERVE_COMPAT_SEED, default 0) so a run is repeatable: how issue #35
# measured them (BENCHMARKS.md, "bounded JSON whitespace"); a sampled run reports pass counts, it is
# not expected to pass every check with a 135M model.
TEMPERATURE = float(os.environ.get("CHATSERVE_COMPAT_TEMPERATURE", "0"))
SEED = int(os.environ.get("CHATSERVE_COMPAT_SEED", "0"))
SAMPLED = "CHATSERVE_COMPAT_TEMPERATURE" in os.environ


class Weather(BaseModel):
    city: Literal["Paris", "London", "Rome"]
    temperature_c: int = Field(ge=-40, le=50)
    sunny: bool


@pytest.fixture(scope="module")
def server(shared_server: ServerProcess) -> ServerProcess:
    """The session's shared server (tests/conftest.py): a model load fewer than a server of our own."""
    return shared_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def async_client(server: ServerProcess) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(autouse=True)
def server_idle_after(request):
    """After every test no request holds a KV block (the grammar paths free what they take)."""
    yield
    for name in ("server", "parser_server"):
        if name in request.fixturenames:
            from tests.clients.test_client_compat import assert_idle

            assert_idle(request.getfixturevalue(name))


def check_call(call: Any, name: str) -> dict[str, Any]:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == name
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER_PARAMS)
    return args


# ---- the openai SDK ----------------------------------------------------------------------------------
@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_openai_forced_calls_validate_and_stream_the_same(client, tool_choice):
    name = "get_weather" if tool_choice == "required" else "get_time"
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                       temperature=TEMPERATURE, seed=SEED, max_tokens=48,
                                       parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    if tool_choice == "required" and SAMPLED:  # sampled, "required" may call either offered function
        assert call.function.name in ("get_weather", "get_time")
        name = call.function.name
    args = check_call(call, name)

    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice,
                                            temperature=TEMPERATURE, seed=SEED, max_tokens=48, parallel_tool_calls=False,
                                            stream=True)
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": None, "arguments": ""})
                if tc.function and tc.function.name:
                    entry["name"] = tc.function.name
                if tc.function and tc.function.arguments:
                    entry["arguments"] += tc.function.arguments
    assert finish == "tool_calls"
    assert list(calls) == [0] and calls[0]["id"].startswith("call_")
    assert (calls[0]["name"], json.loads(calls[0]["arguments"])) == (name, args)

    # the tool's result goes back; the conversation continues in text
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                            temperature=0, max_tokens=6)  # a few tokens show it is text
    assert follow.choices[0].finish_reason in ("stop", "length")
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


def test_openai_parse_with_a_pydantic_model_20_of_20(client):
    def ask(i: int) -> Any:
        return client.chat.completions.parse(
            model=MODEL, messages=[{"role": "user", "content": f"Describe the weather in a European city, day {i}."}],
            response_format=Weather, temperature=TEMPERATURE if SAMPLED else 0.8, seed=SEED * 100 + i,
            max_tokens=64)

    with ThreadPoolExecutor(20) as pool:  # all 20 in one batch (the server's --max-num-seqs is 20)
        replies = list(pool.map(ask, range(20)))
    parsed = [r.choices[0].message.parsed for r in replies]
    assert all(isinstance(p, Weather) for p in parsed), [r.choices[0].message.content for r in replies]
    assert all(r.choices[0].finish_reason == "stop" for r in replies)


def test_invalid_schema_and_bad_regex_are_400_before_queueing(server, client):
    bad_schema = HTTP.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=60, json={
        "model": MODEL, "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}}}})
    bad_regex = HTTP.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=60, json={
        "model": MODEL, "messages": ASK, "structured_outputs": {"regex": "(unclosed"}})
    unknown = HTTP.post(f"{server.url}/v1/chat/completions", headers=server.headers, timeout=60, json={
        "model": MODEL, "messages": ASK, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}})
    for resp, param in ((bad_schema, "response_format.json_schema.schema"), (bad_regex, "structured_outputs.regex"),
                        (unknown, "tool_choice")):
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["param"] == param, resp.text
    assert server.metrics().get("chatserve:num_requests_waiting", 0) == 0


# ---- the OpenAI Agents SDK -----------------------------------------------------------------------------
def _agents_model(server: ServerProcess) -> Any:
    import agents
    from agents import OpenAIChatCompletionsModel

    agents.set_tracing_disabled(True)
    return OpenAIChatCompletionsModel(model=MODEL, openai_client=async_client(server))


def test_agents_function_tool_to_a_final_answer_and_output_type(server):
    from agents import Agent, ModelSettings, Runner, function_tool

    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 degrees in {city}."

    # The SDK resets tool_choice after the first tool call (reset_tool_choice=True), so the second
    # call is "auto" and the model answers from the tool's result.
    agent = Agent(name="weather", instructions="Answer weather questions with the tool.", model=_agents_model(server),
                  tools=[get_weather], model_settings=ModelSettings(tool_choice="required", temperature=TEMPERATURE, max_tokens=40,
                                               extra_body={"seed": SEED}))

    async def main() -> tuple[Any, Any]:
        answer = await Runner.run(agent, "What is the weather in Paris?", max_turns=4)
        typed = Agent(name="typed", instructions="Report the weather.", model=_agents_model(server), output_type=Weather,
                      model_settings=ModelSettings(temperature=TEMPERATURE, max_tokens=48, extra_body={"seed": SEED}))
        return answer, await Runner.run(typed, "The weather in Rome: 25 degrees and sunny.", max_turns=1)

    answer, typed = asyncio.run(main())
    assert len(seen) >= 1 and all(isinstance(c, str) for c in seen)
    assert isinstance(answer.final_output, str) and answer.final_output
    assert isinstance(typed.final_output, Weather)


# ---- LangChain and LangGraph ---------------------------------------------------------------------------
def _chat_openai(server: ServerProcess, max_tokens: int = 48) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=API_KEY, temperature=TEMPERATURE, seed=SEED,
                      max_tokens=max_tokens, max_retries=0, timeout=300)


def test_langchain_bind_tools(server):
    llm = _chat_openai(server)
    msg = llm.bind_tools([WEATHER], tool_choice="required").invoke("What is the weather in Paris?")
    assert msg.tool_calls, msg  # (parallel calls allowed: one or more)
    calls = msg.tool_calls
    if msg.response_metadata.get("finish_reason") == "length":
        # max_tokens cut the last call: it arrives as a call (issue #35), its arguments as far as generated
        calls = calls[:-1]
    else:
        assert not msg.invalid_tool_calls, msg
    for call in calls:
        assert call["name"] == "get_weather" and call["id"].startswith("call_")
        jsonschema.validate(call["args"], WEATHER_PARAMS)


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(server, method):
    llm = _chat_openai(server)
    prompt = "The weather in London: 12 degrees, not sunny."
    if method == "json_mode":
        # json_mode sends response_format json_object: the schema reaches the model only through the
        # prompt, so a 135M model's object is checked for being one (a dict schema: LangChain's JSON parser)
        ask = f"{prompt} Reply in JSON with the keys city, temperature_c and sunny."
        out = llm.with_structured_output(Weather.model_json_schema(), method=method).invoke(ask)
        assert isinstance(out, dict), out
        return
    out = llm.with_structured_output(Weather, method=method).invoke(prompt)
    assert isinstance(out, Weather), (method, out)


def test_langgraph_react_agent_with_one_tool(server):
    run_langgraph_react_agent(server)


def run_langgraph_react_agent(server: ServerProcess) -> None:
    from langchain_core.messages import AIMessage, ToolMessage
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return f"It is sunny and 21 degrees in {city}."

    llm = _chat_openai(server)

    def model(state: Any, runtime: Any) -> Any:
        # LangGraph's dynamic model: force the first call (a 135M model left to "auto" often just
        # answers), then let it answer from the tool's result, as the Agents SDK's reset_tool_choice does.
        answered = any(isinstance(m, ToolMessage) for m in state["messages"])
        return llm.bind_tools([get_weather], tool_choice="none" if answered else "required")

    agent = create_react_agent(model, [get_weather])
    state = agent.invoke({"messages": [("user", "Use get_weather to find the weather in Paris.")]},
                         {"recursion_limit": 8})
    messages = state["messages"]
    assert isinstance(messages[-1], AIMessage) and messages[-1].content and not messages[-1].tool_calls
    tool_results = [m for m in messages if isinstance(m, ToolMessage)]
    assert tool_results and "sunny" in tool_results[0].content


# ---- pydantic-ai -------------------------------------------------------------------------------------
def test_pydantic_ai_tool_and_output_type(server):
    run_pydantic_ai_tool_and_output_type(server)


def run_pydantic_ai_tool_and_output_type(server: ServerProcess, calls: int = 1, min_calls: int = 1) -> None:
    """`calls`: how many get_weather calls the run may make (parallel calls in one reply all run);
    `min_calls`: how many it must make (0 where the model may answer through final_result at once)."""
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    seen: list[str] = []
    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=async_client(server)))
    agent = Agent(model, output_type=Weather, model_settings={"temperature": TEMPERATURE, "seed": SEED, "max_tokens": 96})

    async def once(ctx: Any, tool_def: Any) -> Any:
        """Offered until it has been called: then only pydantic-ai's final_result tool is left."""
        return None if seen else tool_def

    @agent.tool_plain(prepare=once)
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 degrees in {city}."

    # pydantic-ai's default output mode is a tool ("final_result") with tool_choice "required": every
    # reply is a call, of get_weather or of final_result, which ends the run with a validated Weather.
    result = agent.run_sync("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=4))
    assert isinstance(result.output, Weather)
    assert min_calls <= len(seen) <= calls and all(isinstance(city, str) for city in seen)
    # every reply under tool_choice "required" was a call the client parsed and ran: get_weather's, or
    # final_result's, whose validated arguments are the Weather above
    from pydantic_ai.messages import ModelResponse, ToolCallPart

    replies = [m for m in result.all_messages() if isinstance(m, ModelResponse)]
    assert replies and all(any(isinstance(p, ToolCallPart) for p in r.parts) for r in replies)
    assert any(p.tool_name == "final_result" for p in replies[-1].parts if isinstance(p, ToolCallPart))


def test_pydantic_ai_native_output(server):
    """NativeOutput: the output type as response_format json_schema, no tool call."""
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=async_client(server)))
    agent = Agent(model, output_type=NativeOutput(Weather),
                  model_settings={"temperature": TEMPERATURE, "seed": SEED, "max_tokens": 64})
    result = agent.run_sync("The weather in Rome: 25 degrees and sunny.")
    assert isinstance(result.output, Weather)


# ---- the same clients with a forced tool-call format (issue 55) ------------------------------------------
@pytest.fixture(scope="module", params=["llama3_json", "qwen3_coder"])
def parser_server(request) -> Any:
    """The default model served with `--tool-call-parser NAME`: its SmolLM2 template has no such syntax, so
    the tools are described in that format's way (chatserve's shipped template) and replies constrained to it."""
    from tests.helpers.server import start_server

    srv = start_server("--max-model-len", "2048", "--block-size", "16", "--tool-call-parser", request.param,
                       api_key=API_KEY)
    srv.parser = request.param  # type: ignore[attr-defined]
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


def test_openai_sdk_tool_turn_with_a_forced_format(parser_server):
    client = openai.OpenAI(base_url=f"{parser_server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       temperature=TEMPERATURE, seed=SEED, max_tokens=64, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    args = check_call(call, "get_weather")
    # streamed with the openai SDK's own helper: the same call
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                        temperature=TEMPERATURE, seed=SEED, max_tokens=64,
                                        parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    (streamed,) = final.choices[0].message.tool_calls
    assert (streamed.function.name, json.loads(streamed.function.arguments)) == ("get_weather", args)
    # the result goes back through the format's template: with the tools still offered the next prompt
    # extends this one (a prefix-cache hit); with tool_choice "none" the turn ends in text
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 degrees."}]
    again = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], temperature=0, max_tokens=4)
    assert again.usage.prompt_tokens_details.cached_tokens >= r.usage.prompt_tokens // 16 * 16
    follow = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                            temperature=0, max_tokens=6)
    assert follow.choices[0].message.content and not follow.choices[0].message.tool_calls


def test_langgraph_react_agent_with_a_forced_format(parser_server):
    run_langgraph_react_agent(parser_server)


def test_pydantic_ai_tool_and_output_type_with_a_forced_format(parser_server):
    # (pydantic-ai allows parallel calls: in these formats the 135M model may write several in one reply;
    # under "required" with two tools offered, which one it calls first is the model's choice, and that
    # differs between kernel tiers' rounding: a run that answers through final_result at once is a tool
    # call in the forced format too)
    run_pydantic_ai_tool_and_output_type(parser_server, calls=4, min_calls=0)
