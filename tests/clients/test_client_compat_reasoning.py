"""Reasoning through real clients, unchanged, against a live `chatserve serve` of the default model.

SmolLM2-135M does not reason, so the server forces a parser on it (`--reasoning-parser deepseek_r1`)
and each request forces the shape with a grammar (`structured_outputs` regex: a `<think>` block of
lower-case words, then the answer). What is checked is the mechanism, never the model's wording: the
`openai` SDK reads `reasoning` (and `reasoning_content`) from the message's and the delta's extra
fields, stream and not; pydantic-ai and the OpenAI Agents SDK complete a tool-calling turn whose reply
reasons first and then calls the tool (served with `--tool-call-parser hermes`, the call read from the
answer only), then answer from the tool's result. For the agents, an httpx transport under their
`openai` client adds the grammar to each request: a reasoning block then a call of `get_weather` until
the conversation holds a tool result, then a reasoning block and a short answer.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httpx
import openai
import pytest

from tests.helpers.server import SHARED_API_KEY as API_KEY
from tests.helpers.server import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
THINK = r"<think>\n[a-z ]{1,40}\n</think>\n\n"
ANSWER_REGEX = THINK + r"[A-Z][a-z ]{1,30}"
CALL_REGEX = THINK + r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Paris"\}\}\n</tool_call>'
REASONING = re.compile(r"[a-z ]{1,40}")
ASK = [{"role": "user", "content": "Say hello."}]

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def server() -> Any:
    from tests.helpers.server import start_server

    srv = start_server("--max-model-len", "2048", "--block-size", "16", "--reasoning-parser", "deepseek_r1",
                       "--tool-call-parser", "hermes", api_key=API_KEY)
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(autouse=True)
def server_idle_after(server: ServerProcess):
    yield
    from tests.clients.test_client_compat import assert_idle

    assert_idle(server)


def client_for(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300)


def forced(regex: str) -> dict[str, Any]:
    return {"structured_outputs": {"regex": regex}}


# ---- the openai SDK ----------------------------------------------------------------------------------
def test_openai_sdk_reads_reasoning_from_the_message_extras(server):
    reply = client_for(server).chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=120,
                                                       extra_body=forced(ANSWER_REGEX))
    message = reply.choices[0].message
    extra = message.model_extra or {}
    assert REASONING.fullmatch(extra["reasoning"]) and extra["reasoning_content"] == extra["reasoning"]
    assert re.fullmatch(r"[A-Z][a-z ]{1,30}", message.content or ""), message.content
    details = reply.usage.completion_tokens_details
    assert details is not None and 0 < details.reasoning_tokens < reply.usage.completion_tokens


def test_openai_sdk_streams_reasoning_deltas_before_the_answer(server):
    stream = client_for(server).chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=120, stream=True, stream_options={"include_usage": True},
        extra_body=forced(ANSWER_REGEX))
    reasoning, content, order, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            extra = choice.delta.model_extra or {}
            if extra.get("reasoning"):
                assert extra["reasoning_content"] == extra["reasoning"] and not choice.delta.content
                reasoning.append(extra["reasoning"])
                order.append("reasoning")
            if choice.delta.content:
                content.append(choice.delta.content)
                order.append("content")
    assert REASONING.fullmatch("".join(reasoning)), reasoning
    assert re.fullmatch(r"[A-Z][a-z ]{1,30}", "".join(content)), content
    assert order == sorted(order, key=lambda kind: kind == "content")  # every reasoning delta first
    assert usage is not None and usage.completion_tokens_details.reasoning_tokens > 0


def test_openai_sdk_sends_reasoning_back_under_either_name(server):
    client = client_for(server)
    for name in ("reasoning", "reasoning_content"):
        messages = [*ASK, {"role": "assistant", "content": "Hello.", name: "they greet me"},
                    {"role": "user", "content": "Again."}]
        reply = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=120,
                                               extra_body=forced(ANSWER_REGEX))
        assert reply.choices[0].message.model_extra["reasoning"]
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[*ASK, {"role": "assistant", "content": "Hi.",
                                                                     "reasoning": "a", "reasoning_content": "b"}])
    assert err.value.body["param"] == "messages.1.reasoning_content"


# ---- agents: reasoning, then a tool call, then the answer from its result --------------------------------
class ShapeForcing(httpx.AsyncBaseTransport):
    """Adds the grammar of the turn's shape to each chat request (see the module docstring)."""

    def __init__(self) -> None:
        self.inner = httpx.AsyncHTTPTransport()
        self.bodies: list[dict[str, Any]] = []

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/chat/completions"):
            body = json.loads(await request.aread())
            has_result = any(m.get("role") == "tool" for m in body["messages"])
            body.update(forced(ANSWER_REGEX if has_result else CALL_REGEX), max_tokens=160, temperature=0)
            self.bodies.append(body)
            content = json.dumps(body).encode()
            headers = {k: v for k, v in request.headers.items() if k.lower() != "content-length"}
            request = httpx.Request(request.method, request.url, headers=headers, content=content,
                                    extensions=request.extensions)
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def forcing_client(server: ServerProcess) -> tuple[openai.AsyncOpenAI, ShapeForcing]:
    transport = ShapeForcing()
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=300,
                                http_client=httpx.AsyncClient(transport=transport, timeout=300))
    return client, transport


def check_the_turns(transport: ShapeForcing, seen: list[str]) -> None:
    """Two requests: the first answered by a call (after reasoning), the second carries its result."""
    assert seen == ["Paris"]
    assert len(transport.bodies) == 2, [b["messages"] for b in transport.bodies]
    first, second = transport.bodies
    assert not any(m.get("role") == "tool" for m in first["messages"])
    assistant = next(m for m in second["messages"] if m.get("role") == "assistant")
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["get_weather"]
    assert any(m.get("role") == "tool" and "21 degrees" in str(m.get("content")) for m in second["messages"])


def test_pydantic_ai_completes_a_tool_turn_after_reasoning(server):
    from pydantic_ai import Agent
    from pydantic_ai.messages import ThinkingPart, ToolCallPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider
    from pydantic_ai.usage import UsageLimits

    client, transport = forcing_client(server)
    seen: list[str] = []
    agent = Agent(OpenAIChatModel(MODEL, provider=OpenAIProvider(openai_client=client)), output_type=str)

    @agent.tool_plain
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 degrees in {city}."

    result = agent.run_sync("What is the weather in Paris?", usage_limits=UsageLimits(request_limit=3))
    check_the_turns(transport, seen)
    assert re.fullmatch(r"[A-Z][a-z ]{1,30}", result.output), result.output
    replies = [m for m in result.all_messages() if m.kind == "response"]
    first_parts = replies[0].parts
    # pydantic-ai read the reasoning as a thinking part, then the call
    assert [type(p) for p in first_parts] == [ThinkingPart, ToolCallPart], first_parts
    assert REASONING.fullmatch(first_parts[0].content)
    assert any(isinstance(p, ThinkingPart) for p in replies[-1].parts)


def test_agents_sdk_completes_a_tool_turn_after_reasoning(server):
    import agents
    from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool

    agents.set_tracing_disabled(True)
    client, transport = forcing_client(server)
    seen: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"It is sunny and 21 degrees in {city}."

    agent = Agent(name="weather", instructions="Answer weather questions with the tool.",
                  model=OpenAIChatCompletionsModel(model=MODEL, openai_client=client), tools=[get_weather])
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    check_the_turns(transport, seen)
    assert re.fullmatch(r"[A-Z][a-z ]{1,30}", result.final_output), result.final_output
    # the SDK kept the reasoning it read (a reasoning item before the call)
    kinds = [item.type for item in result.new_items]
    assert "reasoning_item" in kinds and kinds.index("reasoning_item") < kinds.index("tool_call_item"), kinds
