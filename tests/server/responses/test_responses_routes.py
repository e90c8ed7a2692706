"""The Responses API over the real app and `FakeEngine`, driven by the real openai SDK in-process.

What does not depend on a model: request validation (every field's 400 names it), the typed
events `client.responses.stream` accepts, output items for text and for function calls, the
stored response / input items / token ids, a `previous_response_id` prompt that starts with the
stored tokens exactly, DELETE removing everything, cancel of a running and a finished response,
replay of a background stream from any cursor, a detached run nobody reads stopped at its lease,
and pydantic-ai's OpenAIResponsesModel answering and calling a tool. The live-model tests (cache
hits over a chain, restarts, the Agents SDK, background resume, Redis faults) are in
tests/server/responses/test_responses_live.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from chatserve.server import ServerSettings, create_app
from chatserve.sessions.memory_response_store import InMemoryResponseStore
from tests.helpers.fake_engine import FakeEngine

CALL_TEXT = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@contextlib.asynccontextmanager
async def sdk(engine: FakeEngine, store: InMemoryResponseStore | None = None,
              **settings: Any) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient, InMemoryResponseStore]]:
    store = store or InMemoryResponseStore()
    app = create_app(engine, None, ServerSettings(serve_web=False, **settings), None, responses=store)
    async with app.router.lifespan_context(app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)
        async with http:
            client = openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http, max_retries=0)
            yield client, http, store


@pytest.mark.anyio
async def test_create_retrieve_input_items_delete(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply="Hello there, friend.", max_model_len=1024)
    async with sdk(engine) as (client, http, store):
        resp = await client.responses.create(model="fake-model", input="Say hello", instructions="Be brief.",
                                             metadata={"k": "v"})
        assert resp.status == "completed" and resp.output_text == "Hello there, friend."
        assert resp.id.startswith("resp_") and resp.instructions == "Be brief." and resp.metadata == {"k": "v"}
        assert resp.usage is not None and resp.usage.output_tokens == len(engine.reply_ids) + 1  # (and the end token)
        assert resp.usage.input_tokens == engine.requests[0].prompt.num_tokens
        again = await client.responses.retrieve(resp.id)
        assert again.output_text == resp.output_text and again.status == "completed"
        items = await client.responses.input_items.list(resp.id)
        assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "Say hello"
        tokens = await store.get_token_ids(resp.id)
        end = smollm_tokenizer.eos_token_id  # generated last, kept with the reply for the next turn
        assert tokens == engine.requests[0].prompt.prompt_token_ids + engine.reply_ids + [end]
        deleted = await http.delete(f"/v1/responses/{resp.id}")
        assert deleted.status_code == 200 and deleted.json()["deleted"] is True
        for path in (f"/v1/responses/{resp.id}", f"/v1/responses/{resp.id}/input_items"):
            assert (await http.get(path)).status_code == 404
        assert await store.get_token_ids(resp.id) is None


@pytest.mark.anyio
async def test_chain_prompt_starts_with_the_stored_tokens(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply="Blue.", max_model_len=1024)
    async with sdk(engine) as (client, _, store):
        first = await client.responses.create(input="Favourite colour?", instructions="Answer in one word.")
        second = await client.responses.create(input="And yours?", previous_response_id=first.id,
                                               instructions="Answer in one word.")
        assert second.status == "completed" and second.previous_response_id == first.id
        history = await store.get_token_ids(first.id)
        assert history and engine.requests[1].prompt.prompt_token_ids[:len(history)] == history
        assert "And yours?" in smollm_tokenizer.decode(engine.requests[1].prompt.prompt_token_ids[len(history):])
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(input="x", previous_response_id=first.id, instructions="Other.")
        assert err.value.body["param"] == "instructions"
        with pytest.raises(openai.BadRequestError) as err:
            await client.responses.create(input="x", previous_response_id="resp_" + "0" * 32)
        assert err.value.body["param"] == "previous_response_id"


@pytest.mark.anyio
async def test_stream_events_parse_in_the_sdk_and_match_the_body(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply="One two three.", max_model_len=1024)
    async with sdk(engine) as (client, _, _store):
        async with client.responses.stream(model="fake-model", input="Count") as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        kinds = [e.type for e in events]
        assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
        assert "response.output_item.added" in kinds and "response.content_part.added" in kinds
        assert [e.sequence_number for e in events] == list(range(len(events)))
        deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert deltas == final.output_text == "One two three."
        stored = await client.responses.retrieve(final.id)
        assert stored.output_text == final.output_text and stored.usage.output_tokens == final.usage.output_tokens


@pytest.mark.anyio
async def test_function_call_items_streamed_and_whole(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=CALL_TEXT, max_model_len=1024)
    async with sdk(engine) as (client, _, _store):
        resp = await client.responses.create(input="Weather in Paris?", tools=[WEATHER], tool_choice="required")
        (call,) = resp.output
        assert call.type == "function_call" and call.name == "get_weather"
        assert json.loads(call.arguments) == {"city": "Paris"} and call.call_id
        assert engine.checked_structured, "the tools' grammar was asked of the engine"
        async with client.responses.stream(model="fake-model", input="Weather in Paris?", tools=[WEATHER]) as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
        kinds = [e.type for e in events]
        assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
        assert final.output[0].type == "function_call" and json.loads(final.output[0].arguments) == {"city": "Paris"}
        # the call's result goes back as an item, the same conversation continues
        follow = await client.responses.create(
            previous_response_id=resp.id, tools=[WEATHER],
            input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21C"}])
        assert follow.status == "completed"
        text = smollm_tokenizer.decode(engine.requests[-1].prompt.prompt_token_ids)
        assert "Sunny, 21C" in text


@pytest.mark.anyio
async def test_json_schema_text_format_reaches_the_engine(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply='{"a": 1}', max_model_len=1024)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    async with sdk(engine) as (client, http, _store):
        resp = await client.responses.create(
            input="json", text={"format": {"type": "json_schema", "name": "obj", "schema": schema}})
        assert json.loads(resp.output_text) == {"a": 1} and resp.text.format.type == "json_schema"
        assert engine.requests[0].params.structured_outputs.json == schema
        bad = await http.post("/v1/responses", json={"input": "x", "text": {"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "text.format.schema", bad.text


BAD_BODIES = [
    ({"input": "x", "foo": 1}, "foo"),
    ({"input": []}, "input"),
    ({"input": 3}, "input"),
    ({"input": [{"type": "item_reference", "id": "r"}]}, "input.0.type"),
    ({"input": [{"type": "reasoning", "id": "r", "summary": [], "content": [{"type": "reasoning_text"}]}]},
     "input.0.content.0"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "reasoning", "id": "r", "summary": [],
                                                   "encrypted_content": "csrc1_forged"}]}, "input.1.encrypted_content"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input.0.content.0"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input.0.call_id"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include.0"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),  # (this model has no reasoning parser)
    ({"input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "background": True, "store": False}, "background"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "model": "other"}, "model"),
    ({"input": "x" * 5000}, "input"),
    ({"input": "x", "max_output_tokens": 1020}, "max_output_tokens"),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools.1.name"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "nonsense"}}]}, "tools.0.parameters"),
    ({"input": "x", "background": True, "disconnect_policy": "abort"}, "disconnect_policy"),
    ({"input": "x", "disconnect_policy": "detach"}, "disconnect_policy"),
    ({"input": "x", "stream": True, "disconnect_policy": {"mode": "detach", "lease_seconds": -1}},
     "disconnect_policy.lease_seconds"),
]


@pytest.mark.anyio
async def test_bad_bodies_are_400s_naming_the_field(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, max_model_len=1024)
    async with sdk(engine) as (_, http, _store):
        for body, param in BAD_BODIES:
            resp = await http.post("/v1/responses", json=body)
            assert resp.status_code in (400, 404), (body, resp.text)
            assert resp.json()["error"]["param"] == param, (body, resp.text)
        assert engine.requests == []
        for path in ("/v1/responses/nope", "/v1/responses/resp_" + "f" * 32 + "/input_items"):
            assert (await http.get(path)).status_code == 404
        assert (await http.post("/v1/responses/nope/cancel")).status_code == 404
        assert (await http.delete("/v1/responses/nope")).status_code == 404


@pytest.mark.anyio
async def test_cancel_running_and_finished(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply="a b c d e f", max_model_len=1024, hold=True)
    async with sdk(engine) as (client, http, _store):
        task = asyncio.ensure_future(client.responses.create(input="go", background=True))
        queued = await task
        assert queued.status in ("queued", "in_progress") and queued.background is True
        for _ in range(200):  # the engine holds it after its first token
            if (await client.responses.retrieve(queued.id)).status == "in_progress":
                break
            await asyncio.sleep(0.01)
        cancelled = await client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled"
        assert (await client.responses.cancel(queued.id)).status == "cancelled"  # idempotent
        engine.hold = False
        engine.release()
        done = await client.responses.create(input="go")
        assert (await client.responses.cancel(done.id)).status == "completed"


@pytest.mark.anyio
async def test_background_stream_replays_from_any_cursor(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply="one two three four", max_model_len=1024)
    async with sdk(engine) as (client, http, _store):
        stream = await client.responses.create(model="fake-model", input="count", background=True, stream=True)
        events = [e async for e in stream]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert [e.type for e in events[:2]] == ["response.created", "response.queued"]
        assert events[-1].type == "response.completed"
        rid = events[0].response.id
        for after in (-1, 0, 3, len(events) - 2):
            again = [e async for e in await client.responses.retrieve(rid, stream=True, starting_after=after)]
            assert [e.sequence_number for e in again] == list(range(after + 1, len(events)))
            assert [e.type for e in again] == [e.type for e in events[after + 1:]]
        assert (await client.responses.retrieve(rid)).output_text == "one two three four"
        plain = await client.responses.create(model="fake-model", input="count")
        resp = await http.get(f"/v1/responses/{plain.id}", params={"stream": "true"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "stream"
        resp = await http.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": "x"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "starting_after"


@pytest.mark.anyio
async def test_a_background_run_nobody_reads_is_stopped_at_its_lease(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply="a b c d e f", max_model_len=1024, hold=True)
    async with sdk(engine) as (client, _, _store):
        resp = await client.responses.create(model="fake-model", input="go", background=True,
                                             extra_body={"disconnect_policy": {"mode": "detach", "lease_seconds": 0.2}})
        for _ in range(300):
            got = await client.responses.retrieve(resp.id)
            if got.status in ("failed", "completed", "cancelled"):
                break
            await asyncio.sleep(0.02)
        assert got.status == "failed" and "lease_expired" in got.error.message, got
        (req,) = engine.requests
        assert req.finished  # the engine request was aborted: its blocks are free


@pytest.mark.anyio
async def test_pydantic_ai_responses_model_answers_and_calls_a_tool(smollm_tokenizer) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    engine = FakeEngine(smollm_tokenizer, reply="Paris.", max_model_len=1024)
    async with sdk(engine) as (client, _, _store):
        agent = Agent(OpenAIResponsesModel("fake-model", provider=OpenAIProvider(openai_client=client)))
        result = await agent.run("Capital of France?", model_settings={"max_tokens": 8})
        assert result.output == "Paris."
    calls = FakeEngine(smollm_tokenizer, reply=CALL_TEXT, max_model_len=1024)
    async with sdk(calls) as (client, _, _store):
        seen: list[str] = []
        agent = Agent(OpenAIResponsesModel("fake-model", provider=OpenAIProvider(openai_client=client)))

        @agent.tool_plain
        def get_weather(city: str) -> str:
            """The weather in a city."""
            seen.append(city)
            calls.reply_ids = smollm_tokenizer.encode("Sunny.", add_special_tokens=False)  # then the answer
            return "Sunny, 21C"

        result = await agent.run("Weather in Paris?")
        assert seen == ["Paris"] and result.output == "Sunny."
        assert "Sunny, 21C" in smollm_tokenizer.decode(calls.requests[-1].prompt.prompt_token_ids)
