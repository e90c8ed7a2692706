"""Reasoning on `/v1/chat/completions`: the parser chosen by --reasoning-parser or the template, reasoning
sent under both of its names and never in `content`, the controls (reasoning_effort, enable_thinking),
reasoning sent back through the template's `reasoning_content`, tool calls read from the answer only.

The engine is the real one over the scripted worker (tests/helpers/fake_engine.py), saying a reply in the
reasoning-then-answer shape with exact text (tests/helpers/reasoning.py), so every check compares exact
text; the split itself is the engine's output processor's (R1's), seen here through the API.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from chatserve.server import ServerSettings
from chatserve.server.context import resolve_reasoning_parser
from tests.helpers.asgi import app_client
from tests.helpers.errors import assert_error
from tests.helpers.fake_engine import FakeEngine
from tests.helpers.reasoning import qwen3_thinking_template, reasoning_reply
from tests.helpers.streams import parse_sse_lines

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

REASONING = "the user greets me so i greet back"
ANSWER = "Hello there, friend."
ASK = {"messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def thinking_template(tmp_path: Path) -> str:
    path = tmp_path / "qwen3_thinking.jinja"
    path.write_text(qwen3_thinking_template(), encoding="utf-8")
    return str(path)


def qwen3_engine(tokenizer: Any, reasoning: str = REASONING, answer: str = ANSWER) -> FakeEngine:
    """Replies as a Qwen3-Thinking model does after a prompt that opened `<think>\\n`."""
    return FakeEngine(tokenizer, reply=reasoning_reply(reasoning, answer), max_model_len=512)


def stream_chunks(resp: httpx.Response) -> list[dict[str, Any]]:
    assert resp.status_code == 200, resp.text
    events = parse_sse_lines(resp.text.replace("\r\n", "\n").split("\n"))
    assert events[-1][1] == "[DONE]"
    return [json.loads(data) for _, data in events[:-1]]


def tokens_through_end_marker(tokenizer: Any, reply: str, end: str = "</think>") -> int:
    """How many of the reply's tokens it takes to have written the end marker (the reasoning tokens)."""
    ids = tokenizer.encode(reply, add_special_tokens=False)
    return next(k for k in range(1, len(ids) + 1) if end in tokenizer.decode(ids[:k]))


# ---- the parser: flag, detection, start-up errors ----------------------------------------------------
def test_the_parser_is_found_from_the_template_forced_by_the_flag_or_off() -> None:
    assert resolve_reasoning_parser(None, qwen3_thinking_template()) == "qwen3"
    assert resolve_reasoning_parser(None, "{{ messages }}") is None
    assert resolve_reasoning_parser("deepseek_r1", "{{ messages }}") == "deepseek_r1"  # forced on any template
    assert resolve_reasoning_parser("none", qwen3_thinking_template()) is None


def test_an_unknown_parser_is_a_start_up_error_naming_the_flag_and_the_choices() -> None:
    with pytest.raises(ValueError, match=r"--reasoning-parser: unknown parser 'qwen9'.*deepseek_r1.*qwen3.*none"):
        ServerSettings(reasoning_parser="qwen9")


# ---- output: both names, never in content, reasoning tokens counted ----------------------------------
async def test_a_reply_splits_into_reasoning_and_answer(smollm_tokenizer, thinking_template) -> None:
    engine = qwen3_engine(smollm_tokenizer)
    async with app_client(engine, chat_template=thinking_template) as client:
        resp = await client.post("/v1/chat/completions", json=ASK)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    message = body["choices"][0]["message"]
    assert message["content"] == ANSWER
    assert message["reasoning"] == message["reasoning_content"] == REASONING
    (req,) = engine.requests
    assert req.params.reasoning.parser == "qwen3" and req.params.reasoning.starts_in_reasoning
    assert req.params.reasoning.budget_tokens is None
    reply = reasoning_reply(REASONING, ANSWER)
    assert body["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": tokens_through_end_marker(smollm_tokenizer, reply)}
    assert body["usage"]["completion_tokens"] > body["usage"]["completion_tokens_details"]["reasoning_tokens"]


async def test_a_stream_sends_reasoning_deltas_under_both_names_and_never_in_content(
        smollm_tokenizer, thinking_template) -> None:
    engine = qwen3_engine(smollm_tokenizer)
    async with app_client(engine, chat_template=thinking_template) as client:
        resp = await client.post("/v1/chat/completions", json={**ASK, "stream": True,
                                                               "stream_options": {"include_usage": True}})
    chunks = stream_chunks(resp)
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    reasoning = [d for d in deltas if "reasoning" in d]
    assert len(reasoning) > 1  # streamed as it comes, not once at the end
    assert all(d["reasoning"] == d["reasoning_content"] and "content" not in d for d in reasoning)
    assert "".join(d["reasoning"] for d in reasoning) == REASONING
    assert "".join(d.get("content") or "" for d in deltas) == ANSWER
    # every reasoning delta comes before the first piece of the answer
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(i < first_answer for i, d in enumerate(deltas) if "reasoning" in d)
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == tokens_through_end_marker(
        smollm_tokenizer, reasoning_reply(REASONING, ANSWER))


async def test_with_the_parser_off_the_reply_is_text_and_reasoning_effort_is_refused(
        smollm_tokenizer, thinking_template) -> None:
    engine = qwen3_engine(smollm_tokenizer)
    async with app_client(engine, chat_template=thinking_template, reasoning_parser="none") as client:
        resp = await client.post("/v1/chat/completions", json=ASK)
        refused = await client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": "high"})
        neutral = await client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": "none"})
    message = resp.json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": reasoning_reply(REASONING, ANSWER), "refusal": None}
    assert "completion_tokens_details" not in resp.json()["usage"]
    assert_error(refused, 400, param="reasoning_effort", code="unsupported_field", contains="does not reason")
    assert neutral.status_code == 200, neutral.text  # "none" asks for nothing a plain model cannot do


async def test_a_parser_forced_on_the_default_template(smollm_tokenizer) -> None:
    """SmolLM2's template shows no markers: --reasoning-parser deepseek_r1 splits a reply that opens `<think>`."""
    engine = FakeEngine(smollm_tokenizer, reply=reasoning_reply(REASONING, ANSWER, parser="deepseek_r1", opens=True))
    async with app_client(engine, reasoning_parser="deepseek_r1") as client:
        resp = await client.post("/v1/chat/completions", json=ASK)
    message = resp.json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (REASONING, ANSWER)
    assert not engine.requests[0].params.reasoning.starts_in_reasoning


# ---- controls ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(("effort", "budget"), [("minimal", 256), ("low", 1024), ("medium", 4096), ("high", 16384),
                                                ("xhigh", 32768), ("none", 0)])
async def test_reasoning_effort_maps_to_the_budget_table(smollm_tokenizer, thinking_template, effort, budget) -> None:
    engine = qwen3_engine(smollm_tokenizer)
    async with app_client(engine, chat_template=thinking_template) as client:
        resp = await client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": effort})
    assert resp.status_code == 200, resp.text
    assert engine.requests[0].params.reasoning.budget_tokens == budget


async def test_an_unknown_effort_is_a_400_naming_the_field(smollm_tokenizer, thinking_template) -> None:
    engine = qwen3_engine(smollm_tokenizer)
    async with app_client(engine, chat_template=thinking_template) as client:
        resp = await client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": "extreme"})
        wrong_type = await client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": 3})
    assert_error(resp, 400, param="reasoning_effort", contains="minimal")
    assert_error(wrong_type, 400, param="reasoning_effort")
    assert engine.requests == []


async def test_effort_none_forces_the_end_marker_at_once(smollm_tokenizer, thinking_template) -> None:
    engine = qwen3_engine(smollm_tokenizer)
    async with app_client(engine, chat_template=thinking_template) as client:
        resp = await client.post("/v1/chat/completions", json={**ASK, "reasoning_effort": "none", "max_tokens": 40})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert not body["choices"][0]["message"]["reasoning"]  # no reasoning: the end marker came first
    end_marker = len(smollm_tokenizer.encode("\n</think>", add_special_tokens=False))
    assert body["usage"]["completion_tokens_details"]["reasoning_tokens"] <= end_marker


async def test_enable_thinking_false_renders_the_closed_block_and_parses_nothing(smollm_tokenizer,
                                                                                 thinking_template) -> None:
    engine = FakeEngine(smollm_tokenizer, reply=ANSWER)
    async with app_client(engine, chat_template=thinking_template) as client:
        resp = await client.post("/v1/chat/completions", json={**ASK, "chat_template_kwargs": {"enable_thinking": False}})
    assert resp.status_code == 200, resp.text
    (req,) = engine.requests
    assert smollm_tokenizer.decode(req.prompt.prompt_token_ids).endswith("<think>\n\n</think>\n\n")
    assert req.params.reasoning is None
    assert resp.json()["choices"][0]["message"]["content"] == ANSWER


# ---- reasoning sent back ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["reasoning", "reasoning_content"])
async def test_reasoning_sent_back_renders_through_the_templates_variable(smollm_tokenizer, thinking_template,
                                                                          name) -> None:
    engine = qwen3_engine(smollm_tokenizer)
    # the assistant turn after the last user message: Qwen3's template renders its reasoning_content
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", name: "they said hi"}]
    async with app_client(engine, chat_template=thinking_template) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": messages})
    assert resp.status_code == 200, resp.text
    prompt = smollm_tokenizer.decode(engine.requests[0].prompt.prompt_token_ids)
    assert "<|im_start|>assistant\n<think>\nthey said hi\n</think>\n\nHello.<|im_end|>" in prompt


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "assistant", "content": "x", "reasoning": "a", "reasoning_content": "b"}, "messages.1.reasoning_content"),
    ({"role": "user", "content": "x", "reasoning": "a"}, "messages.1.reasoning"),
])
async def test_reasoning_sent_back_that_cannot_be_meant_is_a_400(smollm_tokenizer, thinking_template, message,
                                                                 param) -> None:
    engine = qwen3_engine(smollm_tokenizer)
    async with app_client(engine, chat_template=thinking_template) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": [ASK["messages"][0], message]})
    assert_error(resp, 400, param=param)
    assert engine.requests == []


async def test_the_same_reasoning_under_both_names_is_accepted(smollm_tokenizer, thinking_template) -> None:
    engine = qwen3_engine(smollm_tokenizer)
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", "reasoning": "r", "reasoning_content": "r"}]
    async with app_client(engine, chat_template=thinking_template) as client:
        resp = await client.post("/v1/chat/completions", json={"messages": messages})
    assert resp.status_code == 200, resp.text


# ---- tool calls come from the answer only -----------------------------------------------------------
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.parametrize("stream", [False, True])
async def test_tool_calls_are_read_from_the_answer_not_the_reasoning(smollm_tokenizer, stream) -> None:
    # the reasoning writes call markup too: only the answer's call is a call
    reasoning = 'maybe <tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call> no paris'
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    engine = FakeEngine(smollm_tokenizer, reply=reasoning_reply(reasoning, call, opens=True), max_model_len=1024)
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "stream": stream}
    async with app_client(engine, reasoning_parser="qwen3", tool_call_parser="hermes") as client:
        resp = await client.post("/v1/chat/completions", json=body)
    if stream:
        deltas = [c["choices"][0]["delta"] for c in stream_chunks(resp) if c["choices"]]
        assert "".join(d.get("reasoning") or "" for d in deltas) == reasoning
        calls = [tc for d in deltas for tc in d.get("tool_calls") or []]
        assert [c["function"]["name"] for c in calls if "id" in c] == ["get_weather"]
        assert json.loads("".join(c["function"]["arguments"] for c in calls)) == {"city": "Paris"}
        assert not "".join(d.get("content") or "" for d in deltas).strip()
    else:
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["message"]["reasoning"] == reasoning
        assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"city": "Paris"}]
        assert choice["finish_reason"] == "tool_calls"
