"""Reasoning on the Responses API, in-process: the real app over `FakeEngine` (the real engine over a
scripted worker) saying `<think>`-shaped replies through a Qwen3-style thinking template, the
reasoning parser forced (`--reasoning-parser qwen3`).

What is checked: the reasoning item before the message (body and stream, in the openai SDK's event
shapes, `client.responses.stream` accepting the sequence), `usage.output_tokens_details.reasoning_tokens`,
`reasoning.effort` through the budget table (a spent budget forces the end marker; unknown values a
400 naming `reasoning.effort`), `include: ["reasoning.encrypted_content"]` sealing the text, the sealed
item sent back rendering through the template's `reasoning_content` (and a tampered one a 400 naming
`input.N.encrypted_content`), and a model without a parser refusing `reasoning.effort`. How the engine
splits every chunking is the engine's tests' business (tests/reasoning/test_reasoning_engine.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from chatserve.reasoning.signature import ReasoningSigner
from chatserve.server import ServerSettings, create_app
from chatserve.sessions.memory_response_store import InMemoryResponseStore
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.reasoning import qwen3_thinking_template, reasoning_reply

REASONING = "the user greets me so i greet back"
ANSWER = "Hello there, friend."


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def template_file(tmp_path: Path) -> str:
    path = tmp_path / "qwen3_thinking.jinja"
    path.write_text(qwen3_thinking_template(), encoding="utf-8")
    return str(path)


def reasoning_engine(tokenizer: Any, reasoning: str = REASONING, answer: str = ANSWER) -> FakeEngine:
    """The scripted worker writes `reasoning</think>answer` (the template opened the block)."""
    return FakeEngine(tokenizer, reply=reasoning_reply(reasoning, answer), max_model_len=1024)


@contextlib.asynccontextmanager
async def serve(engine: FakeEngine, template_file: str | None, **settings: Any,
                ) -> AsyncIterator[tuple[openai.AsyncOpenAI, httpx.AsyncClient]]:
    if template_file is not None:
        settings.setdefault("chat_template", template_file)
        settings.setdefault("reasoning_parser", "qwen3")
    app = create_app(engine, None, ServerSettings(serve_web=False, **settings), None,
                     responses=InMemoryResponseStore())
    async with app.router.lifespan_context(app):
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test", timeout=30)
        async with http:
            yield openai.AsyncOpenAI(api_key="x", base_url="http://test/v1", http_client=http, max_retries=0), http


def prompt_text(engine: FakeEngine, tokenizer: Any, i: int = -1) -> str:
    return tokenizer.decode(engine.requests[i].prompt.prompt_token_ids)


@pytest.mark.anyio
async def test_reasoning_item_before_the_message_with_usage(smollm_tokenizer, template_file) -> None:
    engine = reasoning_engine(smollm_tokenizer)
    async with serve(engine, template_file) as (client, _):
        resp = await client.responses.create(model="fake-model", input="Say hello")
    assert [item.type for item in resp.output] == ["reasoning", "message"]
    item = resp.output[0]
    assert item.id.startswith("rs_") and item.summary == [] and item.status == "completed"
    assert item.content is not None and [(c.type, c.text) for c in item.content] == [("reasoning_text", REASONING)]
    assert item.encrypted_content is None  # (not included)
    assert resp.output_text == ANSWER
    assert resp.usage is not None
    # the reply's tokens up to and including the end marker are reasoning tokens
    ids = engine.reply_ids
    through_marker = next(k for k in range(len(ids) + 1) if "</think>" in smollm_tokenizer.decode(ids[:k]))
    assert resp.usage.output_tokens_details.reasoning_tokens == through_marker
    assert resp.usage.output_tokens == len(engine.reply_ids) + 1
    assert engine.requests[0].params.reasoning is not None and engine.requests[0].params.reasoning.starts_in_reasoning


@pytest.mark.anyio
async def test_stream_events_in_order_and_accepted_by_the_sdk(smollm_tokenizer, template_file) -> None:
    engine = reasoning_engine(smollm_tokenizer)
    async with serve(engine, template_file) as (client, _):
        async with client.responses.stream(model="fake-model", input="Say hello") as stream:
            events = [e async for e in stream]
            final = await stream.get_final_response()
    kinds = [e.type for e in events]
    rs = [e for e in events if getattr(e, "output_index", None) == 0]
    rs_kinds = [e.type for e in rs]
    assert rs_kinds[:2] == ["response.output_item.added", "response.content_part.added"]
    assert rs_kinds[-3:] == ["response.reasoning_text.done", "response.content_part.done", "response.output_item.done"]
    assert set(rs_kinds[2:-3]) == {"response.reasoning_text.delta"}
    deltas = "".join(e.delta for e in rs if e.type == "response.reasoning_text.delta")
    assert deltas == REASONING
    done = next(e for e in rs if e.type == "response.reasoning_text.done")
    assert done.text == REASONING and done.item_id == rs[0].item.id and rs[0].item.type == "reasoning"
    assert rs[1].part.type == "reasoning_text" and rs[1].part.text == ""
    # the reasoning item is done before the message item is added, and no answer text is reasoning
    assert kinds.index("response.output_item.done") < [i for i, e in enumerate(events)
                                                        if e.type == "response.output_item.added"][1]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == ANSWER
    assert [i.type for i in final.output] == ["reasoning", "message"] and final.output_text == ANSWER
    assert final.output[0].content[0].text == REASONING
    assert [e.sequence_number for e in events] == list(range(len(events)))


@pytest.mark.anyio
async def test_encrypted_content_round_trips_through_reasoning_content(smollm_tokenizer, template_file) -> None:
    engine = reasoning_engine(smollm_tokenizer)
    async with serve(engine, template_file) as (client, http):
        first = await client.responses.create(model="fake-model", input="Say hello", include=["reasoning.encrypted_content"], store=False)
        item = first.output[0]
        assert item.type == "reasoning" and item.encrypted_content and REASONING not in item.encrypted_content
        # the item sent back with its text removed: the sealed value alone renders the reasoning
        sent_back = {"type": "reasoning", "id": item.id, "summary": [], "encrypted_content": item.encrypted_content}
        message = first.output[1].model_dump(exclude_none=True)
        await client.responses.create(model="fake-model", input=[{"role": "user", "content": "Say hello"}, sent_back, message])
        rendered = prompt_text(engine, smollm_tokenizer)
        assert f"<think>\n{REASONING}\n</think>\n\n{ANSWER}" in rendered
        # tampered: one character of the sealed value changed
        sealed = item.encrypted_content
        bad = sealed[:-3] + ("A" if sealed[-3] != "A" else "B") + sealed[-2:]
        r = await http.post("/v1/responses", json={"input": [{"role": "user", "content": "Say hello"},
                                                             {**sent_back, "encrypted_content": bad}, message]})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "input.1.encrypted_content"
        # another server's key (a random per-process key): refused too
        foreign = ReasoningSigner.from_key("another server").seal(REASONING)
        r = await http.post("/v1/responses", json={"input": [{"role": "user", "content": "Say hello"},
                                                             {**sent_back, "encrypted_content": foreign}, message]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input.1.encrypted_content"


@pytest.mark.anyio
async def test_shared_signing_key_lets_another_replica_read_it(smollm_tokenizer, template_file) -> None:
    sealed = ReasoningSigner.from_key("shared secret").seal("an earlier thought")
    engine = reasoning_engine(smollm_tokenizer)
    async with serve(engine, template_file, reasoning_signing_key="shared secret") as (client, _):
        await client.responses.create(model="fake-model", input=[
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": sealed},
            {"role": "assistant", "content": "Hello."}])
    assert "<think>\nan earlier thought\n</think>\n\nHello." in prompt_text(engine, smollm_tokenizer)


@pytest.mark.anyio
async def test_reasoning_items_sent_back_with_content_render(smollm_tokenizer, template_file) -> None:
    """A reasoning item with its `content` (no sealed value) renders that text; with a call after it, the
    call joins the same assistant turn."""
    engine = reasoning_engine(smollm_tokenizer)
    async with serve(engine, template_file) as (client, _):
        await client.responses.create(model="fake-model", input=[
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": "not rendered"}],
             "content": [{"type": "reasoning_text", "text": "plain thought"}]},
            {"role": "assistant", "content": "Hello."}])
        rendered = prompt_text(engine, smollm_tokenizer)
        assert "<think>\nplain thought\n</think>\n\nHello." in rendered and "not rendered" not in rendered
        stored = await client.responses.input_items.list((await client.responses.create(model="fake-model", input=[
            {"role": "user", "content": "Hi"},
            {"type": "reasoning", "id": "rs_2", "summary": [], "content": [{"type": "reasoning_text", "text": "t"}]},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}])).id, order="asc")
    assert [i.type for i in stored.data] == ["message", "reasoning", "function_call", "function_call_output"]
    assert stored.data[1].content[0].text == "t"


@pytest.mark.anyio
async def test_effort_sets_the_budget_and_unknown_values_are_400(smollm_tokenizer, template_file) -> None:
    engine = reasoning_engine(smollm_tokenizer)
    async with serve(engine, template_file) as (client, http):
        resp = await client.responses.create(model="fake-model", input="Say hello", reasoning={"effort": "none", "summary": "auto"})
        assert engine.requests[-1].params.reasoning.budget_tokens == 0
        # a budget of 0: the end marker is forced at once, so no reasoning is written and the reasoning
        # tokens are the marker's alone (the scripted worker then goes on with its script as the answer)
        marker = smollm_tokenizer.encode("</think>", add_special_tokens=False)
        assert [i.type for i in resp.output] == ["message"]
        assert resp.usage is not None and resp.usage.output_tokens_details.reasoning_tokens == len(marker)
        assert resp.reasoning is not None and resp.reasoning.effort == "none" and resp.reasoning.summary == "auto"
        await client.responses.create(model="fake-model", input="Say hello", reasoning={"effort": "low"})
        assert engine.requests[-1].params.reasoning.budget_tokens == 1024
        for body, param in (({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
                            ({"reasoning": {"summary": "verbose"}}, "reasoning.summary"),
                            ({"reasoning": {"context": "all_turns"}}, "reasoning.context"),
                            ({"include": ["message.output_text.logprobs"]}, "include.0")):
            r = await http.post("/v1/responses", json={"input": "Hi", **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.json())


@pytest.mark.anyio
async def test_a_model_without_a_parser_refuses_effort(smollm_tokenizer) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=ANSWER, max_model_len=1024)
    async with serve(engine, None) as (client, http):
        r = await http.post("/v1/responses", json={"input": "Hi", "reasoning": {"effort": "high"}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.effort", r.text
        resp = await client.responses.create(model="fake-model", input="Hi", reasoning={"effort": "none"})
        assert [i.type for i in resp.output] == ["message"]
        assert resp.usage is not None and resp.usage.output_tokens_details.reasoning_tokens == 0
